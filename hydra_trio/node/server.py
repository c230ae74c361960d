"""The server: one listening port, the front door, the HTTP app and the engine, in one nursery."""

from __future__ import annotations

import logging

import anyio.lowlevel
import trio

from ..config import ServerConfig
from ..engine import TRANSFER_POOL, AttachPeerAtStart, Engine, PeerGone, peer_listening
from ..errors import Busy
from ..http import HttpHandler
from ..http.app import build_app
from ..http.inflight import InFlight
from ..hydra.server import HydraHandler
from ..observability import progress
from ..observability.events import EventBus
from ..protocol.classify import Protocol
from ..rpc_backend.backend import RpcBackend
from ..service.metrics import NodeMetrics
from ..service.node_stats import ProgressEvents, StatsTicker
from ..transport.access import new_refusals
from ..transport.frontdoor import FrontDoor
from ..transport.listen import open_tcp_listeners
from ..transport.tunnel import TunnelPool

log = logging.getLogger("hydra_trio.server")

END_WINDOW_S = 5.0
"""Seconds the end of the shutdown grace gives the requests it ended to write their last bytes (an error event,
a 503, a DECODE's padding) before what is still open is cancelled; a client that reads them closes sooner."""


class Server:
    """A running hydra-trio node; start it with ``await nursery.start(server.run)``.

    After ``start`` returns, :attr:`port` is bound and ``/health`` answers
    (503 while the model loads).  Cancel the enclosing scope to stop it.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.events = EventBus()
        """The node's live events (``GET /v1/events``; :mod:`hydra_trio.observability.events`)."""
        engine_config = config.engine
        self.engine = Engine(engine_config, self.events) if engine_config is not None else None
        self.tunnels: TunnelPool | None = None
        """``--rpc-tls``: the TLS tunnels to the peers the engine dials, one per real peer address."""
        if config.rpc_tls is not None and self.engine is not None:
            self.tunnels = TunnelPool(config.rpc_tls)
            self.engine.experts.dial = self.tunnels.dial
        self.frontdoor = FrontDoor({}, config.frontdoor)
        self.refused = new_refusals()  # (protocol, reason) -> count, for /metrics
        self.rpc = RpcBackend(config.rpc_backend, self.refused) if config.rpc_backend is not None else None
        if self.rpc is not None:
            self.rpc.child.events = self.events
        self.inflight = InFlight()
        """The HTTP requests doing work (:mod:`hydra_trio.http.inflight`)."""
        self.metrics = NodeMetrics(
            self.engine,
            self.frontdoor.counts,
            self.rpc,
            lambda: self.frontdoor.active,
            self.frontdoor.open_by_protocol,
            refused=self.refused,
            events=self.events,
            http_in_flight=self.inflight.counts,
        )
        self._progress_events = ProgressEvents(self.events)
        self.stats = StatsTicker(
            self.events, self.engine, self.frontdoor.counts, lambda: self.frontdoor.active, self.rpc
        )
        self.app = build_app(
            self.engine,
            self.frontdoor.counts,
            self.rpc,
            config.http,
            lambda: self.frontdoor.active,
            events=self.events,
            node_metrics=self.metrics,
            access=config.access,
            refused=self.refused,
            inflight=self.inflight,
        )
        self.http = HttpHandler(self.app, config.http)
        self.frontdoor.handlers[Protocol.HTTP] = self.http
        self.hydra = HydraHandler(
            self.engine, config.hydra, rpc=self.rpc, metrics=self.metrics, access=config.access, refused=self.refused
        )
        self.frontdoor.handlers[Protocol.HYDRA] = self.hydra
        if self.rpc is not None:
            self.frontdoor.handlers[Protocol.GGML_RPC] = self.rpc
        self.port: int | None = None
        self.ports: list[int] = []  # every bound port, the main one first
        self.stopping = False
        """True once the node began to stop (:meth:`begin_stop`)."""
        self.stopped = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, load the model in the background, serve until cancelled.

        Raises:
            OSError: the port cannot be bound.
            ModelLoadError: the model failed to load (the node stops).
        """
        cfg = self.config
        listeners = self._listeners = await _open_listeners(cfg.host, (cfg.port, *cfg.extra_ports), cfg.reuse_port)
        await anyio.lowlevel.checkpoint()  # anyio loads its trio backend now (80 ms), not in the first streamed reply
        progress.add_listener(self._progress_events)
        self.ports = list(dict.fromkeys(listener.socket.getsockname()[1] for listener in listeners))
        self.port = self.ports[0]
        log.info(
            "listening on %s port%s %s (HTTP, Hydra and ggml-RPC share each port); status page http://%s:%d/, "
            "live events ws://%s:%d/v1/events",
            cfg.host,
            "s" if len(self.ports) > 1 else "",
            ", ".join(map(str, self.ports)),
            *(_url_host(cfg.host), self.port) * 2,
        )
        if self.rpc is not None:
            self.rpc.warn_if_open(listeners, self.port)
        try:
            async with trio.open_nursery() as outer:  # the tunnels outlive the engine, which frees its peer's buffers
                if self.tunnels is not None:
                    await outer.start(self.tunnels.run)
                try:
                    await self._run_parts(listeners, task_status)
                finally:
                    outer.cancel_scope.cancel()
        finally:
            progress.remove_listener(self._progress_events)
            self.stopped.set()
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()

    async def _run_parts(self, listeners: list[trio.SocketListener], task_status: trio.TaskStatus[Server]) -> None:
        """The front door, the ggml-RPC backend, the engine and its control, in one nursery (:attr:`_scope`)."""
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            self.events.bind()
            nursery.start_soon(self.stats.run)
            await nursery.start(self.frontdoor.serve, listeners)
            if self.rpc is not None:
                await nursery.start(self.rpc.run)
            if self.engine is not None:
                await nursery.start(self.engine.run)
            if self.engine is not None:
                nursery.start_soon(_trim_transfer_pool)
            if self.engine is not None and self.engine.experts.peer is not None:
                nursery.start_soon(self._combined_at_start)
            elif self.engine is not None:  # a peer may come later (SET_EXPERT_MODE, PIPELINE_ATTACH)
                nursery.start_soon(self._watch_peer)
            task_status.started(self)

    def begin_stop(self) -> None:
        """The node is stopping (a stop signal came, or :meth:`shutdown` began): from now on a ggml-RPC child
        that ends is part of the stop, neither a crash nor restarted (it may have got the same signal: a
        stop sent to the whole process group).  Idempotent; any thread of the trio run."""
        self.stopping = True
        if self.rpc is not None:
            self.rpc.child.node_stopping()

    async def shutdown(self, grace: float) -> None:
        """Graceful stop by drain and deadline (hypercorn's way), then cancel what is left.

        Accept nothing new (new clients get "connection refused"); every
        protocol closes its connections *between* requests: idle HTTP
        keep-alive and Hydra connections at once, the others once the reply
        in flight is written whole (a stream up to its ``[DONE]``, a STATE_GET
        blob to its last byte); ggml-RPC connections at their next message
        boundary.  When ``grace`` seconds are over, the requests still in flight
        are ended so that their clients know (:meth:`_end_in_flight`): a
        completion's stream with an error event, a reply not yet started with a
        503, a streamed Hydra DECODE with the rest of its budget padded (error
        flag); then, after at most :data:`END_WINDOW_S` for those last writes,
        whatever is still open is cancelled (engine-side changes such as a
        STATE_PUT restore are atomic on the engine thread, so a cancel never
        leaves one half-applied).
        """
        self.begin_stop()
        self.frontdoor.stop_accepting()
        for listener in self._listeners:
            await listener.aclose()
        self.events.close()  # event subscribers (WebSockets) close at once with 1001
        await self.http.drain()
        self.hydra.drain()
        with trio.move_on_after(grace):
            async with trio.open_nursery() as nursery:
                if self.rpc is not None:
                    nursery.start_soon(self.rpc.drain)
                nursery.start_soon(self.frontdoor.wait_no_connections)
        if self.frontdoor.active:
            e = self.engine
            requests = e.requests_processing + e.requests_waiting if e is not None else 0
            log.warning(
                "grace period of %.1f s over: ending %d connections (%d requests)",
                grace,
                self.frontdoor.active,
                requests,
            )
            await self._end_in_flight(f"the node is stopping: its shutdown grace of {grace:g} s is over")
        self._scope.cancel()

    async def _end_in_flight(self, why: str) -> None:
        """The end of the grace: every request in flight ends, its client told ``why``.

        The engine's requests end at once with :class:`~hydra_trio.errors.Stopping` (their streams' error
        events, their 503s, a DECODE's padding: :meth:`LiveJobs.end_all
        <hydra_trio.engine.requests.LiveJobs.end_all>`), the other HTTP requests whose reply has not
        started are answered 503 (:meth:`InFlight.stop_all <hydra_trio.http.inflight.InFlight.stop_all>`);
        their connections then close after those replies (the drain), for at most :data:`END_WINDOW_S`.
        """
        # first the HTTP requests whose reply has not started (a 503 each), so that their handlers unwind
        # from the cancel rather than from their engine request's end
        answered = self.inflight.stop_all(why)
        ended = self.engine.live.end_all(why, self.engine.cancel) if self.engine is not None else 0
        log.info("ended %d engine requests and %d other HTTP requests: %s", ended, answered, why)
        with trio.move_on_after(END_WINDOW_S):
            await self.frontdoor.wait_no_connections()

    async def _combined_at_start(self) -> None:
        """``--rpc-engine``: once SOLO serves, attach the peer and switch to COMBINED; then watch the peer."""
        engine = self.engine
        assert engine is not None
        await engine.wait_ready()
        for _ in range(100):
            try:
                meta = await engine.run_task(AttachPeerAtStart(trace_id="startup"))
                log.info("start-up COMBINED attach: %s", meta)
                break
            except Busy:
                await trio.sleep(0.5)
        await self._watch_peer()

    async def _watch_peer(self, every: float = 2.0) -> None:
        """Keep ``peer_reachable`` true to life; a peer that vanishes while COMBINED is idle sends the node to SOLO."""
        engine = self.engine
        assert engine is not None
        while True:
            await trio.sleep(every)
            experts = engine.experts
            peer = experts.peer
            if peer is None:
                continue
            # the real peer (with --rpc-tls too: a tunnel's loopback port always accepts)
            # a blocking connect probe: a trio worker thread (bridge.py, "Thread crossings")
            experts.peer_reachable = await trio.to_thread.run_sync(peer_listening, peer)
            if experts.mode in ("combined", "pipeline") and not experts.peer_reachable:
                log.warning("peer %s unreachable while %s: going back to SOLO", peer, str(experts.mode).upper())
                try:
                    await engine.run_task(PeerGone(trace_id="watchdog"))
                except Busy:
                    pass  # a request is running: its decode notices the dead peer itself


async def _open_listeners(host: str, ports: tuple[int, ...], reuse_port: bool = False) -> list[trio.SocketListener]:
    """Listeners on every port of ``ports`` (each as ``trio.open_tcp_listeners``, with ``SO_REUSEPORT`` for
    ``reuse_port``: :func:`~hydra_trio.transport.listen.open_tcp_listeners`); all or none.

    Raises:
        OSError: a port cannot be bound (the ones already bound are closed).
    """
    listeners: list[trio.SocketListener] = []
    try:
        for port in ports:
            listeners += await open_tcp_listeners(port, host, reuse_port)
    except BaseException:
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()
        raise
    return listeners


def _url_host(host: str) -> str:
    """``host`` as it goes in a URL: brackets for IPv6; a wildcard bind as 127.0.0.1."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


async def serve(config: ServerConfig, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a hydra-trio node in the caller's nursery (``await nursery.start(serve, config)``).

    ``task_status.started`` receives the :class:`Server` once it listens; its
    ``port`` is the bound port.  Runs until cancelled.
    """
    await Server(config).run(task_status=task_status)


async def _trim_transfer_pool(every: float = 5.0) -> None:
    """Unmap the KV transfer pool's idle buffer once it has been idle its ``keep_s``
    (:mod:`hydra_trio.engine.kv.blobbuf`)."""
    while True:
        await trio.sleep(every)
        if TRANSFER_POOL.idle_bytes:
            await trio.to_thread.run_sync(TRANSFER_POOL.trim)
