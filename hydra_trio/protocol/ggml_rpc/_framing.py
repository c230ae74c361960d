"""What both directions of a connection share: the input, and the pass-through of a message's bulk.

Each direction (:class:`~._requests.RequestFramer`, client → server;
:class:`~._replies.ReplyTracker`, server → client) collects a message's head
(header and the part that is checked) in :attr:`Direction.head`, then lets the
rest of the payload (SET_TENSOR's tensor data, a large GET_TENSOR reply) pass
through as slices of the input, and ends each message with an ``*End`` event.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from ._state import ConnectionState

EventT = TypeVar("EventT")


class Direction(Generic[EventT]):
    """One direction's parser state, over the bytes fed last (a byte view, not copied).

    Subclasses set :attr:`feed_name` and :attr:`data_event`, and implement
    :meth:`_next_head` (an event from a message's head, or None) and
    :meth:`_finish` (the end event of the message under way).
    """

    feed_name = "feed"
    """The public method that feeds this direction, for the error message."""
    data_event: type
    """The event class of pass-through bytes (``RequestData`` / ``ReplyData``)."""

    def __init__(self, state: ConnectionState) -> None:
        self.state = state
        self.buf: memoryview = memoryview(b"")
        self.pos = 0  # bytes of buf already read
        self.head = bytearray()  # the head of the message under way, being collected
        self.body_left = 0  # bytes of the message under way still to pass through
        self.end: EventT | None = None  # the next event, once the message is whole

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take ``data`` as the next input.

        Raises:
            RuntimeError: the previous input has not been read out yet.
        """
        if self.pos < len(self.buf):
            raise RuntimeError(f"{self.feed_name} before the previous data was consumed")
        self.buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        self.pos = 0

    def next_event(self) -> EventT | None:
        """The next event, or None when more bytes are needed.

        Raises:
            GgmlRpcError: the subclass's, for a message it refuses.
        """
        if self.end is not None:
            ev, self.end = self.end, None
            return ev
        if not self.body_left:
            return self._next_head()
        pos = self.pos
        n = min(self.body_left, len(self.buf) - pos)
        if n == 0:
            return None
        self.pos = pos + n
        self.body_left -= n
        if not self.body_left:
            self.end = self._finish()
        return self.data_event(self.buf[pos : pos + n])

    def _next_head(self) -> EventT | None:
        raise NotImplementedError

    def _finish(self) -> EventT:
        raise NotImplementedError
