"""Hydra replies read as streams: `ResponseStream` (payload bytes) and
`DecodeStream` (DECODE token frames), plus `HydraReply` (a reply in memory).

Both streams share one life cycle, `_ReplyReader`: used with ``async with``
(entering sends the request and reads the reply header, leaving drains or
closes), or iterated bare with ``async for`` (the first step enters, the end
of the items or an error leaves). `DecodeStream` is built on a
`ResponseStream` it owns (composition): it only turns payload bytes into
9-byte frames.

A stream talks to its connection through `ReplyTransport` (what
`hydra_trio.hydra.client_connection.HydraConnection` provides): one
exchange at a time, every reply read to its last byte (docs/hydra-protocol.md
§2). Sizes are in bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeAlias, TypeVar

import attrs

from ..protocol.hydra import (
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_FRAME_SIZE,
    PayloadChunk,
    ResponseEnded,
    ResponseEvent,
    ResponseStarted,
    Status,
    decode_stop_reason,
    unpack_decode_frames,
)
from .errors import HydraProtocolError, error_for_status

__all__ = ["DecodeFrame", "DecodeStream", "HydraReply", "ReplyTransport", "ResponseStream"]

DecodeFrame: TypeAlias = tuple[int, float, int]
"""One DECODE frame: ``(token_id, logprob, flags)`` (docs/hydra-protocol.md §3)."""

T = TypeVar("T")


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


class ReplyTransport(Protocol):
    """What a `ResponseStream` needs from its connection."""

    async def begin_exchange(self) -> None:
        """Take the connection for one exchange (open it when needed).
        Raises RuntimeError when the current task already holds it; on any
        error nothing is held."""

    async def end_exchange(self, *, failed: bool) -> None:
        """Give the connection back; ``failed``: close it first when the
        exchange stopped mid-frame (the stream is out of sync)."""

    async def next_event(self, rs: ResponseStream) -> ResponseEvent:
        """The next decoded reply event. Raises `HydraTimeout`,
        `HydraConnectionClosed`, `HydraProtocolError` (connection closed)."""

    def reply_complete(self) -> None:
        """The reply's last byte has been read: the connection is in sync."""

    async def receive_payload_into(self, rs: ResponseStream, view: memoryview) -> int:
        """Read the rest of the payload into ``view``; the bytes written (errors as `next_event`)."""


