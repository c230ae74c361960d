"""One persistent trio TCP connection to a Hydra engine, client side, kept in sync.

The transport under `hydra_trio.hydra.client.HydraClient`: framing of
docs/hydra-protocol.md §2 with the sans-I/O codec in `hydra_trio.protocol.hydra`
(`encode_request_header` to send, `ResponseDecoder` to read), one exchange
at a time, and the generic requests (`HydraConnection.open_request`,
`exchange`, `request`) that the typed opcodes are built on. Imports neither
llama.cpp nor the server.

Rules the connection keeps (docs/hydra-protocol.md §2):

- One request at a time per connection: every call takes the connection's
  `trio.Lock` for the whole exchange (for streamed replies: until the
  ``async with`` block ends). Calls from several tasks queue up. Starting a
  second request from the task that holds a streamed reply open raises
  RuntimeError.
- Every reply is read to its last payload byte, whatever its status, so the
  connection stays in sync. A non-OK status raises the `HydraError`
  subclass of that status *after* the payload is drained; the connection
  stays usable.
- ``timeout`` (seconds) bounds each wait for progress: each send of at most
  256 KiB and each receive. A request that keeps making progress may take
  longer in total. On a timeout the connection is out of sync: it is
  closed and `HydraTimeout` raised. The same happens (connection closed,
  error raised) when the server closes it (`HydraConnectionClosed`), sends
  bad framing (`HydraProtocolError`), or the request is cancelled or fails
  mid-frame (the original exception propagates). After that every call
  raises `HydraConnectionClosed` until `connect()` opens a new connection,
  unless the connection was made with ``reconnect=True`` (then the next
  call opens a new connection; no request is ever retried).

All sizes are in bytes, all times in seconds.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from typing import Any, Self

import trio

from ..protocol.hydra import (
    NEED_DATA,
    Op,
    PayloadChunk,
    ProtocolError,
    ResponseDecoder,
    ResponseEnded,
    ResponseEvent,
    ResponseStarted,
    Status,
    encode_request,
    encode_request_header,
)
from ..transport.tls_bulk import receives_bulk, recv_bulk_into, send_bulk
from ..validation.address import parse_peer
from .errors import (
    HydraConnectError,
    HydraConnectionClosed,
    HydraProtocolError,
    HydraTimeout,
    error_for_status,
)
from .streams import HydraReply, ResponseStream

__all__ = ["CHUNK_SIZE", "HydraConnection", "Payload", "new_trace_id"]

CHUNK_SIZE = 256 * 1024
"""Bytes per send and most bytes per receive (256 KiB buffers,
docs/hydra-protocol.md §2)."""

Payload = bytes | bytearray | memoryview
"""A request payload held in memory."""


def new_trace_id() -> str:
    """A short random trace id: 8 lowercase hex characters."""
    return secrets.token_hex(4)


def _os_reason(exc: BaseException) -> str:
    """Best words for why a connect failed (trio wraps per-address errors)."""
    seen: list[BaseException] = [exc]
    while seen:
        e = seen.pop(0)
        if isinstance(e, BaseExceptionGroup):
            seen.extend(e.exceptions)
        elif isinstance(e, OSError) and (e.errno or e.strerror):
            # trio's strerror repeats the address; name errors (gaierror)
            # have negative errnos and a good strerror.
            return os.strerror(e.errno) if e.errno and e.errno > 0 else str(e.strerror)
        if e.__cause__ is not None:
            seen.append(e.__cause__)
    return str(exc) or type(exc).__name__


class HydraConnection:
    """A Hydra engine connection: generic requests over one persistent TCP stream.

    Args:
        host, port: the engine's address.
        timeout: seconds without progress before a send/receive (and the
            connect) gives up with `HydraTimeout`.
        reconnect: when the connection was dropped after an error, open a
            new one on the next call instead of raising
            `HydraConnectionClosed` (requests are never retried).
        max_meta: largest reply meta accepted, bytes (default: the 24-bit
            wire maximum); a larger one is a `HydraProtocolError`.
        token: the node's ``--hydra-token``: each new connection first sends
            CONFIGURE ``{"auth": token}``, which makes it trusted for the ops
            that change the node (docs/protocol-notes.md, "Access").  A
            wrong token makes `connect` raise `HydraBadRequest` (meta
            ``refused: "invalid_token"``) and close the connection.
        ssl_context: speak TLS (the node's ``--tls-cert``); the server's
            certificate is verified against it and must name ``host``
            (`hydra_trio.transport.tls.client_context` makes one, with a client
            certificate for mutual TLS). None: plain TCP.

    Use as ``async with`` or call `connect` / `aclose`. Raises ValueError for
    a timeout that is not > 0.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = 30.0,
        reconnect: bool = False,
        max_meta: int | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.host: str = host
        self.port: int = int(port)
        self.timeout: float = float(timeout)
        self.reconnect: bool = reconnect
        self._max_meta = max_meta
        self.token = token
        self.trusted: bool | None = None  # what the node answered to the token; None: not sent
        self.ssl_context = ssl_context
        self._lock = trio.Lock()
        self._stream: trio.abc.Stream | None = None
        self._decoder = ResponseDecoder()
        self._in_request = False
        self._closed_reason: str | None = "not connected"
        self._ever_connected = False

    @classmethod
    def from_address(cls, address: str, **kwargs: Any) -> Self:
        """A connection for ``"HOST:PORT"`` (IPv6 as ``"[::1]:PORT"``);
        kwargs as for the constructor. Raises ValueError on a malformed
        address."""
        host, port = parse_peer(address, field="address")
        return cls(host, port, **kwargs)

    @property
    def address(self) -> str:
        """``"host:port"``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def connected(self) -> bool:
        """True while a connection is open and in sync."""
        return self._stream is not None

    def __repr__(self) -> str:
        state = "connected" if self.connected else f"closed ({self._closed_reason})"
        return f"<{type(self).__name__} {self.address} {state}>"

    # -- connection ---------------------------------------------------------

    async def connect(self) -> None:
        """Open the TCP connection, with the TLS handshake when ``ssl_context`` is set (no-op when already open).

        Raises `HydraConnectError` (an OSError) when it cannot be opened or the
        TLS handshake fails (an untrusted or wrong-name certificate),
        `HydraTimeout` after ``timeout`` seconds.
        """
        if self._stream is not None:
            return
        try:
            with trio.fail_after(self.timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
                if self.ssl_context is not None:
                    tls = trio.SSLStream(stream, self.ssl_context, server_hostname=self.host)
                    try:
                        await tls.do_handshake()
                    except trio.BrokenResourceError as exc:
                        await trio.aclose_forcefully(stream)
                        raise HydraConnectError(
                            self.host, self.port, f"TLS handshake failed: {exc.__cause__ or exc}"
                        ) from exc
                    stream = tls
        except HydraConnectError:
            raise
        except trio.TooSlowError:
            raise HydraTimeout(f"connecting to {self.address} took more than {self.timeout:g} s") from None
        except OSError as exc:
            raise HydraConnectError(self.host, self.port, _os_reason(exc)) from exc
        self._stream = stream
        self._decoder = ResponseDecoder(**({} if self._max_meta is None else {"max_meta": self._max_meta}))
        self._in_request = False
        self._closed_reason = None
        self._ever_connected = True
        if self.token is not None:
            await self._present_token()

    async def _present_token(self) -> None:
        """Send CONFIGURE ``{"auth": token}`` on the fresh connection and read its reply (outside the
        request lock: `connect` may run inside `begin_exchange`).  Sets `trusted`; on any failure the
        connection is closed and the error raised (`HydraBadRequest` for a wrong token)."""
        stream = self._stream
        assert stream is not None and self.token is not None
        trace_id = new_trace_id()
        frame = encode_request(Op.CONFIGURE, "", json.dumps({"auth": self.token}).encode(), trace_id)
        started: ResponseStarted | None = None
        try:
            with trio.fail_after(self.timeout):
                await stream.send_all(frame)
                while not isinstance(ev := self._decoder.next_event(), ResponseEnded):
                    if isinstance(ev, ResponseStarted):
                        started = ev
                    elif ev is NEED_DATA:
                        data = await stream.receive_some(CHUNK_SIZE)
                        if not data:
                            raise HydraConnectionClosed(
                                f"{self.address} closed the connection before answering the token",
                                op=Op.CONFIGURE,
                                trace_id=trace_id,
                            )
                        self._decoder.receive_data(data)
        except trio.TooSlowError:
            await self._abort("token exchange timed out")
            raise HydraTimeout(
                f"{self.address} did not answer the token within {self.timeout:g} s", op=Op.CONFIGURE, trace_id=trace_id
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError, HydraConnectionClosed) as exc:
            await self._abort(f"token exchange failed: {exc}")
            if isinstance(exc, HydraConnectionClosed):
                raise
            raise HydraConnectionClosed(
                f"token exchange with {self.address} failed: {exc}", op=Op.CONFIGURE, trace_id=trace_id
            ) from exc
        assert started is not None
        if started.header.status != Status.OK:
            await self._abort("the node refused the token")
            raise error_for_status(started.header.status, started.meta, op=Op.CONFIGURE, trace_id=trace_id)
        self.trusted = bool(started.meta.get("trusted", False))

    async def aclose(self) -> None:
        """Close the connection (idempotent). A request running in another
        task then fails with `HydraConnectionClosed`."""
        await self._abort("closed by the client")

    async def _abort(self, reason: str) -> None:
        """Forget the connection (it is out of sync or closed) and close it."""
        stream, self._stream = self._stream, None
        if stream is not None:
            self._closed_reason = reason
        self._in_request = False
        if stream is not None:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _closed_error(self, rs: ResponseStream | None = None) -> HydraConnectionClosed:
        return HydraConnectionClosed(
            f"connection to {self.address} is closed: {self._closed_reason}",
            op=None if rs is None else rs.op,
            trace_id=None if rs is None else rs.trace_id,
        )

    # -- one exchange at a time (the `ReplyTransport` of ResponseStream) -----

    async def begin_exchange(self) -> None:
        """Take the lock and open the connection when needed (first use, or
        ``reconnect``). Raises RuntimeError when this task already holds the
        lock, `HydraConnectionClosed` when the connection was dropped and
        may not be reopened, what `connect` raises; on error the lock is free."""
        if self._lock.statistics().owner is trio.lowlevel.current_task():
            raise RuntimeError(
                "this task already has a streamed reply open on this HydraClient: "
                "finish it (leave its `async with`, or aclose() a bare decode_stream) "
                "before sending another request"
            )
        await self._lock.acquire()
        try:
            if self._stream is None:
                if self._ever_connected and not self.reconnect:
                    raise self._closed_error()
                await self.connect()
        except BaseException:
            self._lock.release()
            raise

    async def end_exchange(self, *, failed: bool) -> None:
        """Release the lock; when ``failed`` and the request is still
        mid-frame (the stream is out of sync), close the connection first."""
        try:
            if failed and self._in_request:
                await self._abort("a request failed mid-frame")
        finally:
            self._lock.release()

    def reply_complete(self) -> None:
        """The whole reply has been read: the stream is in sync again."""
        self._in_request = False

    async def next_event(self, rs: ResponseStream) -> ResponseEvent:
        """The next reply event for ``rs``, receiving as needed (each receive
        bounded by ``timeout``). Raises `HydraTimeout`,
        `HydraConnectionClosed`, `HydraProtocolError` (connection closed)."""
        while True:
            try:
                ev = self._decoder.next_event()
            except ProtocolError as exc:
                await self._abort(f"protocol error: {exc}")
                raise HydraProtocolError(
                    f"bad reply from {self.address}: {exc}", op=rs.op, trace_id=rs.trace_id
                ) from exc
            if ev is not NEED_DATA:
                return ev
            stream = self._stream
            if stream is None:
                raise self._closed_error(rs)
            try:
                with trio.fail_after(self.timeout):
                    data = await stream.receive_some(CHUNK_SIZE)
            except trio.TooSlowError:
                await self._abort("receive timed out")
                raise HydraTimeout(
                    f"no reply data from {self.address} for {self.timeout:g} s (op 0x{rs.op:02x}, trace {rs.trace_id})",
                    op=rs.op,
                    trace_id=rs.trace_id,
                ) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                await self._abort("connection lost")
                why = str(exc) or str(exc.__cause__ or "") or type(exc).__name__
                if isinstance(stream, trio.SSLStream):
                    why += (
                        " (over TLS: the node may have refused the handshake, e.g. it requires a client "
                        "certificate: --tls-cert/--tls-key; its log says why)"
                    )
                raise HydraConnectionClosed(
                    f"connection to {self.address} lost: {why}", op=rs.op, trace_id=rs.trace_id
                ) from exc
            if not data:
                mid = "mid-reply" if not self._decoder.idle or rs.payload_len else "before replying"
                await self._abort("closed by the server")
                raise HydraConnectionClosed(
                    f"{self.address} closed the connection {mid}", op=rs.op, trace_id=rs.trace_id
                )
            self._decoder.receive_data(data)

    async def receive_payload_into(self, rs: ResponseStream, view: memoryview) -> int:
        """The rest of ``rs``'s payload into ``view``; the bytes written (:meth:`_receive_payload_into`)."""
        return await self._receive_payload_into(rs, view)

    async def _send_all(self, data: Payload, rs: ResponseStream, *, bulk: bool = False, head: bytes = b"") -> None:
        """Send ``head`` then ``data``; ``bulk``: in `CHUNK_SIZE` pieces by
        `hydra_trio.transport.tls_bulk.send_bulk` (on plain TCP ``head`` rides in its first write)."""
        stream = self._stream
        if stream is None:
            raise self._closed_error(rs)
        self._in_request = True  # from the first byte on, a failure desyncs the stream
        try:
            if bulk:
                await send_bulk(stream, memoryview(data).cast("B"), CHUNK_SIZE, self.timeout, head=head)
            else:
                if head:
                    with trio.fail_after(self.timeout):
                        await stream.send_all(head)
                with trio.fail_after(self.timeout):
                    await stream.send_all(data)
        except trio.TooSlowError:
            await self._abort("send timed out")
            raise HydraTimeout(
                f"sending to {self.address} made no progress for {self.timeout:g} s",
                op=rs.op,
                trace_id=rs.trace_id,
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # The server may have replied (e.g. BAD_REQUEST: payload over its
            # cap) and closed without reading the rest: surface that reply.
            reply = await self._salvage_reply()
            await self._abort("the server closed the connection while the request was sent")
            if reply is not None and reply.header.status != Status.OK:
                raise error_for_status(reply.header.status, reply.meta, op=rs.op, trace_id=rs.trace_id) from exc
            raise HydraConnectionClosed(
                f"{self.address} closed the connection while the request was sent",
                op=rs.op,
                trace_id=rs.trace_id,
            ) from exc

    # -- generic requests ----------------------------------------------------

    def open_request(
        self,
        op: int,
        key: str = "",
        payload: Payload = b"",
        trace_id: str | None = None,
        *,
        check: bool = True,
    ) -> ResponseStream:
        """Send one request with an in-memory payload; the reply is streamed.

        Returns a `ResponseStream` to use with ``async with``. ``check``:
        raise the non-OK status on entry (default) or leave it to the caller
        (``stream.status``). Raises ValueError now for a key or trace id
        that cannot be encoded.
        """
        tid = new_trace_id() if trace_id is None else trace_id
        header = encode_request_header(op, key, tid, len(payload))

        async def send(rs: ResponseStream) -> None:
            if len(payload) <= CHUNK_SIZE:
                await self._send_all(header + bytes(payload), rs)
                return
            await self._send_all(payload, rs, bulk=True, head=header)

        return ResponseStream(self, op, key, tid, send, check)

    def open_request_from_file(
        self,
        op: int,
        key: str,
        path: str | os.PathLike[str],
        trace_id: str | None = None,
        *,
        check: bool = True,
    ) -> ResponseStream:
        """Like `open_request`, the payload streamed from the file at
        ``path`` in `CHUNK_SIZE` pieces (never held whole in memory). The
        file size at open time is the payload_len; a file that shrinks while
        being sent raises OSError and closes the connection."""
        tid = new_trace_id() if trace_id is None else trace_id

        async def send(rs: ResponseStream) -> None:
            async with await trio.open_file(path, "rb") as f:
                size = (await trio.to_thread.run_sync(os.fstat, f.fileno())).st_size  # file I/O: off the loop
                await self._send_all(encode_request_header(op, key, tid, size), rs)
                left = size
                while left:
                    chunk = await f.read(min(CHUNK_SIZE, left))
                    if not chunk:
                        raise OSError(
                            f"{os.fspath(path)!r} shrank while being sent ({size - left} of {size} bytes sent)"
                        )
                    await self._send_all(chunk, rs)
                    left -= len(chunk)

        return ResponseStream(self, op, key, tid, send, check)

    async def exchange(self, op: int, key: str = "", payload: Payload = b"", trace_id: str | None = None) -> HydraReply:
        """One request, the whole reply in memory, whatever its status
        (no HydraError for a non-OK status; transport errors still raise)."""
        async with self.open_request(op, key, payload, trace_id, check=False) as rs:
            data = await rs.read_all()
        return HydraReply(rs.status, rs.meta, data)

    async def request(
        self, op: int, key: str = "", payload: Payload = b"", trace_id: str | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """One request, reply in memory: ``(meta, payload_bytes)``. Raises the
        `HydraError` subclass of a non-OK status (after reading its payload)."""
        async with self.open_request(op, key, payload, trace_id) as rs:
            data = await rs.read_all()
        return rs.meta, data

    async def _receive_payload_into(self, rs: ResponseStream, view: memoryview) -> int:
        """`HydraConnection.receive_payload_into`: read the rest of ``rs``'s payload into ``view`` (at least
        ``rs.remaining`` bytes long); returns the bytes written.  On a plain TCP stream the bytes go from the socket
        straight into ``view``
        (`hydra_trio.transport.net.recv_into_view`: as much as the kernel holds per read), past the decoder; over
        TLS they are decrypted straight into it on a worker thread (`hydra_trio.transport.tls_bulk.tls_recv_into_view`;
        under 256 KiB left: the decrypted chunks are copied in).  ``timeout`` bounds each wait for progress; errors as
        `next_event`."""
        pos = 0
        while not rs.done and (ev := self._decoder.next_event()) is not NEED_DATA:  # what came with the reply header
            pos += self._take_event(rs, view, pos, ev)
        stream = self._stream
        left = self._decoder.payload_remaining
        if not rs.done and left and receives_bulk(stream, left):
            try:
                got, closed = await recv_bulk_into(stream, view[pos : pos + left], self.timeout)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                await self._abort("connection lost")
                raise HydraConnectionClosed(
                    f"connection to {self.address} lost: {exc}", op=rs.op, trace_id=rs.trace_id
                ) from exc
            pos += got
            rs.received += got
            self._decoder.skip_payload(got)
            if got < left:
                await self._abort("closed by the server" if closed else "receive timed out")
                if closed:
                    raise HydraConnectionClosed(
                        f"{self.address} closed the connection mid-reply", op=rs.op, trace_id=rs.trace_id
                    )
                raise HydraTimeout(
                    f"no reply data from {self.address} for {self.timeout:g} s (op 0x{rs.op:02x}, trace {rs.trace_id})",
                    op=rs.op,
                    trace_id=rs.trace_id,
                )
        while not rs.done:  # TLS (or the end event still to come): through the decoder
            pos += self._take_event(rs, view, pos, await self.next_event(rs))
        return pos

    def _take_event(self, rs: ResponseStream, view: memoryview, pos: int, ev: ResponseEvent) -> int:
        """Apply reply event ``ev`` to ``rs``: a payload chunk is copied to ``view[pos:]``
        (its length returned), the end marks the reply complete."""
        if isinstance(ev, PayloadChunk):
            view[pos : pos + len(ev.data)] = ev.data
            rs.received += len(ev.data)
            return len(ev.data)
        if isinstance(ev, ResponseEnded):
            rs.done = True
            self.reply_complete()
            return 0
        raise HydraProtocolError(
            f"unexpected {type(ev).__name__} inside a reply payload",  # pragma: no cover
            op=rs.op,
            trace_id=rs.trace_id,
        )

    async def _salvage_reply(self) -> ResponseStarted | None:
        """A reply header the server sent before closing, read for at most
        2 s; None when there is none (or it is unreadable)."""
        stream = self._stream
        if stream is None:
            return None
        with trio.move_on_after(min(self.timeout, 2.0)):
            try:
                while True:
                    while (ev := self._decoder.next_event()) is not NEED_DATA:
                        if isinstance(ev, ResponseStarted):
                            return ev
                    data = await stream.receive_some(CHUNK_SIZE)
                    if not data:
                        return None
                    self._decoder.receive_data(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
                return None
        return None
