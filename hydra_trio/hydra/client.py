"""Async Hydra protocol client over one persistent trio TCP connection.

Speaks the binary engine protocol of hydra-protocol.md §2 (framing) and §3
(engine opcodes), using the sans-I/O codec in `hydra_trio.protocol.hydra`
(`encode_request_header` to send, `ResponseDecoder` to read). Imports neither
llama.cpp nor the server.

Usage::

    async with HydraClient("127.0.0.1", 8080, timeout=30.0) as c:
        info = await c.info()
        meta = await c.state_get_to_file(0, "slot0.kv")
        await c.state_put_from_file(1, "slot0.kv")
        tokens = await c.decode(1, {"n_predict": 16})

    client = HydraClient.from_address("10.0.0.5:8080")   # same thing

Rules the client keeps (hydra-protocol.md §2):

- One request at a time per connection: every call takes the client's
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
  unless the client was made with ``reconnect=True`` (then the next call
  opens a new connection; no request is ever retried).

All sizes are in bytes, all times in seconds.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import secrets
import struct
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Self, TypeAlias

import attrs
import trio

from ..protocol.hydra import (
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_FRAME_SIZE,
    Op,
    PayloadChunk,
    ProtocolError,
    ResponseDecoder,
    ResponseEnded,
    ResponseEvent,
    ResponseStarted,
    Status,
    encode_request_header,
    unpack_decode_frames,
)
from ..protocol.messages import parse_peer

__all__ = [
    "CHUNK_SIZE",
    "DecodeFrame",
    "DecodeStream",
    "HydraBadRequest",
    "HydraBusy",
    "HydraClient",
    "HydraConnectError",
    "HydraConnectionClosed",
    "HydraError",
    "HydraNotFound",
    "HydraNotImplemented",
    "HydraPartial",
    "HydraProtocolError",
    "HydraReply",
    "HydraServerError",
    "HydraTimeout",
    "ResponseStream",
    "error_for_status",
    "new_trace_id",
]

CHUNK_SIZE = 256 * 1024
"""Bytes per send and most bytes per receive (the spec's 256 KiB buffers,
hydra-protocol.md §2)."""

DecodeFrame: TypeAlias = tuple[int, float, int]
"""One DECODE frame: ``(token_id, logprob, flags)`` (hydra-protocol.md §3)."""


def new_trace_id() -> str:
    """A short random trace id: 8 lowercase hex characters."""
    return secrets.token_hex(4)


def _json_bytes(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _slot_key(slot: int) -> str:
    if not isinstance(slot, int) or isinstance(slot, bool):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    return str(slot)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class HydraError(Exception):
    """Base of every error this client raises about a request.

    Attributes:
        status: the reply's `Status` (a plain int for a code newer than
            `Status`); None for transport errors (`HydraTimeout`,
            `HydraConnectionClosed`, `HydraProtocolError`).
        meta: the reply's meta JSON object (``{}`` for transport errors).
        message: ``meta["error"]`` when the server sent one, else a
            description; also ``str(exc)``.
        op: the request's opcode, when known.
        trace_id: the request's trace id, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        status: Status | int | None = None,
        meta: dict[str, Any] | None = None,
        op: int | None = None,
        trace_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message: str = message
        self.status: Status | int | None = status
        self.meta: dict[str, Any] = {} if meta is None else meta
        self.op: int | None = op
        self.trace_id: str | None = trace_id

    @property
    def status_name(self) -> str:
        """``"BUSY"``, ``"NOT_FOUND"``, ...; ``"STATUS_0x..`` for unknown
        codes; the class's transport label when status is None."""
        if isinstance(self.status, Status):
            return self.status.name
        if self.status is not None:
            return f"STATUS_0x{self.status:02x}"
        return _TRANSPORT_NAMES.get(type(self), "ERROR")


class HydraNotFound(HydraError):
    """Status NOT_FOUND (0x01): e.g. slot id out of range."""


class HydraServerError(HydraError):
    """Status ERROR (0x02): the engine failed (e.g. STATE_PUT of a blob from
    another model: meta has ``expected_hash`` / ``got_hash``)."""


