"""The front door: one accept loop, first-byte classification, one task per connection.

Each accepted connection gets its own task, which peeks one byte with
``MSG_PEEK`` (so the byte stays in the stream), classifies it with
:func:`hydra_trio.protocol.classify.classify` and hands the untouched stream
to that protocol's handler (docs/hydra-protocol.md §1).

With a TLS server context (``--tls-cert``/``--tls-key``), a connection whose
first byte is ``0x16`` is unwrapped (:func:`hydra_trio.transport.tls.unwrap`: the
handshake, then the first bytes inside TLS) and the first byte inside is
classified the same way; the handler gets a :class:`~hydra_trio.transport.tls.TlsStream`.
The classify timeout covers the handshake and that first byte.  With
``--tls-required`` a plain connection from a non-loopback peer is closed
(counted ``plain_refused``).  Handlers learn who is on the other end with
:func:`hydra_trio.transport.tls.connection_info`.
"""

from __future__ import annotations

import collections
import errno
import logging
import socket
import ssl
import typing
from collections.abc import Mapping
from typing import Any, TypeAlias

import attrs
import trio

from ..protocol.classify import Protocol, classify
from .tls import HandshakeFailed, TlsStream, connection_info, plain_allowed, socket_info, unwrap

log = logging.getLogger("hydra_trio.frontdoor")

AcceptedStream: TypeAlias = "trio.SocketStream | TlsStream"
"""What a protocol handler is handed: the accepted TCP stream, or the unwrapped TLS connection
(:class:`~hydra_trio.transport.tls.TlsStream`, its first bytes pushed back); either way untouched by the front door."""


class ConnectionHandler(typing.Protocol):
    """One protocol's server side, as the front door calls it: serve one classified connection until it
    is done (the peer closed, a timeout, a drain).  The front door closes the stream afterwards;
    :class:`trio.BrokenResourceError` and :class:`trio.ClosedResourceError` from it end the
    connection quietly, any other exception is logged.  :class:`hydra_trio.http.HttpHandler`,
    :class:`hydra_trio.hydra.HydraHandler` and :class:`hydra_trio.rpc_backend.backend.RpcBackend` are ones."""

    async def __call__(self, stream: AcceptedStream, /) -> None: ...


@attrs.frozen
class FrontDoorSettings:
    """Limits of the front door.

    Attributes:
        max_connections: connections served at once; when reached, accepting
            pauses (the kernel's backlog holds the rest), which keeps the
            process within its file descriptors.
        classify_timeout: seconds to wait for the first byte before closing (for
            TLS: the handshake and the first byte inside it, together).
        tls: the server-side TLS context (``--tls-cert``/``--tls-key``); None: a
            ``0x16`` connection is closed as a protocol not served.
        tls_required: only loopback peers may connect without TLS (``--tls-required``).
    """

    max_connections: int = 1024
    classify_timeout: float = 5.0
    tls: ssl.SSLContext | None = None
    tls_required: bool = False


