"""Sans-I/O ggml-RPC (protocol v7.0.0): a framer and validator for client messages, and a reply tracker.

Bytes in, events out; no sockets, no trio (like :mod:`hydra_trio.protocol.hydra`).
The front door does not reimplement ggml (hydra-protocol.md §4): llama.cpp's
own ggml-RPC server runs in a child process, and this module only decides,
message by message, whether the bytes a client sends are safe to hand to it.

Wire format (all integers little-endian; ggml-rpc.cpp v7.0.0, ``send_rpc_cmd``
and ``send_msg``)::

    request: [u8 cmd][u64 size][payload: size bytes]
    reply:   [u64 size][payload: size bytes]        (only some commands answer)

The first request is always HELLO (command 14, 24 bytes of transport caps);
``rpc_serve_client`` answers 28 bytes (major, minor, patch, pad, caps).  Which
commands answer and with how many bytes is :data:`REPLY_SIZES`; GET_TENSOR
answers the ``size`` it asked for.  A command the server rejects is not
answered either: the server closes the connection (ggml-RPC has no error reply).

Use one :class:`GgmlRpcConnection` per client connection, feed it what the
client sends (:meth:`~GgmlRpcConnection.feed_request`, then
:meth:`~GgmlRpcConnection.next_request_event` until ``None``) and what the
server answers (:meth:`~GgmlRpcConnection.feed_reply`,
:meth:`~GgmlRpcConnection.next_reply_event`).  Every event carries the bytes to
pass on (``data``); the bulk of a SET_TENSOR or a GET_TENSOR reply comes out
as :class:`RequestData` / :class:`ReplyData` slices of the input, not copied.
A message is released only once its header part (everything but SET_TENSOR's
tensor data) has been validated; :class:`InvalidRequest` says which check
failed (:attr:`InvalidRequest.check`, one of :data:`CHECKS`).

Type sizes and block sizes come from the ``gguf`` package
(``gguf.GGML_QUANT_SIZES``, :data:`TYPE_TRAITS`); :func:`reconcile_type_traits`
checks them against the running ggml, and the front door validates with the
reconciled table.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

import attrs
import gguf

__all__ = [
    "CHECKS",
    "GGML_OP_COUNT",
    "GGML_TYPE_COUNT",
    "HEADER_SIZE",
    "HELLO_REPLY_SIZE",
    "HELLO_REQUEST_SIZE",
    "REMOVED_TYPES",
    "REPLY_SIZES",
    "REQUEST_SIZES",
    "RPC_PROTO_MAJOR_VERSION",
    "RPC_TENSOR_SIZE",
    "SET_TENSOR_HEAD_SIZE",
    "TYPE_TRAITS",
    "UNDESCRIBED_TYPES",
    "GgmlRpcConnection",
    "GgmlRpcError",
    "InvalidReply",
    "InvalidRequest",
    "Reply",
    "ReplyData",
    "ReplyEnd",
    "ReplyEvent",
    "Request",
    "RequestData",
    "RequestEnd",
    "RequestEvent",
    "RpcCmd",
    "RpcTensor",
    "encode_graph_compute",
    "encode_reply",
    "encode_request",
    "encode_set_tensor",
    "hello_request",
    "reconcile_type_traits",
    "tensor_nbytes",
]

# --------------------------------------------------------------------------
# Constants (ggml-rpc.cpp / ggml-rpc.h v7.0.0, ggml.h of llama-cpp-python 0.3.36)
# --------------------------------------------------------------------------

RPC_PROTO_MAJOR_VERSION = 7
"""ggml-rpc.h ``RPC_PROTO_MAJOR_VERSION``: the layouts below are those of 7.x."""
HEADER_SIZE = 9
"""``[u8 cmd][u64 size]`` before every request payload."""
REPLY_HEADER_SIZE = 8
"""``[u64 size]`` before every reply payload."""
RPC_CONN_CAPS_SIZE = 24
"""transport.h: bytes of transport capabilities in HELLO (all zero: plain TCP)."""
HELLO_REQUEST_SIZE = RPC_CONN_CAPS_SIZE
HELLO_REPLY_SIZE = 4 + RPC_CONN_CAPS_SIZE

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64  # bytes
GGML_MAX_NAME = 64
GGML_TYPE_COUNT = 43
"""ggml.h ``GGML_TYPE_COUNT`` of the ggml this node runs (llama-cpp-python 0.3.36)."""
REMOVED_TYPES = frozenset({4, 5, 31, 32, 33, 36, 37, 38})
"""ggml.h: type ids whose support was removed (Q4_2, Q4_3, Q4_0_4_4, ...; ``blck_size`` 0)."""
GGML_OP_COUNT = 101
"""ggml.h ``GGML_OP_COUNT``; ggml-rpc.h pins it with ``static_assert(GGML_OP_COUNT == 101)``."""
GGML_OP_NONE = 0
VIEW_OPS = frozenset({36, 37, 38, 39})
"""GGML_OP_RESHAPE, VIEW, PERMUTE, TRANSPOSE: no computation, no memory of their own."""
MAX_GRAPH_DEPTH = 1024
"""Deepest src/view_src chain a GRAPH_COMPUTE may make ``rpc_server::create_node`` recurse
through (it recurses on the child's stack; llama.cpp's graphs list nodes in order, so theirs
are a few levels deep)."""


class RpcCmd(enum.IntEnum):
    """``enum rpc_cmd`` (ggml-rpc.cpp v7.0.0). ``NONE`` is the client's local no-op, never sent."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    NONE = 18


# struct rpc_tensor (packed): id, type, buffer, ne[4] (u32), nb[4] (u32), op,
# op_params[16] (i32), flags, src[10], view_src, view_offs, data, name[64], use_count
_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
RPC_TENSOR_SIZE = _TENSOR.size
assert RPC_TENSOR_SIZE == 296, RPC_TENSOR_SIZE

