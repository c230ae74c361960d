"""The per-connection pump: a served ggml-RPC client's bytes, both ways, through the validator.

Both directions go through one
:class:`~hydra_trio.protocol.ggml_rpc.GgmlRpcConnection`: each client message
is validated before it reaches the child (a message that fails is never
passed on: the connection is closed, counted and logged), bulk tensor data
streams through without being collected, and the replies are tracked so that
the pump knows when the connection is between messages.  A message that has
begun must keep arriving (``stall_timeout`` seconds without a byte of it
closes the connection), and so must a reply the child has begun (a child that
stops mid-reply is hung: the connection closes as ``backend_stall`` and the
backend kills the child, which its supervisor restarts); between messages a
connection may stay idle as long as it wants (a COMBINED head keeps one open
for hours), and a reply not yet begun may take as long as its compute.

:class:`Close` is how every part of the backend ends a client, with a reason
from :data:`CLOSE_REASONS`.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import attrs
import trio

from ..protocol.ggml_rpc import (
    CHECKS,
    GgmlRpcConnection,
    InvalidReply,
    InvalidRpcRequest,
    ReplyEnd,
    RequestEnd,
    RpcReplyEvent,
    RpcRequestEvent,
)
from ..transport.blocking import (
    LowWater,
    TlsPipe,
    blocking_dup,
    bytes_acked,
    restore,
    run_blocking,
    send_pieces,
    shutdown_all,
)
from ..transport.tls import TlsStream

PUMP_BUFFER = 1 << 20  # bytes per receive: ggml-RPC moves tensors in large messages
# The threads receive into one preallocated buffer each (recv_into): a fresh 1 MiB bytes object per
# receive is an mmap and a munmap, ~30 µs, and a COMBINED token is ~270 receives.
_COALESCE = 1 << 16  # pieces smaller than this (bytes) are joined into one send (the trio loops)
LOW_WATER_CAP = 1 << 18  # most bytes (a receive low-water mark) a pump thread waits for before it wakes

CLOSE_REASONS = (
    "queue_full",  # refused: max_waiting clients already wait
    "wait_timeout",  # waited wait_timeout seconds for the child
    "handshake_timeout",  # HELLO not whole, or not answered, within handshake_timeout
    "stall_timeout",  # a begun message stopped arriving (or the client stopped reading replies)
    "invalid_request",  # a message failed validation (see the invalid-message counts by check)
    "invalid_reply",  # the child answered something unexpected (should never happen)
    "backend_unavailable",  # the child was not back within restart_wait
    "backend_exit",  # the child exited while serving this client
    "backend_stall",  # the child stopped mid-reply for stall_timeout: it is killed and restarted
    "draining",  # drain(): refused, dequeued, or closed at a message boundary
    "not_allowed",  # the peer is not in --rpc-allow: closed before anything is read
)
"""Why the front door closed a ggml-RPC client (stable: they label metrics)."""


class Close(Exception):
    """Ends one ggml-RPC client: ``reason`` (one of :data:`CLOSE_REASONS`) and a ``detail`` for the log."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in CLOSE_REASONS, reason
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@attrs.define
class Counters:
    """Traffic counters of the backend, bumped by the admission and the pumps.

    ``bytes_in``: client → child, ``bytes_out``: child → client (bytes);
    ``connections``: clients served; ``trio_pumped``: of those, pumped by trio tasks
    instead of threads (a stream the threads cannot carry); ``invalid``: refused messages by check
    (:data:`~hydra_trio.protocol.ggml_rpc.CHECKS`).
    """

    connections: int = 0
    trio_pumped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    invalid: collections.Counter[str] = attrs.field(factory=lambda: collections.Counter({c: 0 for c in CHECKS}))

    def refuse(self, exc: InvalidRpcRequest) -> Close:
        """Count a message that failed validation; the Close that ends its connection."""
        self.invalid[exc.check] += 1
        return Close("invalid_request", f"{exc} [{exc.check}]")


def payload(events: Iterable[RpcRequestEvent | RpcReplyEvent]) -> list[bytes | memoryview]:
    """The bytes to pass on of ``events``, in order (the ``*End`` events carry none)."""
    return [ev.data for ev in events if not isinstance(ev, (RequestEnd, ReplyEnd))]


