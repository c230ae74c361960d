"""One Hydra connection, server side: the receive loop, its deadlines, request assembly and the reply on errors.

The layer under the operations (as hypercorn's ``TCPServer`` is under its
protocol): bytes from the socket go through the sans-I/O
:class:`~hydra_trio.protocol.hydra.RequestDecoder` (``receive_data`` / ``next_event``); each whole request is
handed to the connection's one protocol object (a :class:`ConnectionProtocol`,
in the node :class:`hydra_trio.hydra.connection.ServerConnection`), which also
says how large each op's payload may be and whether it is kept; a framing error is answered as its
:class:`~hydra_trio.protocol.hydra.ProtocolError` says (``reply`` with
``status``, then close).  Framing rules: docs/hydra-protocol.md §2:
a payload is always consumed before the next header; over
its cap the reply is BAD_REQUEST and the connection closes; bad magic
closes without a reply.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Protocol

import attrs
import trio

from ..engine import BlobBuffer, RunningChecksum
from ..protocol.hydra import (
    NEED_DATA,
    PayloadChunk,
    ProtocolError,
    RequestDecoder,
    RequestEnded,
    RequestHeader,
    RequestStarted,
    encode_response,
)
from ..transport.tls_bulk import receives_bulk, recv_bulk_into

log = logging.getLogger("hydra_trio.hydra")


@attrs.frozen
class HydraSettings:
    """Limits of the Hydra protocol (bytes and seconds), docs/hydra-protocol.md §2.

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
    :class:`~hydra_trio.engine.kv.blobbuf.BlobBuffer` of the announced size, ``filled`` bytes received so far,
    their KV blob checksum in ``checksum`` (:class:`~hydra_trio.engine.kv.state.RunningChecksum`)."""

    op: int
    key: str
    trace_id: str
    flags: int
    payload_len: int
    key_error: str | None
    payload: bytearray | BlobBuffer = attrs.field(factory=bytearray)
    filled: int = 0
    checksum: RunningChecksum | None = None  # a buffered payload's blob checksum, taken as its bytes arrive


HEAD_READ = 16 * 1024
"""Bytes read at most while no request is under way (its head, or small requests whole)."""


class Drain:
    """Graceful shutdown for every connection: between requests, connections close.

    :meth:`start` closes the idle ones at once (their receive is cancelled);
    a connection busy with a request closes after its reply.  A connection
    loop waits for its next request inside :meth:`while_idle`.
    """

    def __init__(self) -> None:
        self._draining = False
        self._idle: set[trio.CancelScope] = set()

    @property
    def draining(self) -> bool:
        """Whether :meth:`start` was called."""
        return self._draining

    def start(self) -> None:
        """Begin the drain: cancel the scope of every connection waiting in :meth:`while_idle`."""
        self._draining = True
        for scope in list(self._idle):
            scope.cancel()

    @contextlib.contextmanager
    def while_idle(self, scope: trio.CancelScope) -> Iterator[None]:
        """Inside this block, a :meth:`start` cancels ``scope`` (a connection between two requests)."""
        self._idle.add(scope)
        try:
            yield
        finally:
            self._idle.discard(scope)


class ConnectionProtocol(Protocol):
    """What :func:`serve_connection` hands one connection's requests to (hypercorn's transport hands
    its events to one protocol object the same way): the payload policy, then each whole request."""

    def max_payload(self, op: int) -> int:
        """The largest payload (bytes) a request of ``op`` may announce; over it: BAD_REQUEST, then close."""
        ...

    def keeps_payload(self, op: int) -> bool:
        """Whether the payload of ``op`` is collected into :attr:`HydraRequest.payload` (else consumed and dropped)."""
        ...

    def payload_buffer(self, op: int, payload_len: int) -> BlobBuffer | None:
        """A buffer of ``payload_len`` bytes to receive a kept payload into, or None for a growing bytearray."""
        ...

    async def handle(self, req: HydraRequest) -> None:
        """Answer one whole request (its reply written before the next request is read)."""
        ...


async def serve_connection(
    stream: trio.abc.Stream,
    settings: HydraSettings,
    protocol: ConnectionProtocol,
    drain: Drain,
) -> None:
    """Serve requests on ``stream`` until the peer closes, a timeout, a framing error or a drain.

    Deadlines: ``idle_timeout`` between requests; a header (16 bytes + key +
    trace id) must arrive whole within ``request_timeout`` (one byte every few
    seconds does not hold a connection); inside a payload, ``request_timeout``
    without progress.  ``protocol`` sets each op's payload cap and whether its
    payload is collected, and answers each whole request, in the order they came.
    Its ``payload_buffer(op, payload_len)`` may give a buffer for a kept payload:
    on a plain TCP stream the payload then goes from the socket straight into it
    (:func:`~hydra_trio.transport.net.recv_into_view`: as much as the kernel holds per
    read, past the decoder); over TLS it is decrypted straight into it on a worker
    thread (:func:`~hydra_trio.transport.tls_bulk.tls_recv_into_view`; the last
    bytes of a payload, under 256 KiB, as decrypted chunks copied in).
    """
    dec = RequestDecoder(max_payload=settings.max_json_payload, max_payload_for=protocol.max_payload)
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
            got, closed = await recv_bulk_into(stream, into, settings.request_timeout, hash_piece)
            del into  # no view of the buffer outlives the receive
            req.filled += got
            dec.skip_payload(got)
            req, _ = await _handle_events(dec, req, protocol)
            if req is not None and req.filled < req.payload_len:  # the log lines of the receive loop below
                if closed:
                    log.info("[%s] hydra: peer closed mid-request (op 0x%02x); nothing applied", req.trace_id, req.op)
                else:
                    log.info("hydra: connection stalled mid-request; closed")
                return
            continue
        with trio.move_on_at(deadline) as scope:
            # between requests a drain may close it now
            with drain.while_idle(scope) if idle else contextlib.nullcontext():
                # a request's head is read in small pieces: a large payload behind it then goes past the
                # decoder (straight into its buffer) from its first bytes on, instead of up to a chunk of it
                # being copied out of the decoder's events
                data = await stream.receive_some(settings.chunk_size if req is not None else HEAD_READ)
        if scope.cancelled_caught:
            why = "the node is shutting down" if idle and drain.draining else "idle" if idle else "stalled mid-request"
            log.info("hydra: connection %s; closed", why)
            return
        if not data:
            if req is not None:
                log.info("[%s] hydra: peer closed mid-request (op 0x%02x); nothing applied", req.trace_id, req.op)
            return
        dec.receive_data(data)
        req, error = await _handle_events(dec, req, protocol)  # the requests before bad bytes are answered
        if error is not None:
            await _refuse(stream, error)
            return


def _direct_target(req: HydraRequest | None, dec: RequestDecoder, stream: Any) -> memoryview | None:
    """Where the next bytes go when they can skip the decoder: the rest of a buffered payload on a plain
    socket, or over TLS when at least :data:`~hydra_trio.transport.tls_bulk.BULK_TLS_MIN` bytes are left
    (received on a worker thread, :func:`~hydra_trio.transport.tls_bulk.tls_recv_into_view`)."""
    if req is None or not isinstance(req.payload, BlobBuffer):
        return None
    left = dec.payload_remaining
    if not receives_bulk(stream, left):
        return None
    return req.payload.view()[req.filled : req.filled + left] if left else None


async def _handle_events(
    dec: RequestDecoder,
    req: HydraRequest | None,
    protocol: ConnectionProtocol,
) -> tuple[HydraRequest | None, ProtocolError | None]:
    """Read the decoder's events until it needs data into the request in progress; hand each completed
    request to ``protocol``.  Returns the request still in progress and the error that broke the framing
    (the decoder is closed then), or None."""
    while True:
        try:
            ev = dec.next_event()
        except ProtocolError as exc:
            return req, exc
        if ev is NEED_DATA:
            return req, None
        if isinstance(ev, RequestStarted):
            h = ev.header
            req = HydraRequest(h.op, ev.key, ev.trace_id, h.flags, h.payload_len, ev.key_error)
            if h.payload_len and protocol.keeps_payload(h.op):
                req.payload = protocol.payload_buffer(h.op, h.payload_len) or req.payload
                if isinstance(req.payload, BlobBuffer):
                    req.checksum = RunningChecksum()
        elif isinstance(ev, PayloadChunk):
            assert req is not None
            if isinstance(req.payload, BlobBuffer):
                req.payload.view()[req.filled : req.filled + len(ev.data)] = ev.data
                req.filled += len(ev.data)
                if req.checksum is not None:
                    req.checksum.update(ev.data)
            elif protocol.keeps_payload(req.op):
                req.payload += ev.data
        elif isinstance(ev, RequestEnded):
            assert req is not None
            await protocol.handle(req)
            req = None


async def _refuse(stream: trio.abc.Stream, error: ProtocolError) -> None:
    """The framing broke: reply as the error says (status and op), then the caller closes."""
    if error.reply:
        h = error.header
        log.warning("hydra: %s; replying %s and closing", error, error.status.name)
        op = h.op if isinstance(h, RequestHeader) else None  # a request's framing: its header, if read
        await stream.send_all(encode_response(error.status, {"error": str(error), "op": op}))
    else:
        log.warning("hydra: %s; closing without a reply", error)
