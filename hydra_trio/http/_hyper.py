"""Serve one already-accepted, already-classified trio stream with hypercorn.

hypercorn's trio worker is built for its own accept loop; its per-connection
server (``hypercorn.trio.tcp_server.TCPServer``) works on any trio
``SocketStream``, which is how the front door hands HTTP connections over.
This uses hypercorn internals (not public API): pyproject pins hypercorn's
minor version and ``tests/test_frontdoor.py`` exercises the path (split
request lines included).

Timeouts: hypercorn's ``read_timeout`` bounds *every* receive on the
connection, also while the server is busy producing a reply, so it would cut
long generations (a client that waits for its reply sends nothing).  It is
off; the times the server waits for the client are bounded instead by
hypercorn's keep-alive timer (idle connections and request headers), by
the app's body timeout, and by the write timeout: a client that takes none of
a reply's bytes for ``write_timeout`` seconds loses its connection
(:class:`~hydra_trio.http.settings.HttpSettings`; llama-server's ``-to`` is
both its read and its write timeout).

Everything here is per server: each :class:`HttpHandler` has its own
hypercorn ``Config`` (carrying its body limits) and its connections run this
module's protocol class, handed to hypercorn's ``ProtocolWrapper`` per
connection (:attr:`_TCPServer.protocol`).  Nothing of hypercorn's is
replaced process-wide, so two servers in one process (the library API) each
keep their own limits (``tests/test_embedded_servers.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import H11Protocol, ProtocolWrapper
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

from ..transport.frontdoor import AcceptedStream
from ..transport.tls import connection_info
from .settings import HttpSettings, waiting_for_client

log = logging.getLogger("hydra_trio.http")


class _Config(Config):
    """hypercorn's config plus this server's body limits (bytes, :class:`HttpSettings`'s), read per
    request by :class:`_H11Protocol`."""

    def __init__(self, settings: HttpSettings) -> None:
        self.max_body = settings.max_body
        self.max_state_body = settings.max_state_body

    def body_limit(self, request: h11.Request) -> int:
        """The app's limit for ``request``'s body in bytes: ``max_state_body`` for ``PUT
        /slots/{id}/state`` (a KV state blob, :mod:`hydra_trio.http.native`), ``max_body`` otherwise."""
        path = request.target.split(b"?", 1)[0]
        if request.method == b"PUT" and path.startswith(b"/slots/") and path.endswith(b"/state"):
            return self.max_state_body
        return self.max_body


class _H11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, but no ``100 Continue`` for a body over the cap, and
    ``Connection: close`` on a reply that starts before the request's body was read (:meth:`_send_h11_event`).

    hypercorn answers ``Expect: 100-continue`` itself, before the app sees
    the request; for a declared ``Content-Length`` over the server's limit
    (:meth:`_Config.body_limit`) the 100 is held back, so the client gets the
    app's 413 at once and never sends the body (RFC 9110 §10.1.1 lets a
    server answer with a final status instead).  Built for each connection
    of an :class:`HttpHandler` (:attr:`_TCPServer.protocol`);
    ``tests/test_http_edges.py`` and ``tests/test_embedded_servers.py``
    would catch a change in hypercorn that bypasses it.
    """

    config: _Config

    async def _check_protocol(self, request: h11.Request) -> None:
        """HTTP/1.1 only: ``Upgrade: h2c`` is ignored (RFC 9110 §7.8), the request answered in HTTP/1.1.

        hypercorn would switch to HTTP/2 here (``h2c``, or the ``PRI *`` prior-knowledge preface),
        where none of this class's nor :class:`_TCPServer`'s fixes apply: an HTTP/2 client's
        connection was held open, its request unfinished, until shutdown.  The preface
        (``PRI * HTTP/2.0``, which h11 parses as a request) gets 505 and the connection closes.
        """
        if request.method == b"PRI" and request.target == b"*":
            self._http2_refused = True
            await self._send_error_response(505)
            await self.send(Closed())

    _http2_refused = False

    async def _create_stream(self, request: h11.Request) -> None:
        if self._http2_refused:
            return
        declared = next((int(v) for k, v in request.headers if k == b"content-length" and v.isdigit()), 0)
        self._over_limit = declared > self.config.body_limit(request)
        await super()._create_stream(request)

    _over_limit = False

    async def _send_h11_event(self, event: Any) -> None:
        """hypercorn's send, but no ``100 Continue`` over the cap, and a reply that starts before the
        request's body was read whole says ``Connection: close``.

        hypercorn keeps a connection only if both sides are done when the reply ends, and closes it
        otherwise (``_maybe_recycle``) without telling the client.  A reply sent before the body was
        read (a 501 or 401 that needs no body, a 413 over the cap) then ended a kept-alive connection
        unannounced, and a client that sent its next request on it got no reply ("Server disconnected
        without sending a response").  With the header the client knows to open a new one (RFC 9112
        §9.6).  A reply to a request whose body the app read whole is unchanged.
        """
        if isinstance(event, h11.InformationalResponse) and event.status_code == 100 and self._over_limit:
            return
        if (
            isinstance(event, h11.Response)
            and self.connection.their_state is not h11.DONE
            and not any(k.lower() == b"connection" for k, _ in event.headers)
        ):
            event = h11.Response(
                status_code=event.status_code,
                headers=[*event.headers, (b"connection", b"close")],
                reason=event.reason,
                http_version=event.http_version,
            )
        await super()._send_h11_event(event)


class _TCPServer(TCPServer):
    """hypercorn's per-connection server, but a connection the client closed is closed at once.

    hypercorn's keep-alive timer is a task in the connection's task group;
    after the client's EOF (or reset) the read loop ends, yet the group (and
    so the socket, in CLOSE-WAIT) waits for that timer: up to
    ``keep_alive_timeout`` seconds per closed connection.  Here the timer
    stops once reading has ended, and is not started again by a reply that
    finishes afterwards (the connection closes then instead): the client's
    end is gone, so there is nothing left to wait for.
    ``tests/test_http_edges.py`` checks it with a 600 s keep-alive timeout.
    """

    _reading_done = False
    write_timeout: float | None = None  # seconds a send may wait for the client to read; None: no limit
    _protocol: ProtocolWrapper

    @property
    def protocol(self) -> ProtocolWrapper:
        """The connection's hypercorn ``ProtocolWrapper``, its HTTP/1.1 protocol this module's.

        hypercorn's ``TCPServer.run`` builds the wrapper, which picks hypercorn's own
        ``H11Protocol``; this setter swaps in :class:`_H11Protocol`, built with the same
        arguments, before ``run`` first uses it (``initiate()``; constructing hypercorn's
        protocol does no I/O).  So the fix is this connection's, not the process's.  (An
        ALPN ``h2`` TLS connection keeps hypercorn's H2Protocol: the front door offers no h2.)
        """
        return self._protocol

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        if type(wrapper.protocol) is H11Protocol:
            wrapper.protocol = _H11Protocol(
                wrapper.app,
                wrapper.config,
                wrapper.context,
                wrapper.task_group,
                wrapper.state,
                wrapper.ssl,
                wrapper.client,
                wrapper.server,
                wrapper.send,
            )
        self._protocol = wrapper

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            self._reading_done = True
            await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated) and event.idle and self._reading_done:
            await self._close()
            return
        if isinstance(event, Updated) and event.idle:
            # the keep-alive timer starts (``nursery.start``) in the task that ended the reply; after a
            # streamed reply that is Starlette's body task, which its response cancels as soon as the end
            # of the stream reaches the app as ``http.disconnect``: a cancel inside ``start`` reached the
            # new timer too, and the kept-alive connection then had no timer (neither the keep-alive
            # timeout nor a drain closed it: a node's stop waited out its whole grace).  Shielded, the
            # timer starts whole (``start`` returns as soon as it has).
            with trio.CancelScope(shield=True):
                await super().protocol_send(event)
            return
        if isinstance(event, RawData) and self.write_timeout is not None:
            await self._send_data(event.data, self.write_timeout)
            return
        await super().protocol_send(event)

    async def _close(self) -> None:
        """hypercorn's close (``send_eof``, then ``aclose``), but under the send lock when it is free.

        hypercorn calls ``send_eof`` without the lock its sends hold, and trio's ``send_eof`` keeps the
        stream's send side busy across a checkpoint: a reply the app sends in that moment failed with
        ``BusyResourceError`` (an ``ERROR`` traceback, and the client got no reply), e.g. a 404 or 405
        racing hypercorn's own 400 for a malformed chunked body (``tests/test_http_edges.py``).  Under
        the lock, a send that comes after the close finds the stream closed, which ends it as a client
        that went away.  A send that holds the lock now (it may be blocked on a client that reads
        nothing, or not yet inside ``send_all``) is not waited for and not raced: ``send_eof`` is
        skipped (hypercorn skips it too when the send side is busy) and ``aclose`` ends that send.

        Shielded, as hypercorn's own server-side close is: a close runs in whichever task ended the
        connection's last reply, and after a streamed reply that is Starlette's body task, which its
        response cancels as soon as the stream's end reaches the app; cut short there, a stream that
        ended during a stop left its connection open, and the stop waited out its grace.  Nothing here
        waits on the client.
        """
        with trio.CancelScope(shield=True):
            if self.send_lock.locked():
                await self.stream.aclose()
                return
            async with self.send_lock:
                await super()._close()

    async def _send_data(self, data: bytes, timeout: float) -> None:
        """hypercorn's send of reply bytes (shielded from the connection's cancellation, as hypercorn's),
        but a client that takes none of them for ``timeout`` seconds has its connection closed: the
        reply's stream ends as for a client that went away."""
        stalled = False
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True):
                    async with waiting_for_client(timeout) as timer:
                        await self.stream.send_all(data)
                stalled = timer.cancelled_caught
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
        if stalled:
            log.info(
                "HTTP client %s read nothing for %g s: connection closed (write timeout, -to)",
                connection_info(self.stream).peer,
                timeout,
            )
            await self._close()
            await self.protocol.handle(Closed())