def coalesce(pieces: Sequence[bytes | memoryview]) -> Sequence[bytes | memoryview]:
    """Join runs of small pieces into one send; pass big ones (tensor data) as they are; drop empty ones."""
    if len(pieces) == 1 and len(pieces[0]):
        return pieces
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for p in pieces:
        if len(p) >= _COALESCE:
            if small:
                out.append(small[0] if len(small) == 1 else b"".join(small))
                small = []
            out.append(p)
        elif len(p):
            small.append(p)
    if small:
        out.append(small[0] if len(small) == 1 else b"".join(small))
    return out


async def exchange_hello(
    upstream: trio.SocketStream, conn: GgmlRpcConnection, early: Sequence[bytes | memoryview], timeout: float
) -> list[bytes | memoryview] | None:
    """Send a client's first bytes (``early``: its validated HELLO and what followed) to the child;
    return the child's reply bytes up to and with its HELLO answer, within ``timeout`` seconds.

    None: the child closed first (it exited).

    Raises:
        Close: ``handshake_timeout``, or ``invalid_reply`` for a reply the tracker refuses.
    """
    replies: list[bytes | memoryview] = []
    try:
        with trio.fail_after(timeout):
            for piece in coalesce(early):
                await upstream.send_all(piece)
            while not conn.hello_answered:
                data = await upstream.receive_some(PUMP_BUFFER)
                if not data:
                    return None
                replies += payload(conn.receive_reply(data))
    except trio.TooSlowError:
        raise Close("handshake_timeout", f"the ggml-RPC backend did not answer HELLO within {timeout:g} s") from None
    except (trio.BrokenResourceError, OSError):
        return None
    except InvalidReply as exc:
        raise Close("invalid_reply", str(exc)) from None
    return replies


