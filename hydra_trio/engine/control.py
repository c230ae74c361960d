"""The one serialized control channel for engine-wide changes.

Every change that touches the engine as a whole (SET_EXPERT_MODE, CONFIGURE
T2/T3, model reload) is put on one trio memory channel and run by one task,
first in, first out (hydra-protocol.md §3).  A change runs on the engine
thread *between two batching steps* and only when every slot is idle;
otherwise it is refused with :class:`~hydra_trio.errors.Busy` and nothing changes.  While it
runs the engine thread is inside the change, so no slot can start new work:
HTTP and Hydra requests that arrive meanwhile wait in the engine's queue and
then run on the new state.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .bridge import Call
from ..errors import Busy

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Busy", "Change", "ControlChannel"]

log = logging.getLogger("hydra_trio.control")


@attrs.frozen
class Change:
    """One engine-wide change: ``apply(engine)`` runs on the engine thread with every slot idle.

    ``apply`` is a typed task (:mod:`hydra_trio.engine.tasks`: calling it dispatches it through
    :meth:`Engine.execute <hydra_trio.engine.engine.Engine.execute>`, so it is counted and logged by
    kind); it must leave the engine as it was when it raises.
    """

    name: str
    apply: Callable[[Engine], Any]
    trace_id: str = ""


class ControlChannel:
    """The serialized control channel: a FIFO of changes, one consumer task (:meth:`run`).

    Each change is a :class:`~hydra_trio.engine.bridge.Call` the consumer hands
    to the engine thread, and waits for, before it takes the next one; the
    submitter waits for the same call's outcome.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._send, self._recv = trio.open_memory_channel[Call[Any]](math.inf)
        self.applied = 0  # changes applied, refused BUSY, or whose apply raised (``/metrics``)
        self.refused_busy = 0
        self.failed = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Consume changes one at a time until cancelled."""
        task_status.started()
        async for call in self._recv:
            self.engine.post(call)
            await call.finished()

    def _apply(self, change: Change) -> Any:
        engine = self.engine
        busy = [s.id for s in engine.slots if s.is_processing]
        if busy:
            self.refused_busy += 1
            log.info("[%s] %s refused: slots %s busy", change.trace_id, change.name, busy,
                     extra={"trace_id": change.trace_id, "op": change.name})
            engine.events.publish("control.busy", change.trace_id, change=change.name, busy_slots=busy)
            raise Busy(f"slots {busy} are processing; retry when every slot is idle", busy)
        t0 = time.perf_counter()
        try:
            result = change.apply(engine)
        except BaseException as exc:
            self.failed += 1
            engine.events.publish("control.failed", change.trace_id, change=change.name, error=str(exc))
            raise
        self.applied += 1
        ms = (time.perf_counter() - t0) * 1e3
        log.info("[%s] %s applied", change.trace_id, change.name,
                 extra={"trace_id": change.trace_id, "op": change.name, "ms": round(ms, 3)})
        engine.events.publish("control.applied", change.trace_id, change=change.name, ms=round(ms, 3),
                              **({"success": result["success"]} if isinstance(result, dict) and "success" in result else {}))
        return result

    async def submit(self, change: Change) -> Any:
        """Queue a change and wait for its result.

        A submitter cancelled while it waits stops waiting; the change still
        runs in its turn (:mod:`hydra_trio.engine.bridge`).

        Raises:
            Busy: a slot was processing when the change's turn came.
            NotReady: no model serves yet.
            Exception: whatever ``change.apply`` raised (the engine is unchanged).
        """
        self.engine.check_ready()
        call: Call[Any] = Call(functools.partial(self._apply, change))
        self._send.send_nowait(call)
        return await call.wait()
