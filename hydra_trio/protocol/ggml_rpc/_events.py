"""What a :class:`~hydra_trio.protocol.ggml_rpc.GgmlRpcConnection` hands back: events and errors.

Every event carries the bytes to pass on (``data``), except the ``*End`` ones,
which only mark where a message ends.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

from ._wire import RpcCmd

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
"""Values of :attr:`InvalidRpcRequest.check` (stable: they label metrics)."""


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class GgmlRpcError(Exception):
    """Base class of this package's errors. After one, the connection object is unusable."""


class InvalidRpcRequest(GgmlRpcError):
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
class ReplyHeader:
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


RpcRequestEvent: TypeAlias = Request | RequestData | RequestEnd
RpcReplyEvent: TypeAlias = ReplyHeader | ReplyData | ReplyEnd