@attrs.define
class Pump:
    """One served connection, client ↔ child, after the child answered its HELLO.

    Three tasks share this object: inbound (client → child), outbound (child →
    client) and a watchdog.  The two pumping tasks only bump counters (``ticks_*``,
    ``n_in``) and flags; the watchdog turns them into times, so the per-message
    path reads no clock and arms no timer.

    The two pumping tasks run on their own threads with blocking socket calls
    (on duplicates of the connections' descriptors), not in the trio loop: a
    small message then costs two thread wake-ups instead of two trips through
    the scheduler.  Those two wake-ups are most of a round trip's cost: on the
    2-core development VM, ``bench/rpc_passthrough.py`` measures a DEVICE_COUNT
    round trip at ~27 µs direct, ~110-150 µs through a C relay that only
    copies (``bench/bare_relay.c``) and ~125-180 µs through this pump.  A TLS
    client (:class:`~hydra_trio.transport.tls.TlsStream`) too: its TLS state, handshaken by trio, is taken over by a
    :class:`~hydra_trio.transport.blocking.TlsPipe` on the socket.  The validator is shared
    by both threads under one lock.  The watchdog stays a trio task; whatever
    ends the connection (a close, the watchdog, the child's exit, cancellation)
    shuts both sockets down, which wakes the threads, and waits for them.  A
    stream the threads cannot carry (another stream type, or a trio whose
    ``SSLStream`` keeps its state elsewhere) is pumped by trio tasks
    (:meth:`_inbound_trio`, :meth:`_outbound_trio`): slower per message, same
    validation and deadlines.

    Args:
        conn: the connection's validator, past the handshake.
        client, upstream: the client's stream and the one to the child (the pump closes ``upstream``).
        counters: where the bytes passed on are counted.
        stall_timeout: seconds a begun message may go without a byte, or a reply without being read.
        drain_idle: seconds of quiet between messages before a drain closes the connection.
        drain_started: set when the node drains (:meth:`RpcBackend.drain
            <hydra_trio.rpc_backend.backend.RpcBackend.drain>`).
    """

    conn: GgmlRpcConnection
    client: trio.SocketStream | TlsStream
    upstream: trio.SocketStream
    counters: Counters
    stall_timeout: float = attrs.field(kw_only=True)
    drain_idle: float = attrs.field(kw_only=True)
    drain_started: trio.Event = attrs.field(kw_only=True)
    ticks_in: int = attrs.field(default=0, init=False)  # bumped when inbound starts waiting, and when bytes arrive
    n_in: int = attrs.field(default=0, init=False)  # receives that brought bytes
    receiving: bool = attrs.field(default=False, init=False)  # waiting for the client's bytes
    busy_up: bool = attrs.field(default=False, init=False)  # forwarding client bytes to the child right now
    ticks_out: int = attrs.field(default=0, init=False)  # bumped when a send to the client starts, and at each piece
    busy_down: bool = attrs.field(default=False, init=False)  # forwarding child bytes to the client right now
    ticks_up: int = attrs.field(
        default=0, init=False
    )  # bumped when outbound starts waiting for the child, and on bytes
    receiving_up: bool = attrs.field(default=False, init=False)  # waiting for the child's bytes
    close: Close | None = attrs.field(default=None, init=False)  # the first reason a task ended the connection
    _both: trio.CancelScope = attrs.field(factory=trio.CancelScope, init=False)  # the three tasks
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)  # the validator, shared by the threads
    _socks: list[Any] = attrs.field(factory=list, init=False)  # the threads' ends: [client, upstream]
    _low_in: LowWater | None = attrs.field(default=None, init=False)  # a plain client's low-water mark
    _low_up: LowWater | None = attrs.field(default=None, init=False)  # the child's socket's low-water mark

    async def run(self, first: Sequence[bytes | memoryview], bound: set[trio.CancelScope]) -> None:
        """Send ``first`` (the child's answer to HELLO) to the client, then pump both ways until one
        side closes.  The connection is bound to the current child: the child's supervisor cancels
        the scopes in ``bound`` when it exits.

        Raises:
            Close: why the connection ended, unless it ended by a normal close or a reset
                (``backend_exit`` when the child exited meanwhile).
        """
        with trio.CancelScope() as child_scope:
            bound.add(child_scope)
            try:
                async with self.upstream:
                    await self._send_first(first)
                    self._socks = self._thread_ends()
                    inbound: tuple[Any, ...]  # a task and its arguments, for _guard
                    outbound: tuple[Any, ...]
                    if self._socks:
                        inbound = (self._threaded, self._inbound)
                        outbound = (self._threaded, self._outbound)
                    else:  # a stream the threads cannot carry: pump it in trio
                        self.counters.trio_pumped += 1
                        inbound, outbound = (self._inbound_trio,), (self._outbound_trio,)
                    try:
                        with self._both:
                            async with trio.open_nursery() as nursery:
                                nursery.start_soon(self._guard, *inbound)
                                nursery.start_soon(self._guard, *outbound)
                                nursery.start_soon(self._guard, self._watchdog)
                    finally:
                        for sock in self._socks:
                            restore(sock)
            except Close as exc:  # from the first send of replies
                self.close = exc
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                bound.discard(child_scope)
        if self.close is not None:
            raise self.close
        if child_scope.cancelled_caught:
            raise Close("backend_exit", "the ggml-RPC backend exited")

    async def _send_first(self, pieces: Sequence[bytes | memoryview]) -> None:
        """The child's first replies (HELLO's answer), to the client, within ``stall_timeout``."""
        with trio.move_on_after(self.stall_timeout) as scope:
            for piece in coalesce(pieces):
                await self.client.send_all(piece)
                self.counters.bytes_out += len(piece)
        if scope.cancelled_caught:
            raise Close("stall_timeout", f"the client read no reply bytes for {self.stall_timeout:g} s")

    async def _guard(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run one of the connection's tasks; any end but a normal one ends the connection."""
        try:
            await fn(*args)
        except Close as exc:
            if self.close is None:
                self.close = exc
            self._both.cancel()
        except (_ChildClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self._both.cancel()  # the child closed, or a reset on either side: the whole connection ends

    def _thread_ends(self) -> list[Any]:
        """Blocking ends for the pumping threads, ``[client, upstream]``; [] for the trio loops.

        A plain client: a blocking duplicate of its socket.  A TLS client
        (:class:`~hydra_trio.transport.tls.TlsStream`): a :class:`~hydra_trio.transport.blocking.TlsPipe`
        that takes over its TLS state, the bytes it had pushed back first.
        """
        up = blocking_dup(self.upstream.socket)
        if isinstance(self.client, trio.SocketStream):
            plain = blocking_dup(self.client.socket)
            self._low_in = LowWater(plain)
            return [plain, up]
        if isinstance(self.client, TlsStream):
            raw = blocking_dup(self.client.transport_stream.socket)
            pushed = self.client.take_pushback()
            pipe = TlsPipe.take_over(self.client.ssl_stream, raw, plain=pushed)
            if pipe is not None:
                return [pipe, up]
            self.client.unread(pushed)
            restore(raw)
        restore(up)
        return []

    async def _threaded(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a pumping loop) on a thread; when the connection ends first, wake it and wait.

        Shutting the sockets down ends the blocking calls at once, so the wait is short.
        """
        await run_blocking(fn, self._shutdown, name="ggml-rpc-pump")

    def _shutdown(self) -> None:
        shutdown_all(self._socks)

    def _requests(self, data: bytes | memoryview) -> list[bytes | memoryview]:
        """Validate client bytes (either thread, or a trio task); what may go on to the child
        (:meth:`~hydra_trio.protocol.ggml_rpc.GgmlRpcConnection.pass_requests`: whole valid
        messages as one slice of ``data``).

        Raises:
            Close: a message failed validation (counted by its check).
        """
        try:
            with self._lock:
                return self.conn.pass_requests(data)
        except InvalidRpcRequest as exc:
            raise self.counters.refuse(exc) from None

    def _replies(self, data: bytes | memoryview) -> list[bytes | memoryview]:
        """Track the child's bytes (either thread, or a trio task); what goes on to the client.

        Raises:
            Close: ``invalid_reply``.
        """
        try:
            with self._lock:
                return self.conn.pass_replies(data)
        except InvalidReply as exc:
            raise Close("invalid_reply", str(exc)) from None

    def _inbound(self) -> None:
        """Client → child (on a thread): validate each message, pass on what passed, half-close on EOF.

        Per receive: one wake-up (a plain client's low-water mark is the rest of the head being
        collected, :class:`~hydra_trio.transport.blocking.LowWater`, so that a request sent in three
        pieces wakes this thread once), the checks, and one send of what passed.
        """
        client, upstream = self._socks
        conn, counters = self.conn, self.counters
        low = self._low_in
        buf = bytearray(PUMP_BUFFER)  # one buffer for the connection: the pieces are sent before it is reused
        view = memoryview(buf)
        while True:
            if low is not None:
                low.set(conn.request_low_water(LOW_WATER_CAP))
            self.ticks_in += 1
            self.receiving = True
            n = client.recv_into(buf) if low is None else low.recv_into(buf)
            self.receiving = False
            self.ticks_in += 1
            self.n_in += 1
            if not n:
                upstream.shutdown(socket.SHUT_WR)  # half-close: the replies keep flowing
                return
            pieces = self._requests(view[:n])
            if pieces:
                self.busy_up = True
                counters.bytes_in += send_pieces(upstream, pieces)
                self.busy_up = False

    def _outbound(self) -> None:
        """Child → client (on a thread): track the replies and pass them on.

        The child's socket gets a low-water mark of the reply owed (ggml's server sends a reply's size
        and its payload in two sends: one wake-up here, not two).  When the child closes, the
        client gets EOF and the connection ends (this returns; the caller cancels the other tasks).
        """
        client, upstream = self._socks
        conn, counters = self.conn, self.counters
        low = self._low_up = LowWater(upstream)
        buf = bytearray(PUMP_BUFFER)
        view = memoryview(buf)
        while True:
            low.set(conn.reply_low_water(LOW_WATER_CAP))
            self.ticks_up += 1
            self.receiving_up = True
            n = low.recv_into(buf)
            self.receiving_up = False
            self.ticks_up += 1
            if not n:  # the child is done with this client (it closed, or rejected a message)
                client.shutdown(socket.SHUT_WR)
                raise _ChildClosed
            pieces = self._replies(view[:n])
            if pieces:
                self.busy_down = True
                self.ticks_out += 1
                counters.bytes_out += send_pieces(client, pieces)
                self.busy_down = False

    async def _inbound_trio(self) -> None:
        """Client → child as a trio task (a TLS client): as :meth:`_inbound`."""
        while True:
            self.ticks_in += 1
            self.receiving = True
            data = await self.client.receive_some(PUMP_BUFFER)
            self.receiving = False
            self.ticks_in += 1
            self.n_in += 1
            if not data:
                await self.upstream.send_eof()  # half-close: the replies keep flowing
                return
            pieces = self._requests(data)
            self.busy_up = True
            for piece in coalesce(pieces):
                await self.upstream.send_all(piece)
                self.counters.bytes_in += len(piece)
            self.busy_up = False

    async def _outbound_trio(self) -> None:
        """Child → client as a trio task (a TLS client): as :meth:`_outbound` (no half-close: TLS has none in trio)."""
        while True:
            self.ticks_up += 1
            self.receiving_up = True
            data = await self.upstream.receive_some(PUMP_BUFFER)
            self.receiving_up = False
            self.ticks_up += 1
            if not data:
                raise _ChildClosed
            pieces = self._replies(data)
            self.busy_down = True
            for piece in coalesce(pieces):
                self.ticks_out += 1
                await self.client.send_all(piece)
                self.counters.bytes_out += len(piece)
            self.busy_down = False

    async def _watchdog(self) -> None:
        """The connection's deadlines, checked a few times per ``stall_timeout``.

        Closes it when a begun message gets no byte, or the client reads none of its replies
        (a send to it stays blocked and its kernel acknowledges no byte: a slow reader behind one
        big send is reading), for ``stall_timeout`` seconds (detected within a quarter of it more), and as
        ``backend_stall`` when a reply the child has begun gets no byte for as long while the
        pump waits for it; once the drain has started, at the first message boundary with
        ``drain_idle`` seconds of quiet.
        """
        stall, idle = self.stall_timeout, self.drain_idle
        period = max(0.01, min(stall / 4, 5.0))
        client_sock = (
            self._socks[0]
            if self._socks
            else getattr(getattr(self.client, "transport_stream", self.client), "socket", None)
        )
        progress = _LastChange(
            trio.current_time(),
            ticks_in=self.ticks_in,
            n_in=self.n_in,
            ticks_out=self.ticks_out,
            queued=0,
            ticks_up=self.ticks_up,
            queued_up=0,
            acked=0,
        )
        while True:
            if self.drain_started.is_set():
                await trio.sleep(0.02)
            else:
                with trio.move_on_after(period):
                    await self.drain_started.wait()
            now = trio.current_time()
            # bytes the kernel holds for the inbound thread below its low-water mark: they count as
            # arrived (a begun message, and progress while their number grows)
            queued = self._low_in.queued() if self._low_in is not None and self.receiving else 0
            queued_up = self._low_up.queued() if self._low_up is not None and self.receiving_up else 0
            # the client's kernel acknowledging reply bytes while a send to it is blocked: it reads
            acked = bytes_acked(client_sock) if self.busy_down and client_sock is not None else 0
            progress.update(
                now,
                ticks_in=self.ticks_in,
                n_in=self.n_in,
                ticks_out=self.ticks_out,
                queued=queued,
                ticks_up=self.ticks_up,
                queued_up=queued_up,
                acked=acked,
            )
            conn = self.conn
            begun = conn.request_in_progress or queued > 0
            if self.receiving and begun and progress.quiet(now, "ticks_in", "queued") > stall:
                raise Close("stall_timeout", f"a begun message got no byte for {stall:g} s")
            if self.busy_down and progress.quiet(now, "ticks_out", "acked") > stall:
                raise Close("stall_timeout", f"the client read no reply bytes for {stall:g} s")
            if (
                self.receiving_up
                and (conn.reply_in_progress or queued_up > 0)
                and progress.quiet(now, "ticks_up", "queued_up") > stall
            ):
                raise Close("backend_stall", f"the ggml-RPC backend sent no byte of a begun reply for {stall:g} s")
            if (
                self.drain_started.is_set()
                and conn.between_messages
                and not queued
                and not (self.busy_up or self.busy_down)
                and progress.quiet(now, "n_in", "queued") >= idle
            ):
                raise Close("draining", "closed between messages: the node is shutting down")


class _LastChange:
    """When each of the watchdog's progress signals last changed (trio time, seconds).

    A signal is any value that changes while its side makes progress: the pump's tick counters,
    the bytes queued below a low-water mark, the client's acknowledged bytes.
    """

    def __init__(self, now: float, **values: int) -> None:
        self._seen = dict(values)
        self._since = dict.fromkeys(values, now)

    def update(self, now: float, **values: int) -> None:
        """Note the signals' current values; a changed one restarts its quiet time."""
        for name, value in values.items():
            if value != self._seen[name]:
                self._seen[name], self._since[name] = value, now

    def quiet(self, now: float, *names: str) -> float:
        """Seconds since the last change of any of ``names``."""
        return now - max(self._since[n] for n in names)


class _ChildClosed(Exception):
    """The child closed its end: the client got EOF and the connection ends normally."""
