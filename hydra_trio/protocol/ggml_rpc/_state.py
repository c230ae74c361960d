"""What one ggml-RPC connection knows across messages, and the checks made against it.

ggml-rpc.cpp v7.0.0's ``rpc_server`` keeps the buffers it allocated per client
connection and serves one message at a time, in order; this mirrors that
state as the front door sees it: the buffers (ALLOC_BUFFER and
BUFFER_GET_BASE replies, FREE_BUFFER requests), the replies still owed, the
handshake and whether a graph compute may still be running.  Both directions
(:mod:`._requests`, :mod:`._replies`) read and update one
:class:`ConnectionState`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import attrs

from ._events import InvalidRpcRequest
from ._tensor import RpcTensor, check_tensor
from ._tensor import type_traits as _default_traits
from ._wire import CMDS, RpcCmd

_ALLOC = RpcCmd.ALLOC_BUFFER
CHECKED_BYTES = 4 << 20
"""Most bytes of validated heads one connection remembers (:meth:`ConnectionState.remember`); then it starts over."""
CHECKED_MAX_HEAD = 64 << 10
"""Larger heads (bytes; a graph of more than ~200 tensors) are validated every time."""


@attrs.define
class Buffer:
    """A server buffer this connection allocated: ``size`` bytes at ``base`` (server address)."""

    size: int
    base: int | None = None  # known once BUFFER_GET_BASE was answered


@attrs.define
class Pending:
    """A reply the server owes: to ``cmd``, ``size`` payload bytes."""

    cmd: RpcCmd
    size: int
    key: int = 0  # BUFFER_GET_BASE: the buffer asked about
    seq: int = 0  # index of the request it answers


class ConnectionState:
    """Limits, buffers, owed replies and flags of one client connection (both directions).

    Args: those of :class:`~hydra_trio.protocol.ggml_rpc.GgmlRpcConnection`.
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
        self.traits = _default_traits() if type_traits is None else type_traits
        self.max_message_size = max_message_size
        self.max_graph_size = max_graph_size
        self.n_devices = n_devices
        self.cached_size = cached_size
        self.mask_caps = mask_caps
        self.buffers: dict[int, Buffer] = {}
        self.pending: deque[Pending] = deque()
        """Replies owed by the server, oldest first."""
        self.hello_sent = False
        self.hello_answered = False
        self.compute_pending = False
        """A GRAPH_COMPUTE / GRAPH_RECOMPUTE was sent and no request sent after it has been
        answered yet (the server works in order: such a reply means the compute is done)."""
        self.requests = 0
        """Requests complete so far."""
        self.replies = 0
        """Replies complete so far."""
        self.compute_seq = -1
        """Index of the last GRAPH_COMPUTE / GRAPH_RECOMPUTE request (-1: none yet)."""
        self.layout = 0
        """Bumped whenever :attr:`buffers` changes (a buffer allocated, its base learnt, freed)."""
        self.checked: dict[bytes, int] = {}
        """Validated request heads (header and held payload, as passed on) -> the :attr:`layout`
        they passed under; see :meth:`passed_before`."""
        self._checked_bytes = 0

    def buffers_changed(self) -> None:
        """Call after any change to :attr:`buffers`: heads validated before must be checked again."""
        self.layout += 1

    def passed_before(self, wire: bytes) -> bool:
        """Whether the same request head (``wire``: header and held payload) passed validation under
        the buffers as they are now, so that checking it again would give the same answer.

        The checks of the cacheable commands (:data:`~._requests.CACHEABLE`) read only the
        head, the connection's limits (fixed), its buffers (:attr:`layout`) and whether an
        ALLOC_BUFFER is still unanswered (a tensor naming an unknown buffer passes only when
        none is); the cache is not used while one is.  A COMBINED head sends the same few
        dozen graphs and tensor heads every token, so most checks become one dict lookup.
        """
        return self.checked.get(wire) == self.layout and not any(p.cmd is _ALLOC for p in self.pending)

    def remember(self, wire: bytes) -> None:
        """Note that ``wire`` passed under the current :attr:`layout` (bounded: :data:`CHECKED_BYTES`)."""
        if len(wire) > CHECKED_MAX_HEAD:
            return
        if self._checked_bytes + len(wire) > CHECKED_BYTES:
            self.checked.clear()
            self._checked_bytes = 0
        if wire not in self.checked:
            self._checked_bytes += len(wire)
        self.checked[wire] = self.layout

    def expect(self, c: int, size: int, key: int = 0) -> Pending:
        """Queue the reply (``size`` payload bytes) that the request being released will get."""
        pending = Pending(CMDS[c], size, key, self.requests)
        self.pending.append(pending)
        return pending

    def check_device(self, cmd: RpcCmd, device: int) -> None:
        """Raises InvalidRpcRequest (``device``) for a device index the server does not serve."""
        if self.n_devices is not None and device >= self.n_devices:
            raise InvalidRpcRequest("device", f"device {device}, the server has {self.n_devices}", cmd)

    def check_tensor(self, cmd: RpcCmd, t: RpcTensor, *, allow_empty: bool) -> int:
        """``rpc_server::deserialize_tensor``'s preconditions, and the asserts behind it; returns nbytes.

        :func:`~._tensor.check_tensor`, then: data inside the buffer it names
        (``ggml_backend_buffer_get_base`` .. ``+ size``), when that buffer is one
        of this connection's.  A buffer the server does not know is treated as
        none, as ``deserialize_tensor`` does.

        Raises:
            InvalidRpcRequest: as :func:`~._tensor.check_tensor`, or ``tensor_bounds``.
        """
        nbytes = check_tensor(cmd, t, self.traits, allow_empty=allow_empty)
        if t.buffer:
            buf = self.buffers.get(t.buffer)
            if buf is None:
                if any(p.cmd is RpcCmd.ALLOC_BUFFER for p in self.pending):
                    raise InvalidRpcRequest(
                        "tensor_bounds",
                        f"tensor {t.id:#x}: buffer {t.buffer:#x} named before its ALLOC_BUFFER was answered",
                        cmd,
                    )
                # not this server's buffer: deserialize_tensor treats it as none
            else:
                base = 0 if buf.size == 0 else buf.base  # ggml_backend_buffer_get_base: NULL when size 0
                if base is None:
                    raise InvalidRpcRequest(
                        "tensor_bounds", f"tensor {t.id:#x}: buffer {t.buffer:#x} used before BUFFER_GET_BASE", cmd
                    )
                if t.data < base or t.data + nbytes > base + buf.size:
                    raise InvalidRpcRequest(
                        "tensor_bounds",
                        f"tensor {t.id:#x}: data [{t.data:#x}, +{nbytes}) outside buffer [{base:#x}, +{buf.size})",
                        cmd,
                    )
        return nbytes

    def need_buffer(self, cmd: RpcCmd, t: RpcTensor) -> None:
        """Raises InvalidRpcRequest (``tensor_region``) unless ``t`` is in one of this connection's buffers."""
        if t.buffer not in self.buffers:
            raise InvalidRpcRequest("tensor_region", f"tensor {t.id:#x} is in no buffer of this connection", cmd)

    def check_region(self, cmd: RpcCmd, t: RpcTensor, offset: int, size: int) -> int:
        """Tensor checks, then ``offset + size <= ggml_nbytes`` (ggml_backend_tensor_set/get assert it).

        ``offset`` and ``size`` in bytes; returns the tensor's nbytes.
        """
        nbytes = self.check_tensor(cmd, t, allow_empty=False)
        self.need_buffer(cmd, t)
        if offset + size > nbytes:
            raise InvalidRpcRequest(
                "tensor_region", f"tensor {t.id:#x}: [{offset}, +{size}) outside its {nbytes} bytes", cmd
            )
        return nbytes
