"""The node's live event stream: one bus, many subscribers, none of them able to slow the node.

Every part of the node publishes what happens to it (:meth:`EventBus.publish`,
callable from any thread: the engine thread, worker threads, the trio loop);
``GET /v1/events`` (a WebSocket, :mod:`hydra_trio.http.events`),
``hydra-trio watch`` and the status page at ``/`` read it.

An event is one JSON object: ``{"ts": unix seconds (float), "type":
"<category>.<name>", "trace_id": str (where one exists), ...fields}``.  The
categories, each a ``?types=`` filter value:

============  ===================================================================
load          ``load.stage`` (stage, seconds of the stage before), ``load.progress``
slot          ``slot.assigned``, ``slot.first_token``, ``slot.finished`` (with the
              reply's ``timings``), ``slot.cancelled``, ``slot.failed``, ``slot.purged``
              (an idle slot's cells freed for others in a full unified KV cache)
prompt_cache  ``prompt_cache.saved``, ``.restored``, ``.evicted`` (``reason``),
              ``.restore_failed``: the host-RAM prompt cache (``--cache-ram``)
control       ``control.applied``, ``control.busy`` (``busy_slots``), ``control.failed``
mode          ``mode.changed`` (``mode``, ``previous``, ``peer``)
peer          ``peer.attached``, ``peer.lost``, ``peer.fallback`` (``reason``)
state         ``state.get``, ``state.put`` (``slot``, ``bytes``, ``ms``, ``result``)
rpc           ``rpc.child_started``, ``rpc.child_died``, ``rpc.child_restarted``
stats         ``stats``, once a second while anyone subscribes: slots, queue, mode, connections per protocol
============  ===================================================================

A subscriber also gets ``hello`` first (the node's identity) and
``dropped`` (``count``) when events for it were dropped.

Back-pressure: publishing never blocks and never waits for a reader.  Each
subscriber has a bounded queue; when it is full, new events for that
subscriber are dropped and counted, and the count is delivered as one
``dropped`` event before the next event it does receive (the same policy as
a Prometheus remote-write queue or a syslog ring: the producer wins).
Events published from another thread cross to the trio loop with
``TrioToken.run_sync_soon`` (thread-safe, ordered, non-blocking).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import trio

CATEGORIES = ("load", "slot", "prompt_cache", "control", "mode", "peer", "state", "rpc", "stats")
"""The ``?types=`` filter values: an event's type up to its first dot."""

ALWAYS = frozenset({"hello", "dropped"})
"""Types every subscriber receives, whatever its filter."""

Event = dict[str, Any]


def category(event_type: str) -> str:
    """``"slot.finished"`` → ``"slot"``; a type without a dot is its own category."""
    return event_type.split(".", 1)[0]


class Subscription:
    """One reader's view of the bus: a bounded queue and a count of what it missed.

    Read with ``async for event in subscription`` (or :meth:`get`); the
    subscription ends when the bus closes or the ``with`` block of
    :meth:`EventBus.subscribe` exits.
    """

    def __init__(self, types: frozenset[str] | None, maxlen: int) -> None:
        self.types = types
        self.maxlen = maxlen
        self.queue: collections.deque[Event] = collections.deque()
        self.dropped = 0
        """Events dropped for this subscriber and not yet reported (reset when reported)."""
        self.dropped_total = 0
        self._wake = trio.Event()
        self.closed = False

    def wants(self, event_type: str) -> bool:
        return self.types is None or event_type in ALWAYS or category(event_type) in self.types

    def _offer(self, event: Event) -> bool:
        """Queue ``event`` (trio thread); False when it was dropped."""
        if len(self.queue) >= self.maxlen:
            self.dropped += 1
            self.dropped_total += 1
            return False
        self.queue.append(event)
        self._wake.set()
        return True

    async def get(self) -> Event:
        """The next event; a ``dropped`` event first when some were dropped since the last one.

        Raises:
            trio.EndOfChannel: the subscription was closed.
        """
        while not self.queue and not self.dropped:
            if self.closed:
                raise trio.EndOfChannel
            self._wake = trio.Event()
            await self._wake.wait()
        if self.dropped:
            n, self.dropped = self.dropped, 0
            return {"ts": time.time(), "type": "dropped", "count": n}
        return self.queue.popleft()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.get()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self.closed = True
        self._wake.set()


