"""The connection object: both directions of one ggml-RPC client connection, sans-I/O."""

from __future__ import annotations

from functools import cached_property

from ..need_data import NEED_DATA, NeedData
from ._events import GgmlRpcError, RpcReplyEvent, RpcRequestEvent
from ._framing import Direction, EventT
from ._replies import ReplyTracker
from ._requests import RequestFramer
from ._state import ConnectionState


class GgmlRpcConnection(ConnectionState):
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
    with ``GGML_ASSERT``, and the replies still owed, in order (the attributes of
    :class:`~._state.ConnectionState`: ``buffers``, ``pending``, ``hello_sent``,
    ``hello_answered``, ``compute_pending``, ``requests``, ``replies``).  The
    first error in either direction makes the object unusable: every later call
    for an event raises it again.
    """

    _error: GgmlRpcError | None = None
    """The first error of either direction (set on the instance): raised again by every later call."""

    @cached_property
    def _requests(self) -> RequestFramer:
        return RequestFramer(self)

    @cached_property
    def _replies(self) -> ReplyTracker:
        return ReplyTracker(self)

    # ------------------------------------------------------------ state
    @property
    def request_in_progress(self) -> bool:
        """Some bytes of a request have arrived but not all of it."""
        return self._requests.in_progress

    @property
    def reply_in_progress(self) -> bool:
        """Some bytes of a reply have arrived but not all of it (or its end is not yet read out)."""
        return self._replies.in_progress

    @property
    def between_messages(self) -> bool:
        """Nothing half-sent either way, no reply owed, no compute unread: closing now loses nothing."""
        return not (self.request_in_progress or self.reply_in_progress or self.pending or self.compute_pending)

    # ------------------------------------------------------------ requests
    def receive_request_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes the client sent (not copied); read the events with :meth:`next_request_event`.

        Raises:
            RuntimeError: the previous input has not been read out yet.
        """
        self._requests.feed(data)

    def next_request_event(self) -> RpcRequestEvent | NeedData:
        """The next event of the client's stream, or :data:`NEED_DATA` when more bytes are needed.

        Raises:
            InvalidRpcRequest: the message at hand failed validation (again on every later call).
        """
        ev = self._next(self._requests)
        return NEED_DATA if ev is None else ev

    def receive_request(self, data: bytes | bytearray | memoryview) -> list[RpcRequestEvent]:
        """:meth:`receive_request_data` then every event it makes (convenience for tests and tools)."""
        return self._receive(self._requests, data)

    def pass_requests(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """:meth:`receive_request`'s bytes to pass on, without the events: the same checks and state,
        the input passed on unchanged as slices of ``data`` (one slice for whole valid messages).

        Raises:
            InvalidRpcRequest: a message failed validation (nothing of ``data`` is to be passed on;
                again on every later call).
        """
        return self._pass(self._requests, data)

    def request_low_water(self, cap: int) -> int:
        """Bytes the client must send before its stream can move on (a receive low-water mark,
        1 to ``cap``): the rest of a header and head, or 9 between messages; 1 in a message's data."""
        return self._requests.low_water(cap)

    # ------------------------------------------------------------ replies
    def receive_reply_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes the server sent; as :meth:`receive_request_data`, read with :meth:`next_reply_event`."""
        self._replies.feed(data)

    def next_reply_event(self) -> RpcReplyEvent | NeedData:
        """The next event of the server's stream, or :data:`NEED_DATA`; raises InvalidReply for bytes nobody
        asked for, or a reply of the wrong size or version (again on every later call)."""
        ev = self._next(self._replies)
        return NEED_DATA if ev is None else ev

    def receive_reply(self, data: bytes | bytearray | memoryview) -> list[RpcReplyEvent]:
        """:meth:`receive_reply_data` then every event it makes."""
        return self._receive(self._replies, data)

    def pass_replies(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """:meth:`receive_reply`'s bytes to pass on, as :meth:`pass_requests` (raises InvalidReply)."""
        return self._pass(self._replies, data)

    def reply_low_water(self, cap: int) -> int:
        """Bytes the server will surely send next without being asked for more (a receive low-water
        mark, 1 to ``cap``): the rest of the reply under way or the next owed; 1 when none is owed."""
        return self._replies.low_water(cap)

    # ------------------------------------------------------------ both
    def _pass(
        self,
        direction: RequestFramer | ReplyTracker,
        data: bytes | bytearray | memoryview,
    ) -> list[bytes | memoryview]:
        if self._error is not None:
            raise self._error
        try:
            return direction.pass_on(data)
        except GgmlRpcError as exc:
            self._error = exc
            raise

    def _next(self, direction: Direction[EventT]) -> EventT | None:
        """``direction``'s next event; its first error sticks to the connection."""
        if self._error is not None:
            raise self._error
        try:
            return direction.next_event()
        except GgmlRpcError as exc:
            self._error = exc
            raise

    def _receive(self, direction: Direction[EventT], data: bytes | bytearray | memoryview) -> list[EventT]:
        direction.feed(data)
        out: list[EventT] = []
        while (ev := self._next(direction)) is not None:
            out.append(ev)
        return out