class HttpHandler:
    """One server's hypercorn config and ASGI app: each handler keeps its own limits
    (:class:`HttpSettings`), so servers in one process do not share them."""

    def __init__(self, app: object, settings: HttpSettings = HttpSettings()) -> None:
        config = _Config(settings)
        config.keep_alive_timeout = settings.keep_alive_timeout
        config.read_timeout = None  # see the module docstring
        # hypercorn's access log is off: the app logs each request once (hydra_trio.http.app._access_log).
        # hypercorn's would log some requests twice: HTTPStream._send_closed awaits the send of the
        # end of the body before it marks the stream CLOSED, and a client that closes the connection
        # in that moment (urllib does, after each response) makes hypercorn handle StreamClosed on a
        # stream that is not CLOSED yet, which logs a '"GET /health 1.1" - -' line before the real one.
        config.accesslog = None
        config.errorlog = logging.getLogger("hydra_trio.http.error")
        self.config = config
        self.write_timeout = settings.write_timeout
        self.app = ASGIWrapper(app)  # type: ignore[arg-type]  # any ASGI app (hypercorn types its own kind)
        self.context = WorkerContext(None)

    async def __call__(self, stream: AcceptedStream) -> None:
        """Serve HTTP/1.1 on ``stream`` until the client or the server closes it."""
        server = _TCPServer(self.app, self.config, self.context, {}, stream)  # type: ignore[arg-type]  # any trio stream
        server.write_timeout = self.write_timeout
        await server.run()

    async def drain(self) -> None:
        """Graceful shutdown: idle keep-alive connections close now; the others after their reply.

        (hypercorn's ``WorkerContext.terminated``: its keep-alive timer and
        its request recycling both watch it.)
        """
        await self.context.terminated.set()
