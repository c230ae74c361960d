"""Server → client: reply tracking.

A reply is ``[u64 size][payload: size bytes]`` (ggml-rpc.cpp v7.0.0,
``send_msg``) and comes only to the commands in
:data:`~._wire.REPLY_SIZES`, in the order they were sent.  The tracker matches
each against the oldest reply owed (``ConnectionState.pending``), checks its
size and HELLO's version, and learns the buffers the server allocated
(ALLOC_BUFFER, BUFFER_GET_BASE) for the request checks.  Replies up to 64
bytes come out whole in one event; a larger one (a GET_TENSOR answer)
streams through as slices of the input.
"""

from __future__ import annotations

from ._events import InvalidReply, ReplyData, ReplyEnd, ReplyHeader, RpcReplyEvent
from ._framing import NOT_HERE, Direction
from ._state import Buffer, ConnectionState, Pending
from ._wire import REPLY_HEADER_SIZE, RPC_CONN_CAPS_SIZE, RPC_PROTO_MAJOR_VERSION, U64, U64_PAIR, RpcCmd

SMALL_REPLY = 64
"""Replies up to this size (bytes) are handed over whole, in one event."""
_LEARN = frozenset({RpcCmd.HELLO, RpcCmd.ALLOC_BUFFER, RpcCmd.BUFFER_GET_BASE})
"""Replies the tracker reads (:meth:`ReplyTracker._reply_payload`); the others pass unread."""


class ReplyTracker(Direction[RpcReplyEvent]):
    """Turns the server's bytes into :data:`~._events.RpcReplyEvent` s, updating ``state``."""

    feed_name = "receive_reply_data"
    data_event = ReplyData

    def __init__(self, state: ConnectionState) -> None:
        super().__init__(state)
        self.cur: Pending | None = None  # the reply under way (None between replies)
        self.need = REPLY_HEADER_SIZE  # bytes of header (and small payload) to collect

    @property
    def in_progress(self) -> bool:
        """Some bytes of a reply have arrived but not all of it (or its end is not yet read out)."""
        return bool(self.head) or self.cur is not None or self.end is not None

    def _pass_in_place(self, buf: memoryview, pos: int, n: int) -> object:
        pending = self.state.pending
        if self.cur is not None or self.head or n - pos < REPLY_HEADER_SIZE or not pending:
            return NOT_HERE
        cur = pending[0]  # at a reply boundary with its header here
        size = U64.unpack_from(buf, pos)[0]
        end = pos + REPLY_HEADER_SIZE + size
        if size != cur.size or (size <= SMALL_REPLY and end > n):
            return NOT_HERE
        changed = None
        if size > SMALL_REPLY:  # its payload streams through
            end = pos + REPLY_HEADER_SIZE
            self.cur, self.body_left = cur, size
        else:
            if size and cur.cmd in _LEARN:
                whole = bytes(buf[pos:end])
                kept = self._reply_payload(cur, whole)
                changed = None if kept is whole else kept
            self.cur = cur
            self._finish()
        self.pos = end
        return changed

    def low_water(self, cap: int) -> int:
        """Bytes the server will send for sure before anything more is asked (at least 1, at most
        ``cap``): the rest of the reply under way, or all of the next one owed; 1 when none is owed."""
        if self.body_left:
            return min(self.body_left, cap)
        pending = self.state.pending
        if self.cur is not None:
            left = REPLY_HEADER_SIZE + self.cur.size - len(self.head)
        elif pending:
            left = REPLY_HEADER_SIZE + pending[0].size - len(self.head)
        else:
            return 1
        return max(1, min(left, cap))

    def _next_head(self) -> RpcReplyEvent | None:
        """The ReplyHeader event of the next reply header (whole, for a small reply), once here and as
        expected (InvalidReply if not)."""
        buf, pos = self.buf, self.pos
        pending = self.state.pending
        cur: Pending | None
        if self.cur is None and not self.head and len(buf) - pos >= REPLY_HEADER_SIZE and pending:
            cur = pending[0]  # at a reply boundary, a small reply all here: parse it in place
            size = U64.unpack_from(buf, pos)[0]
            end = pos + REPLY_HEADER_SIZE + size
            if size == cur.size and size <= SMALL_REPLY and end <= len(buf):
                self.pos = end
                data = bytes(buf[pos:end])
                if size:
                    data = self._reply_payload(cur, data)
                self.cur = cur
                self.end = self._finish()
                return ReplyHeader(cur.cmd, size, data)
        while True:
            need = self.need - len(self.head)
            n = min(need, len(buf) - self.pos)
            if n:
                if self.cur is None and not pending:
                    raise InvalidReply(f"{len(buf) - self.pos} bytes from the server while no reply is owed")
                self.head += buf[self.pos : self.pos + n]
                self.pos += n
                need -= n
            if need:
                return None
            cur = self.cur
            if cur is None:  # the 8-byte size is complete
                cur = self.cur = pending[0]
                (size,) = U64.unpack_from(self.head)
                if size != cur.size:
                    raise InvalidReply(f"{cur.cmd.name} answered {size} bytes, {cur.size} expected")
                if size <= SMALL_REPLY:
                    self.need = REPLY_HEADER_SIZE + size
                    continue
                data = bytes(self.head)
                self.head = bytearray()
                self.body_left = size
                return ReplyHeader(cur.cmd, size, data)
            data = self._reply_payload(cur, bytes(self.head))
            self.head = bytearray()
            self.end = self._finish()
            return ReplyHeader(cur.cmd, cur.size, data)

    def _reply_payload(self, cur: Pending, data: bytes) -> bytes:
        """Check and learn from a whole small reply (``data``: header and payload); returns what to pass on."""
        p = data[REPLY_HEADER_SIZE:]
        state = self.state
        if cur.cmd is RpcCmd.HELLO:
            if p[0] != RPC_PROTO_MAJOR_VERSION:
                raise InvalidReply(
                    f"the server speaks ggml-RPC {p[0]}.{p[1]}.{p[2]}, this front door "
                    f"validates {RPC_PROTO_MAJOR_VERSION}.x"
                )
            if state.mask_caps:
                data = data[: REPLY_HEADER_SIZE + 4] + bytes(RPC_CONN_CAPS_SIZE)
        elif cur.cmd is RpcCmd.ALLOC_BUFFER:
            ptr, size = U64_PAIR.unpack_from(p)
            if ptr:
                state.buffers[ptr] = Buffer(size)
                state.buffers_changed()
        elif cur.cmd is RpcCmd.BUFFER_GET_BASE:
            buf = state.buffers.get(cur.key)
            if buf is not None:
                buf.base = U64.unpack_from(p)[0]
                state.buffers_changed()
        return data

    def _finish(self) -> ReplyEnd:
        state, cur = self.state, self.cur
        assert cur is not None
        self.cur = None
        self.need = REPLY_HEADER_SIZE
        state.pending.popleft()
        state.replies += 1
        if cur.seq > state.compute_seq:  # asked after the last compute, answered: the compute is done
            state.compute_pending = False
        if cur.cmd is RpcCmd.HELLO:
            state.hello_answered = True
        return ReplyEnd(cur.cmd)