SET_TENSOR_HEAD_SIZE = RPC_TENSOR_SIZE + 1 + 8
"""SET_TENSOR payload before the tensor data: ``rpc_tensor``, u8 cache_flag, u64 offset."""
GRAPH_HEAD_SIZE = 4 + 4 + 4
"""GRAPH_COMPUTE payload without nodes and tensors: u32 device, u32 n_nodes, u32 n_tensors."""

REQUEST_SIZES: dict[RpcCmd, int] = {
    RpcCmd.ALLOC_BUFFER: 4 + 8,  # rpc_msg_alloc_buffer_req
    RpcCmd.GET_ALIGNMENT: 4,
    RpcCmd.GET_MAX_SIZE: 4,
    RpcCmd.BUFFER_GET_BASE: 8,
    RpcCmd.FREE_BUFFER: 8,
    RpcCmd.BUFFER_CLEAR: 8 + 1,
    RpcCmd.SET_TENSOR_HASH: RPC_TENSOR_SIZE + 8 + 8,
    RpcCmd.GET_TENSOR: RPC_TENSOR_SIZE + 8 + 8,
    RpcCmd.COPY_TENSOR: 2 * RPC_TENSOR_SIZE,
    RpcCmd.GET_DEVICE_MEMORY: 4,
    RpcCmd.INIT_TENSOR: RPC_TENSOR_SIZE,
    RpcCmd.GET_ALLOC_SIZE: 4 + (1 + GGML_MAX_SRC) * RPC_TENSOR_SIZE,
    RpcCmd.HELLO: HELLO_REQUEST_SIZE,
    RpcCmd.DEVICE_COUNT: 0,
    RpcCmd.GRAPH_RECOMPUTE: 4,
    RpcCmd.MEMSET_TENSOR: RPC_TENSOR_SIZE + 8 + 8 + 1,
}
"""Exact payload size of every fixed-size request (``sizeof`` the ``rpc_msg_*_req``).
SET_TENSOR and GRAPH_COMPUTE are variable: their sizes follow from their own counts."""

REPLY_SIZES: dict[RpcCmd, int | None] = {
    RpcCmd.ALLOC_BUFFER: 16,
    RpcCmd.GET_ALIGNMENT: 8,
    RpcCmd.GET_MAX_SIZE: 8,
    RpcCmd.BUFFER_GET_BASE: 8,
    RpcCmd.SET_TENSOR_HASH: 1,
    RpcCmd.GET_TENSOR: None,  # the size the request asked for
    RpcCmd.COPY_TENSOR: 1,
    RpcCmd.GET_DEVICE_MEMORY: 16,
    RpcCmd.GET_ALLOC_SIZE: 8,
    RpcCmd.HELLO: HELLO_REPLY_SIZE,
    RpcCmd.DEVICE_COUNT: 4,
}
"""Commands that ``rpc_serve_client`` answers (``send_msg``), with their reply payload size.
The others (FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR, GRAPH_COMPUTE, INIT_TENSOR,
GRAPH_RECOMPUTE, MEMSET_TENSOR) are not answered."""

_SMALL_REPLY = 64  # replies up to this size are handed over whole, in one event

# int-indexed views of the tables above, for the per-message hot path
_CMDS: tuple[RpcCmd, ...] = tuple(RpcCmd)
_FIXED = tuple(REQUEST_SIZES.get(c, -1) for c in _CMDS)
_REPLY = tuple(-1 if c not in REPLY_SIZES else (REPLY_SIZES[c] if REPLY_SIZES[c] is not None else -2) for c in _CMDS)
_HELLO, _NONE = int(RpcCmd.HELLO), int(RpcCmd.NONE)
_SET_TENSOR, _SET_TENSOR_HASH, _GET_TENSOR = int(RpcCmd.SET_TENSOR), int(RpcCmd.SET_TENSOR_HASH), int(RpcCmd.GET_TENSOR)
_COPY_TENSOR, _MEMSET_TENSOR, _INIT_TENSOR = int(RpcCmd.COPY_TENSOR), int(RpcCmd.MEMSET_TENSOR), int(RpcCmd.INIT_TENSOR)
_GRAPH_COMPUTE, _GRAPH_RECOMPUTE = int(RpcCmd.GRAPH_COMPUTE), int(RpcCmd.GRAPH_RECOMPUTE)
_GET_ALLOC_SIZE, _BUFFER_GET_BASE = int(RpcCmd.GET_ALLOC_SIZE), int(RpcCmd.BUFFER_GET_BASE)
_FREE_BUFFER = int(RpcCmd.FREE_BUFFER)
_DEVICE_FIRST = frozenset(int(c) for c in (RpcCmd.ALLOC_BUFFER, RpcCmd.GET_ALIGNMENT, RpcCmd.GET_MAX_SIZE,
                                           RpcCmd.GET_DEVICE_MEMORY, RpcCmd.GRAPH_RECOMPUTE, RpcCmd.GET_ALLOC_SIZE))
_UNCHECKED = frozenset({_HELLO, int(RpcCmd.DEVICE_COUNT), int(RpcCmd.BUFFER_CLEAR)})
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_TWO64 = 1 << 64
_INT64_MAX = (1 << 63) - 1

