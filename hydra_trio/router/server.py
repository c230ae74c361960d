"""A router node: one listening port, the front door, the router's HTTP app and the children of its models."""

from __future__ import annotations

import logging

import trio

from ..config import ServerConfig
from ..http import HttpHandler
from ..protocol.classify import Protocol
from ..rpc_backend.backend import RpcBackend
from ..transport.access import new_refusals
from ..transport.frontdoor import FrontDoor
from ..transport.listen import open_tcp_listeners
from .app import build_router_app
from .hydra_relay import RouterHydra
from .models import ModelInstance, ModelRouter

log = logging.getLogger("hydra_trio.router")


class RouterServer:
    """A running router (``await nursery.start(server.run)``): after ``start`` returns, :attr:`port` is bound
    and the models marked ``load-on-startup`` are loading.  The port serves HTTP (:mod:`.app`), Hydra
    (:mod:`.hydra_relay`: INFO here, the other ops relayed to a model's child) and, unless
    ``config.rpc_backend`` is None (``--no-rpc-backend``), ggml-RPC: the router lends compute as a
    compute-only node does, with the node's backend (:class:`~hydra_trio.rpc_backend.backend.RpcBackend`).
    ``config.engine`` is not used.
    """

    def __init__(self, config: ServerConfig, router: ModelRouter, startup: list[ModelInstance]) -> None:
        self.config = config
        self.router = router
        self.startup = startup
        self.refused = new_refusals()
        self.app = build_router_app(router, config.http, config.access, self.refused)
        self.http = HttpHandler(self.app, config.http)
        self.rpc = RpcBackend(config.rpc_backend, self.refused) if config.rpc_backend is not None else None
        self.hydra = RouterHydra(router, config.hydra, config.access, self.refused, self.rpc)
        self.frontdoor = FrontDoor({Protocol.HTTP: self.http, Protocol.HYDRA: self.hydra}, config.frontdoor)
        if self.rpc is not None:
            self.frontdoor.handlers[Protocol.GGML_RPC] = self.rpc
        self.port: int | None = None
        self.stopped = trio.Event()
        self._scope: trio.CancelScope | None = None

    async def run(self, *, task_status: trio.TaskStatus[RouterServer] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, start the ``load-on-startup`` models, serve until cancelled or :meth:`shutdown`.

        Raises:
            OSError: the port cannot be bound.
        """
        cfg = self.config
        listeners = await open_tcp_listeners(cfg.port, cfg.host, cfg.reuse_port)
        self.port = listeners[0].socket.getsockname()[1]
        log.info(
            "router listening on %s port %d (HTTP, Hydra%s); %d models: %s",
            cfg.host,
            self.port,
            ", ggml-RPC" if self.rpc is not None else "",
            len(self.router.models),
            ", ".join(self.router.models),
        )
        if self.rpc is not None:
            self.rpc.warn_if_open(listeners, self.port)
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                await nursery.start(self.router.run)
                await nursery.start(self.hydra.run)
                if self.rpc is not None:
                    await nursery.start(self.rpc.run)
                await nursery.start(self.frontdoor.serve, listeners)
                for m in self.startup:
                    log.info("(startup) loading model %s", m.name)
                    await self.router.load(m)
                task_status.started(self)
        finally:
            self.stopped.set()
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, stop every child (each within its ``stop-timeout``), then stop; ``grace`` bounds
        the wait for the router's own connections."""
        self.frontdoor.stop_accepting()
        await self.http.drain()
        self.hydra.drain()
        await self.router.unload_all()
        self.router.events.close()  # /models/sse streams end
        with trio.move_on_after(grace):
            async with trio.open_nursery() as nursery:
                if self.rpc is not None:
                    nursery.start_soon(self.rpc.drain)
                nursery.start_soon(self.frontdoor.wait_no_connections)
        if self._scope is not None:
            self._scope.cancel()
