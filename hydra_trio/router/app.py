"""The router's HTTP API, as llama-server's in router mode (``server.cpp`` and ``server_models_routes`` in
``tools/server/server-models.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors).

Its own routes: ``GET /health`` (``{"status": "ok", "models": [{"id", "status"}]}``: llama-server's, with every
model's status), ``GET /models`` and ``/v1/models`` (:meth:`ModelInstance.entry
<hydra_trio.router.models.ModelInstance.entry>` of each), ``POST /models/load`` and ``POST /models/unload``
(body ``{"model": NAME}``, reply ``{"success": true}``), ``GET /props`` without ``?model=`` (the router's
props), ``GET /version``; ``GET /models/sse``, ``POST /models`` and ``DELETE /models`` are
:mod:`hydra_trio.router.manage`'s; ``GET /`` is the status page (:mod:`hydra_trio.router.page`).

Every other route of a node goes to the child of the model it names: a POST by its JSON body's ``model``, a
GET or PUT by ``?model=`` (a name or an alias).  With autoload (``--models-autoload``, the default, or the
request's ``?autoload=true|1``; ``?autoload=`` anything else turns it off) a model that is not running is loaded
first and the request waits for it.

Refusals (llama-server's statuses and messages)::

    no model named                400 "model name is missing from the request"
    an unknown model              400 "model 'X' not found"
    not running, no autoload      400 "model is not loaded"
    its load failed               500 "model name=X failed to load"
    /models/load: unknown         404 "model is not found"
    /models/load: running         400 "model is already running" (loading or loaded)
    /models/load past the limit   500 "model limit reached, try again later" (every loaded model busy)
    /models/unload: unknown       400 "model is not found"         not running: 400 "model is not running"

A body that is no JSON is 400 (llama-server answers 500 with its parser's message).
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._version import __version__
from ..errors import InvalidRequest, NotFound
from ..http.auth import ApiKeyMiddleware
from ..http.errors import guarded, http_exception
from ..http.native import NOT_IMPLEMENTED
from ..http.settings import HttpSettings
from ..transport.access import AccessSettings, Refusals, Secrets
from .manage import ModelsManageApi
from .models import CHILD_HOST, ModelInstance, ModelRouter
from .page import page_routes
from .proxy import RelayResponse, open_relay

POST_ROUTES = (
    "/completion",
    "/completions",
    "/v1/completions",
    "/chat/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/embeddings",
    "/embedding",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/props",
    "/slots/{id_slot}",
    *NOT_IMPLEMENTED,
)
"""POST routes relayed to the model their body's ``model`` names (every POST route of a node)."""

GET_ROUTES = ("/metrics", "/slots", "/slots/{id_slot}/state/meta", "/slots/{id_slot}/state", *NOT_IMPLEMENTED)
"""GET routes relayed to the model ``?model=`` names (``GET /props`` too, when it has ``?model=``)."""


