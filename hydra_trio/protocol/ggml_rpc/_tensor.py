"""``rpc_tensor``: decoding, type sizes, and the checks that need no connection state.

Type sizes and block sizes come from the ``gguf`` package
(``gguf.GGML_QUANT_SIZES``, :data:`TYPE_TRAITS`, read on first use: ``gguf``
imports numpy, 15 MiB of resident memory a node without ggml-RPC
clients does not need); :func:`reconcile_type_traits`
checks them against the running ggml, and the front door validates with the
reconciled table.  :func:`check_tensor` holds the preconditions of ggml-rpc.cpp
v7.0.0's ``rpc_server::deserialize_tensor`` (and the ggml asserts behind it)
that depend on the tensor alone; the checks against the connection's buffers
are :meth:`~hydra_trio.protocol.ggml_rpc._state.ConnectionState.check_tensor`.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import Any

import attrs

from ._events import InvalidRpcRequest
from ._wire import (
    GGML_MAX_DIMS,
    GGML_MAX_OP_PARAMS,
    GGML_MAX_SRC,
    GGML_TYPE_COUNT,
    REMOVED_TYPES,
    TENSOR_STRUCT,
    RpcCmd,
    encode_request,
)

TWO64 = 1 << 64
INT64_MAX = (1 << 63) - 1


@functools.cache
def type_traits() -> dict[int, tuple[int, int]]:
    """:data:`TYPE_TRAITS`, computed on the first call (it imports ``gguf``)."""
    import gguf

    out: dict[int, tuple[int, int]] = {}
    for qtype, (blck, size) in gguf.GGML_QUANT_SIZES.items():
        t = int(qtype)
        if t < GGML_TYPE_COUNT and t not in REMOVED_TYPES and blck > 0 and size > 0:
            out[t] = (int(blck), int(size))
    return out


TYPE_TRAITS: dict[int, tuple[int, int]]
"""``type id -> (blck_size, type_size)`` in bytes, from ``gguf.GGML_QUANT_SIZES``: the default of
:class:`~hydra_trio.protocol.ggml_rpc.GgmlRpcConnection`.  Check it against the running ggml with
:func:`reconcile_type_traits`.  Computed on first use (:func:`type_traits`)."""
UNDESCRIBED_TYPES: frozenset[int]
"""Live ggml types the installed ``gguf`` has no sizes for; with :data:`TYPE_TRAITS` they are refused."""


def __getattr__(name: str) -> Any:
    """:data:`TYPE_TRAITS` and :data:`UNDESCRIBED_TYPES` on first use (PEP 562)."""
    if name == "TYPE_TRAITS":
        return type_traits()
    if name == "UNDESCRIBED_TYPES":
        return frozenset(range(GGML_TYPE_COUNT)) - REMOVED_TYPES - type_traits().keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def live_type_table(ggml_traits: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """The table to validate with: ``ggml_traits`` (every type id below :data:`GGML_TYPE_COUNT` to what
    ``ggml_blck_size`` / ``ggml_type_size`` return, blck_size 0 for a removed type) without the removed
    types.  The child computes with ggml's sizes, so these are the ones a request is checked against;
    :func:`reconcile_type_traits` says where gguf's differ."""
    return {t: live for t in range(GGML_TYPE_COUNT) if (live := ggml_traits.get(t, (0, 0)))[0] > 0}


def reconcile_type_traits(
    ggml_traits: Mapping[int, tuple[int, int]],
) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """Check :data:`TYPE_TRAITS` (gguf's) against the running ggml's own ``(blck_size, type_size)``.

    ``ggml_traits`` maps every type id below :data:`GGML_TYPE_COUNT` to what
    ``ggml_blck_size`` / ``ggml_type_size`` return (blck_size 0: a removed type).
    Returns the table to validate with (:func:`live_type_table`: gguf's wherever
    the two agree and ggml's where they do not, the child computes with ggml's),
    and one line per disagreement or type gguf lacks (the gguf 0.19.0 on the
    registry says 40 bytes for a Q8_1 block, ggml-common.h has 36, and it lacks Q2_0).
    """
    notes: list[str] = []
    for t in range(GGML_TYPE_COUNT):
        live = ggml_traits.get(t, (0, 0))
        ours = type_traits().get(t)
        if live[0] <= 0:
            if ours is not None:
                notes.append(f"type {t}: gguf describes it {ours}, this ggml has removed it")
            continue
        if ours is None:
            notes.append(f"type {t}: gguf has no sizes; using ggml's {live}")
        elif ours != live:
            notes.append(f"type {t}: gguf says {ours}, ggml {live}; using ggml's")
    return live_type_table(ggml_traits), notes


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
        v = TENSOR_STRUCT.unpack_from(buf, offset)
        return cls(
            id=v[0],
            type=v[1],
            buffer=v[2],
            ne=v[3:7],
            nb=v[7:11],
            op=v[11],
            op_params=v[12:28],
            flags=v[28],
            src=v[29:39],
            view_src=v[39],
            view_offs=v[40],
            data=v[41],
            name=v[42].rstrip(b"\0"),
            use_count=v[43],
        )

    def pack(self) -> bytes:
        """The 296 wire bytes (``struct.error`` for a field out of its C type's range)."""
        return TENSOR_STRUCT.pack(
            self.id,
            self.type,
            self.buffer,
            *self.ne,
            *self.nb,
            self.op,
            *self.op_params,
            self.flags,
            *self.src,
            self.view_src,
            self.view_offs,
            self.data,
            self.name,
            self.use_count,
        )


