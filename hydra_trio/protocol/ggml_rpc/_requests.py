"""Client → server: framing of requests, released only once validated.

A request is ``[u8 cmd][u64 size][payload: size bytes]`` (ggml-rpc.cpp v7.0.0,
``send_rpc_cmd``).  The framer checks the header (HELLO first and only once,
a known command, the size its ``rpc_msg_*_req`` has, caps on the variable
ones), holds the part to validate (the whole payload, except SET_TENSOR's
tensor data), runs the command's validator from :data:`~._validators.VALIDATORS`,
and only then releases it; SET_TENSOR's data then streams through as slices of
the input, never collected.
"""

from __future__ import annotations

from ._events import InvalidRpcRequest, Request, RequestData, RequestEnd, RpcRequestEvent
from ._framing import NOT_HERE, Direction
from ._state import ConnectionState, Pending
from ._validators import VALIDATORS
from ._wire import (
    CMDS,
    FIXED_SIZE,
    GRAPH_HEAD_SIZE,
    HEADER_SIZE,
    HELLO_REQUEST_SIZE,
    REPLY_SIZE,
    RPC_TENSOR_SIZE,
    SET_TENSOR_HEAD_SIZE,
    U64,
    RpcCmd,
)

_HELLO, _NONE = int(RpcCmd.HELLO), int(RpcCmd.NONE)
_SET_TENSOR = int(RpcCmd.SET_TENSOR)
_COMPUTES = frozenset({int(RpcCmd.GRAPH_COMPUTE), int(RpcCmd.GRAPH_RECOMPUTE)})
_ASKED_AT = HEADER_SIZE + RPC_TENSOR_SIZE + 8  # GET_TENSOR: where the size it asks for is

CACHEABLE = frozenset(
    {
        RpcCmd.SET_TENSOR,
        RpcCmd.GET_TENSOR,
        RpcCmd.GRAPH_COMPUTE,
        RpcCmd.COPY_TENSOR,
        RpcCmd.INIT_TENSOR,
        RpcCmd.GET_ALLOC_SIZE,
        RpcCmd.MEMSET_TENSOR,
    }
)
"""Commands whose checks depend only on the head, the limits and the buffers, and change nothing:
a head that passed once passes again while the buffers stay as they were
(:meth:`~._state.ConnectionState.passed_before`).  Not SET_TENSOR_HASH (it reads the
tensor cache's files), nor those that change state (FREE_BUFFER) or learn from their reply."""
_CACHEABLE = tuple(c in CACHEABLE for c in CMDS)


