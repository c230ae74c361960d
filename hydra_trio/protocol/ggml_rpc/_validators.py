"""Per-command request checks, as a table: :data:`VALIDATORS` (index: command id).

Each validator gets the part of a request that is held before it is passed on
(the whole payload, except SET_TENSOR's tensor data) and makes the checks that
ggml-rpc.cpp v7.0.0's ``rpc_server`` method for that command makes, or that
the ggml calls behind it assert (a failed ``GGML_ASSERT`` aborts the server
process, so these must fail here first).  Payload layouts are the
``rpc_msg_*_req`` structs of ggml-rpc.cpp.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import TypeAlias

from ._events import InvalidRpcRequest
from ._state import ConnectionState, Pending
from ._tensor import RpcTensor
from ._wire import (
    CMDS,
    GGML_MAX_SRC,
    GGML_OP_COUNT,
    GGML_OP_NONE,
    MAX_GRAPH_DEPTH,
    REPLY_SIZE,
    RPC_TENSOR_SIZE,
    SET_TENSOR_HEAD_SIZE,
    U32,
    U64,
    U64_PAIR,
    VIEW_OPS,
    RpcCmd,
)

Validator: TypeAlias = Callable[[ConnectionState, RpcCmd, bytes | memoryview, int], Pending | None]
"""``(state, cmd, held part of the payload, payload size in bytes) -> the reply queued, or None``.

It raises InvalidRpcRequest when a check fails.  A validator that returns None
leaves queueing the reply (of the fixed size in REPLY_SIZES, if any; GET_TENSOR's: the size it
asks for) to the caller."""


def _device(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """Requests that begin with ``u32 device`` and name nothing else to check."""
    state.check_device(cmd, U32.unpack_from(p)[0])


def _buffer_get_base(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> Pending:
    """``| buffer u64 |``: the reply carries the base that later tensors' data are checked against."""
    return state.expect(cmd, REPLY_SIZE[cmd], U64.unpack_from(p)[0])