def tensor_nbytes(t: RpcTensor, traits: Mapping[int, tuple[int, int]] | None = None) -> int:
    """``ggml_nbytes`` of a tensor whose type is in ``traits`` (default :data:`TYPE_TRAITS`), in bytes (exact,
    no wrap-around).

    0 when some ``ne[i]`` is 0 (an empty tensor), as ggml.c computes it.
    """
    if 0 in t.ne:
        return 0
    blck, size = (type_traits() if traits is None else traits)[t.type]
    tail = sum((t.ne[i] - 1) * t.nb[i] for i in range(1, GGML_MAX_DIMS))
    if blck == 1:
        return size + (t.ne[0] - 1) * t.nb[0] + tail
    return t.ne[0] * t.nb[0] // blck + tail


def check_tensor(cmd: RpcCmd, t: RpcTensor, traits: Mapping[int, tuple[int, int]], *, allow_empty: bool) -> int:
    """The checks of ``t`` alone: type, shape, strides, size; returns its ``ggml_nbytes`` (bytes).

    ``allow_empty``: an ``ne[i]`` of 0 is allowed (no data moves).  The element
    count must fit in int64 (``ggml_new_tensor_impl``), the byte size too, and
    the data must not wrap around the address space.

    Raises:
        InvalidRpcRequest: ``tensor_type``, ``tensor_shape``, ``tensor_strides`` or ``tensor_bounds``.
    """
    if t.type >= GGML_TYPE_COUNT or t.type in REMOVED_TYPES:
        raise InvalidRpcRequest("tensor_type", f"tensor {t.id:#x}: type {t.type} is not a ggml type", cmd)
    blck_tsize = traits.get(t.type)
    if blck_tsize is None:
        raise InvalidRpcRequest("tensor_type", f"tensor {t.id:#x}: type {t.type} has no known block size", cmd)
    blck, tsize = blck_tsize
    ne, nb = t.ne, t.nb
    if not allow_empty and 0 in ne:
        raise InvalidRpcRequest("tensor_shape", f"tensor {t.id:#x}: ne {list(ne)} has a zero", cmd)
    if ne[0] % blck:
        raise InvalidRpcRequest(
            "tensor_shape",
            f"tensor {t.id:#x}: ne[0] = {ne[0]} is not a multiple of the block size {blck} of type {t.type}",
            cmd,
        )
    n = ne[0]  # ggml_new_tensor_impl: the element count must fit in int64
    for i in range(1, GGML_MAX_DIMS):
        if ne[i] > 1:
            if INT64_MAX // ne[i] <= n:
                raise InvalidRpcRequest("tensor_shape", f"tensor {t.id:#x}: ne {list(ne)} overflows int64", cmd)
            n *= ne[i]
    if blck > 1 and nb[0] != tsize:
        raise InvalidRpcRequest(
            "tensor_strides", f"tensor {t.id:#x}: nb[0] = {nb[0]}, type {t.type} has {tsize}-byte blocks", cmd
        )
    for i in range(GGML_MAX_DIMS):
        if ne[i] > 1 and nb[i] < tsize:
            raise InvalidRpcRequest(
                "tensor_strides", f"tensor {t.id:#x}: nb[{i}] = {nb[i]} < element size {tsize}", cmd
            )
    nbytes = tensor_nbytes(t, traits)
    if nbytes > INT64_MAX or t.data + nbytes >= TWO64:
        raise InvalidRpcRequest("tensor_bounds", f"tensor {t.id:#x}: {nbytes} bytes at {t.data:#x} overflow", cmd)
    return nbytes


# --------------------------------------------------------------------------
# Encoders of the messages that carry tensors (tests, fuzzing, probes)
# --------------------------------------------------------------------------


def encode_set_tensor(t: RpcTensor, offset: int, data: bytes, cache_flag: int = 0) -> bytes:
    """SET_TENSOR: ``| rpc_tensor | u8 cache_flag | u64 offset | data |``."""
    return encode_request(RpcCmd.SET_TENSOR, t.pack() + struct.pack("<BQ", cache_flag, offset) + data)


def encode_graph_compute(device: int, nodes: list[int], tensors: list[RpcTensor]) -> bytes:
    """GRAPH_COMPUTE as ``serialize_graph`` lays it out:
    ``| device u32 | n_nodes u32 | nodes u64[n_nodes] | n_tensors u32 | rpc_tensor[n_tensors] |``."""
    body = struct.pack(f"<II{len(nodes)}QI", device, len(nodes), *nodes, len(tensors))
    return encode_request(RpcCmd.GRAPH_COMPUTE, body + b"".join(t.pack() for t in tensors))
