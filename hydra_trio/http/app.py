"""The HTTP API: an ASGI (Starlette) app over the engine.

Routes follow llama-server and the OpenAI API (hydra-protocol.md §5):
``/health``, ``/version``, ``/props``, ``/v1/models``, ``/slots``,
``/slots/{id}`` (erase, save, restore), ``/slots/{id}/state/meta``, ``/tokenize``, ``/detokenize``,
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/embedding(s)``, ``/metrics``; llama-server's
native routes (``/completion``, ``/apply-template``, ``POST /props``, ``/slots/{id}/state``, the 501s) in :mod:`.native`;
``GET /v1/events``
(WebSocket, :mod:`.events`) and the status page ``GET /`` with its files under
``/static/`` (:data:`STATIC_DIR`).  Errors use
OpenAI's body shape ``{"error": {"message", "type", "code"}}``.

Each request is logged once when it ends (logger ``hydra_trio.http.access``,
:func:`_access_log`): INFO, or DEBUG for ``/health`` polls.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import urllib.parse
import uuid
from pathlib import Path
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import attrs
import llama_cpp
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from .._version import __version__
from ..service import slot_files
from ..engine.engine import Engine, kv_cache, memory_use
from ..engine.ggml_backend import build_backends, local_devices
from ..engine.requests import CompletionJob, JobRun, TextDelta
from ..engine.tasks import EraseSlot
from ..errors import HydraTrioError
from . import metrics
from ..observability import node_stats
from ..observability.events import EventBus
from .errors import error_response
from ._common import (
    _BodyError, _bad_request, body_chunks, _sse, _unavailable, error_for, json_body, json_reply, off_loop,
)
from .events import events_endpoint
from .inflight import InFlight
from .native import native_routes
from ..service.jobs import chat_job, job_from_completion
from ..openai.embeddings import EmbeddingsRequest
from ..service.embeddings import embed_request
from ..engine.engine import NO_EMBEDDINGS
from ..openai.native import models_reply, task_params
from ..openai.replies import ResponseContext
from ..openai.template_caps import known, template_caps
from ..engine.model import model_meta
from ..openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SlotFileRequest,
    TokenizeRequest,
    parse_body,
)
from ..protocol.strict import MessageError
from .settings import HttpSettings
from .auth import ApiKeyMiddleware, redact_query, send_refusal
from ..transport.access import AccessSettings, Refusals, Secrets

log = logging.getLogger("hydra_trio.http")
access_log = logging.getLogger("hydra_trio.http.access")

STATIC_DIR = Path(__file__).with_name("static")
"""The status page's files (``index.html``, ``status.js``, ``status.css``), shipped as package data."""
MEDIA_MARKER = os.environ.get("LLAMA_MEDIA_MARKER") or f"<__media_{secrets.token_hex(16)}__>"
"""``/props``' ``media_marker``: llama-server's (``LLAMA_MEDIA_MARKER``, else drawn once per process)."""
_NO_CACHE = {"Cache-Control": "no-cache"}  # a node upgraded in place serves its new page at once


