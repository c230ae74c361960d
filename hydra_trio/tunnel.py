"""An encrypted ggml-RPC link between hydra-trio nodes: a local plain port, TLS to the peer's one port.

ggml's RPC client (inside llama.cpp) speaks plain TCP only.  A head started
with ``--rpc-engine HOST:PORT --rpc-tls`` gives ggml's client
``127.0.0.1:<tunnel port>`` instead; every connection to that loopback port
is carried over TLS to ``HOST:PORT``, whose front door unwraps TLS and
classifies ``0x0E`` (ggml-RPC) as for a plain connection.  One TLS
connection per ggml connection; bytes are copied both ways as they come (no
framing: the peer validates the messages).

The peer's certificate is verified against the client context (``--tls-ca``)
and must name ``HOST`` (an IP address in the certificate's subjectAltName
for ``--rpc-engine 10.0.0.5:8080``).  The head's own ``--tls-cert`` is
presented for a peer with ``--tls-client-ca``.

:data:`TUNNELS` maps a tunnel's local address to its peer, so the server's
peer watchdog (:func:`hydra_trio.engine.combined.peer_listening`) looks at
the real peer, not at the tunnel (which always accepts).  The HELLO probe
``peer_reachable`` goes through the tunnel (a tunnel that cannot reach the
peer closes at once, so the probe fails).
"""

from __future__ import annotations

import logging
import socket
import ssl

import trio

from .protocol.address import parse_peer

log = logging.getLogger("hydra_trio.tunnel")

TUNNELS: dict[str, str] = {}
"""Local ``127.0.0.1:port`` of each tunnel in this process → the peer's ``host:port``."""

COPY_BUFFER = 1 << 20  # bytes per receive: ggml-RPC moves tensors in large messages


def through_tunnel(peer: str) -> str:
    """The address a check should probe for ``peer``: the tunnel's peer when ``peer`` is a tunnel, else ``peer``."""
    return TUNNELS.get(peer, peer)


class RpcTunnel:
    """A loopback listener (bound at construction) that carries each connection over TLS to ``peer``.

    Args:
        peer: ``host:port`` of the peer node (its one port, with ``--tls-cert``).
        context: the client context (:func:`hydra_trio.tls.client_context`).
        connect_timeout: seconds for the TCP connect plus the TLS handshake.

    Raises:
        OSError: no loopback port could be bound.
        hydra_trio.protocol.strict.MessageError: a malformed ``peer``.

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
        TUNNELS[self.local] = peer

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept on the loopback port and carry each connection until cancelled."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        log.info("ggml-RPC tunnel %s -> %s over TLS", self.local, self.peer)
        try:
            async with listener, trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    client = await listener.accept()
                    nursery.start_soon(self._carry, client)
        finally:
            TUNNELS.pop(self.local, None)

    async def _connect(self) -> trio.SSLStream[trio.SocketStream] | None:
        try:
            with trio.fail_after(self.connect_timeout):
                tcp = await trio.open_tcp_stream(self.host, self.port)  # TCP_NODELAY: trio sets it
                tls = trio.SSLStream(tcp, self.context, server_hostname=self.host)
                try:
                    await tls.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
                return tls
        except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            self.failed += 1
            log.warning("ggml-RPC tunnel to %s: %s", self.peer, getattr(exc, "__cause__", None) or exc or "timeout")
            return None

    async def _carry(self, client: trio.SocketStream) -> None:
        """One ggml connection: TLS to the peer, then bytes both ways until either side closes."""
        try:
            remote = await self._connect()
            if remote is None:
                return  # ggml's client sees the connection close: the peer is unreachable
            self.connections += 1
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_copy, client, remote, nursery.cancel_scope)
                    nursery.start_soon(_copy, remote, client, nursery.cancel_scope)
            finally:
                await trio.aclose_forcefully(remote)
        finally:
            await trio.aclose_forcefully(client)


async def _copy(src: trio.abc.ReceiveStream, dst: trio.abc.SendStream, done: trio.CancelScope) -> None:
    """Copy ``src`` to ``dst`` until EOF or an error on either side; then end both directions (``done``).

    No half-close: trio's TLS stream has none, and a ggml-RPC connection that
    closes one way is over.
    """
    try:
        while True:
            data = await src.receive_some(COPY_BUFFER)
            if not data:
                break
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        done.cancel()
