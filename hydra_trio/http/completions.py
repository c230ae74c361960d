"""The HTTP completion routes, one pipeline for all: OpenAI's ``POST /v1/chat/completions`` (and
``/chat/completions``), ``POST /v1/completions``, and llama-server's ``POST /completion`` (and ``/completions``).

Each request: the node serves a model (:func:`~hydra_trio.service.node.serving`), the body is read and parsed
(:class:`~.bodies.RequestReader`), the completion is prepared in a worker thread that stops when the client
leaves and started (:mod:`hydra_trio.service.completions`), and its reply (:mod:`hydra_trio.openai.replies`,
:class:`~hydra_trio.openai.native.NativeCompletion`) is streamed as server-sent events or sent whole.  A client
that leaves cancels the handler (:mod:`.inflight`) and with it the engine's request.  The routes differ only
in what :class:`Kind` says: the body's class, the reply's shape and the id's prefix.  Typed errors go to the
boundary (:mod:`.errors`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine import Engine
from ..openai.native import NativeCompletion, generation_settings
from ..openai.replies import CompletionReply, ResponseContext
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..service import completions
from ..service.completions import PreparedCompletion
from ..service.node import serving
from ..validation.strict import MessageError
from .bodies import RequestReader, stop_of
from .errors import guarded_stream


@attrs.frozen
class Kind:
    """What sets one completion route apart: the body's ``body_class``, how a completion is ``prepare``-d
    from it, the ``changes`` the route makes to the job, the ``reply`` object and the reply id's
    ``id_prefix``."""

    body_class: type[Any]
    prepare: Callable[[Engine, Any], PreparedCompletion]
    reply: Callable[[Engine, Any, PreparedCompletion, str], CompletionReply]
    id_prefix: str
    changes: Callable[[Any], dict[str, Any]] = lambda body: {}


def _openai_reply(
    e: Engine, body: ChatCompletionRequest | CompletionRequest, prepared: PreparedCompletion, request_id: str
) -> CompletionReply:
    assert e.identity is not None and e.model_view is not None
    chat = isinstance(body, ChatCompletionRequest)
    echo = ""
    if not isinstance(body, ChatCompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else e.model_view.detokenize(prepared.job.prompt_tokens)
    return ResponseContext(
        chat=chat,
        model=e.identity.model_alias,
        include_usage=body.include_usage,
        logprobs=body.wants_logprobs,
        piece=e.model_view.token_bytes,
        echo=echo,
        id=request_id,
        thinking=prepared.plan.thinking,
        tools=prepared.plan.tools,
    )


def _prepare_native(e: Engine, body: CompletionRequest) -> PreparedCompletion:
    if body.echo:
        raise MessageError("echo: an OpenAI field; /completion always returns the prompt in 'prompt'")
    return completions.prepare_text(e, body)


def _native_changes(body: CompletionRequest) -> dict[str, Any]:
    n_probs = body.top_logprobs_n  # n_probs, else its alias logprobs (llama-server's order)
    return {"logprobs": n_probs > 0, "n_probs": n_probs}


def _native_reply(e: Engine, body: CompletionRequest, prepared: PreparedCompletion, request_id: str) -> CompletionReply:
    m = e.model_view
    assert m is not None and e.identity is not None
    job = prepared.job
    prompt_text = b"".join(m.token_bytes(t, special=True) for t in job.prompt_tokens).decode("utf-8", "replace")
    return NativeCompletion(
        model=e.identity.model_alias,
        return_tokens=bool(body.return_tokens),
        n_probs=job.n_probs,
        response_fields=body.response_fields,
        timings_per_token=bool(body.timings_per_token),
        piece=m.token_bytes,
        prompt_text=prompt_text,
        settings=generation_settings(body, job, bool(body.stream)),
    )


CHAT = Kind(ChatCompletionRequest, completions.prepare_chat, _openai_reply, "chatcmpl-")
"""OpenAI's chat completion."""
TEXT = Kind(CompletionRequest, completions.prepare_text, _openai_reply, "cmpl-")
"""OpenAI's (legacy) text completion."""
NATIVE = Kind(CompletionRequest, _prepare_native, _native_reply, "cmpl-", _native_changes)
"""llama-server's ``/completion``: the prompt in ``prompt``, ``n_probs``, no ``echo``."""


class CompletionRoutes:
    """The completion handlers over one engine (None: a node without a model) and a body reader."""

    def __init__(self, engine: Engine | None, reader: RequestReader) -> None:
        self.engine = engine
        self.reader = reader

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, CHAT)

    async def text(self, request: Request) -> Response:
        return await self.complete(request, TEXT)

    async def native(self, request: Request) -> Response:
        return await self.complete(request, NATIVE)

    async def complete(self, request: Request, kind: Kind) -> Response:
        """One completion (this module's docstring).  Raises the typed errors of every step."""
        e = serving(self.engine)
        request_id = kind.id_prefix + uuid.uuid4().hex  # the reply's id, and the engine's log line's
        request.state.trace_id = request_id  # and the access log line's
        body = await self.reader.read(request, kind.body_class)
        prepared = await completions.prepare(
            lambda: kind.prepare(e, body), stop=stop_of(request), request_id=request_id, **kind.changes(body)
        )
        run = completions.start(e, prepared)
        try:
            reply = kind.reply(e, body, prepared, request_id)
        except BaseException:
            run.close()
            raise
        if body.stream:
            return StreamingResponse(
                guarded_stream(completions.stream(run, reply)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(await completions.collect(run, reply))