class FrontDoor:
    """Accepts on listeners and dispatches each connection by its first byte.

    ``handlers`` maps a :class:`Protocol` to its :class:`ConnectionHandler`
    (called with the stream); a protocol without a handler is closed with a log line.  Counts
    per protocol (plus ``timeout``, ``closed_early``; with TLS ``tls`` for the
    outer layer, then the protocol inside, ``tls_failed`` for a failed
    handshake, ``plain_refused`` for plain from a non-loopback peer under
    ``tls_required``) are in :attr:`counts`; connections open now by
    protocol in :attr:`open_by_protocol`.
    """

    def __init__(
        self, handlers: Mapping[Protocol, ConnectionHandler], settings: FrontDoorSettings = FrontDoorSettings()
    ) -> None:
        self.handlers: dict[Protocol, ConnectionHandler] = dict(handlers)
        self.settings = settings
        self.counts: collections.Counter[str] = collections.Counter()
        self.active = 0
        self.open_by_protocol: collections.Counter[str] = collections.Counter()
        self._limiter = trio.CapacityLimiter(settings.max_connections)
        self._accepting = trio.CancelScope()
        self._none_active = trio.Event()
        self._none_active.set()

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on every listener until cancelled (or :meth:`stop_accepting`); connections live in this task's
        nursery."""
        async with trio.open_nursery() as connections, trio.open_nursery() as accepting:
            self._accepting = accepting.cancel_scope
            for listener in listeners:
                accepting.start_soon(self._accept_loop, listener, connections)
            task_status.started()

    def stop_accepting(self) -> None:
        """Stop accepting new connections; the ones in flight go on."""
        self._accepting.cancel()

    async def wait_no_connections(self) -> None:
        """Return once no connection is open (at once if none is)."""
        while self.active:
            await self._none_active.wait()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            token = object()  # the connection's hold on the limiter
            await self._limiter.acquire_on_behalf_of(token)
            try:
                stream = await listener.accept()
            except OSError as exc:
                self._limiter.release_on_behalf_of(token)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("accept failed (%s); pausing 100 ms", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            except BaseException:
                self._limiter.release_on_behalf_of(token)
                raise
            nursery.start_soon(self._connection, stream, token)

    async def _connection(self, stream: trio.SocketStream, token: object) -> None:
        if not self.active:
            self._none_active = trio.Event()
        self.active += 1
        peer = peer_name(stream)
        proto: Protocol | None = None
        try:
            conn: AcceptedStream = stream
            first = b""
            with trio.move_on_after(self.settings.classify_timeout) as scope:
                first = await _first_byte(stream)
                if first and classify(first) is Protocol.TLS and self.settings.tls is not None:
                    self.counts["tls"] += 1
                    try:
                        unwrapped = await unwrap(stream, self.settings.tls)
                    except HandshakeFailed as exc:
                        self.counts["tls_failed"] += 1
                        log.info("%s: TLS handshake failed: %s; closed", peer, exc)
                        return
                    first = b""
                    if unwrapped is not None:
                        conn, first = unwrapped, unwrapped.peek()
                        info = unwrapped.info
                        log.info(
                            "%s: TLS %s%s",
                            peer,
                            info.tls_version,
                            f", client certificate subject {info.tls_subject!r}" if info.tls_subject else "",
                        )
            if scope.cancelled_caught:
                self.counts["timeout"] += 1
                log.info("%s: no first byte within %.1f s; closed", peer, self.settings.classify_timeout)
                return
            if not first:
                self.counts["closed_early"] += 1
                return
            if conn is stream and not plain_allowed(socket_info(stream).host, self.settings.tls_required):
                self.counts["plain_refused"] += 1
                log.warning("%s: plain (not TLS) connection from a non-loopback peer; --tls-required; closed", peer)
                return
            proto = classify(first)
            if conn is not stream and proto is Protocol.TLS:
                proto = Protocol.UNKNOWN  # TLS inside TLS
            self.counts[proto.value] += 1
            self.open_by_protocol[proto.value] += 1
            handler = self.handlers.get(proto)
            if handler is None:
                if proto is Protocol.UNKNOWN:
                    log.warning("%s: unknown first byte 0x%02x; closed", peer, first[0])
                else:
                    log.info(
                        "%s: %s connection (first byte 0x%02x) not served yet; closed", peer, proto.value, first[0]
                    )
                return
            await handler(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("%s: connection handler failed", peer)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(conn)
            self._limiter.release_on_behalf_of(token)
            if proto is not None:
                self.open_by_protocol[proto.value] -= 1
            self.active -= 1
            if not self.active:
                self._none_active.set()


MAX_LEADING_EMPTY_LINES = 8


async def _first_byte(stream: trio.SocketStream) -> bytes:
    """The connection's first byte, peeked (``MSG_PEEK``: it stays in the stream); b"" if the peer closed.

    Empty lines before an HTTP request line are consumed: RFC 9112 §2.2 says a
    server should ignore at least one CRLF there, and none of the three
    protocols begins with CR or LF.  At most 8 such lines are skipped.
    """
    try:
        for _ in range(2 * MAX_LEADING_EMPTY_LINES):
            first = await stream.socket.recv(1, socket.MSG_PEEK)
            if first not in (b"\r", b"\n"):
                return first
            await stream.socket.recv(1)
        return await stream.socket.recv(1, socket.MSG_PEEK)
    except OSError:
        return b""


def peer_name(stream: Any) -> str:
    """``host:port`` of the stream's remote end (plain or TLS), for log lines; ``?`` once the socket has no peer."""
    return connection_info(stream).peer
