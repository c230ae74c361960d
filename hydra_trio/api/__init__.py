"""The OpenAI request bodies and the engine jobs built from them, shared by HTTP and the Hydra protocol."""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".schemas": ["ChatCompletionRequest", "CompletionRequest", "ChatMessage", "parse_body", "structure_body"],
        ".jobs": ["job_from_chat", "job_from_completion", "job_continue"],
    },
)
