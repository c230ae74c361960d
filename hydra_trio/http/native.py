"""llama-server's native HTTP routes beyond the OpenAI API, its completion and slot routes aside
(:mod:`.completions`, :mod:`.slots`; the shapes live in :mod:`hydra_trio.openai.native`).

* ``POST /apply-template``: ``{"messages": [...]}`` -> ``{"prompt": text}``, the chat template in effect.
* ``POST /props``: llama-server at this version sets no property through it and ignores the body:
  ``{"success": true}`` with ``--props``, else 501 (llama-server's message).
* ``/infill``, ``/rerank``, ``/reranking``, ``/v1/rerank``, ``/v1/reranking``, ``/lora-adapters``,
  ``/v1/responses``, ``/responses``, ``/v1/messages``, ``/v1/messages/count_tokens``: 501 naming the endpoint and why.

Typed errors go to the boundary (:mod:`.errors`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine import Engine
from ..errors import NotSupported
from ..openai.schemas import ChatCompletionRequest
from ..service import completions
from ..service.node import serving
from .bodies import RequestReader, stop_of
from .settings import HttpSettings

NOT_IMPLEMENTED: dict[str, str] = {
    "/infill": "fill-in-the-middle completion is not implemented by this node (use /completion with the "
    "model's FIM tokens in the prompt)",
    "/rerank": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/reranking": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/v1/rerank": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/v1/reranking": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/lora-adapters": "this node loads no LoRA adapters (there is no --lora here)",
    "/v1/responses": "the OpenAI Responses API is not implemented by this node (use /v1/chat/completions)",
    "/responses": "the OpenAI Responses API is not implemented by this node (use /v1/chat/completions)",
    "/v1/messages": "the Anthropic Messages API is not implemented by this node (use /v1/chat/completions)",
    "/v1/messages/count_tokens": "the Anthropic Messages API is not implemented by this node (use /tokenize)",
}
"""llama-server endpoints this node answers 501 (``not_supported_error``), and why."""


class NativeRoutes:
    """The handlers over one engine (None: a node without a model), the HTTP settings and a body reader."""

    def __init__(self, engine: Engine | None, settings: HttpSettings, reader: RequestReader) -> None:
        self.engine = engine
        self.settings = settings
        self.reader = reader

    async def apply_template(self, request: Request) -> Response:
        """``{"messages": [...]}`` -> ``{"prompt": the chat rendered by the template in effect}``, as the
        chat endpoint would render it (generation prompt included); a template that fails is a 400
        (ChatTemplateError)."""
        e = serving(self.engine)
        body = await self.reader.read(request, ChatCompletionRequest)
        prompt = await completions.in_worker(lambda: completions.chat_prompt(e, body), stop_of(request))
        return JSONResponse({"prompt": prompt})

    async def post_props(self, request: Request) -> Response:
        """As llama-server's ``post_props`` (``tools/server/server-context.cpp`` of the llama.cpp that
        llama-cpp-python 0.3.36 vendors): it changes no property and does not look at the body, so any body
        gets ``{"success": true}`` with ``--props`` and 501 without; 503 while the model loads (llama-server's
        middleware), 501 on a compute-only node.  The body is read (413 over the body limit, 408 when the
        client stalls), so the connection stays open for the next request, as llama-server's."""
        await self.reader.read_bytes(request, self.settings.max_body)
        serving(self.engine)
        if not self.settings.endpoint_props:
            raise NotSupported("This server does not support changing global properties. Start it with `--props`")
        return JSONResponse({"success": True})

    async def not_implemented(self, request: Request) -> Response:
        path = request.url.path
        raise NotSupported(f"{request.method} {path}: {NOT_IMPLEMENTED[path]}")