class _ReplyReader(Generic[T]):
    """The life cycle shared by the reply streams.

    ``async with stream`` enters once (`_open`: send, read the header) and
    leaves once (`_close`): normally it drains what was not read, after an
    exception it closes the connection if still mid-frame. A bare
    ``async for item in stream`` enters on its first step and leaves when
    the items end or a step raises; left early (``break``), it keeps the
    connection held until `aclose`. When the items end (`_next_item`
    returns None) the rest of the reply is read at once (`_end`).
    """

    def __init__(self) -> None:
        self._entered = False
        self._bare = False
        self._closed = False

    async def _open(self) -> None:
        """Start the exchange; on error, release what was taken and raise."""
        raise NotImplementedError

    async def _close(self, failed: bool) -> None:
        """End the exchange (drain unless ``failed``) and release the connection."""
        raise NotImplementedError

    async def _next_item(self) -> T | None:
        """The next item, or None once there are no more."""
        raise NotImplementedError

    async def _discard_rest(self) -> None:
        """Read and discard the rest of the reply payload."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError(f"a {type(self).__name__} can only be entered once")
        self._entered = True
        try:
            await self._open()
        except BaseException:
            self._closed = True  # _open released what it took
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(failed=exc_type is not None)

    async def _exit(self, failed: bool) -> None:
        if not self._closed:
            self._closed = True
            await self._close(failed)

    async def aclose(self) -> None:
        """Drain the rest of the reply and release the client (idempotent)."""
        if self._entered:
            await self._exit(failed=False)

    async def _end(self) -> None:
        """The items are over: read the rest of the reply now, and release
        the client when iterated bare."""
        await self._discard_rest()
        if self._bare:
            await self._exit(failed=False)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        if not self._entered:
            self._bare = True
            await self.__aenter__()
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._next_item()
            if item is None:
                await self._end()
        except BaseException:
            if self._bare:
                await self._exit(failed=True)
            raise
        if item is None:
            raise StopAsyncIteration
        return item


class ResponseStream(_ReplyReader[bytes]):
    """One request/reply exchange with a streamed reply payload.

    Made by `HydraClient.open_request` and friends; use it with ``async with``
    (or a bare ``async for``, see `_ReplyReader`): entering sends the
    request and waits for the reply header + meta; then ``status``, ``meta``
    and ``payload_len`` (bytes) are set and the payload is read with
    ``async for chunk in stream`` (bytes chunks of at most
    `hydra_trio.hydra.client_connection.CHUNK_SIZE`, boundaries meaningless),
    `receive_chunk`, `read_all` or `drain`.

    With ``check=True`` (the default) a non-OK status is raised on entry as
    its `HydraError` subclass after the payload has been drained.

    Leaving the block normally drains what the caller did not read (the
    connection stays in sync; each receive still bounded by the timeout).
    Leaving it with an exception while payload is still unread closes the
    connection instead (draining a multi-GB state after a failure is
    wasteful and impossible under cancellation). The client's lock is held
    from entry to exit.

    Args:
        connection: where the exchange runs (`ReplyTransport`).
        op, key, trace_id: the request's, for errors and logs.
        send: writes the whole request; awaited once on entry, with this stream.
        check: raise a non-OK status on entry.
    """

    def __init__(
        self,
        connection: ReplyTransport,
        op: int,
        key: str,
        trace_id: str,
        send: Callable[[ResponseStream], Awaitable[None]],
        check: bool,
    ) -> None:
        super().__init__()
        self._conn = connection
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

    @property
    def remaining(self) -> int:
        """Payload bytes not received yet."""
        return self.payload_len - self.received

    async def _open(self) -> None:
        conn = self._conn
        await conn.begin_exchange()
        try:
            await self._send(self)
            ev = await conn.next_event(self)
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
                raise error_for_status(ev.header.status, ev.meta, op=self.op, trace_id=self.trace_id)
        except BaseException:
            await conn.end_exchange(failed=True)
            raise

    async def _close(self, failed: bool) -> None:
        try:
            if not failed:
                await self.drain()
        except BaseException:
            failed = True
            raise
        finally:
            await self._conn.end_exchange(failed=failed)

    async def _next_item(self) -> bytes | None:
        return await self.receive_chunk()

    async def _discard_rest(self) -> None:
        await self.drain()

    async def receive_chunk(self) -> bytes | None:
        """The next payload chunk (non-empty bytes), or None once the whole
        payload has arrived. Raises `HydraTimeout`,
        `HydraConnectionClosed`, `HydraProtocolError`."""
        if self.done:
            return None
        ev = await self._conn.next_event(self)
        if isinstance(ev, PayloadChunk):
            self.received += len(ev.data)
            return ev.data
        if isinstance(ev, ResponseEnded):
            self.done = True
            self._conn.reply_complete()
            return None
        raise HydraProtocolError(  # pragma: no cover - decoder guarantees
            f"unexpected {type(ev).__name__} inside a reply payload",
            op=self.op,
            trace_id=self.trace_id,
        )

    async def receive_into(self, buffer: bytearray | memoryview) -> int:
        """The rest of the payload straight into ``buffer`` (writable, at least `remaining` bytes),
        from its start; returns the bytes written.  On a plain TCP connection the socket writes into
        ``buffer`` itself (``recv_into``); no chunk objects are made.  Raises ValueError for a buffer
        that is too small (nothing read), `HydraTimeout`, `HydraConnectionClosed`, `HydraProtocolError`."""
        view = memoryview(buffer).cast("B")
        if view.readonly or len(view) < self.remaining:
            raise ValueError(
                f"the buffer must be writable and hold {self.remaining} bytes "
                f"({'read-only' if view.readonly else f'{len(view)} bytes'})"
            )
        if self.done:
            return 0
        return await self._conn.receive_payload_into(self, view)

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


class DecodeStream(_ReplyReader[DecodeFrame]):
    """A DECODE reply read token by token (docs/hydra-protocol.md §3).

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
    ``budget`` is the announced frame count, ``meta`` the reply meta,
    `stop_reason` why generation stopped.

    Raises the `HydraError` subclass of a non-OK status on entry, and
    `HydraProtocolError` when payload_len is not a multiple of 9 (after
    draining: the outer framing is intact).
    """

    def __init__(self, response: ResponseStream) -> None:
        super().__init__()
        self._resp = response
        self._buf = bytearray()
        self._ended = False
        self._stop_reason: str | None = None
        self.tokens: list[DecodeFrame] = []
        """The real token frames received so far."""
        self.trace_id: str = response.trace_id
        """The request's trace id."""
        self.meta: dict[str, Any] = {}
        """The reply meta, set on entry (``slot_id``, ``n_predict``, ``n_past``,
        ... see docs/protocol-notes.md "DECODE frames and padding")."""
        self.budget: int = 0
        """Frames announced by the reply header (payload_len / 9), set on entry."""

    @property
    def stop_reason(self) -> str | None:
        """Why generation stopped: ``"eos"``, ``"length"``,
        ``"n_tokens_limit"``, ``"stop"`` or ``"error"``, from the flags of
        the frame that ended it (the FINAL frame, or the first PAD frame when
        no token came: `DECODE_STOP_FLAGS`, docs/protocol-notes.md "DECODE
        frames and padding"); for a reply whose payload ends without either
        (``"stream": false`` and no token), the meta's ``stop_reason``.
        None before the end, and when the server marked no reason."""
        return self._stop_reason

    async def _open(self) -> None:
        resp = self._resp
        try:
            await resp.__aenter__()
        finally:  # an error reply's meta too
            self.meta = resp.meta
            self.budget = resp.payload_len // DECODE_FRAME_SIZE
        if resp.payload_len % DECODE_FRAME_SIZE:
            err = HydraProtocolError(
                f"DECODE payload_len {resp.payload_len} is not a multiple of {DECODE_FRAME_SIZE}",
                status=resp.status,
                meta=resp.meta,
                op=resp.op,
                trace_id=resp.trace_id,
            )
            await resp.aclose()  # drains, releases
            raise err

    async def _close(self, failed: bool) -> None:
        await self._resp._exit(failed)

    async def _discard_rest(self) -> None:
        await self._resp.drain()

    def _finish(self, reason: str | None) -> None:
        self._ended = True
        self._stop_reason = reason

    async def _next_item(self) -> DecodeFrame | None:
        if self._ended:
            return None
        frame = await self._read_frame()
        if frame is None:  # the payload ended without FINAL or PAD
            reason = self.meta.get("stop_reason")
            self._finish(reason if isinstance(reason, str) else None)
            return None
        flags = frame[2]
        if flags & DECODE_FLAG_PAD:
            self._finish(decode_stop_reason(flags))
            return None
        self.tokens.append(frame)
        if flags & DECODE_FLAG_FINAL:
            self._finish(decode_stop_reason(flags))
            # Padding follows at once: consume it now so that a caller who
            # stops at FINAL leaves the connection in sync.
            await self._end()
        return frame

    async def _read_frame(self) -> DecodeFrame | None:
        """The next 9-byte frame, padding included; None at the end of the payload."""
        while len(self._buf) < DECODE_FRAME_SIZE:
            chunk = await self._resp.receive_chunk()
            if chunk is None:
                return None
            self._buf += chunk
        ((token_id, logprob, flags),) = unpack_decode_frames(self._buf[:DECODE_FRAME_SIZE])
        del self._buf[:DECODE_FRAME_SIZE]
        return (token_id, logprob, flags)