CHECKS = (
    "hello_expected",  # the first message is not HELLO
    "hello_size",  # HELLO of another size (another protocol major version)
    "hello_repeated",  # HELLO after the handshake (the server closes on it)
    "unknown_command",  # command id >= RPC_CMD_NONE
    "size",  # payload size wrong for the command, or inconsistent with its own counts
    "too_large",  # over the configured cap
    "device",  # device index >= the number of devices served
    "tensor_type",  # type >= GGML_TYPE_COUNT, a removed type, or one gguf does not describe
    "tensor_shape",  # ne[] zero where data moves, ne[0] not whole blocks, element count overflow
    "tensor_strides",  # nb[] inconsistent with the type
    "tensor_bounds",  # byte size overflows, or data outside its buffer
    "tensor_region",  # offset/size outside the tensor, or no buffer where one is needed
    "graph",  # GRAPH_COMPUTE nodes/sources that do not resolve, bad ops, unbacked nodes
)
"""Values of :attr:`InvalidRequest.check` (stable: they label metrics)."""


def _type_traits() -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for qtype, (blck, size) in gguf.GGML_QUANT_SIZES.items():
        t = int(qtype)
        if t < GGML_TYPE_COUNT and t not in REMOVED_TYPES and blck > 0 and size > 0:
            out[t] = (int(blck), int(size))
    return out


TYPE_TRAITS: dict[int, tuple[int, int]] = _type_traits()
"""``type id -> (blck_size, type_size)`` in bytes, from ``gguf.GGML_QUANT_SIZES``: the default of
:class:`GgmlRpcConnection`.  Check it against the running ggml with :func:`reconcile_type_traits`."""
UNDESCRIBED_TYPES: frozenset[int] = frozenset(range(GGML_TYPE_COUNT)) - REMOVED_TYPES - TYPE_TRAITS.keys()
"""Live ggml types the installed ``gguf`` has no sizes for; with :data:`TYPE_TRAITS` they are refused."""


def reconcile_type_traits(
    ggml_traits: Mapping[int, tuple[int, int]],
) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """Check :data:`TYPE_TRAITS` (gguf's) against the running ggml's own ``(blck_size, type_size)``.

    ``ggml_traits`` maps every type id below :data:`GGML_TYPE_COUNT` to what
    ``ggml_blck_size`` / ``ggml_type_size`` return (blck_size 0: a removed type).
    Returns the table to validate with, which is gguf's wherever the two agree
    and ggml's where they do not (the child computes with ggml's), and one line
    per disagreement or type gguf lacks (the gguf 0.19.0 on the registry says
    40 bytes for a Q8_1 block, ggml-common.h has 36, and it lacks Q2_0).
    """
    table: dict[int, tuple[int, int]] = {}
    notes: list[str] = []
    for t in range(GGML_TYPE_COUNT):
        live = ggml_traits.get(t, (0, 0))
        ours = TYPE_TRAITS.get(t)
        if live[0] <= 0:
            if ours is not None:
                notes.append(f"type {t}: gguf describes it {ours}, this ggml has removed it")
            continue
        if ours is None:
            notes.append(f"type {t}: gguf has no sizes; using ggml's {live}")
        elif ours != live:
            notes.append(f"type {t}: gguf says {ours}, ggml {live}; using ggml's")
        table[t] = live
    return table, notes


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class GgmlRpcError(Exception):
    """Base class of this module's errors. After one, the connection object is unusable."""


class InvalidRequest(GgmlRpcError):
    """A client message failed validation; it must not reach the server.

    Attributes:
        check: which rule failed, one of :data:`CHECKS`.
        cmd: the command id (None when the header itself was not complete).
    """

    def __init__(self, check: str, message: str, cmd: int | None = None) -> None:
        assert check in CHECKS, check
        name = _cmd_name(cmd) if cmd is not None else "message"
        super().__init__(f"{name}: {message}")
        self.check = check
        self.cmd = cmd


class InvalidReply(GgmlRpcError):
    """The server sent something that is not the reply the tracker expects (desynchronised)."""


def _cmd_name(cmd: int) -> str:
    try:
        return RpcCmd(cmd).name
    except ValueError:
        return f"command {cmd}"


# --------------------------------------------------------------------------
# rpc_tensor
# --------------------------------------------------------------------------