class RouterApi:
    """The routes of the module docstring over one :class:`ModelRouter`."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router
        self.started = int(time.time())

    # ------------------------------------------------------------------------------------- own routes
    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "models": [
                    {"id": m.name, "status": m.status, **({"failed": True} if m.failed else {})}
                    for m in self.router.models.values()
                ],
            }
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"engine": "hydra-trio", "version": __version__, "role": "router"})

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        return JSONResponse({"data": [m.entry(created) for m in self.router.models.values()], "object": "list"})

    async def load(self, request: Request) -> Response:
        m = self.router.find(_model_field(await _json_body(request)))
        if m is None:
            raise NotFound("model is not found")
        if m.running:
            raise InvalidRequest("model is already running")
        await self.router.load(m)
        return JSONResponse({"success": True})

    async def unload(self, request: Request) -> Response:
        m = self.router.find(_model_field(await _json_body(request)))
        if m is None:
            raise InvalidRequest("model is not found")
        if not m.running:
            raise InvalidRequest("model is not running")
        self.router.unload(m)
        return JSONResponse({"success": True})

    async def props(self, request: Request) -> Response:
        """``GET /props``: with ``?model=`` the model's own (relayed), else the router's, llama-server's keys:
        ``role: "router"``, ``max_instances``, ``models_autoload`` and placeholders for a web UI."""
        if request.query_params.get("model"):
            return await self.relay_by_query(request)
        s = self.router.settings
        return JSONResponse(
            {
                "role": "router",
                "max_instances": s.models_max,
                "models_autoload": s.models_autoload,
                "model_alias": "llama-server",
                "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0},
                "ui_settings": {},
                "build_info": f"hydra-trio {__version__}",
                "cors_proxy_enabled": False,
            }
        )

    # ------------------------------------------------------------------------------------- relayed
    async def relay_by_query(self, request: Request) -> Response:
        """A GET or PUT for the model of ``?model=``."""
        m = await self._ready(request, request.query_params.get("model", ""))
        return await self._relay(request, m, await request.body(), used=False)

    async def relay_by_body(self, request: Request) -> Response:
        """A POST for the model of its JSON body's ``model``; it becomes the most recently used."""
        body = await request.body()
        m = await self._ready(request, _model_field(_parse(body)))
        return await self._relay(request, m, body, used=True)

    async def _ready(self, request: Request, name: str) -> ModelInstance:
        if not name:
            raise InvalidRequest("model name is missing from the request")
        m = self.router.find(name)
        if m is None:
            raise InvalidRequest(f"model '{name}' not found")
        param = request.query_params.get("autoload", "")
        autoload = self.router.settings.models_autoload if not param else param in ("true", "1")
        if not autoload and not m.running:
            raise InvalidRequest("model is not loaded")
        if autoload:
            await self.router.ensure_ready(m)
        return m

    async def _relay(self, request: Request, m: ModelInstance, body: bytes, used: bool) -> Response:
        release = self.router.acquire(m, used=used)
        try:
            upstream = await open_relay(
                self.router.client,
                request.method,
                f"http://{CHILD_HOST}:{m.port}",
                request.url.path,
                request.scope.get("query_string", b""),
                list(request.scope.get("headers", [])),
                body,
                self.router.settings.relay_timeout,
            )
        except BaseException:
            release()
            raise
        return RelayResponse(upstream, release)


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body) if body.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is no JSON: {exc}") from exc


async def _json_body(request: Request) -> Any:
    return _parse(await request.body())


def _model_field(body: Any) -> str:
    """The body's ``model`` when it is a string, else ``""`` (llama-server's ``json_value`` default)."""
    value = body.get("model") if isinstance(body, dict) else None
    return value if isinstance(value, str) else ""


def build_router_app(
    router: ModelRouter, settings: HttpSettings, access: AccessSettings, refused: Refusals | None = None
) -> Any:
    """The router's ASGI app (the module docstring), behind CORS and the API keys as a node's."""
    api = RouterApi(router)
    manage = ModelsManageApi(router)

    def route(path: str, handler: Any, *methods: str) -> Route:
        return Route(path, guarded(handler), methods=list(methods))

    routes = [
        route("/health", api.health, "GET"),
        route("/v1/health", api.health, "GET"),
        route("/version", api.version, "GET"),
        route("/models", api.models, "GET"),
        route("/v1/models", api.models, "GET"),
        route("/models/load", api.load, "POST"),
        route("/models/unload", api.unload, "POST"),
        route("/models/sse", manage.models_sse, "GET"),
        route("/models", manage.post_models, "POST"),
        route("/models", manage.delete_models, "DELETE"),
        route("/props", api.props, "GET"),
        route("/slots/{id_slot}/state", api.relay_by_query, "PUT"),
        *(route(p, api.relay_by_body, "POST") for p in POST_ROUTES),
        *(route(p, api.relay_by_query, "GET") for p in GET_ROUTES),
        *page_routes(),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_exception},
        middleware=[
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
    return app
