"""ggml-RPC v7 wire constants: command ids, message layouts and sizes, and encoders for tests.

Source: ggml-rpc.cpp / ggml-rpc.h v7.0.0 (``enum rpc_cmd``, the ``rpc_msg_*``
structs, ``send_rpc_cmd`` / ``send_msg``) and ggml.h of llama-cpp-python 0.3.36.
All integers are little-endian.
"""

from __future__ import annotations

import enum
import struct

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


TENSOR_STRUCT = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
"""``struct rpc_tensor`` (packed): id, type, buffer, ne[4] (u32), nb[4] (u32), op,
op_params[16] (i32), flags, src[10], view_src, view_offs, data, name[64], use_count."""
RPC_TENSOR_SIZE = TENSOR_STRUCT.size
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

# int-indexed views of the tables above, for the per-message hot path (index: command id)
CMDS: tuple[RpcCmd, ...] = tuple(RpcCmd)
FIXED_SIZE: tuple[int, ...] = tuple(REQUEST_SIZES.get(c, -1) for c in CMDS)
"""Payload size of each fixed-size command; -1: variable (SET_TENSOR, GRAPH_COMPUTE) or NONE."""
REPLY_SIZE: tuple[int, ...] = tuple(
    -1 if c not in REPLY_SIZES else (-2 if (n := REPLY_SIZES[c]) is None else n) for c in CMDS
)
"""Reply payload size of each command; -1: no reply, -2: the size the request asks for (GET_TENSOR)."""
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
U64_PAIR = struct.Struct("<QQ")


def encode_request(cmd: int, payload: bytes = b"") -> bytes:
    """``[u8 cmd][u64 size][payload]`` (``send_rpc_cmd``), for tests, fuzzing and probes."""
    return struct.pack("<BQ", cmd, len(payload)) + payload


def hello_request(caps: bytes = bytes(RPC_CONN_CAPS_SIZE)) -> bytes:
    """The HELLO a v7 client sends (caps all zero: plain TCP)."""
    return encode_request(RpcCmd.HELLO, caps)


def encode_reply(payload: bytes) -> bytes:
    """``[u64 size][payload]`` (the server side's ``send_msg``, for tests)."""
    return struct.pack("<Q", len(payload)) + payload
