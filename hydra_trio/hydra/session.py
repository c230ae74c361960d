"""One Hydra connection, server side: the receive loop, its deadlines, request assembly and the reply on errors.

The layer under the operations (as hypercorn's ``TCPServer`` is under its
protocol): bytes from the socket go through the sans-I/O
:class:`~hydra_trio.protocol.hydra.RequestDecoder`; each whole request is
handed to ``dispatch``; a framing error is answered as its
:class:`~hydra_trio.protocol.hydra.ProtocolError` says (``reply`` with
``status``, then close).  Framing rules: hydra-protocol.md §2, the **[fix]**
rows included: a payload is always consumed before the next header; over
its cap the reply is BAD_REQUEST and the connection closes; bad magic
closes without a reply.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from .._net import recv_into_view
from ..engine.blobbuf import BlobBuffer
from ..engine.state import RunningChecksum
from ..protocol.hydra import (
    PayloadChunk,
    ProtocolError,
    RequestDecoder,
    RequestEnded,
    RequestStarted,
    encode_response,
)

log = logging.getLogger("hydra_trio.hydra")


@attrs.frozen
class HydraSettings:
    """Limits of the Hydra protocol (bytes and seconds), hydra-protocol.md §2.

    Attributes:
        max_json_payload: cap on JSON payloads (64 MiB).
        max_state_payload: cap on STATE_PUT payloads (4 GiB).
        idle_timeout: seconds a connection may sit between requests.
        request_timeout: seconds of no progress inside a request before closing.
        chunk_size: bytes per receive, and per send when streaming a state blob (256 KiB).
        decode_default: DECODE frame budget when the body gives none.
        decode_cap: the most frames one DECODE may announce.
    """

    max_json_payload: int = 64 * 1024 * 1024
    max_state_payload: int = 4 * 1024 * 1024 * 1024
    idle_timeout: float = 120.0
    request_timeout: float = 30.0
    chunk_size: int = 256 * 1024
    decode_default: int = 128
    decode_cap: int = 8192


@attrs.define
class HydraRequest:
    """One whole request: header fields, the decoded key and trace id, and (for ops that keep it) the payload:
    a bytearray, or for a large payload of an op that takes one (STATE_PUT) a
    :class:`~hydra_trio.engine.blobbuf.BlobBuffer` of the announced size, ``filled`` bytes received so far,
    their KV blob checksum in ``checksum`` (:class:`~hydra_trio.engine.state.RunningChecksum`)."""

    op: int
    key: str
    trace_id: str
    flags: int
    payload_len: int
    key_error: str | None
    payload: bytearray | BlobBuffer = attrs.field(factory=bytearray)
    filled: int = 0
    checksum: RunningChecksum | None = None  # a buffered payload's blob checksum, taken as its bytes arrive


BufferFor = Callable[[int, int], "BlobBuffer | None"]
"""``(op, payload_len) -> a buffer to receive the payload into``, or None for a bytearray."""


class Drain:
    """Graceful shutdown for every connection: between requests, connections close.

    :meth:`start` closes the idle ones at once (their receive is cancelled);
    a connection busy with a request closes after its reply.
    """

    def __init__(self) -> None:
        self.draining = False
        self._idle: set[trio.CancelScope] = set()

    def start(self) -> None:
        self.draining = True
        for scope in list(self._idle):
            scope.cancel()


Dispatch = Callable[[HydraRequest, trio.SocketStream], Awaitable[None]]


async def serve_connection(
    stream: trio.SocketStream,
    settings: HydraSettings,
    dispatch: Dispatch,
    *,
    keeps_payload: Callable[[int], bool],
    max_payload_for: Callable[[int], int],
    drain: Drain,
    buffer_for: BufferFor | None = None,
) -> None:
    """Serve requests on ``stream`` until the peer closes, a timeout, a framing error or a drain.

    Deadlines: ``idle_timeout`` between requests; a header (16 bytes + key +
    trace id) must arrive whole within ``request_timeout`` (one byte every few
    seconds does not hold a connection); inside a payload, ``request_timeout``
    without progress.  ``keeps_payload(op)`` says whether the op's payload is
    collected (the others are consumed and dropped).  ``buffer_for(op,
    payload_len)`` may give a buffer for a kept payload: on a plain TCP stream
    the payload then goes from the socket straight into it
    (:func:`~hydra_trio._net.recv_into_view`: as much as the kernel holds per
    read, past the decoder); over TLS the decrypted chunks are copied in.
    """
    dec = RequestDecoder(max_payload=settings.max_json_payload, max_payload_for=max_payload_for)
    req: HydraRequest | None = None
    header_deadline = math.inf
    while True:
        idle = req is None and dec.idle
        if idle:
            if drain.draining:
                log.info("hydra: the node is shutting down; closing an idle connection")
                return
            deadline = trio.current_time() + settings.idle_timeout
            header_deadline = math.inf
        elif req is None:
            if header_deadline == math.inf:
                header_deadline = trio.current_time() + settings.request_timeout
            deadline = header_deadline
        else:  # payload: the timeout is per receive (no progress)
            deadline = trio.current_time() + settings.request_timeout
        into = _direct_target(req, dec, stream)
        if into is not None:  # the rest of a buffered payload, straight from the socket
            assert req is not None
            hash_piece = req.checksum.update if req.checksum is not None else None
            got, closed = await recv_into_view(stream, into, settings.request_timeout, hash_piece)
            del into  # no view of the buffer outlives the receive
            req.filled += got
            req = await _handle_events(dec.skip_payload(got), req, stream, dispatch, keeps_payload, buffer_for)
            if req is not None and req.filled < req.payload_len:  # the log lines of the receive loop below
                if closed:
                    log.info("[%s] hydra: peer closed mid-request (op 0x%02x); nothing applied", req.trace_id, req.op)
                else:
                    log.info("hydra: connection stalled mid-request; closed")
                return
            continue
        with trio.move_on_at(deadline) as scope:
            if idle:  # between requests: a drain may close it now
                drain._idle.add(scope)
            try:
                data = await stream.receive_some(settings.chunk_size)
            finally:
                drain._idle.discard(scope)
        if scope.cancelled_caught:
            why = "the node is shutting down" if idle and drain.draining else "idle" if idle else "stalled mid-request"
            log.info("hydra: connection %s; closed", why)
            return
        if not data:
            if req is not None:
                log.info("[%s] hydra: peer closed mid-request (op 0x%02x); nothing applied", req.trace_id, req.op)
            return
        error: ProtocolError | None = None
        try:
            events = dec.feed(data)
        except ProtocolError as exc:
            events, error = list(exc.events or []), exc  # requests completed before the bad bytes
        req = await _handle_events(events, req, stream, dispatch, keeps_payload, buffer_for)
        if error is not None:
            await _refuse(stream, error)
            return


def _direct_target(req: HydraRequest | None, dec: RequestDecoder, stream: Any) -> memoryview | None:
    """Where the next bytes go when they can skip the decoder: the rest of a buffered payload on a plain socket."""
    if req is None or not isinstance(req.payload, BlobBuffer) or not isinstance(stream, trio.SocketStream):
        return None
    left = dec.payload_remaining
    return req.payload.view()[req.filled : req.filled + left] if left else None


async def _handle_events(
    events: list[Any], req: HydraRequest | None, stream: trio.SocketStream, dispatch: Dispatch,
    keeps_payload: Callable[[int], bool], buffer_for: BufferFor | None = None,
) -> HydraRequest | None:
    """Feed decoder events into the request in progress; dispatch each completed request."""
    for ev in events:
        if isinstance(ev, RequestStarted):
            h = ev.header
            req = HydraRequest(h.op, ev.key, ev.trace_id, h.flags, h.payload_len, ev.key_error)
            if buffer_for is not None and h.payload_len and keeps_payload(h.op):
                req.payload = buffer_for(h.op, h.payload_len) or req.payload
                if isinstance(req.payload, BlobBuffer):
                    req.checksum = RunningChecksum()
        elif isinstance(ev, PayloadChunk):
            assert req is not None
            if isinstance(req.payload, BlobBuffer):
                req.payload.view()[req.filled : req.filled + len(ev.data)] = ev.data
                req.filled += len(ev.data)
                if req.checksum is not None:
                    req.checksum.update(ev.data)
            elif keeps_payload(req.op):
                req.payload += ev.data
        elif isinstance(ev, RequestEnded):
            assert req is not None
            await dispatch(req, stream)
            req = None
    return req


async def _refuse(stream: trio.SocketStream, error: ProtocolError) -> None:
    """The framing broke: reply as the error says (status and op), then the caller closes."""
    if error.reply:
        h = error.header
        log.warning("hydra: %s; replying %s and closing", error, error.status.name)
        await stream.send_all(encode_response(error.status, {"error": str(error), "op": h.op if h else None}))
    else:
        log.warning("hydra: %s; closing without a reply", error)
