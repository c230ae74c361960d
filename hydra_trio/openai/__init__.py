"""The OpenAI API's and llama-server's request and reply shapes, sans-I/O: request bodies (:mod:`.schemas`,
:mod:`.embeddings`), reply objects and their streams (:mod:`.replies`, :mod:`.native`), the thinking split
(:mod:`.reasoning`), tool calls (:mod:`.tools`) and JSON schemas as grammars (:mod:`.json_schema`).  Shared by
every front end through :mod:`hydra_trio.service`."""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".schemas": ["ChatCompletionRequest", "CompletionRequest", "ChatMessage", "parse_body", "structure_body"],
    },
)