class HydraPartial(HydraError):
    """Status PARTIAL (0x03)."""


class HydraBusy(HydraError):
    """Status BUSY (0x04): e.g. SET_EXPERT_MODE while slots are processing;
    meta has ``busy_slots`` (list of slot ids)."""


class HydraBadRequest(HydraError):
    """Status BAD_REQUEST (0x05): malformed key or payload, payload over the
    server's cap (the server then closes the connection)."""


class HydraNotImplemented(HydraError):
    """Status NOT_IMPLEMENTED (0x06): unknown or unsupported opcode."""


class HydraTimeout(HydraError):
    """No progress for ``timeout`` seconds while sending or receiving. The
    connection has been closed (it is out of sync)."""


class HydraConnectionClosed(HydraError):
    """The server closed the connection (or it was closed earlier after an
    error, or by `HydraClient.aclose`)."""


class HydraProtocolError(HydraError):
    """The server's reply broke the framing (bad meta JSON, a DECODE payload
    that is not whole 9-byte frames, ...). For framing errors the connection
    has been closed."""


class HydraConnectError(ConnectionError):
    """The TCP connection could not be opened (refused, unreachable, name
    resolution failed). An OSError, not a HydraError: no request was sent.
    ``host`` and ``port`` say where; ``reason`` is the underlying cause in
    words (e.g. ``"Connection refused"``)."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot connect to {host}:{port}: {reason}")
        self.host = host
        self.port = port
        self.reason = reason


_TRANSPORT_NAMES: dict[type[HydraError], str] = {
    HydraTimeout: "TIMEOUT",
    HydraConnectionClosed: "CONNECTION_CLOSED",
    HydraProtocolError: "PROTOCOL_ERROR",
}

_STATUS_ERRORS: dict[int, type[HydraError]] = {
    Status.NOT_FOUND: HydraNotFound,
    Status.ERROR: HydraServerError,
    Status.PARTIAL: HydraPartial,
    Status.BUSY: HydraBusy,
    Status.BAD_REQUEST: HydraBadRequest,
    Status.NOT_IMPLEMENTED: HydraNotImplemented,
}


def error_for_status(
    status: int,
    meta: dict[str, Any],
    *,
    op: int | None = None,
    trace_id: str | None = None,
) -> HydraError:
    """The exception for a non-OK reply: the subclass mapped to ``status``
    (`HydraError` itself for codes outside `Status`), message from
    ``meta["error"]``."""
    st: Status | int
    try:
        st = Status(status)
        name = Status(status).name
    except ValueError:
        st, name = status, f"status 0x{status:02x}"
    err = meta.get("error")
    message = err if isinstance(err, str) and err else name
    cls = _STATUS_ERRORS.get(status, HydraError)
    return cls(message, status=st, meta=meta, op=op, trace_id=trace_id)


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


# --------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------


@attrs.frozen
class HydraReply:
    """A whole reply held in memory: ``status`` (`Status`, or int for an
    unknown code), ``meta`` (JSON object), ``payload`` (bytes)."""

    status: Status | int
    meta: dict[str, Any]
    payload: bytes

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


class ResponseStream:
    """One request/reply exchange with a streamed reply payload.

    An async context manager (made by `HydraClient.open_request` and friends):
    entering sends the request and waits for the reply header + meta;
    then ``status``, ``meta`` and ``payload_len`` (bytes) are set and the
    payload is read with ``async for chunk in stream`` (bytes chunks of at
    most `CHUNK_SIZE`, boundaries meaningless), `receive_chunk`, `read_all`
    or `drain`.

    With ``check=True`` (the default) a non-OK status is raised on entry as
    its `HydraError` subclass after the payload has been drained.

    Leaving the block normally drains what the caller did not read (the
    connection stays in sync; each receive still bounded by the timeout).
    Leaving it with an exception while payload is still unread closes the
    connection instead (draining a multi-GB state after a failure is
    wasteful and impossible under cancellation). The client's lock is held
    from entry to exit.
    """

    def __init__(
        self,
        client: HydraClient,
        op: int,
        key: str,
        trace_id: str,
        send: Callable[[], Awaitable[None]],
        check: bool,
    ) -> None:
        self._client = client
        self.op: int = op
        self.key: str = key
        self.trace_id: str = trace_id
        self._send = send
        self._check = check
        self.status: Status | int = -1
        self.meta: dict[str, Any] = {}
        self.payload_len: int = 0
        self.received: int = 0
        """Payload bytes received so far."""
        self.done: bool = False
        """True once the whole payload has been received."""
        self._entered = False

    @property
    def remaining(self) -> int:
        """Payload bytes not received yet."""
        return self.payload_len - self.received

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a ResponseStream can only be entered once")
        self._entered = True
        c = self._client
        await c._acquire()
        try:
            await c._ensure_open()
            await self._send()
            ev = await c._next_event(self)
            if not isinstance(ev, ResponseStarted):  # pragma: no cover - decoder guarantees
                raise HydraProtocolError(
                    f"expected a reply header, got {type(ev).__name__}",
                    op=self.op,
                    trace_id=self.trace_id,
                )
            try:
                self.status = Status(ev.header.status)
            except ValueError:
                self.status = ev.header.status
            self.meta = ev.meta
            self.payload_len = ev.header.payload_len
            if self._check and self.status != Status.OK:
                await self.drain()
                raise error_for_status(
                    ev.header.status, ev.meta, op=self.op, trace_id=self.trace_id
                )
        except BaseException:
            await c._fail_request()
            c._lock.release()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        c = self._client
        try:
            if exc_type is None:
                await self.drain()
        except BaseException:
            await c._fail_request()
            raise
        finally:
            if exc_type is not None:
                await c._fail_request()
            c._lock.release()

    async def receive_chunk(self) -> bytes | None:
        """The next payload chunk (non-empty bytes), or None once the whole
        payload has arrived. Raises `HydraTimeout`,
        `HydraConnectionClosed`, `HydraProtocolError`."""
        if self.done:
            return None
        ev = await self._client._next_event(self)
        if isinstance(ev, PayloadChunk):
            self.received += len(ev.data)
            return ev.data
        if isinstance(ev, ResponseEnded):
            self._mark_done()
            return None
        raise HydraProtocolError(  # pragma: no cover - decoder guarantees
            f"unexpected {type(ev).__name__} inside a reply payload",
            op=self.op,
            trace_id=self.trace_id,
        )

    def _mark_done(self) -> None:
        self.done = True
        self._client._in_request = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.receive_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def read_all(self) -> bytes:
        """The rest of the payload, in memory (use only for small payloads)."""
        parts = []
        while (chunk := await self.receive_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def drain(self) -> int:
        """Read and discard the rest of the payload; returns the bytes discarded."""
        n = 0
        while (chunk := await self.receive_chunk()) is not None:
            n += len(chunk)
        return n


class DecodeStream:
    """A DECODE reply read token by token (hydra-protocol.md §3).

    The reply announces ``payload_len = 9 * budget``; frames
    ``(token_id, logprob, flags)`` arrive as the engine generates them.
    Iteration yields real token frames, the last one carrying
    `DECODE_FLAG_FINAL`, and stops there; it also stops (without yielding
    it) at the first padding frame (`DECODE_FLAG_PAD`, generation ended
    without a final token) or at the end of the payload. On stopping, the
    rest of the payload (the padding) is read and discarded at once so the
    connection stays in sync.

    Two ways to use it::

        async with client.decode_stream(0, body) as tokens:   # safe with break
            async for token_id, logprob, flags in tokens: ...

        async for token_id, logprob, flags in client.decode_stream(0, body):
            ...   # bare: fine when run to the end

    A bare ``async for`` that is left early (``break``, exception) keeps the
    client locked mid-reply; call `aclose` then (it drains), or prefer
    ``async with``. ``tokens`` lists the real frames received so far,
    ``budget`` is the announced frame count, ``meta`` the reply meta.

    Raises the `HydraError` subclass of a non-OK status on entry, and
    `HydraProtocolError` when payload_len is not a multiple of 9 (after
    draining: the outer framing is intact).
    """

    def __init__(self, response: ResponseStream) -> None:
        self._resp = response
        self._buf = bytearray()
        self._stopped = False
        self._entered = False
        self._bare = False
        self._closed = False
        self.tokens: list[DecodeFrame] = []

    @property
    def meta(self) -> dict[str, Any]:
        return self._resp.meta

    @property
    def trace_id(self) -> str:
        return self._resp.trace_id

    @property
    def budget(self) -> int:
        """Frames announced by the reply header (payload_len / 9)."""
        return self._resp.payload_len // DECODE_FRAME_SIZE

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a DecodeStream can only be entered once")
        self._entered = True
        await self._resp.__aenter__()
        if self._resp.payload_len % DECODE_FRAME_SIZE:
            err = HydraProtocolError(
                f"DECODE payload_len {self._resp.payload_len} is not a multiple of "
                f"{DECODE_FRAME_SIZE}",
                status=self._resp.status,
                meta=self._resp.meta,
                op=self._resp.op,
                trace_id=self._resp.trace_id,
            )
            await self._resp.__aexit__(None, None, None)  # drains, releases
            self._closed = True
            raise err
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopped = True
        await self._resp.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Drain the rest of the reply and release the client (idempotent)."""
        if self._entered:
            await self.__aexit__(None, None, None)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> DecodeFrame:
        if not self._entered:
            self._bare = True
            await self.__aenter__()
        if self._stopped:
            raise StopAsyncIteration
        try:
            frame = await self._next_frame()
            if frame is None:
                await self._stop()
        except BaseException as exc:
            if self._bare:
                await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if frame is None:
            raise StopAsyncIteration
        return frame

    async def _stop(self) -> None:
        self._stopped = True
        await self._resp.drain()
        if self._bare:
            await self.__aexit__(None, None, None)

    async def _next_frame(self) -> DecodeFrame | None:
        while len(self._buf) < DECODE_FRAME_SIZE:
            chunk = await self._resp.receive_chunk()
            if chunk is None:
                return None
            self._buf += chunk
        ((token_id, logprob, flags),) = unpack_decode_frames(self._buf[:DECODE_FRAME_SIZE])
        del self._buf[:DECODE_FRAME_SIZE]
        if flags & DECODE_FLAG_PAD:
            return None
        frame = (token_id, logprob, flags)
        self.tokens.append(frame)
        if flags & DECODE_FLAG_FINAL:
            # Padding follows at once: consume it now so that a caller who
            # stops at FINAL leaves the connection in sync.
            await self._stop()
        return frame


