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

NOT_HERE = object()
""":meth:`Direction._pass_in_place`'s answer when the next message's head is not whole in the input."""


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

    def pass_on(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """Feed ``data`` and return the bytes to pass on, as the events' ``data`` would give them, in
        fewer pieces: input bytes passed on unchanged come out as slices of ``data``, one per run
        (a chunk of whole valid messages is one slice: the input itself).

        The per-message path of the front door's pump: no event objects, the same checks and the
        same state changes as :meth:`next_event` (``tests/test_ggml_rpc_codec.py`` compares them).
        A message whose head is whole in the input is checked in place (:meth:`_pass_in_place`);
        a head that arrives in pieces goes the event path (collected, copied, across inputs).

        Raises:
            RuntimeError: the previous input has not been read out yet.
            GgmlRpcError: the subclass's, as :meth:`next_event`; nothing of ``data`` is to be passed on then.
        """
        self.feed(data)
        buf = self.buf
        n = len(buf)
        out: list[bytes | memoryview] = []
        run = -1  # start of the current run of input bytes passed on unchanged; -1: none
        while True:
            pos = self.pos
            if self.body_left:  # a message's bulk streams through
                k = min(self.body_left, n - pos)
                if not k:
                    break
                if run < 0:
                    run = pos
                self.pos = pos + k
                self.body_left -= k
                if not self.body_left:
                    self._finish()
                continue
            if pos == n:
                break
            changed = self._pass_in_place(buf, pos, n)
            if changed is None:  # a whole head, passed on as it came
                if run < 0:
                    run = pos
                continue
            if run >= 0:
                out.append(buf[run:pos])
                run = -1
            if changed is not NOT_HERE:  # a whole head, passed on changed
                out.append(changed)  # type: ignore[arg-type]  # neither None nor NOT_HERE: bytes
                continue
            ev = self._next_head()
            if ev is None:
                break
            out.append(ev.data)  # type: ignore[attr-defined]  # each direction's head events carry data
            self.end = None
        if run >= 0:
            out.append(buf[run : self.pos])
        return out

    def _pass_in_place(self, buf: memoryview, pos: int, n: int) -> object:
        """Check the message whose header starts at ``buf[pos]`` in place when its head is whole in
        ``buf[:n]``, moving :attr:`pos` past it: None (pass it on unchanged), or the bytes to pass on
        instead; :data:`NOT_HERE` (nothing moved) when the head is not all here."""
        raise NotImplementedError

    def _next_head(self) -> EventT | None:
        raise NotImplementedError

    def _finish(self) -> EventT:
        raise NotImplementedError
