"""The HTTP API: an ASGI (Starlette) app over the engine.

Routes follow llama-server and the OpenAI API (docs/hydra-protocol.md §5):
``/health``, ``/version``, ``/props``, ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/v1/embeddings``,
``/embedding(s)``, ``/metrics`` here; the completions (``/v1/chat/completions``, ``/v1/completions``,
``/completion``) in :mod:`.completions`; the slots (``/slots``, ``/slots/{id}`` erase, save, restore,
``/slots/{id}/state``, ``/slots/{id}/state/meta``) in :mod:`.slots`; llama-server's other native routes
(``/apply-template``, ``POST /props``, the 501s) in :mod:`.native`; ``GET /v1/events`` (WebSocket,
:mod:`.events`) and the status page ``GET /`` with its files under ``/static/`` (:data:`STATIC_DIR`).

Every route is :func:`.errors.guarded`: a handler raises a typed error (:mod:`hydra_trio.errors`) and the
boundary answers with OpenAI's body shape ``{"error": {"message", "type", "code"}}`` and the error's status.

Each request is logged once when it ends (logger ``hydra_trio.http.access``,
:func:`_access_log`): INFO, or DEBUG for ``/health`` polls.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import llama_cpp
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from .._version import __version__
from ..engine import CompletionJob, Engine
from ..errors import InvalidRequest, ModelLoadError, NotReady
from ..observability.events import EventBus
from ..openai.embeddings import EmbeddingsRequest
from ..openai.native import models_reply, task_params
from ..openai.schemas import DetokenizeRequest, TokenizeRequest
from ..openai.template_caps import known, template_caps
from ..protocol.media import MEDIA_MARKER
from ..service import metrics, node, node_stats
from ..service.completions import in_worker
from ..service.embeddings import check_offered, embed_request
from ..transport.access import AccessSettings, Refusals, Secrets
from .auth import ApiKeyMiddleware, redact_query, send_refusal
from .bodies import RequestReader, json_body, json_reply, stop_of
from .completions import CompletionRoutes
from .errors import error_body, error_reply, guarded, http_exception, no_route, upgrade_required
from .events import events_endpoint
from .inflight import InFlight
from .native import NOT_IMPLEMENTED, NativeRoutes
from .settings import HttpSettings
from .slots import SlotRoutes

log = logging.getLogger("hydra_trio.http")
access_log = logging.getLogger("hydra_trio.http.access")

STATIC_DIR = Path(__file__).with_name("static")
"""The status page's files (``index.html``, ``status.js``, ``status.css``), shipped as package data."""
_NO_CACHE = {"Cache-Control": "no-cache"}  # a node upgraded in place serves its new page at once


