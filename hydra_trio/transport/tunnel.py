"""An encrypted ggml-RPC link between hydra-trio nodes: a local plain port, TLS to the peer's one port.

ggml's RPC client (inside llama.cpp) speaks plain TCP only.  A head started
with ``--rpc-tls`` gives ggml's client ``127.0.0.1:<tunnel port>`` for a peer
``HOST:PORT`` instead; every connection to that loopback port
is carried over TLS to ``HOST:PORT``, whose front door unwraps TLS and
classifies ``0x0E`` (ggml-RPC) as for a plain connection.  One TLS
connection per ggml connection; bytes are copied both ways as they come (no
framing: the peer validates the messages), each way by a thread on blocking
sockets (:mod:`hydra_trio.transport.blocking`), as the peer's pump does.

The peer's certificate is verified against the client context (``--tls-ca``)
and must name ``HOST`` (an IP address in the certificate's subjectAltName
for ``--rpc-engine 10.0.0.5:8080``).  The head's own ``--tls-cert`` is
presented for a peer with ``--tls-client-ca``.

Every peer the head dials gets one: :class:`TunnelPool` (owned by the
server) starts one :class:`RpcTunnel` per real peer address, lazily, the
first time the engine dials that peer (``--rpc-engine`` at start,
SET_EXPERT_MODE with a ``peer``, PIPELINE_ATTACH).  The engine keeps the
*real* address (INFO ``peer_addr``, events, logs, the watchdog's liveness
check); only the addresses handed to ggml's client and to the HELLO probe
``peer_reachable`` are the tunnel's loopback port (a tunnel that cannot
reach the peer closes at once, so the probe fails).
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any

import trio

from ..validation.address import parse_peer
from .blocking import LowWater, TlsPipe, blocking_dup, restore, run_blocking, shutdown_all

log = logging.getLogger("hydra_trio.tunnel")

COPY_BUFFER = 1 << 20  # bytes per receive: ggml-RPC moves tensors in large messages
MAX_TUNNELS = 64  # distinct peers one head may dial over TLS in its life (each holds a loopback port)


class RpcTunnel:
    """A loopback listener (bound at construction) that carries each connection over TLS to ``peer``.

    Args:
        peer: ``host:port`` of the peer node (its one port, with ``--tls-cert``).
        context: the client context (:func:`hydra_trio.transport.tls.client_context`).
        connect_timeout: seconds for the TCP connect plus the TLS handshake.

    Raises:
        OSError: no loopback port could be bound.
        hydra_trio.validation.strict.MessageError: a malformed ``peer``.

    Attributes:
        local: ``127.0.0.1:port``, the address to give ggml's RPC client.
        connections: connections carried so far; ``failed``: connects or handshakes that failed.
    """

    def __init__(self, peer: str, context: ssl.SSLContext, connect_timeout: float = 10.0) -> None:
        self.peer = peer
        self.host, self.port = parse_peer(peer)
        self.context = context
        self.connect_timeout = connect_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.local = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections = 0
        self.failed = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept on the loopback port and carry each connection until cancelled."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        log.info("ggml-RPC tunnel %s -> %s over TLS", self.local, self.peer)
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                client = await listener.accept()
                nursery.start_soon(self._carry, client)

    async def _carry(self, client: trio.SocketStream) -> None:
        """One ggml connection: TLS to the peer, then bytes both ways until either side closes.

        The connect and handshake run on a worker thread (blocking, within
        ``connect_timeout``); then each direction is a thread on blocking sockets
        (:func:`~hydra_trio.transport.blocking.run_blocking`, :class:`~hydra_trio.transport.blocking.TlsPipe`):
        a COMBINED token is about 60 round trips, each of which took four trio task
        switches here before.
        """
        try:
            try:
                remote = await trio.to_thread.run_sync(
                    TlsPipe.connect, self.host, self.port, self.context, self.connect_timeout, abandon_on_cancel=True
                )
            except OSError as exc:
                self.failed += 1
                log.warning("ggml-RPC tunnel to %s: %s", self.peer, exc or type(exc).__name__)
                return  # ggml's client sees the connection close: the peer is unreachable
            self.connections += 1
            plain = blocking_dup(client.socket)
            ends = [plain, remote]
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._direction, plain, remote, ends, _RequestBounds())
                    nursery.start_soon(self._direction, remote, plain, ends, None)
            finally:
                restore(plain)
                remote.close()
        finally:
            await trio.aclose_forcefully(client)

    @staticmethod
    async def _direction(src: Any, dst: Any, ends: list[Any], bounds: _RequestBounds | None) -> None:
        """One direction on a thread; when it ends, both ends are shut down (the other one ends too)."""
        try:
            await run_blocking(lambda: _copy(src, dst, bounds), lambda: shutdown_all(ends), name="rpc-tunnel")
        finally:
            shutdown_all(ends)


def _copy(src: Any, dst: Any, bounds: _RequestBounds | None = None) -> None:
    """Copy ``src`` to ``dst`` (blocking) until EOF or an error on either side.

    With ``bounds`` (ggml's requests, on the plain loopback side): ``src``'s receive low-water mark
    is the rest of the request under way, so a request that ggml's client writes in three sends
    (command, size, payload) crosses as one TLS record and wakes the peer once.
    No half-close: a ggml-RPC connection that closes one way is over (the caller shuts both down).
    """
    buf = bytearray(COPY_BUFFER)  # reused: each piece is sent before the next receive
    view = memoryview(buf)
    low = LowWater(src) if bounds is not None else None
    try:
        while True:
            if low is not None and bounds is not None:
                low.set(bounds.low_water(LOW_WATER_CAP))
            n = src.recv_into(buf) if low is None else low.recv_into(buf)
            if not n:
                break
            if bounds is not None:
                bounds.feed(view[:n])
            dst.sendall(view[:n])
    except OSError:  # ssl.SSLError too
        pass


class _RequestBounds:
    """Where ggml-RPC requests (``[u8 cmd][u64 size][payload]``) end in a client's byte stream.

    No checks (the peer's front door validates): only the rest of the request under way, for a
    receive low-water mark that never exceeds what ggml's client sends before it waits for an answer.
    """

    def __init__(self) -> None:
        self.header = bytearray()  # a request header being collected
        self.left = 0  # payload bytes of the request under way still to come

    def feed(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if self.left:
                k = min(self.left, n - pos)
                self.left -= k
                pos += k
                continue
            k = min(_HEADER - len(self.header), n - pos)
            self.header += data[pos : pos + k]
            pos += k
            if len(self.header) == _HEADER:
                self.left = int.from_bytes(self.header[1:], "little")
                self.header.clear()

    def low_water(self, cap: int) -> int:
        """Bytes surely still to come of the request under way (1 to ``cap``); a header's 9 between requests."""
        if self.left:
            return min(self.left, cap)
        return min(_HEADER - len(self.header), cap)


_HEADER = 9  # a ggml-RPC request header: u8 command, u64 payload size
LOW_WATER_CAP = 1 << 18  # most bytes the copying thread waits for before it wakes


class TunnelPool:
    """One :class:`RpcTunnel` per real peer address, started lazily in :meth:`run`'s nursery.

    Owned by the server and run in a nursery that outlives the engine (the
    engine frees its peer's buffers through the tunnel at shutdown).  The
    engine thread calls :meth:`dial` (the ``dial`` hook of
    :class:`~hydra_trio.engine.experts.combined.ExpertModes`); tunnels stay for the
    life of the node (llama.cpp caches its connection per endpoint, so a
    peer keeps one loopback address).

    Args:
        context: the client TLS context (``--rpc-tls``, :func:`hydra_trio.transport.tls.client_context`).
        limit: most distinct peers (:data:`MAX_TUNNELS`).
    """

    def __init__(self, context: ssl.SSLContext, limit: int = MAX_TUNNELS) -> None:
        self.context = context
        self.limit = limit
        self.tunnels: dict[str, RpcTunnel] = {}  # real peer "host:port" -> its tunnel
        self._nursery: trio.Nursery | None = None
        self._lock = trio.Lock()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the tunnels' nursery until cancelled (then every tunnel closes)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def local_for(self, peer: str) -> str:
        """The loopback ``127.0.0.1:port`` that carries ``peer`` over TLS; starts its tunnel the first time.

        Raises:
            OSError: the pool is not running, holds :attr:`limit` tunnels already, or no port could be bound.
            hydra_trio.validation.strict.MessageError: a malformed ``peer``.
        """
        async with self._lock:
            tunnel = self.tunnels.get(peer)
            if tunnel is None:
                if self._nursery is None:
                    raise OSError("the TLS tunnel pool is not running")
                if len(self.tunnels) >= self.limit:
                    raise OSError(
                        f"{self.limit} TLS tunnels to other peers already: this head dials no new peer "
                        "until it restarts"
                    )
                tunnel = RpcTunnel(peer, self.context)
                await self._nursery.start(tunnel.run)
                self.tunnels[peer] = tunnel
            return tunnel.local

    def dial(self, peer: str) -> str:
        """From a worker thread (the engine thread): :meth:`local_for` run on the trio side.

        Raises OSError (including a malformed ``peer`` or a node shutting down) when no tunnel can serve ``peer``.
        """
        try:  # the reverse crossing (a thread waits for trio code: starting a tunnel in the nursery), which
            # bridge.Call (trio waits for a thread) does not serve: trio.from_thread.run is trio's own for it
            return trio.from_thread.run(self.local_for, peer)
        except (ValueError, trio.RunFinishedError, trio.Cancelled) as exc:  # MessageError is a ValueError
            raise OSError(f"no TLS tunnel to {peer}: {exc}") from None

    def stats(self) -> dict[str, dict[str, int | str]]:
        """Per real peer: the tunnel's ``local`` address, ``connections`` carried and ``failed`` connects."""
        return {
            peer: {"local": t.local, "connections": t.connections, "failed": t.failed}
            for peer, t in self.tunnels.items()
        }