async def status_page(request: Request) -> Response:
    """``GET /``: the status page, a live view drawn from ``GET /v1/events`` in the browser
    (``static/status.js``; README "Status page").  Plain files, nothing fetched from elsewhere."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_NO_CACHE)

async def _to_the_page(request: Request) -> Response:
    """``GET /static/index.html``: 308 to ``../``, the page's own address.  The page's links are relative
    (``static/status.js``, ``v1/events``: it works behind a proxy's path prefix), so from here they would
    miss; a relative redirect keeps any prefix."""
    return RedirectResponse("../", status_code=308)


async def _upgrade_required(request: Request) -> Response:
    """``GET /v1/events`` without a WebSocket upgrade: 426 with ``Upgrade: websocket`` (RFC 9110 §15.5.22)."""
    return error_response(426, "GET /v1/events is a WebSocket: send the upgrade (Connection: Upgrade, "
                          "Upgrade: websocket)", "invalid_request_error", headers={"Upgrade": "websocket"})


class Api:
    """Route handlers bound to one engine (``None`` for a node without a model)."""

    def __init__(
        self,
        engine: Engine | None,
        connections: Mapping[str, int],
        rpc: Any = None,
        settings: HttpSettings = HttpSettings(),
        open_connections: Callable[[], int] | None = None,
        node_metrics: metrics.NodeMetrics | None = None,
        refused: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        self.engine = engine
        self.connections = connections
        self.open_connections = open_connections
        self.refused = refused
        self.rpc = rpc
        self.node_metrics = node_metrics or metrics.NodeMetrics(engine, connections, rpc, open_connections,
                                                                 refused=refused)
        self.settings = settings
        self.started = time.time()

    # ----------------------------------------------------------- status routes
    async def health(self, request: Request) -> Response:
        e = self.engine
        if e is None:  # a compute-only node: ready once the ggml-RPC backend serves
            if self.rpc is not None and not self.rpc.active:
                return JSONResponse({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"},
                                     "status": "loading", "stage": "starting_rpc_backend", "progress": 0.0},
                                    status_code=503)
            return JSONResponse({"status": "ok", "stage": "ready"})
        if e.ready:
            return JSONResponse({"status": "ok", "stage": "ready"})
        if e.stage == "error":
            return error_response(500, f"model failed to load: {e.error}", "server_error")
        # llama-server's body while it loads is the error object alone; the stage and progress are the node's
        body = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"},
                "status": "loading", "stage": e.stage, "progress": round(e.progress, 4)}
        return JSONResponse(body, status_code=503)

    async def version(self, request: Request) -> Response:
        return JSONResponse(
            {"engine": "hydra-trio", "version": __version__, "llama_cpp_python": llama_cpp.__version__}
        )

    async def props(self, request: Request) -> Response:
        """``GET /props``, llama-server's keys (``get_res_props`` in ``tools/server/server-context.cpp``) and the
        node's (tools read ``model_path`` here)::

            {"default_generation_settings": {"params": {sampling defaults, "n_predict", ...}, "n_ctx": tokens per slot},
             "total_slots", "model_alias", "model_ftype", "model_path", "model_hash",
             "modalities": {"vision", "video", "audio"}, "media_marker", "endpoint_slots", "endpoint_props",
             "endpoint_metrics", "ui": false, "ui_settings": {}, "chat_template", "chat_template_caps",
             "bos_token", "eos_token", "build_info", "is_sleeping", "cors_proxy_enabled": false,
             "tensor_placement", "tensor_placement_peer",
             "backends": the ggml backends of this build (["CPU", "RPC"], "CUDA" on a GPU build),
             "devices": [{"name", "memory_free", "memory_total"} (bytes)] the devices ggml finds,
             "kv_cache": {"type_k", "type_v", "flash_attn"}, "memory": {device: {"weights", "kv", "compute"}}}

        ``params`` is :func:`~hydra_trio.openai.native.task_params` of the node's defaults: every sampler
        setting under llama-server's name (``EngineConfig.sampling``, changed by CONFIGURE), ``n_predict`` /
        ``max_tokens`` (``EngineConfig.n_predict``), the chain's order in ``samplers``, ``ignore_eos`` and
        ``adaptive_target`` / ``adaptive_decay`` (``EngineConfig.generation``),
        and the context-shift defaults ``n_keep`` (``--keep``) and ``n_discard`` (0: half), as
        llama-server's ``task_params::to_json`` does.
        ``chat_template`` is the Jinja text in effect, or the name of llama.cpp's built-in
        template in effect (``chatml`` for a GGUF without one); ``chat_template_caps`` what it renders
        (:mod:`hydra_trio.openai.template_caps`); ``model_ftype`` the weights' type (``Q4_1``);
        ``media_marker`` llama-server's placeholder for media in a prompt (this node takes no media; the
        marker is drawn at start-up, or ``LLAMA_MEDIA_MARKER``).  hydra-trio's own keys: ``kv_cache``, the
        KV cache types (``-ctk`` / ``-ctv``, e.g. ``q8_0``) and flash attention in effect (``on`` / ``off``;
        ``auto`` when llama.cpp did not say what ``-fa auto`` chose), and ``memory``, bytes per device
        (``CPU``, ``CUDA0``, ``RPC0[host:port]``) of weights, KV cache and compute buffers, as llama.cpp
        allocated them (its log's buffer sizes; weights and KV exact when on one device).  503 while the model
        loads, 501 on a compute-only node.  ``POST /props``: :mod:`.native`.
        ``tensor_placement`` (hydra-trio's): how many of the SOLO model's tensors a tensor
        override placed, by buffer type name (``{"CPU": 24}`` with ``--n-cpu-moe 8`` on a
        3-expert-tensors-per-layer MoE; ``{}`` without overrides), counted from llama.cpp's
        "buffer type overridden to" load lines; ``tensor_placement_peer``: the same for the
        COMBINED / PIPELINE model while one is attached (``{"RPC0[host:port]": 90, ...}``), else null.
        """
        e = self.engine
        if e is None:
            return error_response(501, "this node has no model (compute-only)", "not_supported_error")
        if not e.ready:
            return _unavailable(e)
        m = e.solo_model or e.model
        assert m is not None and e.identity is not None
        defaults = e.request_defaults  # one consistent pair (CONFIGURE swaps a new one in)
        g = defaults.generation  # --samplers, --ignore-eos, --adaptive-*
        params = task_params(CompletionJob((), n_predict=defaults.n_predict, sampling=defaults.sampling,
                                           samplers=g.samplers, ignore_eos=g.ignore_eos,
                                           adaptive_target=g.adaptive_target, adaptive_decay=g.adaptive_decay),
                             n_keep=e.config.n_keep, reasoning_format=e.config.reasoning_format,
                             spec_types=",".join(e.config.speculative.types))
        tmpl = m.chat_template
        caps = template_caps(tmpl) if known(tmpl) else await trio.to_thread.run_sync(template_caps, tmpl)
        return JSONResponse({
            "default_generation_settings": {"params": params, "n_ctx": e.n_ctx_slot},
            "total_slots": e.n_slots,
            "model_alias": e.identity.model_alias,
            "model_ftype": model_meta(m)["ftype"],
            "model_path": e.identity.model_path,
            "model_hash": e.identity.model_hash,
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": MEDIA_MARKER,
            "endpoint_slots": True,
            "endpoint_props": self.settings.endpoint_props,
            "endpoint_metrics": True,
            "ui": False,
            "ui_settings": {},
            "chat_template": tmpl.source,
            "chat_template_caps": caps,
            "bos_token": m.token_text(m.bos_id) if m.bos_id >= 0 else "",
            "eos_token": m.token_text(m.eos_id) if m.eos_id >= 0 else "",
            "build_info": f"hydra-trio {__version__} (llama-cpp-python {llama_cpp.__version__})",
            "is_sleeping": False,
            "cors_proxy_enabled": False,
            "backends": build_backends(),
            "devices": [{"name": name, "memory_free": free, "memory_total": total}
                        for name, free, total in local_devices()],
            "tensor_placement": dict(m.tensor_placement),
            "tensor_placement_peer": dict(c.tensor_placement) if (c := e.experts.combined) is not None else None,
            "kv_cache": kv_cache(e),
            "memory": memory_use(e),
        })

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``, llama-server's: ``{"content": str, "add_special": false, "parse_special": true,
        "with_pieces": false}`` → ``{"tokens": [id, ...]}``, or with ``with_pieces``
        ``{"tokens": [{"id": int, "piece": str}]}`` (a piece that is not valid UTF-8 on its
        own, part of a character, is a list of its byte values, as llama-server sends it).
        400 for an invalid body."""
        e, body = await self._simple_body(request, TokenizeRequest)
        if isinstance(body, Response):
            return body
        m = e.solo_model or e.model
        assert m is not None

        def work() -> bytes:  # reads only the vocabulary: a worker thread that stops with the request
            tokens = m.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special) \
                if body.content else []
            return json_body({"tokens": _with_pieces(m, tokens) if body.with_pieces else tokens})

        return json_reply(await off_loop(request, work))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``, llama-server's: ``{"tokens": [id, ...]}`` → ``{"content": str}``
        (special tokens as their text; bytes that are not valid UTF-8 as U+FFFD).  400 for an
        id outside the vocabulary (``0 .. n_vocab-1``) or an invalid body."""
        e, body = await self._simple_body(request, DetokenizeRequest)
        if isinstance(body, Response):
            return body
        m = e.solo_model or e.model
        assert m is not None
        bad = next((t for t in body.tokens if not 0 <= t < m.n_vocab), None)
        if bad is not None:
            return _bad_request(f"tokens: token id {bad} is out of the vocabulary (0..{m.n_vocab - 1})")
        return json_reply(await off_loop(request, lambda: json_body(
            {"content": b"".join(_token_bytes(m, body.tokens)).decode("utf-8", "replace")})))

    async def _simple_body(self, request: Request, cls: type[Any]) -> tuple[Engine, Any]:
        """``(engine, parsed body)`` for a route that needs the model, or ``(engine, error response)``."""
        e = self.engine
        if e is None:
            return e, error_response(501, "this node has no model (compute-only)", "not_supported_error")  # type: ignore[return-value]
        if not e.ready:
            return e, _unavailable(e)
        try:
            return e, await self._read(request, cls)
        except _BodyError as exc:
            return e, error_response(exc.status, str(exc), "invalid_request_error", headers={"Connection": "close"})
        except MessageError as exc:
            return e, _bad_request(str(exc))

    async def models(self, request: Request) -> Response:
        """``GET /v1/models`` (and ``/models``): :func:`~hydra_trio.openai.native.models_reply`."""
        return JSONResponse(models_reply(self.engine, int(self.started)))

    async def slots(self, request: Request) -> Response:
        """``GET /slots``: one object per slot (:meth:`~hydra_trio.engine.snapshot.SlotSnapshot.info`, its
        ``params`` :func:`~hydra_trio.openai.native.task_params`).  With ``?fail_on_no_slot=<anything but empty>``
        and every slot processing, 503 ``no slot available`` (``unavailable_error``), as llama-server answers."""
        e = self.engine
        if e is None:
            return JSONResponse([])
        if not e.ready:
            return _unavailable(e)
        n_keep, fmt, spec = e.config.n_keep, e.config.reasoning_format, ",".join(e.config.speculative.types)
        slots = e.slots_info(lambda job: task_params(job, n_keep=n_keep, reasoning_format=fmt, spec_types=spec))
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in slots):
            return error_response(503, "no slot available", "unavailable_error")
        return JSONResponse(slots)

    def _slot_id(self, request: Request) -> int | Response:
        """The path's slot id, or the error response (503 loading, 400 not a number, 404 no such slot)."""
        e = self.engine
        if e is not None and not e.ready:
            return _unavailable(e)
        raw = request.path_params["id_slot"]
        if not (raw.isascii() and raw.isdigit() and len(raw) < 10):
            return _bad_request(f"id_slot: {raw!r} is not a slot id (a decimal integer)")
        id_slot = int(raw)
        if e is None or not (0 <= id_slot < e.n_slots):
            return error_response(404, f"slot {id_slot} not found", "not_found_error")
        return id_slot

    async def slot_state_meta(self, request: Request) -> Response:
        e = self.engine
        id_slot = self._slot_id(request)
        if isinstance(id_slot, Response):
            return id_slot
        assert e is not None and e.identity is not None

        body = e.slot_meta_now(id_slot)  # the engine's published snapshot: never waits behind a prefill
        if body is None:  # the slot count changed since _slot_id looked
            return error_response(404, f"slot {id_slot} not found", "not_found_error")
        body.update(e.identity.as_meta())
        return JSONResponse(body)

    async def slot_action(self, request: Request) -> Response:
        """``POST /slots/{id}?action=erase|save|restore``, llama-server's replies: erase ``{"id_slot", "n_erased"}``;
        save and restore take ``{"filename"}`` (:mod:`hydra_trio.service.slot_files`).  Save and restore answer
        501 without ``slot_save_path`` (erase always works); 400 for another action, a bad or missing filename,
        or a file this node cannot restore; 409 while the slot processes a request; 500 when the file cannot be
        written."""
        e = self.engine
        id_slot = self._slot_id(request)
        if isinstance(id_slot, Response):
            return id_slot
        assert e is not None
        action = request.query_params.get("action")
        try:
            if action == "erase":
                n = await e.run_task(EraseSlot(id_slot))
                return JSONResponse({"id_slot": id_slot, "n_erased": n})
            if action not in ("save", "restore"):
                return _bad_request(f"action: {action!r} is not supported (supported: erase, save, restore)")
            directory = e.config.slot_save_path
            if directory is None:
                return error_response(501, "This server does not support slots action. Start it with "
                                      "`--slot-save-path`", "not_supported_error")
            body = await self._read(request, SlotFileRequest)
            run = slot_files.save if action == "save" else slot_files.restore
            return JSONResponse(await run(e, id_slot, Path(directory), body.filename))
        except _BodyError as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", headers={"Connection": "close"})
        except MessageError as exc:
            return _bad_request(str(exc))
        except HydraTrioError as exc:
            return error_for(exc)

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.node_metrics.render()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------ completions
    async def _read(self, request: Request, cls: type[Any]) -> Any:
        """Read and parse the body: at most ``max_body`` bytes, no gap longer than ``body_timeout``; a body over
        :data:`PARSE_INLINE_MAX` is parsed in a worker thread (16 MiB of token ids take seconds to parse, which
        would stall every other request on the event loop).

        Raises:
            MessageError: invalid body (400).
            _BodyError: too large (413) or the client stalled (408).
        """
        raw = bytes(await self._read_bytes(request, self.settings.max_body))
        if len(raw) > PARSE_INLINE_MAX:
            return await trio.to_thread.run_sync(parse_body, raw, cls)
        return parse_body(raw, cls)

    async def _read_bytes(self, request: Request, limit: int) -> bytearray:
        """The raw body: at most ``limit`` bytes, no gap longer than ``body_timeout``.

        Raises:
            _BodyError: too large (413) or the client stalled (408).
        """
        timeout = self.settings.body_timeout
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _BodyError(413, f"the body is {declared} bytes; the limit is {limit}")
        raw = bytearray()
        async for chunk in body_chunks(request, timeout):
            raw += chunk
            if len(raw) > limit:
                raise _BodyError(413, f"the body is over the limit of {limit} bytes")
        return raw

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings`` (OpenAI's shape) and ``POST /embedding``, ``/embeddings`` (llama-server's):
        :mod:`hydra_trio.openai.embeddings`.  501 on a node without ``--embedding``, as llama-server."""
        e = self.engine
        if e is not None and not e.config.embeddings:
            return error_response(501, NO_EMBEDDINGS, "not_supported_error")
        e, body = await self._simple_body(request, EmbeddingsRequest)
        if isinstance(body, Response):
            return body
        try:  # the client leaving cancels it (.inflight): no input is embedded after that
            reply = await embed_request(e, body, oai=request.url.path == "/v1/embeddings",
                                        prepare=lambda work: off_loop(request, work))
            return json_reply(await trio.to_thread.run_sync(json_body, reply))  # up to 2048 vectors: off the loop
        except HydraTrioError as exc:
            return error_for(exc)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        e = self.engine
        if e is None:
            return error_response(501, "this node has no model (compute-only)", "not_supported_error")
        if not e.ready:
            return _unavailable(e)
        cls = ChatCompletionRequest if chat else CompletionRequest
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex  # the reply's id, and the engine's log line's
        request.state.trace_id = request_id  # and the access log line's (see _access_log)
        try:
            body = await self._read(request, cls)
            # templating and tokenization only read the vocabulary: keep them off the event loop, and
            # stop them for a client that leaves meanwhile
            job, tools = await off_loop(
                request, lambda: chat_job(e, body) if chat else (job_from_completion(e, body), None))
            run = JobRun(e, attrs.evolve(job, request_id=request_id)).submit()
        except _BodyError as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", headers={"Connection": "close"})
        except HydraTrioError as exc:
            return error_for(exc)
        assert e.identity is not None and e.model is not None
        echo = ""
        if not chat and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else e.model.detokenize(job.prompt_tokens)
        ctx = ResponseContext(chat=chat, model=e.identity.model_alias, include_usage=body.include_usage,
                               logprobs=body.wants_logprobs, piece=e.model.token_bytes, echo=echo, id=request_id,
                               thinking=job.chat_reply, tools=tools)
        if body.stream:
            return StreamingResponse(
                self._sse(run, ctx),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._collect(request, run, ctx)

    async def _collect(self, request: Request, run: JobRun, ctx: ResponseContext) -> Response:
        """A non-streamed reply: gather the text.  A client that disconnects cancels the handler at once
        (:mod:`.inflight`); the engine's request is cancelled on every way out."""
        try:
            async for delta in run:
                ctx.add(delta)
        except HydraTrioError as exc:
            return error_for(exc)
        finally:
            run.close()
        assert run.finished is not None
        return JSONResponse(ctx.final_body(run.finished))

    async def _sse(self, run: JobRun, ctx: ResponseContext) -> AsyncIterator[str]:
        """The stream's events; the deltas that arrived together (one engine step's, or more when the
        client reads slower than the engine writes) go out in one write, as does the stream's end."""
        try:
            if ctx.chat:
                yield _sse(ctx.chunk({"role": "assistant", "content": ""}, None))
            elif ctx.echo:
                yield _sse(ctx.chunk(ctx.echo, None))
            async for delta in run:
                out = _stream_events(ctx, delta)
                for more in run.ready():
                    out += _stream_events(ctx, more)
                if out:
                    yield out
            tail = ""
            if ctx.reply is not None:
                for d, lp in ctx.chat_deltas(ctx.reply.finish(), None, False, end=True):
                    tail += f"data: {ctx.chunk_json(d, lp)}\n\n"
            end = run.finished
            assert end is not None
            final = ctx.chunk({} if ctx.chat else "", ctx.finish_reason(end.finish_reason))
            final["id_slot"] = end.id_slot
            final["timings"] = end.timings()
            tail += _sse(final)
            if ctx.include_usage:
                usage = ctx.chunk(None, None)
                usage["choices"] = []
                usage["usage"] = ctx.usage(end)
                tail += _sse(usage)
            yield tail + "data: [DONE]\n\n"
        except HydraTrioError as exc:  # the 200 is out: the error goes in the stream
            body = json.loads(error_for(exc).body)
            yield _sse(body)
        finally:
            run.close()


PARSE_INLINE_MAX = 1 << 20
"""Bytes of request body parsed on the event loop; a larger one is parsed in a worker thread (:meth:`Api._read`)."""
_STOP_CHECK_EVERY = 4096
"""Tokens between two stop checks of a worker thread's loop over a request's tokens (:func:`_token_bytes`)."""


def _token_bytes(m: Any, tokens: Any) -> list[bytes]:
    """Worker thread: each token's bytes, special tokens as their text (``/detokenize``, ``with_pieces``);
    stops (Cancelled) with its request (:func:`~hydra_trio.engine.tokenize.check_stop`)."""
    from ..engine.tokenize import check_stop

    out = []
    for i, t in enumerate(tokens):
        if i % _STOP_CHECK_EVERY == 0:
            check_stop("its tokens were rendered")
        out.append(m.token_bytes(t, special=True))
    return out


def _with_pieces(m: Any, tokens: list[int]) -> list[dict[str, Any]]:
    """``/tokenize``'s ``with_pieces`` list: ``{"id", "piece"}``, a piece that is not valid UTF-8 on its own as
    its list of byte values (llama-server's)."""
    out: list[dict[str, Any]] = []
    for t, raw in zip(tokens, _token_bytes(m, tokens), strict=True):
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": t, "piece": piece})
    return out


def _stream_events(ctx: ResponseContext, delta: TextDelta) -> str:
    """The SSE events for one engine delta of a streamed OpenAI reply ("" when it adds none)."""
    if ctx.reply is not None:  # chat: thinking, then tool calls in what is content (parsers hold some back)
        lp = ctx.add(delta)  # first: it sets ctx.split
        pairs = ctx.chat_deltas(ctx.split, lp, bool(delta.tokens))
        return "".join(f"data: {ctx.chunk_json(d, lp)}\n\n" for d, lp in pairs)
    if delta.text or (ctx.logprobs and delta.tokens):
        return f"data: {ctx.chunk_json(delta.text, ctx.add(delta))}\n\n"
    return ""


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, f"no route for {request.url.path}", "not_found_error")
    if exc.status_code == 405:
        return error_response(405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed")
    return error_response(exc.status_code, exc.detail, "invalid_request_error")


def build_app(
    engine: Engine | None,
    connections: Mapping[str, int] | None = None,
    rpc: Any = None,
    settings: HttpSettings = HttpSettings(),
    open_connections: Callable[[], int] | None = None,
    events: EventBus | None = None,
    node_metrics: metrics.NodeMetrics | None = None,
    access: AccessSettings = AccessSettings(),
    refused: Refusals | None = None,
    inflight: InFlight | None = None,
) -> Any:
    """The ASGI app for one engine (``None``: a node without a model).

    ``connections`` maps protocol names to accepted-connection counts and
    ``open_connections`` gives the connections open now (the front door's),
    exported by ``/metrics``; ``node_metrics`` is the node's whole
    ``/metrics`` (Hydra and control counts included), built from the
    others when not given; ``events`` is the bus ``GET /v1/events`` streams (a new one when None).
    ``access.api_keys`` puts the API behind keys
    (:class:`~hydra_trio.http.auth.ApiKeyMiddleware`, inside CORS so that
    preflights and the CORS headers of a 401 work); ``refused`` counts the
    refusals of every protocol, exported by ``/metrics``; ``inflight`` tracks the requests that do work
    (:mod:`.inflight`: counted, stopped when their client leaves, ended at the node's stop; a new one when None).
    """
    api = Api(engine, connections if connections is not None else {}, rpc, settings, open_connections, node_metrics,
              refused)
    bus = events if events is not None else (engine.events if engine is not None else EventBus())
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/props", api.props, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/models", api.models, methods=["GET"]),
        Route("/slots", api.slots, methods=["GET"]),
        Route("/slots/{id_slot}", api.slot_action, methods=["POST"]),
        Route("/slots/{id_slot}/state/meta", api.slot_state_meta, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        *(Route(path, api.embeddings, methods=["POST"]) for path in ("/v1/embeddings", "/embeddings", "/embedding")),
        WebSocketRoute("/v1/events", events_endpoint(bus, lambda: node_stats.hello(engine, rpc),
                                                     settings.max_event_subscribers)),
        Route("/v1/events", _upgrade_required, methods=["GET"]),
        Route("/", status_page, methods=["GET"]),
        Route("/static/index.html", _to_the_page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    routes += native_routes(api)
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error},
        middleware=[
            # llama-server answers CORS preflights and allows any origin unless told otherwise
            Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                       allow_headers=["*"], max_age=600),
            Middleware(ApiKeyMiddleware, keys=Secrets(access.api_keys), metrics_auth=access.metrics_auth,
                       refused=refused),
        ],
    )
    not_found = app.router.default

    async def websocket_not_found(scope: dict[str, Any], receive: Any, send: Any) -> None:
        # Starlette closes an unrouted handshake, which reaches the client as a bare 403
        if scope["type"] == "websocket" and "websocket.http.response" in scope.get("extensions", {}):
            await send_refusal(scope, send, 404, error_response(404, f"no route for {scope['path']}",
                                                                "not_found_error").body)
            return
        await not_found(scope, receive, send)

    app.router.default = websocket_not_found
    return _absolute_form(_access_log((inflight or InFlight()).wrap(app)))


