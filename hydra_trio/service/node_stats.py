"""The once-a-second ``stats`` event and the ``hello`` event of the live event stream.

Read from the trio thread while the engine thread runs: the slots come from
the engine's published snapshot (:mod:`hydra_trio.engine.snapshot`), every
other value is a plain attribute read (ints, strings), so a tick can be a
step out of date but never broken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from .._version import __version__
from ..observability.events import EventBus

if TYPE_CHECKING:
    from ..engine import Engine


def hello(engine: Engine | None, rpc: Any) -> dict[str, Any]:
    """The first event a subscriber gets: ``{"type": "hello", "version", "model": alias or None,
    "model_hash", "n_slots", "rpc_backend": bool}``."""
    ident = engine.identity if engine is not None else None
    return {
        "ts": time.time(),
        "type": "hello",
        "version": __version__,
        "model": ident.model_alias if ident is not None else None,
        "model_hash": ident.model_hash if ident is not None else None,
        "n_slots": engine.n_slots if engine is not None else 0,
        "rpc_backend": rpc is not None,
    }


class StatsTicker:
    """Publishes ``stats`` once a second while someone subscribes to the event bus (:meth:`run`).

    Fields: ``stage``, ``mode``, ``peer``, ``peer_reachable``, ``queue``
    (requests waiting for a slot), ``processing``, ``slots`` (``id``,
    ``state`` ``"processing"``/``"idle"``, ``n_prompt``, ``n_decoded``,
    ``n_past``, ``n_ctx``, ``trace_id``, ``tok_s`` over the last tick),
    ``tok_s`` (all slots), ``tokens_predicted_total``, ``connections``
    (accepted, by protocol, since start), ``connections_per_s``,
    ``connections_open``, ``subscribers``, ``events_dropped_total``.
    """

    def __init__(
        self,
        bus: EventBus,
        engine: Engine | None,
        connections: Mapping[str, int],
        open_connections: Callable[[], int],
        rpc: Any = None,
    ) -> None:
        self.bus = bus
        self.engine = engine
        self.connections = connections
        self.open_connections = open_connections
        self.rpc = rpc
        self._t = time.monotonic()
        self._decoded: dict[int, tuple[int, int]] = {}  # slot id -> (id of its handle, n_decoded)
        self._predicted = 0
        self._conns: dict[str, int] = {}

    async def run(self, every: float = 1.0) -> None:
        """Publish every ``every`` seconds while the bus has subscribers, until cancelled.

        With none, it sleeps until one comes (no wake-ups on a node nobody watches) and the bus
        forgets the last ``stats``; the rates of the first tick after cover that tick alone.
        """
        while True:
            if not self.bus.subscribers:
                self.bus.clear_stats()
                await self.bus.wait_subscribed()
                self.sample()  # the rates start afresh
            await trio.sleep(every)
            if self.bus.subscribers:
                self.bus.publish("stats", **self.sample())

    def sample(self) -> dict[str, Any]:
        """The ``stats`` event's fields now: the counters, and the rates since the last sample."""
        now = time.monotonic()
        dt = max(now - self._t, 1e-6)
        self._t = now
        conns = dict(self.connections)
        per_s = {k: round((v - self._conns.get(k, 0)) / dt, 3) for k, v in conns.items()}
        self._conns = conns
        out: dict[str, Any] = {
            "connections": conns,
            "connections_per_s": per_s,
            "connections_open": self.open_connections(),
            "subscribers": self.bus.subscribers,
            "events_dropped_total": self.bus.dropped_total,
        }
        if self.rpc is not None:
            out["rpc"] = {
                "active": bool(self.rpc.active),
                "serving": self.rpc.serving,
                "waiting": self.rpc.waiting,
                "bytes_in": self.rpc.bytes_in,
                "bytes_out": self.rpc.bytes_out,
                "restarts": self.rpc.restarts,
            }
        e = self.engine
        if e is None:
            out.update(stage="ready", mode="none", slots=[], queue=0, processing=0, tok_s=0.0)
            return out
        experts = e.experts
        out.update(
            stage=str(e.stage),
            mode=str(experts.mode),
            peer=experts.peer or "",
            peer_reachable=bool(experts.peer_reachable),
            queue=e.requests_waiting,
            processing=e.requests_processing,
        )
        predicted = e.stats.tokens_predicted_total
        out["tokens_predicted_total"] = predicted
        out["tok_s"] = round(max(predicted - self._predicted, 0) / dt, 2)
        self._predicted = predicted
        slots = []
        seen: dict[int, tuple[int, int]] = {}
        for s in e.snapshot.slots:  # the engine's published snapshot
            n_decoded = s.n_decoded
            entry: dict[str, Any] = {
                "id": s.id,
                "state": "processing" if s.is_processing else "idle",
                "n_ctx": s.n_ctx,
                "n_past": s.n_past,
                "n_prompt": s.n_prompt,
                "n_decoded": n_decoded,
                "tok_s": 0.0,
            }
            if s.is_processing:
                entry["trace_id"] = s.trace_id
                prev = self._decoded.get(s.id)
                before = prev[1] if prev is not None and prev[0] == s.id_task else 0
                entry["tok_s"] = round(max(n_decoded - before, 0) / dt, 2)
                seen[s.id] = (s.id_task, n_decoded)
            slots.append(entry)
        self._decoded = seen
        out["slots"] = slots
        return out


class ProgressEvents:
    """A :func:`hydra_trio.observability.progress.add_listener` listener that publishes ``load.progress`` events.

    ``{"step": name, "done", "total" (None when unknown), "finished": bool}``, at most
    one per step per 5 % of its total (or per second when the total is unknown),
    plus the step's start and end.  Progress listeners are process-wide: two nodes
    embedded in one process both see each other's steps.
    """

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self._last: dict[str, tuple[float, float]] = {}  # step -> (done, monotonic time) last published

    def __call__(self, name: str, done: float, total: float | None, finished: bool) -> None:
        now = time.monotonic()
        last = self._last.get(name)
        if last is not None and not finished:
            moved = (done - last[0]) / total if total else 0.0
            if moved < 0.05 and (total or now - last[1] < 1.0):
                return
        if finished:
            self._last.pop(name, None)
        else:
            self._last[name] = (done, now)
        self.bus.publish("load.progress", step=name, done=done, total=total, finished=finished)