# --------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------


class HydraClient:
    """A Hydra engine client over one persistent TCP connection.

    Args:
        host, port: the engine's address.
        timeout: seconds without progress before a send/receive (and the
            connect) gives up with `HydraTimeout`.
        reconnect: when the connection was dropped after an error, open a
            new one on the next call instead of raising
            `HydraConnectionClosed` (requests are never retried).
        max_meta: largest reply meta accepted, bytes (default: the 24-bit
            wire maximum); a larger one is a `HydraProtocolError`.

    Use as ``async with HydraClient(...) as c`` or call `connect` / `aclose`.
    Every request method takes ``trace_id`` (str; default: a fresh
    `new_trace_id`), sent in the request frame for log correlation
    (hydra-protocol.md §2). Slot methods send the slot id in decimal as the
    key; engine-wide methods send key ``""``.

    Every request method can raise: the `HydraError` subclass of a non-OK
    status (connection still usable), `HydraTimeout`,
    `HydraConnectionClosed`, `HydraProtocolError` (connection closed),
    `HydraConnectError` (an OSError) when (re)connecting fails, ValueError /
    TypeError for arguments that cannot be encoded.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = 30.0,
        reconnect: bool = False,
        max_meta: int | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.host: str = host
        self.port: int = int(port)
        self.timeout: float = float(timeout)
        self.reconnect: bool = reconnect
        self._max_meta = max_meta
        self._lock = trio.Lock()
        self._stream: trio.SocketStream | None = None
        self._decoder = ResponseDecoder()
        self._events: collections.deque[ResponseEvent] = collections.deque()
        self._in_request = False
        self._closed_reason: str | None = "not connected"
        self._ever_connected = False

    @classmethod
    def from_address(cls, address: str, **kwargs: Any) -> HydraClient:
        """A client for ``"HOST:PORT"`` (IPv6 as ``"[::1]:PORT"``); kwargs as
        for the constructor. Raises ValueError on a malformed address."""
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
        return f"<HydraClient {self.address} {state}>"

    # -- connection ---------------------------------------------------------

    async def connect(self) -> None:
        """Open the TCP connection (no-op when already open).

        Raises `HydraConnectError` (an OSError) when it cannot be opened,
        `HydraTimeout` after ``timeout`` seconds.
        """
        if self._stream is not None:
            return
        try:
            with trio.fail_after(self.timeout):
                stream = await trio.open_tcp_stream(self.host, self.port)
        except trio.TooSlowError:
            raise HydraTimeout(
                f"connecting to {self.address} took more than {self.timeout:g} s"
            ) from None
        except OSError as exc:
            raise HydraConnectError(self.host, self.port, _os_reason(exc)) from exc
        self._stream = stream
        self._decoder = ResponseDecoder(
            **({} if self._max_meta is None else {"max_meta": self._max_meta})
        )
        self._events.clear()
        self._in_request = False
        self._closed_reason = None
        self._ever_connected = True

    async def aclose(self) -> None:
        """Close the connection (idempotent). A request running in another
        task then fails with `HydraConnectionClosed`."""
        await self._abort("closed by the client")

    def _detach(self, reason: str) -> trio.SocketStream | None:
        """Forget the connection (it is out of sync or closed); return the
        stream for the caller to close."""
        stream, self._stream = self._stream, None
        if stream is not None:
            self._closed_reason = reason
        self._in_request = False
        self._events.clear()
        return stream

    async def _abort(self, reason: str) -> None:
        stream = self._detach(reason)
        if stream is not None:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def _fail_request(self) -> None:
        """Called on every error path of an exchange: a request that is
        still mid-frame leaves the stream out of sync, so close it."""
        if self._in_request:
            await self._abort("a request failed mid-frame")

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _acquire(self) -> None:
        if self._lock.statistics().owner is trio.lowlevel.current_task():
            raise RuntimeError(
                "this task already has a streamed reply open on this HydraClient: "
                "finish it (leave its `async with`, or aclose() a bare decode_stream) "
                "before sending another request"
            )
        await self._lock.acquire()

    async def _ensure_open(self) -> None:
        if self._stream is not None:
            return
        if self.reconnect or not self._ever_connected:
            await self.connect()
            return
        raise HydraConnectionClosed(f"connection to {self.address} is closed: {self._closed_reason}")

    # -- wire I/O -----------------------------------------------------------

    async def _send_all(self, data: bytes | bytearray | memoryview, rs: ResponseStream) -> None:
        stream = self._stream
        if stream is None:
            raise HydraConnectionClosed(
                f"connection to {self.address} is closed: {self._closed_reason}",
                op=rs.op,
                trace_id=rs.trace_id,
            )
        self._in_request = True  # from the first byte on, a failure desyncs the stream
        try:
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
                raise error_for_status(
                    reply.header.status, reply.meta, op=rs.op, trace_id=rs.trace_id
                ) from exc
            raise HydraConnectionClosed(
                f"{self.address} closed the connection while the request was sent",
                op=rs.op,
                trace_id=rs.trace_id,
            ) from exc

    async def _salvage_reply(self) -> ResponseStarted | None:
        stream = self._stream
        if stream is None:
            return None
        with trio.move_on_after(min(self.timeout, 2.0)):
            try:
                while True:
                    for ev in self._events:
                        if isinstance(ev, ResponseStarted):
                            return ev
                    data = await stream.receive_some(CHUNK_SIZE)
                    if not data:
                        return None
                    self._events.extend(self._decoder.feed(data))
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
                return None
        return None

    async def _next_event(self, rs: ResponseStream) -> ResponseEvent:
        while not self._events:
            stream = self._stream
            if stream is None:
                raise HydraConnectionClosed(
                    f"connection to {self.address} is closed: {self._closed_reason}",
                    op=rs.op,
                    trace_id=rs.trace_id,
                )
            try:
                with trio.fail_after(self.timeout):
                    data = await stream.receive_some(CHUNK_SIZE)
            except trio.TooSlowError:
                await self._abort("receive timed out")
                raise HydraTimeout(
                    f"no reply data from {self.address} for {self.timeout:g} s "
                    f"(op 0x{rs.op:02x}, trace {rs.trace_id})",
                    op=rs.op,
                    trace_id=rs.trace_id,
                ) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                await self._abort("connection lost")
                raise HydraConnectionClosed(
                    f"connection to {self.address} lost: {exc}", op=rs.op, trace_id=rs.trace_id
                ) from exc
            if not data:
                mid = "mid-reply" if not self._decoder.idle or rs.payload_len else "before replying"
                await self._abort("closed by the server")
                raise HydraConnectionClosed(
                    f"{self.address} closed the connection {mid}", op=rs.op, trace_id=rs.trace_id
                )
            try:
                self._events.extend(self._decoder.feed(data))
            except ProtocolError as exc:
                await self._abort(f"protocol error: {exc}")
                raise HydraProtocolError(
                    f"bad reply from {self.address}: {exc}", op=rs.op, trace_id=rs.trace_id
                ) from exc
        return self._events.popleft()

    # -- generic requests ----------------------------------------------------

    def open_request(
        self,
        op: int,
        key: str = "",
        payload: bytes | bytearray | memoryview = b"",
        trace_id: str | None = None,
        *,
        check: bool = True,
    ) -> ResponseStream:
        """Send one request with an in-memory payload; the reply is streamed.

        Returns a `ResponseStream` to use with ``async with``. ``check``:
        raise the non-OK status on entry (default) or leave it to the caller
        (``stream.status``).
        """
        tid = new_trace_id() if trace_id is None else trace_id
        header = encode_request_header(op, key, tid, len(payload))
        rs: ResponseStream

        async def send() -> None:
            if len(payload) <= CHUNK_SIZE:
                await self._send_all(header + bytes(payload), rs)
                return
            await self._send_all(header, rs)
            mv = memoryview(payload).cast("B")
            for i in range(0, len(mv), CHUNK_SIZE):
                await self._send_all(mv[i : i + CHUNK_SIZE], rs)

        rs = ResponseStream(self, op, key, tid, send, check)
        return rs

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
        rs: ResponseStream

        async def send() -> None:
            async with await trio.open_file(path, "rb") as f:
                size = (await trio.to_thread.run_sync(os.fstat, f.fileno())).st_size
                await self._send_all(encode_request_header(op, key, tid, size), rs)
                left = size
                while left:
                    chunk = await f.read(min(CHUNK_SIZE, left))
                    if not chunk:
                        raise OSError(
                            f"{os.fspath(path)!r} shrank while being sent "
                            f"({size - left} of {size} bytes sent)"
                        )
                    await self._send_all(chunk, rs)
                    left -= len(chunk)

        rs = ResponseStream(self, op, key, tid, send, check)
        return rs

    async def exchange(
        self,
        op: int,
        key: str = "",
        payload: bytes | bytearray | memoryview = b"",
        trace_id: str | None = None,
    ) -> HydraReply:
        """One request, the whole reply in memory, whatever its status
        (no HydraError for a non-OK status; transport errors still raise)."""
        async with self.open_request(op, key, payload, trace_id, check=False) as rs:
            data = await rs.read_all()
        return HydraReply(rs.status, rs.meta, data)

    async def request(
        self,
        op: int,
        key: str = "",
        payload: bytes | bytearray | memoryview = b"",
        trace_id: str | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """One request, reply in memory: ``(meta, payload_bytes)``. Raises the
        `HydraError` subclass of a non-OK status (after reading its payload)."""
        async with self.open_request(op, key, payload, trace_id) as rs:
            data = await rs.read_all()
        return rs.meta, data

    async def _meta(
        self,
        op: int,
        key: str = "",
        payload: bytes | bytearray | memoryview = b"",
        trace_id: str | None = None,
    ) -> dict[str, Any]:
        meta, _ = await self.request(op, key, payload, trace_id)
        return meta

    # -- typed opcodes (hydra-protocol.md §3) -----------------------------------

    async def info(self, *, trace_id: str | None = None) -> dict[str, Any]:
        """INFO (0x41): the engine description (``engine``, ``version``,
        ``capabilities``, ``mode``, ``peer_addr``, ... see §3)."""
        return await self._meta(Op.INFO, "", b"", trace_id)

    async def state_meta(self, slot: int, *, trace_id: str | None = None) -> dict[str, Any]:
        """STATE_META (0x32): ``slot_id``, ``n_past`` (tokens),
        ``state_size`` (bytes), ``is_processing``, model identity. Raises
        `HydraNotFound` for a slot out of range."""
        return await self._meta(Op.STATE_META, _slot_key(slot), b"", trace_id)

    def state_get(self, slot: int, *, trace_id: str | None = None) -> ResponseStream:
        """STATE_GET (0x30), streamed::

            async with client.state_get(0) as r:
                r.meta          # n_past, state_size, model identity
                r.payload_len   # bytes of KV state
                async for chunk in r: ...

        A non-OK status raises on entry (e.g. `HydraNotFound`)."""
        return self.open_request(Op.STATE_GET, _slot_key(slot), b"", trace_id)

    async def state_get_to_file(
        self,
        slot: int,
        path: str | os.PathLike[str],
        *,
        trace_id: str | None = None,
        fsync: bool = False,
    ) -> dict[str, Any]:
        """STATE_GET (0x30) streamed into the file at ``path``; returns the
        meta. Chunks are written as they arrive (memory stays about
        `CHUNK_SIZE`) to a temporary file in the same directory, renamed to
        ``path`` once the whole payload is in (``fsync``: flush it to disk
        first). On any error the temporary file is removed and ``path`` is
        left untouched. Raises what the request raises, and OSError for
        file errors."""
        target = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(target))
        tmp = os.path.join(
            directory, f".{os.path.basename(target)}.{secrets.token_hex(4)}.part"
        )
        try:
            async with (
                self.state_get(slot, trace_id=trace_id) as rs,
                await trio.open_file(tmp, "wb") as f,
            ):
                async for chunk in rs:
                    await f.write(chunk)
                if fsync:
                    await f.flush()
                    await trio.to_thread.run_sync(os.fsync, f.fileno())
            await trio.to_thread.run_sync(os.replace, tmp, target)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_unlink_quiet, tmp)
            raise
        return rs.meta

    async def state_get_bytes(
        self, slot: int, *, trace_id: str | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """STATE_GET (0x30) into memory: ``(meta, state_blob)``. Only for
        small states; use `state_get_to_file` for real ones."""
        return await self.request(Op.STATE_GET, _slot_key(slot), b"", trace_id)

    async def state_put(
        self, slot: int, data: bytes | bytearray | memoryview, *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """STATE_PUT (0x31) of an in-memory blob (sent in `CHUNK_SIZE`
        pieces). Returns meta (``restored``, ``bytes``, ``n_past``, model
        identity). A blob from another model raises `HydraServerError` with
        ``expected_hash`` / ``got_hash`` in meta."""
        return await self._meta(Op.STATE_PUT, _slot_key(slot), data, trace_id)

    async def state_put_from_file(
        self, slot: int, path: str | os.PathLike[str], *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """STATE_PUT (0x31) streamed from the file at ``path`` (its size is
        the payload_len; read and sent in `CHUNK_SIZE` pieces). Returns
        meta as `state_put`. Raises OSError for file errors (before anything
        is sent when the file cannot be opened)."""
        async with self.open_request_from_file(
            Op.STATE_PUT, _slot_key(slot), path, trace_id
        ) as rs:
            await rs.drain()
        return rs.meta

    async def configure(
        self, params: Mapping[str, Any], *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """CONFIGURE (0x40) with a JSON object of engine/sampling params.
        Returns meta: ``success``, ``tier``, ``params_applied``,
        ``deferred_keys``, ``unrecognized_keys``, ``state_chunk_size_applied``
        (bytes) when that key was sent."""
        return await self._meta(Op.CONFIGURE, "", _json_bytes(params), trace_id)

    async def prefill(
        self, slot: int, body: Mapping[str, Any], *, trace_id: str | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """PREFILL (0x42) with an OpenAI chat-completions body (``messages``
        required). Returns ``(meta, kv_state_blob)``; meta has ``n_past``,
        ``tokens_processed``, ``prefill_ms`` (milliseconds), model identity,
        ``model_fallback``."""
        return await self.request(Op.PREFILL, _slot_key(slot), _json_bytes(body), trace_id)

    def decode_stream(
        self, slot: int, body: Mapping[str, Any], *, trace_id: str | None = None
    ) -> DecodeStream:
        """DECODE (0x43), tokens as they arrive: see `DecodeStream`. ``body``
        is ``{"n_predict": N, "messages": [...]}`` or a full chat body."""
        return DecodeStream(
            self.open_request(Op.DECODE, _slot_key(slot), _json_bytes(body), trace_id)
        )

    async def decode(
        self, slot: int, body: Mapping[str, Any], *, trace_id: str | None = None
    ) -> list[DecodeFrame]:
        """DECODE (0x43) to completion: the real token frames
        ``[(token_id, logprob, flags), ...]``, the last with
        `DECODE_FLAG_FINAL` when the engine marked one; padding dropped."""
        async with self.decode_stream(slot, body, trace_id=trace_id) as s:
            async for _ in s:
                pass
        return s.tokens

    async def set_expert_mode(
        self, mode: str, peer: str | None = None, *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """SET_EXPERT_MODE (0x44): ``mode`` is ``"solo"`` or ``"combined"``
        (sent raw when ``peer`` is None, else as JSON ``{"mode", "peer"}``,
        peer ``"host:port"``). Returns meta ``success``, ``mode`` (the mode
        in effect: ``"solo"`` plus ``fallback_reason`` when combined had no
        usable peer), ``peer``. Raises `HydraBusy` (meta ``busy_slots``)
        while slots are processing, `HydraBadRequest` for a bad mode/peer."""
        payload = (
            mode.encode("utf-8") if peer is None else _json_bytes({"mode": mode, "peer": peer})
        )
        return await self._meta(Op.SET_EXPERT_MODE, "", payload, trace_id)

    async def swap_quant(
        self, quant_key: str, tensor_pattern: str, *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """SWAP_QUANT (0x45), payload ``[u16 LE len][quant_key][tensor_pattern]``.
        Returns meta ``swapped``, ``bytes``, ``swap_ms``, ``kv_preserved``;
        may raise `HydraNotImplemented`. ValueError when quant_key is over
        65535 UTF-8 bytes."""
        qk = quant_key.encode("utf-8")
        if len(qk) > 0xFFFF:
            raise ValueError(f"quant_key is {len(qk)} bytes, at most 65535 fit")
        payload = struct.pack("<H", len(qk)) + qk + tensor_pattern.encode("utf-8")
        return await self._meta(Op.SWAP_QUANT, "", payload, trace_id)

    async def pipeline_attach(
        self, peer: str, ot_split: str, *, trace_id: str | None = None
    ) -> dict[str, Any]:
        """PIPELINE_ATTACH (0x46) with JSON ``{"peer": "host:port",
        "ot_split": "<regex>"}``. May raise `HydraNotImplemented`."""
        return await self._meta(
            Op.PIPELINE_ATTACH, "", _json_bytes({"peer": peer, "ot_split": ot_split}), trace_id
        )


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
