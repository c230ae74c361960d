"""The router's routes that watch and change its list of models, as llama-server's router
(``get_router_models_sse``, ``post_router_models`` and ``del_router_models`` in ``tools/server/server-models.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors):

``GET /models/sse``
    ``text/event-stream``, one ``data: {"model", "event"[, "data"]}`` event per change of a model
    (:mod:`hydra_trio.router.events`), until the client leaves or the router stops.
``POST /models`` ``{"model": NAME}``
    llama-server downloads a Hugging Face model into its cache and lists it (``source: "cache"``,
    ``can_remove: true``).  Nothing is downloaded here: a model whose files are already on this machine (one
    of the project's installed models, ``hydra-trio models``, or a GGUF file) joins the list at once, named
    ``NAME``, with the router's ``[*]`` and command-line flags (events ``download_finished``, then
    ``models_reload``); any other name is refused as llama-server refuses a model it cannot download.
``DELETE /models?model=NAME``
    a model ``POST /models`` added is stopped (waited for) and leaves the list (event ``model_remove``); its
    files stay (they were not downloaded for it).

Refusals (llama-server's statuses and messages)::

    POST / DELETE without a model       400 "model must be a non-empty string"
    POST of a model not on this machine 400 "model validation failed, unable to download"
    POST of a name already listed       400 "model 'X' already exists"
    DELETE of an unknown model          500 "model name=X is not found"
    DELETE of a preset's model          500 "model name=X is not removable (not from cache)"
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import HydraTrioError, InvalidRequest
from .models import ModelRouter
from .presets import ModelsConfigError

log = logging.getLogger("hydra_trio.router")


class ModelsManageApi:
    """The routes of the module docstring over one :class:`ModelRouter`."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    async def models_sse(self, request: Request) -> Response:
        """``GET /models/sse``: llama-server's ``data: JSON`` events, nothing else (no ``event:`` line)."""

        async def events() -> AsyncIterator[str]:
            with self.router.events.subscribe() as receive:
                async for message in receive:
                    yield f"data: {json.dumps(message, separators=(',', ':'))}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def post_models(self, request: Request) -> Response:
        """``POST /models``: add a model whose files are here (the module docstring)."""
        name = _model_name(await request.body())
        if self.router.factory is None:
            raise InvalidRequest("model validation failed, unable to download")
        try:
            m = self.router.factory(name)
        except ModelsConfigError as exc:
            log.warning("POST /models %s: %s", name, exc)
            raise InvalidRequest("model validation failed, unable to download") from exc
        if self.router.find(name) is not None:
            raise InvalidRequest(f"model '{name}' already exists")
        self.router.add(m)
        log.info("added model name=%s (its files are here: nothing to download)", name)
        self.router.events.notify("download_finished", name)
        self.router.events.notify("models_reload", "*")
        return JSONResponse({"success": True})

    async def delete_models(self, request: Request) -> Response:
        """``DELETE /models?model=NAME``: stop a model ``POST /models`` added and drop it from the list."""
        name = request.query_params.get("model", "")
        if not name:
            raise InvalidRequest("model must be a non-empty string")
        m = self.router.models.get(name)
        if m is None:
            raise HydraTrioError(f"model name={name} is not found")
        if m.source != "cache":
            raise HydraTrioError(f"model name={name} is not removable (not from cache)")
        await self.router.stop_and_wait(m)
        if self.router.models.get(name) is m:
            self.router.remove(m)
            log.info("removing model name=%s (its files stay)", name)
            self.router.events.notify("model_remove", name)
        return JSONResponse({"success": True})


def _model_name(body: bytes) -> str:
    try:
        parsed: Any = json.loads(body) if body.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is no JSON: {exc}") from exc
    name = parsed.get("model") if isinstance(parsed, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequest("model must be a non-empty string")
    return name
