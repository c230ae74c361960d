"""Sans-I/O ggml-RPC (protocol v7.0.0): a framer and validator for client messages, and a reply tracker.

Bytes in, events out; no sockets, no trio (like :mod:`hydra_trio.protocol.hydra`).
The front door does not reimplement ggml (docs/hydra-protocol.md §4): llama.cpp's
own ggml-RPC server runs in a child process, and this package only decides,
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
client sends (:meth:`~GgmlRpcConnection.receive_request_data`, then
:meth:`~GgmlRpcConnection.next_request_event` until :data:`~hydra_trio.protocol.need_data.NEED_DATA`, as the
Hydra codec and h11) and what the server answers (:meth:`~GgmlRpcConnection.receive_reply_data`,
:meth:`~GgmlRpcConnection.next_reply_event`).  Every event carries the bytes to
pass on (``data``); the bulk of a SET_TENSOR or a GET_TENSOR reply comes out
as :class:`RequestData` / :class:`ReplyData` slices of the input, not copied.
A message is released only once its header part (everything but SET_TENSOR's
tensor data) has been validated; :class:`InvalidRpcRequest` says which check
failed (:attr:`InvalidRpcRequest.check`, one of :data:`CHECKS`).

Type sizes and block sizes come from the ``gguf`` package
(``gguf.GGML_QUANT_SIZES``, :data:`TYPE_TRAITS`, read on first use:
``gguf`` imports numpy); :func:`reconcile_type_traits` checks them against
the running ggml, and the front door validates with ggml's own sizes
(:func:`live_type_table`).

The parts (private modules; this package re-exports their public names):

- ``_wire``: command ids, layouts and sizes, the request/reply encoders;
- ``_events``: the events and errors, :data:`CHECKS`;
- ``_tensor``: ``rpc_tensor`` decoding, type sizes, the checks of a tensor alone;
- ``_state``: what a connection knows across messages (buffers, replies owed),
  and the checks against it;
- ``_validators``: one validator per command, as a table;
- ``_requests``: request framing (client → server); ``_replies``: reply
  tracking (server → client);
- ``_connection``: :class:`GgmlRpcConnection`, both directions together.
"""

from __future__ import annotations

from typing import Any

from . import _tensor
from ._connection import GgmlRpcConnection
from ._events import (
    CHECKS,
    GgmlRpcError,
    InvalidReply,
    InvalidRpcRequest,
    ReplyData,
    ReplyEnd,
    ReplyHeader,
    Request,
    RequestData,
    RequestEnd,
    RpcReplyEvent,
    RpcRequestEvent,
)
from ._tensor import (
    RpcTensor,
    encode_graph_compute,
    encode_set_tensor,
    live_type_table,
    reconcile_type_traits,
    tensor_nbytes,
    type_traits,
)
from ._wire import (
    GGML_MAX_DIMS,
    GGML_MAX_NAME,
    GGML_MAX_OP_PARAMS,
    GGML_MAX_SRC,
    GGML_OP_COUNT,
    GGML_OP_NONE,
    GGML_TYPE_COUNT,
    GRAPH_HEAD_SIZE,
    HEADER_SIZE,
    HELLO_REPLY_SIZE,
    HELLO_REQUEST_SIZE,
    MAX_GRAPH_DEPTH,
    REMOVED_TYPES,
    REPLY_HEADER_SIZE,
    REPLY_SIZES,
    REQUEST_SIZES,
    RPC_CONN_CAPS_SIZE,
    RPC_PROTO_MAJOR_VERSION,
    RPC_TENSOR_SIZE,
    SET_TENSOR_HEAD_SIZE,
    VIEW_OPS,
    RpcCmd,
    encode_reply,
    encode_request,
    hello_request,
)


def __getattr__(name: str) -> Any:
    """:data:`TYPE_TRAITS` and :data:`UNDESCRIBED_TYPES` from :mod:`._tensor`, computed on first use (PEP 562):
    they import ``gguf``, and with it numpy."""
    if name in ("TYPE_TRAITS", "UNDESCRIBED_TYPES"):
        return getattr(_tensor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKS",
    "GGML_MAX_DIMS",
    "GGML_MAX_NAME",
    "GGML_MAX_OP_PARAMS",
    "GGML_MAX_SRC",
    "GGML_OP_COUNT",
    "GGML_OP_NONE",
    "GGML_TYPE_COUNT",
    "GRAPH_HEAD_SIZE",
    "HEADER_SIZE",
    "HELLO_REPLY_SIZE",
    "HELLO_REQUEST_SIZE",
    "MAX_GRAPH_DEPTH",
    "REMOVED_TYPES",
    "REPLY_HEADER_SIZE",
    "REPLY_SIZES",
    "REQUEST_SIZES",
    "RPC_CONN_CAPS_SIZE",
    "RPC_PROTO_MAJOR_VERSION",
    "RPC_TENSOR_SIZE",
    "SET_TENSOR_HEAD_SIZE",
    "TYPE_TRAITS",
    "UNDESCRIBED_TYPES",
    "VIEW_OPS",
    "GgmlRpcConnection",
    "GgmlRpcError",
    "InvalidReply",
    "InvalidRpcRequest",
    "ReplyData",
    "ReplyEnd",
    "ReplyHeader",
    "Request",
    "RequestData",
    "RequestEnd",
    "RpcCmd",
    "RpcReplyEvent",
    "RpcRequestEvent",
    "RpcTensor",
    "encode_graph_compute",
    "encode_reply",
    "encode_request",
    "encode_set_tensor",
    "hello_request",
    "live_type_table",
    "reconcile_type_traits",
    "tensor_nbytes",
    "type_traits",
]