def _free_buffer(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| buffer u64 |``: forget the buffer (an unknown one is the server's to refuse)."""
    if state.buffers.pop(U64.unpack_from(p)[0], None) is not None:
        state.buffers_changed()


def _set_tensor(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| rpc_tensor | u8 cache_flag | u64 offset | data |``: the data must fit in the tensor."""
    t = RpcTensor.unpack_from(p)
    offset = U64.unpack_from(p, RPC_TENSOR_SIZE + 1)[0]
    state.check_region(cmd, t, offset, size - SET_TENSOR_HEAD_SIZE)


def _tensor_and_pair(p: bytes | memoryview) -> tuple[RpcTensor, int, int]:
    """``| rpc_tensor | u64 | u64 | ...``: the tensor and the two numbers after it."""
    a, b = U64_PAIR.unpack_from(p, RPC_TENSOR_SIZE)
    return RpcTensor.unpack_from(p), a, b


def _set_tensor_hash(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| rpc_tensor | u64 offset | u64 hash |``: the cached data (when the cache has it) must fit."""
    t, offset, h = _tensor_and_pair(p)
    nbytes = state.check_region(cmd, t, offset, 0)
    cached = state.cached_size(h) if state.cached_size is not None else None
    if cached is not None and offset + cached > nbytes:
        raise InvalidRpcRequest(
            "tensor_region",
            f"cached data {h:016x} ({cached} bytes at offset {offset}) overruns the tensor ({nbytes} bytes)",
            cmd,
        )


def _get_tensor(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| rpc_tensor | u64 offset | u64 size |``: the region must be in the tensor (the reply, that
    size, is queued by the caller: :data:`~._wire.REPLY_SIZE` -2)."""
    t, offset, want = _tensor_and_pair(p)
    state.check_region(cmd, t, offset, want)


def _memset_tensor(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| rpc_tensor | u64 offset | u64 size | u8 value |``: the region must be in the tensor."""
    t, offset, n = _tensor_and_pair(p)
    state.check_region(cmd, t, offset, n)


def _copy_tensor(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| rpc_tensor src | rpc_tensor dst |``: both valid and in buffers (``ggml_backend_tensor_copy``)."""
    for i in range(2):
        t = RpcTensor.unpack_from(p, i * RPC_TENSOR_SIZE)
        state.check_tensor(cmd, t, allow_empty=True)
        state.need_buffer(cmd, t)


def _init_tensor(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| rpc_tensor |``."""
    state.check_tensor(cmd, RpcTensor.unpack_from(p), allow_empty=True)


def _get_alloc_size(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """``| u32 device | rpc_tensor | rpc_tensor srcs[GGML_MAX_SRC] |``: the tensor, and the sources
    whose id is not 0 (``rpc_server::get_alloc_size`` deserializes only these)."""
    _device(state, cmd, p, size)
    state.check_tensor(cmd, RpcTensor.unpack_from(p, 4), allow_empty=True)
    for i in range(GGML_MAX_SRC):
        s = RpcTensor.unpack_from(p, 4 + (1 + i) * RPC_TENSOR_SIZE)
        if s.id != 0:
            state.check_tensor(cmd, s, allow_empty=True)


def _graph_compute(state: ConnectionState, cmd: RpcCmd, p: bytes | memoryview, size: int) -> None:
    """GRAPH_COMPUTE: ``| device u32 | n_nodes u32 | nodes u64[n_nodes] | n_tensors u32 | rpc_tensor[n_tensors] |``
    (ggml-rpc.cpp v7.0.0, ``serialize_graph`` / ``rpc_server::graph_compute``).

    Counts consistent with the size, every tensor valid with an op below
    GGML_OP_COUNT, every source and node among the graph's tensors, every
    computed node backed by memory, and no source chain deeper than
    :data:`MAX_GRAPH_DEPTH`.
    """
    device, n_nodes = struct.unpack_from("<II", p)
    state.check_device(cmd, device)
    if n_nodes == 0:
        raise InvalidRpcRequest("graph", "no nodes", cmd)
    at = 8 + 8 * n_nodes
    if at + 4 > len(p):
        raise InvalidRpcRequest("size", f"{n_nodes} nodes do not fit in {len(p)} bytes", cmd)
    (n_tensors,) = U32.unpack_from(p, at)
    want = at + 4 + n_tensors * RPC_TENSOR_SIZE
    if want != len(p):
        raise InvalidRpcRequest("size", f"{n_nodes} nodes and {n_tensors} tensors make {want} bytes, not {len(p)}", cmd)
    nodes = struct.unpack_from(f"<{n_nodes}Q", p, 8)
    tensors: dict[int, RpcTensor] = {}
    for i in range(n_tensors):
        t = RpcTensor.unpack_from(p, at + 4 + i * RPC_TENSOR_SIZE)
        state.check_tensor(cmd, t, allow_empty=True)
        if t.op >= GGML_OP_COUNT:
            raise InvalidRpcRequest("graph", f"tensor {t.id:#x}: op {t.op} >= GGML_OP_COUNT", cmd)
        tensors.setdefault(t.id, t)  # the server keeps the first of duplicate ids
    for t in tensors.values():
        for s in (*t.src, t.view_src):
            if s and s not in tensors:
                raise InvalidRpcRequest("graph", f"tensor {t.id:#x} refers to {s:#x}, which is not in the graph", cmd)
    for i, node in enumerate(nodes):
        if node == 0:
            raise InvalidRpcRequest("graph", f"node {i} has id 0", cmd)
        tensor = tensors.get(node)
        if tensor is None:
            raise InvalidRpcRequest("graph", f"node {i} ({node:#x}) is not among the graph's tensors", cmd)
        if tensor.op != GGML_OP_NONE and tensor.op not in VIEW_OPS and 0 not in tensor.ne and tensor.data == 0:
            raise InvalidRpcRequest("graph", f"node {i} ({node:#x}) is computed (op {tensor.op}) into no memory", cmd)
    _check_depth(nodes, tensors)


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
                raise InvalidRpcRequest("graph", f"sources nest deeper than {MAX_GRAPH_DEPTH}", RpcCmd.GRAPH_COMPUTE)
            for s in stack[-1]:
                if s and s not in created:
                    created.add(s)
                    t = tensors[s]
                    stack.append(iter((*t.src, t.view_src)))
                    break
            else:
                stack.pop()


_BY_COMMAND: dict[RpcCmd, Validator] = {
    RpcCmd.ALLOC_BUFFER: _device,
    RpcCmd.GET_ALIGNMENT: _device,
    RpcCmd.GET_MAX_SIZE: _device,
    RpcCmd.BUFFER_GET_BASE: _buffer_get_base,
    RpcCmd.FREE_BUFFER: _free_buffer,
    RpcCmd.SET_TENSOR: _set_tensor,
    RpcCmd.SET_TENSOR_HASH: _set_tensor_hash,
    RpcCmd.GET_TENSOR: _get_tensor,
    RpcCmd.COPY_TENSOR: _copy_tensor,
    RpcCmd.GRAPH_COMPUTE: _graph_compute,
    RpcCmd.GET_DEVICE_MEMORY: _device,
    RpcCmd.INIT_TENSOR: _init_tensor,
    RpcCmd.GET_ALLOC_SIZE: _get_alloc_size,
    RpcCmd.GRAPH_RECOMPUTE: _device,
    RpcCmd.MEMSET_TENSOR: _memset_tensor,
}
# not checked: HELLO (its size is the check), DEVICE_COUNT (no payload), BUFFER_CLEAR (the server
# looks the buffer up in its own set and refuses an unknown one without crashing)

VALIDATORS: tuple[Validator | None, ...] = tuple(_BY_COMMAND.get(c) for c in CMDS)
"""The validator of each command id (None: nothing to check beyond the size)."""