class EventBus:
    """Fan-out of node events to :class:`Subscription` s.

    Args:
        history: how many recent events a new subscriber may ask for (``recent``).

    Attributes:
        dropped_total: events dropped for any subscriber since start (``/metrics``).
        published: events published since start.
    """

    def __init__(self, history: int = 200) -> None:
        self._subs: list[Subscription] = []
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._last_stats: Event | None = None  # ``stats`` is a sample: only the newest is kept, not in _history
        self._lock = threading.Lock()  # guards _history when no trio loop is bound yet
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_thread: int | None = None
        self._subscribed: trio.Event | None = None  # set when a subscriber arrives (wait_subscribed)
        self.dropped_total = 0
        self.published = 0
        self.closed = False

    def close(self) -> None:
        """End every subscription (their readers see the end); new subscribers are refused (shutdown)."""
        self.closed = True
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.close()

    def bind(self) -> None:
        """Attach the bus to the running trio loop (call from it); publishing from other threads needs this."""
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()

    def publish(self, type: str, trace_id: str | None = None, **fields: Any) -> None:
        """Publish one event from any thread; returns at once (never blocks, never raises).

        ``fields`` must be JSON-serializable.  ``trace_id`` is left out when
        empty.
        """
        event: Event = {"ts": time.time(), "type": type}
        if trace_id:
            event["trace_id"] = trace_id
        event.update(fields)
        token = self._token
        if token is None or threading.get_ident() == self._loop_thread:
            self._deliver(event)
            return
        try:
            token.run_sync_soon(self._deliver, event)
        except trio.RunFinishedError:  # the loop is gone (shutdown): nobody is listening
            pass

    def _deliver(self, event: Event) -> None:
        with self._lock:
            self.published += 1
            if event["type"] == "stats":
                self._last_stats = event
            else:
                self._history.append(event)
            subs = list(self._subs)
        for sub in subs:
            if sub.wants(event["type"]) and not sub._offer(event):
                self.dropped_total += 1

    def recent(self, types: frozenset[str] | None = None, n: int | None = None) -> list[Event]:
        """The last ``n`` (default: all kept) published events a filter of ``types`` would pass.

        The once-a-second ``stats`` samples are not history (they would push
        every other event out of it within minutes): only the newest one is
        kept, and it comes last (within the ``n``) when the filter wants it.
        """
        with self._lock:
            events = list(self._history)
            last_stats = self._last_stats
        probe = Subscription(types, 0)
        out = [e for e in events if probe.wants(e["type"])]
        if last_stats is not None and probe.wants("stats"):
            out.append(last_stats)
        return out[-n:] if n is not None else out

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    async def wait_subscribed(self) -> None:
        """Return once the bus has a subscriber, at once if it has one (trio thread): a periodic
        publisher such as the ``stats`` ticker sleeps here while nobody listens."""
        while not self._subs:
            if self._subscribed is None or self._subscribed.is_set():
                self._subscribed = trio.Event()
            await self._subscribed.wait()

    def clear_stats(self) -> None:
        """Forget the newest ``stats`` event (:meth:`recent` has none until the next): its publisher
        paused, so it is no longer the node's state."""
        with self._lock:
            self._last_stats = None

    @contextmanager
    def subscribe(self, types: Collection[str] | None = None, maxlen: int = 1024) -> Iterator[Subscription]:
        """A subscription for the ``with`` block (trio thread); leaving the block frees it.

        Args:
            types: categories to receive (:data:`CATEGORIES`), None for all.
            maxlen: events queued for this subscriber before new ones are dropped.

        Raises:
            ValueError: an unknown category, or ``maxlen`` < 1.
        """
        if self.closed:
            raise RuntimeError("the event bus is closed (the node is shutting down)")
        wanted = parse_types(types)
        if self._token is None:
            self.bind()
        if not 1 <= maxlen < math.inf:
            raise ValueError(f"maxlen: {maxlen} must be at least 1")
        sub = Subscription(wanted, maxlen)
        with self._lock:
            self._subs.append(sub)
        if self._subscribed is not None:
            self._subscribed.set()
        try:
            yield sub
        finally:
            with self._lock:
                self._subs.remove(sub)
            sub.close()


def parse_types(types: Collection[str] | str | None) -> frozenset[str] | None:
    """``"slot,mode"`` or ``["slot", "mode"]`` → a category set; None or empty → None (everything).

    Raises:
        ValueError: a name that is not in :data:`CATEGORIES`.
    """
    if types is None:
        return None
    if isinstance(types, str):
        types = [t for t in types.split(",")]
    names = {t.strip() for t in types if t.strip()}
    if not names:
        return None
    unknown = sorted(names - set(CATEGORIES))
    if unknown:
        raise ValueError(f"types: unknown event categories {unknown} (known: {', '.join(CATEGORIES)})")
    return frozenset(names)