async def status_page(request: Request) -> Response:
    """``GET /``: the status page, a live view drawn from ``GET /v1/events`` in the browser
    (``static/status.js``; docs/operations.md "Status page").  Plain files, nothing fetched from elsewhere."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_NO_CACHE)


async def _to_the_page(request: Request) -> Response:
    """``GET /static/index.html``: 308 to ``../``, the page's own address.  The page's links are relative
    (``static/status.js``, ``v1/events``: it works behind a proxy's path prefix), so from here they would
    miss; a relative redirect keeps any prefix."""
    return RedirectResponse("../", status_code=308)


class Api:
    """The status, model and tokenizer routes over one engine (``None`` for a node without a model)."""

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
        self.node_metrics = node_metrics or metrics.NodeMetrics(
            engine, connections, rpc, open_connections, refused=refused
        )
        self.settings = settings
        self.reader = RequestReader(settings)
        self.started = time.time()

    # ----------------------------------------------------------- status routes
    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 ``{"status": "ok", "stage": "ready"}`` once the node serves; while its model
        loads (or a compute-only node's ggml-RPC backend starts), 503 with llama-server's loading error object
        and the node's ``status``, ``stage`` and ``progress`` (0..1); 500 when the model failed to load."""
        e = self.engine
        if e is None:  # a compute-only node: ready once the ggml-RPC backend serves
            if self.rpc is not None and not self.rpc.active:
                return _loading("starting_rpc_backend", 0.0)
            return JSONResponse({"status": "ok", "stage": "ready"})
        if e.ready:
            return JSONResponse({"status": "ok", "stage": "ready"})
        if e.stage == "error":
            raise ModelLoadError(f"model failed to load: {e.error}")
        return _loading(str(e.stage), round(e.progress, 4))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"engine": "hydra-trio", "version": __version__, "llama_cpp_python": llama_cpp.__version__})

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
        ``modalities`` the media the node takes (its ``--mmproj`` projector's encoders; ``video``: vision, in a
        build with video);
        ``media_marker`` llama-server's placeholder for media in a prompt (drawn at start-up, or
        ``LLAMA_MEDIA_MARKER``; a ``/completion`` prompt with ``multimodal_data`` holds it once per item).
        hydra-trio's own keys: ``kv_cache``, the
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
        e = node.serving(self.engine)
        m = e.model_view
        assert m is not None and e.identity is not None
        defaults = e.request_defaults  # one consistent pair (CONFIGURE swaps a new one in)
        g = defaults.generation  # --samplers, --ignore-eos, --adaptive-*
        params = task_params(
            CompletionJob(
                (),
                n_predict=defaults.n_predict,
                sampling=defaults.sampling,
                samplers=g.samplers,
                ignore_eos=g.ignore_eos,
                adaptive_target=g.adaptive_target,
                adaptive_decay=g.adaptive_decay,
            ),
            n_keep=e.config.n_keep,
            reasoning_format=e.config.reasoning_format,
            spec_types=",".join(e.config.speculative.types),
        )
        tmpl = m.chat_template
        caps = template_caps(tmpl) if known(tmpl) else await trio.to_thread.run_sync(template_caps, tmpl)
        return JSONResponse(
            {
                "default_generation_settings": {"params": params, "n_ctx": e.n_ctx_slot},
                "total_slots": e.n_slots,
                "model_alias": e.identity.model_alias,
                "model_ftype": m.facts()["ftype"],
                "model_path": e.identity.model_path,
                "model_hash": e.identity.model_hash,
                "modalities": node.modalities(e),
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
                **node.hardware(),
                "tensor_placement": dict(m.tensor_placement),
                "tensor_placement_peer": dict(c.tensor_placement) if (c := e.experts.combined) is not None else None,
                **node.model_use(e),
            }
        )

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``, llama-server's: ``{"content": str, "add_special": false, "parse_special": true,
        "with_pieces": false}`` → ``{"tokens": [id, ...]}``, or with ``with_pieces``
        ``{"tokens": [{"id": int, "piece": str}]}`` (a piece that is not valid UTF-8 on its
        own, part of a character, is a list of its byte values, as llama-server sends it).
        400 for an invalid body."""
        e = node.serving(self.engine)
        body = await self.reader.read(request, TokenizeRequest)
        m = e.model_view
        assert m is not None

        def work() -> bytes:  # reads only the vocabulary: a worker thread that stops with the request
            tokens = (
                m.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
                if body.content
                else []
            )
            return json_body({"tokens": _with_pieces(m, tokens) if body.with_pieces else tokens})

        return json_reply(await in_worker(work, stop_of(request)))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``, llama-server's: ``{"tokens": [id, ...]}`` → ``{"content": str}``
        (special tokens as their text; bytes that are not valid UTF-8 as U+FFFD).  400 for an
        id outside the vocabulary (``0 .. n_vocab-1``) or an invalid body."""
        e = node.serving(self.engine)
        body = await self.reader.read(request, DetokenizeRequest)
        m = e.model_view
        assert m is not None
        bad = next((t for t in body.tokens if not 0 <= t < m.n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"tokens: token id {bad} is out of the vocabulary (0..{m.n_vocab - 1})")
        return json_reply(
            await in_worker(
                lambda: json_body({"content": b"".join(_token_bytes(m, body.tokens)).decode("utf-8", "replace")}),
                stop_of(request),
            )
        )

    async def models(self, request: Request) -> Response:
        """``GET /v1/models`` (and ``/models``): :func:`~hydra_trio.openai.native.models_reply`."""
        return JSONResponse(models_reply(self.engine, int(self.started)))

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.node_metrics.render()
        return Response(body, media_type=content_type)

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings`` (OpenAI's shape) and ``POST /embedding``, ``/embeddings`` (llama-server's):
        :mod:`hydra_trio.service.embeddings`.  501 on a node without ``--embedding``, as llama-server."""
        if self.engine is not None:
            check_offered(self.engine)
        e = node.serving(self.engine)
        body = await self.reader.read(request, EmbeddingsRequest)
        # the client leaving cancels it (.inflight): no input is embedded after that
        reply = await embed_request(
            e, body, oai=request.url.path == "/v1/embeddings", prepare=lambda work: in_worker(work, stop_of(request))
        )
        return json_reply(await trio.to_thread.run_sync(json_body, reply))  # up to 2048 vectors: off the loop


def _loading(stage: str, progress: float) -> Response:
    """``/health`` while the node gets ready: llama-server's loading body is the error object alone
    (``Loading model``, NotReady's status); the stage and progress are the node's."""
    status = NotReady.http_status
    return JSONResponse(
        {**error_body(status, "Loading model"), "status": "loading", "stage": stage, "progress": progress},
        status_code=status,
    )


_STOP_CHECK_EVERY = 4096
"""Tokens between two stop checks of a worker thread's loop over a request's tokens (:func:`_token_bytes`)."""


def _token_bytes(m: Any, tokens: Any) -> list[bytes]:
    """Worker thread: each token's bytes, special tokens as their text (``/detokenize``, ``with_pieces``);
    stops (Cancelled) with its request (:func:`~hydra_trio.engine.llama.tokenize.raise_if_stopped`)."""
    from ..engine import raise_if_stopped

    out = []
    for i, t in enumerate(tokens):
        if i % _STOP_CHECK_EVERY == 0:
            raise_if_stopped("its tokens were rendered")
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
    api = Api(
        engine, connections if connections is not None else {}, rpc, settings, open_connections, node_metrics, refused
    )
    completions = CompletionRoutes(engine, api.reader)
    slots = SlotRoutes(engine, api.reader)
    native = NativeRoutes(engine, settings, api.reader)
    bus = events if events is not None else (engine.events if engine is not None else EventBus())

    def route(path: str, handler: Any, *methods: str) -> Route:
        return Route(path, guarded(handler), methods=list(methods))

    routes: list[BaseRoute] = [
        route("/health", api.health, "GET"),
        route("/v1/health", api.health, "GET"),
        route("/version", api.version, "GET"),
        route("/props", api.props, "GET"),
        route("/props", native.post_props, "POST"),
        route("/tokenize", api.tokenize, "POST"),
        route("/detokenize", api.detokenize, "POST"),
        route("/apply-template", native.apply_template, "POST"),
        route("/v1/models", api.models, "GET"),
        route("/models", api.models, "GET"),
        route("/slots", slots.list, "GET"),
        route("/slots/{id_slot}", slots.action, "POST"),
        route("/slots/{id_slot}/state/meta", slots.state_meta, "GET"),
        route("/slots/{id_slot}/state", slots.get_state, "GET"),
        route("/slots/{id_slot}/state", slots.put_state, "PUT"),
        route("/metrics", api.metrics, "GET"),
        route("/v1/chat/completions", completions.chat, "POST"),
        route("/chat/completions", completions.chat, "POST"),
        route("/v1/completions", completions.text, "POST"),
        route("/completion", completions.native, "POST"),
        route("/completions", completions.native, "POST"),
        *(route(path, api.embeddings, "POST") for path in ("/v1/embeddings", "/embeddings", "/embedding")),
        *(route(path, native.not_implemented, "GET", "POST") for path in NOT_IMPLEMENTED),
        WebSocketRoute(
            "/v1/events", events_endpoint(bus, lambda: node_stats.hello(engine, rpc), settings.max_event_subscribers)
        ),
        Route("/v1/events", upgrade_required, methods=["GET"]),
        Route("/", status_page, methods=["GET"]),
        Route("/static/index.html", _to_the_page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_exception},
        middleware=[
            # llama-server answers CORS preflights and allows any origin unless told otherwise
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                max_age=600,
            ),
            Middleware(
                ApiKeyMiddleware, keys=Secrets(access.api_keys), metrics_auth=access.metrics_auth, refused=refused
            ),
        ],
    )
    not_found = app.router.default

    async def websocket_not_found(scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette closes an unrouted handshake, which reaches the client as a bare 403
        if scope["type"] == "websocket" and "websocket.http.response" in scope.get("extensions", {}):
            refusal = error_reply(no_route(scope["path"]))
            await send_refusal(scope, send, refusal.status_code, bytes(refusal.body))
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
            extra = {"op": f"{scope['method']} {scope['path']}", "ms": round(seconds * 1e3, 3)}
            if "trace_id" in request_state:
                extra["trace_id"] = request_state["trace_id"]
            access_log.log(
                level,
                '%s "%s %s HTTP/%s" %s %s %.6fs%s',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                target.decode("latin-1"),
                scope.get("http_version", "1.1"),
                state["status"] if state["status"] is not None else "-",
                state["bytes"] if state["status"] is not None else "-",
                seconds,
                "" if state["done"] else " (incomplete)",
                extra=extra,
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
                scope = {
                    **scope,
                    "path": urllib.parse.unquote(path),
                    "raw_path": path.encode("latin-1"),
                    "query_string": parts.query.encode("latin-1"),
                }
        await app(scope, receive, send)

    return wrapped