class RequestFramer(Direction[RpcRequestEvent]):
    """Turns the client's bytes into :data:`~._events.RpcRequestEvent` s, updating ``state``."""

    feed_name = "receive_request_data"
    data_event = RequestData

    def __init__(self, state: ConnectionState) -> None:
        super().__init__(state)
        self.cmd: int | None = None  # command id of the request under way (None between requests)
        self.size = 0  # its payload size, bytes
        self.head_need = HEADER_SIZE  # bytes of header and head to collect
        self.reply: Pending | None = None  # the reply the request under way will get

    @property
    def in_progress(self) -> bool:
        """Some bytes of a request have arrived but not all of it."""
        return bool(self.head) or self.body_left > 0 or self.end is not None

    def _next_head(self) -> RpcRequestEvent | None:
        """The Request event of the next header and head, once whole and valid (InvalidRpcRequest if not)."""
        buf, pos = self.buf, self.pos
        avail = len(buf) - pos
        if not self.head:  # at a message boundary: parse in place when header and head are all here
            if avail >= HEADER_SIZE:
                head = self._start_request(buf[pos], U64.unpack_from(buf, pos + 1)[0])
                end = pos + HEADER_SIZE + head
                if end <= len(buf):
                    self.pos = end
                    return self._release_head(buf[pos:end])
                self.head_need = HEADER_SIZE + head
            if avail:
                self.head += buf[pos:]
                self.pos = len(buf)
            return None
        while True:  # collecting a header and head that arrived in pieces
            need = self.head_need - len(self.head)
            n = min(need, len(buf) - self.pos)
            if n:
                self.head += buf[self.pos : self.pos + n]
                self.pos += n
                need -= n
            if need:
                return None
            if self.cmd is None:  # the 9-byte header is complete
                self.head_need = HEADER_SIZE + self._start_request(self.head[0], U64.unpack_from(self.head, 1)[0])
                if len(self.head) < self.head_need:
                    continue
            wire, self.head, self.head_need = bytes(self.head), bytearray(), HEADER_SIZE
            return self._release_head(wire)

    def _start_request(self, c: int, size: int) -> int:
        """Check a request header (command ``c``, payload ``size``); returns the bytes to validate before passing on."""
        state = self.state
        if not state.hello_sent and c != _HELLO:
            raise InvalidRpcRequest("hello_expected", "the first message must be HELLO", c)
        if c >= _NONE:
            raise InvalidRpcRequest("unknown_command", f"unknown command {c}", c)
        if c == _HELLO:
            if state.hello_sent:
                raise InvalidRpcRequest("hello_repeated", "HELLO after the handshake", c)
            if size != HELLO_REQUEST_SIZE:
                raise InvalidRpcRequest("hello_size", f"size {size}, protocol v7 sends {HELLO_REQUEST_SIZE}", c)
        fixed = FIXED_SIZE[c]
        if fixed >= 0:
            if size != fixed:
                raise InvalidRpcRequest("size", f"size {size}, expected {fixed}", c)
            head = fixed
        elif c == _SET_TENSOR:
            if size < SET_TENSOR_HEAD_SIZE:
                raise InvalidRpcRequest("size", f"size {size} < {SET_TENSOR_HEAD_SIZE}", c)
            if size > state.max_message_size:
                raise InvalidRpcRequest("too_large", f"size {size} > cap {state.max_message_size}", c)
            head = SET_TENSOR_HEAD_SIZE
        else:  # GRAPH_COMPUTE
            if size < GRAPH_HEAD_SIZE + 8:
                raise InvalidRpcRequest("size", f"size {size} < {GRAPH_HEAD_SIZE + 8}", c)
            cap = min(state.max_graph_size, state.max_message_size)
            if size > cap:
                raise InvalidRpcRequest("too_large", f"size {size} > cap {cap}", c)
            head = size
        self.cmd, self.size = c, size
        return head

    def _pass_in_place(self, buf: memoryview, pos: int, n: int) -> object:
        if self.head or n - pos < HEADER_SIZE:
            return NOT_HERE
        end = pos + HEADER_SIZE + self._start_request(buf[pos], U64.unpack_from(buf, pos + 1)[0])
        if end > n:
            return NOT_HERE
        self.pos = end
        changed = self._release(buf[pos:end])
        if self.end is not None:
            self.end = None  # _finish ran: the message is whole
        return changed

    def low_water(self, cap: int) -> int:
        """Bytes that must arrive before :meth:`pass_on` can pass anything on (1 to ``cap``): the rest
        of a header and head being collected; 9 (a header) between messages; 1 in a message's data."""
        if self.body_left:
            return 1
        return min(self.head_need - len(self.head), cap) if self.head else min(HEADER_SIZE, cap)

    def _release_head(self, wire: bytes | memoryview) -> RpcRequestEvent:
        """Validate a whole header and head (``wire``); the Request event that passes it on."""
        c = self.cmd
        assert c is not None
        size = self.size
        changed = self._release(wire)
        return Request(CMDS[c], size, bytes(wire) if changed is None else changed)

    def _release(self, wire: bytes | memoryview) -> bytes | None:
        """Validate a whole header and head (``wire``) and queue its reply; None: pass ``wire`` on as it
        is, else the bytes to pass on instead (HELLO with its caps zeroed).

        A head of a :data:`CACHEABLE` command that passed before under the same buffers is not
        checked again (the same bytes give the same answer).
        """
        c = self.cmd
        assert c is not None
        state = self.state
        data = bytes(wire)
        validate = VALIDATORS[c]
        reply = None
        if validate is not None:
            if not _CACHEABLE[c]:
                reply = validate(state, CMDS[c], memoryview(data)[HEADER_SIZE:], self.size)
            elif not state.passed_before(data):
                validate(state, CMDS[c], memoryview(data)[HEADER_SIZE:], self.size)
                state.remember(data)
        if reply is None:
            n = REPLY_SIZE[c]
            if n >= 0:
                reply = state.expect(c, n)
            elif n == -2:  # GET_TENSOR: the size it asks for
                reply = state.expect(c, U64.unpack_from(data, _ASKED_AT)[0])
        changed = None
        if c == _HELLO and state.mask_caps:
            changed = data[:HEADER_SIZE] + bytes(HELLO_REQUEST_SIZE)
        self.body_left = self.size - (len(data) - HEADER_SIZE)
        self.reply = reply
        if not self.body_left:
            self.end = self._finish()
        return changed

    def _finish(self) -> RequestEnd:
        c = self.cmd
        assert c is not None
        state, reply = self.state, self.reply
        self.cmd = None
        state.requests += 1
        if c == _HELLO:
            state.hello_sent = True
        elif c in _COMPUTES:
            state.compute_pending = True
            state.compute_seq = state.requests - 1
        return RequestEnd(CMDS[c], None if reply is None else reply.size)