def _access_log(app: Any) -> Any:
    """ASGI wrapper: one access-log line per request, written when the app is done with it.

    ``client "METHOD target HTTP/version" status bytes seconds``; ``-`` for a status
    never sent, and `` (incomplete)`` when the body did not end (the client went away,
    the server stopped).  ``/health`` and ``/v1/health`` polls log at DEBUG, everything else at INFO.
    The record carries ``op`` (``METHOD path``), ``ms`` and, for a completion,
    ``trace_id`` (the reply's id, as on the engine's timing line) for
    :mod:`hydra_trio.observability.logs`.
    (hypercorn's own access log is off: it logs a request twice, a ``- -`` line and
    the real one, when the client closes the connection while hypercorn is still
    inside its final send: see :mod:`hydra_trio.http._hyper`.)
    """

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        t0 = time.perf_counter()
        state: dict[str, Any] = {"status": None, "bytes": 0, "done": False}
        request_state = scope.setdefault("state", {})  # Starlette's request.state writes here

        async def send_logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body":
                state["bytes"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
            await send(message)

        try:
            await app(scope, receive, send_logged)
        finally:
            client = scope.get("client")
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + redact_query(scope["query_string"])  # a key in a query is logged as ***
            level = logging.DEBUG if scope["path"] in ("/health", "/v1/health") else logging.INFO
            seconds = time.perf_counter() - t0
            extra = {"op": f'{scope["method"]} {scope["path"]}', "ms": round(seconds * 1e3, 3)}
            if "trace_id" in request_state:
                extra["trace_id"] = request_state["trace_id"]
            access_log.log(
                level, '%s "%s %s HTTP/%s" %s %s %.6fs%s',
                f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                target.decode("latin-1"), scope.get("http_version", "1.1"),
                state["status"] if state["status"] is not None else "-",
                state["bytes"] if state["status"] is not None else "-",
                seconds, "" if state["done"] else " (incomplete)", extra=extra,
            )

    return wrapped


def _absolute_form(app: Any) -> Any:
    """ASGI wrapper: route a request target in absolute form (``GET http://host/health``) like its origin form,
    WebSocket handshakes included.

    RFC 9112 §3.2.2: a server must accept the absolute form; the path and
    query come from the URI.
    """

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            target = scope.get("raw_path") or b""
            if target[:7].lower() == b"http://" or target[:8].lower() == b"https://":
                parts = urllib.parse.urlsplit(target.decode("latin-1"))
                path = parts.path or "/"
                scope = {**scope, "path": urllib.parse.unquote(path), "raw_path": path.encode("latin-1"),
                         "query_string": parts.query.encode("latin-1")}
        await app(scope, receive, send)

    return wrapped