@attrs.frozen
class RpcTensor:
    """``struct rpc_tensor`` (ggml-rpc.cpp v7.0.0), 296 bytes on the wire.

    ``id`` is the client's tensor pointer (0: no tensor), ``buffer`` the
    server's buffer handle from ALLOC_BUFFER (0: none), ``data`` an address
    in the server's memory; ``ne`` element counts and ``nb`` byte strides
    (both u32 on the wire), ``src``/``view_src`` other tensors' ids.
    """

    id: int = 0
    type: int = 0
    buffer: int = 0
    ne: tuple[int, int, int, int] = (1, 1, 1, 1)
    nb: tuple[int, int, int, int] = (4, 4, 4, 4)
    op: int = 0
    op_params: tuple[int, ...] = (0,) * (GGML_MAX_OP_PARAMS // 4)
    flags: int = 0
    src: tuple[int, ...] = (0,) * GGML_MAX_SRC
    view_src: int = 0
    view_offs: int = 0
    data: int = 0
    name: bytes = b""
    use_count: int = 0

    @classmethod
    def unpack_from(cls, buf: bytes | bytearray | memoryview, offset: int = 0) -> RpcTensor:
        """Read one tensor at ``offset`` (``struct.error`` if fewer than 296 bytes remain)."""
        v = _TENSOR.unpack_from(buf, offset)
        return cls(
            id=v[0], type=v[1], buffer=v[2], ne=v[3:7], nb=v[7:11], op=v[11], op_params=v[12:28], flags=v[28],
            src=v[29:39], view_src=v[39], view_offs=v[40], data=v[41], name=v[42].rstrip(b"\0"), use_count=v[43],
        )

    def pack(self) -> bytes:
        """The 296 wire bytes (``struct.error`` for a field out of its C type's range)."""
        return _TENSOR.pack(
            self.id, self.type, self.buffer, *self.ne, *self.nb, self.op, *self.op_params, self.flags,
            *self.src, self.view_src, self.view_offs, self.data, self.name, self.use_count,
        )


def tensor_nbytes(t: RpcTensor, traits: Mapping[int, tuple[int, int]] = TYPE_TRAITS) -> int:
    """``ggml_nbytes`` of a tensor whose type is in ``traits``, in bytes (exact, no wrap-around).

    0 when some ``ne[i]`` is 0 (an empty tensor), as ggml.c computes it.
    """
    if 0 in t.ne:
        return 0
    blck, size = traits[t.type]
    tail = sum((t.ne[i] - 1) * t.nb[i] for i in range(1, GGML_MAX_DIMS))
    if blck == 1:
        return size + (t.ne[0] - 1) * t.nb[0] + tail
    return t.ne[0] * t.nb[0] // blck + tail


@attrs.define
class _Buffer:
    size: int
    base: int | None = None  # known once BUFFER_GET_BASE was answered


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


@attrs.frozen
class Request:
    """A validated request header: pass ``data`` on (the 9-byte header and the validated part
    of the payload: all of it, except SET_TENSOR's tensor data, which follows as RequestData)."""

    cmd: RpcCmd
    size: int
    data: bytes


@attrs.frozen
class RequestData:
    """Payload bytes passed through without validation (SET_TENSOR's tensor data): a slice of the input."""

    data: bytes | memoryview


@attrs.frozen
class RequestEnd:
    """The request is complete. ``reply_size``: bytes the server will answer, None: no reply."""

    cmd: RpcCmd
    reply_size: int | None


@attrs.frozen
class Reply:
    """A reply header (and, for small replies, the whole payload) to pass on in ``data``."""

    cmd: RpcCmd
    size: int
    data: bytes


@attrs.frozen
class ReplyData:
    """Reply payload passed through (a GET_TENSOR answer): a slice of the input."""

    data: bytes | memoryview


@attrs.frozen
class ReplyEnd:
    """The reply to ``cmd`` is complete."""

    cmd: RpcCmd


RequestEvent: TypeAlias = Request | RequestData | RequestEnd
ReplyEvent: TypeAlias = Reply | ReplyData | ReplyEnd


@attrs.define
class _Pending:
    cmd: RpcCmd
    size: int
    key: int = 0  # BUFFER_GET_BASE: the buffer asked about
    seq: int = 0  # index of the request it answers


# --------------------------------------------------------------------------
# The connection
# --------------------------------------------------------------------------


class GgmlRpcConnection:
    """State of one ggml-RPC client connection, both directions (ggml-rpc.cpp v7.0.0).

    Args:
        max_message_size: largest request payload accepted, bytes (SET_TENSOR streams through).
        max_graph_size: largest GRAPH_COMPUTE payload, bytes (held whole to be validated).
        n_devices: devices the server exposes; device indexes at or above are refused.
            None: not checked (the server rejects them itself, without crashing).
        cached_size: ``hash -> size in bytes`` of the server's tensor cache file for
            SET_TENSOR_HASH, or None when it has none; None: no cache (nothing to check).
        mask_caps: zero the transport caps in HELLO both ways, so that the connection stays
            plain TCP through the front door (an RDMA upgrade would bypass it; transport.cpp:
            all-zero caps mean "no RDMA").
        type_traits: ``type id -> (blck_size, type_size)``; default :data:`TYPE_TRAITS`
            (gguf's). Types missing from it are refused.

    It tracks the buffers the server allocated for this client (ALLOC_BUFFER and
    BUFFER_GET_BASE replies, FREE_BUFFER requests; ``rpc_server`` keeps them per
    connection) to check tensor data against them as ``deserialize_tensor`` does
    with ``GGML_ASSERT``, and the replies still owed, in order.
    """

    def __init__(
        self,
        *,
        max_message_size: int = 16 << 30,
        max_graph_size: int = 256 << 20,
        n_devices: int | None = None,
        cached_size: Callable[[int], int | None] | None = None,
        mask_caps: bool = True,
        type_traits: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        self.traits = TYPE_TRAITS if type_traits is None else type_traits
        self.max_message_size = max_message_size
        self.max_graph_size = max_graph_size
        self.n_devices = n_devices
        self.cached_size = cached_size
        self.mask_caps = mask_caps
        self.buffers: dict[int, _Buffer] = {}
        self.pending: deque[_Pending] = deque()
        """Replies owed by the server, oldest first."""
        self.hello_sent = False
        self.hello_answered = False
        self.compute_pending = False
        """A GRAPH_COMPUTE / GRAPH_RECOMPUTE was sent and no request sent after it has been
        answered yet (the server works in order: such a reply means the compute is done)."""
        self.requests = 0
        """Requests complete so far."""
        self.replies = 0
        self._compute_seq = -1
        self._error: GgmlRpcError | None = None
        # request direction
        self._in: memoryview = memoryview(b"")
        self._in_pos = 0
        self._head = bytearray()  # header + validated part being collected
        self._cmd: RpcCmd | None = None
        self._size = 0
        self._head_need = HEADER_SIZE
        self._body_left = 0
        self._req_end: RequestEnd | None = None
        self._pending_reply_size: _Pending | None = None
        # reply direction
        self._rin: memoryview = memoryview(b"")
        self._rin_pos = 0
        self._rhead = bytearray()
        self._rcur: _Pending | None = None
        self._rbody_left = 0
        self._rneed = REPLY_HEADER_SIZE
        self._rend: ReplyEnd | None = None

    # ------------------------------------------------------------ state
    @property
    def request_in_progress(self) -> bool:
        """Some bytes of a request have arrived but not all of it."""
        return bool(self._head) or self._body_left > 0 or self._req_end is not None

    @property
    def reply_in_progress(self) -> bool:
        """Some bytes of a reply have arrived but not all of it (or its end is not yet read out)."""
        return bool(self._rhead) or self._rcur is not None or self._rend is not None

    @property
    def between_messages(self) -> bool:
        """Nothing half-sent either way, no reply owed, no compute unread: closing now loses nothing."""
        return not (self.request_in_progress or self.reply_in_progress or self.pending or self.compute_pending)

    # ------------------------------------------------------------ requests
    def feed_request(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes the client sent; read the events with :meth:`next_request_event`.

        Raises:
            RuntimeError: the previous input has not been read out yet.
        """
        if self._in_pos < len(self._in):
            raise RuntimeError("feed_request before the previous data was consumed")
        self._in = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        self._in_pos = 0

    def next_request_event(self) -> RequestEvent | None:
        """The next event of the client's stream, or None when more bytes are needed.

        Raises:
            InvalidRequest: the message at hand failed validation (again on every later call).
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next_request()
        except GgmlRpcError as exc:
            self._error = exc
            raise

    def receive_request(self, data: bytes | bytearray | memoryview) -> list[RequestEvent]:
        """:meth:`feed_request` then every event it makes (convenience for tests and tools)."""
        self.feed_request(data)
        out: list[RequestEvent] = []
        while (ev := self.next_request_event()) is not None:
            out.append(ev)
        return out

    def _next_request(self) -> RequestEvent | None:
        if self._req_end is not None:
            ev, self._req_end = self._req_end, None
            return ev
        buf, pos = self._in, self._in_pos
        avail = len(buf) - pos
        if self._body_left:
            n = min(self._body_left, avail)
            if n == 0:
                return None
            self._in_pos = pos + n
            self._body_left -= n
            if not self._body_left:
                self._req_end = self._end_request(self._cmd)
            return RequestData(buf[pos : pos + n])
        if not self._head:  # at a message boundary: parse in place when header and head are all here
            if avail >= HEADER_SIZE:
                head = self._start_request(buf[pos], _U64.unpack_from(buf, pos + 1)[0])
                end = pos + HEADER_SIZE + head
                if end <= len(buf):
                    self._in_pos = end
                    return self._release_head(buf[pos:end])
                self._head_need = HEADER_SIZE + head
            if avail:
                self._head += buf[pos:]
                self._in_pos = len(buf)
            return None
        while True:  # collecting a header and head that arrived in pieces
            need = self._head_need - len(self._head)
            n = min(need, len(buf) - self._in_pos)
            if n:
                self._head += buf[self._in_pos : self._in_pos + n]
                self._in_pos += n
                need -= n
            if need:
                return None
            if self._cmd is None:  # the 9-byte header is complete
                self._head_need = HEADER_SIZE + self._start_request(self._head[0], _U64.unpack_from(self._head, 1)[0])
                if len(self._head) < self._head_need:
                    continue
            wire, self._head, self._head_need = bytes(self._head), bytearray(), HEADER_SIZE
            return self._release_head(wire)

    def _start_request(self, c: int, size: int) -> int:
        """Check a request header (command ``c``, payload ``size``); returns the bytes to validate before passing on."""
        if not self.hello_sent and c != _HELLO:
            raise InvalidRequest("hello_expected", "the first message must be HELLO", c)
        if c >= _NONE:
            raise InvalidRequest("unknown_command", f"unknown command {c}", c)
        if c == _HELLO:
            if self.hello_sent:
                raise InvalidRequest("hello_repeated", "HELLO after the handshake", c)
            if size != HELLO_REQUEST_SIZE:
                raise InvalidRequest("hello_size", f"size {size}, protocol v7 sends {HELLO_REQUEST_SIZE}", c)
        fixed = _FIXED[c]
        if fixed >= 0:
            if size != fixed:
                raise InvalidRequest("size", f"size {size}, expected {fixed}", c)
            head = fixed
        elif c == _SET_TENSOR:
            if size < SET_TENSOR_HEAD_SIZE:
                raise InvalidRequest("size", f"size {size} < {SET_TENSOR_HEAD_SIZE}", c)
            if size > self.max_message_size:
                raise InvalidRequest("too_large", f"size {size} > cap {self.max_message_size}", c)
            head = SET_TENSOR_HEAD_SIZE
        else:  # GRAPH_COMPUTE
            if size < GRAPH_HEAD_SIZE + 8:
                raise InvalidRequest("size", f"size {size} < {GRAPH_HEAD_SIZE + 8}", c)
            cap = min(self.max_graph_size, self.max_message_size)
            if size > cap:
                raise InvalidRequest("too_large", f"size {size} > cap {cap}", c)
            head = size
        self._cmd, self._size = c, size
        return head

    def _release_head(self, wire: bytes | memoryview) -> RequestEvent:
        """Validate a whole header and head (``wire``); the Request event that passes it on."""
        c = self._cmd
        reply = self._validate(c, wire[HEADER_SIZE:]) if c not in _UNCHECKED else None
        if reply is None and _REPLY[c] >= 0:
            reply = self._expect(c, _REPLY[c])
        data = bytes(wire)
        if c == _HELLO and self.mask_caps:
            data = data[:HEADER_SIZE] + bytes(HELLO_REQUEST_SIZE)
        self._body_left = self._size - (len(data) - HEADER_SIZE)
        self._pending_reply_size = reply
        if not self._body_left:
            self._req_end = self._end_request(c)
        return Request(_CMDS[c], self._size, data)

    def _end_request(self, c: int) -> RequestEnd:
        reply = self._pending_reply_size
        self._cmd = None
        self.requests += 1
        if c == _HELLO:
            self.hello_sent = True
        elif c == _GRAPH_COMPUTE or c == _GRAPH_RECOMPUTE:
            self.compute_pending = True
            self._compute_seq = self.requests - 1
        return RequestEnd(_CMDS[c], None if reply is None else reply.size)

    # ------------------------------------------------------------ validation
    def _validate(self, c: int, p: bytes | memoryview) -> _Pending | None:
        """Check one request's validated part; returns the reply it will get (queued) if it settled it."""
        cmd = _CMDS[c]
        if c in _DEVICE_FIRST:
            self._check_device(cmd, _U32.unpack_from(p)[0])
        if c == _BUFFER_GET_BASE:
            return self._expect(c, _REPLY[c], _U64.unpack_from(p)[0])
        if c == _FREE_BUFFER:
            self.buffers.pop(_U64.unpack_from(p)[0], None)
        elif c == _SET_TENSOR:
            t = RpcTensor.unpack_from(p)
            offset = _U64.unpack_from(p, RPC_TENSOR_SIZE + 1)[0]
            self._check_region(cmd, t, offset, self._size - SET_TENSOR_HEAD_SIZE)
        elif c == _SET_TENSOR_HASH:
            t = RpcTensor.unpack_from(p)
            offset, h = struct.unpack_from("<QQ", p, RPC_TENSOR_SIZE)
            nbytes = self._check_region(cmd, t, offset, 0)
            size = self.cached_size(h) if self.cached_size is not None else None
            if size is not None and offset + size > nbytes:
                raise InvalidRequest("tensor_region", f"cached data {h:016x} ({size} bytes at offset {offset}) "
                                     f"overruns the tensor ({nbytes} bytes)", cmd)
        elif c == _GET_TENSOR:
            t = RpcTensor.unpack_from(p)
            offset, size = struct.unpack_from("<QQ", p, RPC_TENSOR_SIZE)
            self._check_region(cmd, t, offset, size)
            return self._expect(c, size)
        elif c == _MEMSET_TENSOR:
            t = RpcTensor.unpack_from(p)
            offset, size = struct.unpack_from("<QQ", p, RPC_TENSOR_SIZE)
            self._check_region(cmd, t, offset, size)
        elif c == _COPY_TENSOR:
            for i in range(2):
                t = RpcTensor.unpack_from(p, i * RPC_TENSOR_SIZE)
                self._check_tensor(cmd, t, allow_empty=True)
                self._need_buffer(cmd, t)
        elif c == _INIT_TENSOR:
            self._check_tensor(cmd, RpcTensor.unpack_from(p), allow_empty=True)
        elif c == _GET_ALLOC_SIZE:
            self._check_tensor(cmd, RpcTensor.unpack_from(p, 4), allow_empty=True)
            for i in range(GGML_MAX_SRC):
                s = RpcTensor.unpack_from(p, 4 + (1 + i) * RPC_TENSOR_SIZE)
                if s.id != 0:  # rpc_server::get_alloc_size deserializes only these
                    self._check_tensor(cmd, s, allow_empty=True)
        elif c == _GRAPH_COMPUTE:
            self._check_graph(p)
        return None

    def _expect(self, c: int, size: int, key: int = 0) -> _Pending:
        pending = _Pending(_CMDS[c], size, key, self.requests)
        self.pending.append(pending)
        return pending

    def _check_device(self, cmd: RpcCmd, device: int) -> None:
        if self.n_devices is not None and device >= self.n_devices:
            raise InvalidRequest("device", f"device {device}, the server has {self.n_devices}", cmd)

    def _check_tensor(self, cmd: RpcCmd, t: RpcTensor, *, allow_empty: bool) -> int:
        """``rpc_server::deserialize_tensor``'s preconditions, and the asserts behind it; returns nbytes."""
        if t.type >= GGML_TYPE_COUNT or t.type in REMOVED_TYPES:
            raise InvalidRequest("tensor_type", f"tensor {t.id:#x}: type {t.type} is not a ggml type", cmd)
        traits = self.traits.get(t.type)
        if traits is None:
            raise InvalidRequest("tensor_type", f"tensor {t.id:#x}: type {t.type} has no known block size", cmd)
        blck, tsize = traits
        ne, nb = t.ne, t.nb
        if not allow_empty and 0 in ne:
            raise InvalidRequest("tensor_shape", f"tensor {t.id:#x}: ne {list(ne)} has a zero", cmd)
        if ne[0] % blck:
            raise InvalidRequest("tensor_shape", f"tensor {t.id:#x}: ne[0] = {ne[0]} is not a multiple of "
                                 f"the block size {blck} of type {t.type}", cmd)
        n = ne[0]  # ggml_new_tensor_impl: the element count must fit in int64
        for i in range(1, GGML_MAX_DIMS):
            if ne[i] > 1:
                if _INT64_MAX // ne[i] <= n:
                    raise InvalidRequest("tensor_shape", f"tensor {t.id:#x}: ne {list(ne)} overflows int64", cmd)
                n *= ne[i]
        if blck > 1 and nb[0] != tsize:
            raise InvalidRequest("tensor_strides", f"tensor {t.id:#x}: nb[0] = {nb[0]}, type {t.type} "
                                 f"has {tsize}-byte blocks", cmd)
        for i in range(GGML_MAX_DIMS):
            if ne[i] > 1 and nb[i] < tsize:
                raise InvalidRequest("tensor_strides", f"tensor {t.id:#x}: nb[{i}] = {nb[i]} < element "
                                     f"size {tsize}", cmd)
        nbytes = tensor_nbytes(t, self.traits)
        if nbytes > _INT64_MAX or t.data + nbytes >= _TWO64:
            raise InvalidRequest("tensor_bounds", f"tensor {t.id:#x}: {nbytes} bytes at {t.data:#x} overflow", cmd)
        if t.buffer:
            buf = self.buffers.get(t.buffer)
            if buf is None:
                if any(p.cmd is RpcCmd.ALLOC_BUFFER for p in self.pending):
                    raise InvalidRequest("tensor_bounds", f"tensor {t.id:#x}: buffer {t.buffer:#x} named before "
                                         "its ALLOC_BUFFER was answered", cmd)
                # not this server's buffer: deserialize_tensor treats it as none
            else:
                base = 0 if buf.size == 0 else buf.base  # ggml_backend_buffer_get_base: NULL when size 0
                if base is None:
                    raise InvalidRequest("tensor_bounds", f"tensor {t.id:#x}: buffer {t.buffer:#x} used "
                                         "before BUFFER_GET_BASE", cmd)
                if t.data < base or t.data + nbytes > base + buf.size:
                    raise InvalidRequest("tensor_bounds", f"tensor {t.id:#x}: data [{t.data:#x}, +{nbytes}) "
                                         f"outside buffer [{base:#x}, +{buf.size})", cmd)
        return nbytes

    def _need_buffer(self, cmd: RpcCmd, t: RpcTensor) -> None:
        if t.buffer not in self.buffers:
            raise InvalidRequest("tensor_region", f"tensor {t.id:#x} is in no buffer of this connection", cmd)

    def _check_region(self, cmd: RpcCmd, t: RpcTensor, offset: int, size: int) -> int:
        """Tensor checks, then ``offset + size <= ggml_nbytes`` (ggml_backend_tensor_set/get assert it)."""
        nbytes = self._check_tensor(cmd, t, allow_empty=False)
        self._need_buffer(cmd, t)
        if offset + size > nbytes:
            raise InvalidRequest("tensor_region", f"tensor {t.id:#x}: [{offset}, +{size}) outside its "
                                 f"{nbytes} bytes", cmd)
        return nbytes

    def _check_graph(self, p: bytes | memoryview) -> None:
        """GRAPH_COMPUTE: ``| device u32 | n_nodes u32 | nodes u64[n_nodes] | n_tensors u32 | rpc_tensor[n_tensors] |``
        (ggml-rpc.cpp v7.0.0, ``serialize_graph`` / ``rpc_server::graph_compute``)."""
        cmd = RpcCmd.GRAPH_COMPUTE
        device, n_nodes = struct.unpack_from("<II", p)
        self._check_device(cmd, device)
        if n_nodes == 0:
            raise InvalidRequest("graph", "no nodes", cmd)
        at = 8 + 8 * n_nodes
        if at + 4 > len(p):
            raise InvalidRequest("size", f"{n_nodes} nodes do not fit in {len(p)} bytes", cmd)
        (n_tensors,) = struct.unpack_from("<I", p, at)
        want = at + 4 + n_tensors * RPC_TENSOR_SIZE
        if want != len(p):
            raise InvalidRequest("size", f"{n_nodes} nodes and {n_tensors} tensors make {want} bytes, "
                                 f"not {len(p)}", cmd)
        nodes = struct.unpack_from(f"<{n_nodes}Q", p, 8)
        tensors: dict[int, RpcTensor] = {}
        for i in range(n_tensors):
            t = RpcTensor.unpack_from(p, at + 4 + i * RPC_TENSOR_SIZE)
            self._check_tensor(cmd, t, allow_empty=True)
            if t.op >= GGML_OP_COUNT:
                raise InvalidRequest("graph", f"tensor {t.id:#x}: op {t.op} >= GGML_OP_COUNT", cmd)
            tensors.setdefault(t.id, t)  # the server keeps the first of duplicate ids
        for t in tensors.values():
            for s in (*t.src, t.view_src):
                if s and s not in tensors:
                    raise InvalidRequest("graph", f"tensor {t.id:#x} refers to {s:#x}, which is not in the graph", cmd)
        for i, node in enumerate(nodes):
            if node == 0:
                raise InvalidRequest("graph", f"node {i} has id 0", cmd)
            t = tensors.get(node)
            if t is None:
                raise InvalidRequest("graph", f"node {i} ({node:#x}) is not among the graph's tensors", cmd)
            if t.op != GGML_OP_NONE and t.op not in VIEW_OPS and 0 not in t.ne and t.data == 0:
                raise InvalidRequest("graph", f"node {i} ({node:#x}) is computed (op {t.op}) into no memory", cmd)
        self._check_depth(nodes, tensors)

    @staticmethod
    def _check_depth(nodes: Iterable[int], tensors: dict[int, RpcTensor]) -> None:
        """Replay ``rpc_server::create_node``'s recursion without recursing; refuse it if too deep."""
        created: set[int] = set()
        for node in nodes:
            if node in created:
                continue
            created.add(node)
            stack = [iter((*tensors[node].src, tensors[node].view_src))]
            while stack:
                if len(stack) > MAX_GRAPH_DEPTH:
                    raise InvalidRequest("graph", f"sources nest deeper than {MAX_GRAPH_DEPTH}", RpcCmd.GRAPH_COMPUTE)
                for s in stack[-1]:
                    if s and s not in created:
                        created.add(s)
                        t = tensors[s]
                        stack.append(iter((*t.src, t.view_src)))
                        break
                else:
                    stack.pop()

    # ------------------------------------------------------------ replies
    def feed_reply(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes the server sent; read the events with :meth:`next_reply_event`."""
        if self._rin_pos < len(self._rin):
            raise RuntimeError("feed_reply before the previous data was consumed")
        self._rin = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        self._rin_pos = 0

    def next_reply_event(self) -> ReplyEvent | None:
        """The next event of the server's stream, or None when more bytes are needed.

        Raises:
            InvalidReply: bytes nobody asked for, or a reply of the wrong size or version.
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next_reply()
        except GgmlRpcError as exc:
            self._error = exc
            raise

    def receive_reply(self, data: bytes | bytearray | memoryview) -> list[ReplyEvent]:
        """:meth:`feed_reply` then every event it makes."""
        self.feed_reply(data)
        out: list[ReplyEvent] = []
        while (ev := self.next_reply_event()) is not None:
            out.append(ev)
        return out

    def _next_reply(self) -> ReplyEvent | None:
        if self._rend is not None:
            ev, self._rend = self._rend, None
            return ev
        buf = self._rin
        if self._rbody_left:
            n = min(self._rbody_left, len(buf) - self._rin_pos)
            if n == 0:
                return None
            pos = self._rin_pos
            self._rin_pos += n
            self._rbody_left -= n
            if not self._rbody_left:
                assert self._rcur is not None
                self._rend = self._end_reply(self._rcur)
            return ReplyData(buf[pos : pos + n])
        pos = self._rin_pos
        if self._rcur is None and not self._rhead and len(buf) - pos >= REPLY_HEADER_SIZE and self.pending:
            cur = self.pending[0]  # at a reply boundary, a small reply all here: parse it in place
            size = _U64.unpack_from(buf, pos)[0]
            end = pos + REPLY_HEADER_SIZE + size
            if size == cur.size and size <= _SMALL_REPLY and end <= len(buf):
                self._rin_pos = end
                data = bytes(buf[pos:end])
                if size:
                    data = self._reply_payload(cur, data)
                self._rend = self._end_reply(cur)
                return Reply(cur.cmd, size, data)
        while True:
            need = self._rneed - len(self._rhead)
            n = min(need, len(buf) - self._rin_pos)
            if n:
                if self._rcur is None and not self.pending:
                    raise InvalidReply(f"{len(buf) - self._rin_pos} bytes from the server while no reply is owed")
                self._rhead += buf[self._rin_pos : self._rin_pos + n]
                self._rin_pos += n
                need -= n
            if need:
                return None
            cur = self._rcur
            if cur is None:  # the 8-byte size is complete
                cur = self._rcur = self.pending[0]
                (size,) = struct.unpack_from("<Q", self._rhead)
                if size != cur.size:
                    raise InvalidReply(f"{cur.cmd.name} answered {size} bytes, {cur.size} expected")
                if size <= _SMALL_REPLY:
                    self._rneed = REPLY_HEADER_SIZE + size
                    continue
                data = bytes(self._rhead)
                self._rhead = bytearray()
                self._rbody_left = size
                return Reply(cur.cmd, size, data)
            data = self._reply_payload(cur, bytes(self._rhead))
            self._rhead = bytearray()
            self._rneed = REPLY_HEADER_SIZE
            self._rend = self._end_reply(cur)
            return Reply(cur.cmd, cur.size, data)

    def _reply_payload(self, cur: _Pending, data: bytes) -> bytes:
        p = data[REPLY_HEADER_SIZE:]
        if cur.cmd is RpcCmd.HELLO:
            if p[0] != RPC_PROTO_MAJOR_VERSION:
                raise InvalidReply(f"the server speaks ggml-RPC {p[0]}.{p[1]}.{p[2]}, this front door "
                                   f"validates {RPC_PROTO_MAJOR_VERSION}.x")
            if self.mask_caps:
                data = data[: REPLY_HEADER_SIZE + 4] + bytes(RPC_CONN_CAPS_SIZE)
        elif cur.cmd is RpcCmd.ALLOC_BUFFER:
            ptr, size = struct.unpack_from("<QQ", p)
            if ptr:
                self.buffers[ptr] = _Buffer(size)
        elif cur.cmd is RpcCmd.BUFFER_GET_BASE:
            buf = self.buffers.get(cur.key)
            if buf is not None:
                buf.base = struct.unpack_from("<Q", p)[0]
        return data

    def _end_reply(self, cur: _Pending) -> ReplyEnd:
        self._rcur = None
        self._rneed = REPLY_HEADER_SIZE
        self.pending.popleft()
        self.replies += 1
        if cur.seq > self._compute_seq:  # asked after the last compute, answered: the compute is done
            self.compute_pending = False
        if cur.cmd is RpcCmd.HELLO:
            self.hello_answered = True
        return ReplyEnd(cur.cmd)


# --------------------------------------------------------------------------
# Encoders (tests, fuzzing, probes)
# --------------------------------------------------------------------------


def encode_request(cmd: int, payload: bytes = b"") -> bytes:
    """``[u8 cmd][u64 size][payload]``."""
    return struct.pack("<BQ", cmd, len(payload)) + payload


def hello_request(caps: bytes = bytes(RPC_CONN_CAPS_SIZE)) -> bytes:
    """The HELLO a v7 client sends (caps all zero: plain TCP)."""
    return encode_request(RpcCmd.HELLO, caps)


def encode_reply(payload: bytes) -> bytes:
    """``[u64 size][payload]`` (the server side, for tests)."""
    return struct.pack("<Q", len(payload)) + payload


def encode_set_tensor(t: RpcTensor, offset: int, data: bytes, cache_flag: int = 0) -> bytes:
    """SET_TENSOR: ``| rpc_tensor | u8 cache_flag | u64 offset | data |``."""
    return encode_request(RpcCmd.SET_TENSOR, t.pack() + struct.pack("<BQ", cache_flag, offset) + data)


def encode_graph_compute(device: int, nodes: list[int], tensors: list[RpcTensor]) -> bytes:
    """GRAPH_COMPUTE as ``serialize_graph`` lays it out."""
    body = struct.pack(f"<II{len(nodes)}QI", device, len(nodes), *nodes, len(tensors))
    return encode_request(RpcCmd.GRAPH_COMPUTE, body + b"".join(t.pack() for t in tensors))
