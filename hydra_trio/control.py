"""The one serialized control channel for engine-wide changes.

Every change that touches the engine as a whole (SET_EXPERT_MODE, CONFIGURE
T2/T3, model reload) is put on one trio memory channel and run by one task,
first in, first out (hydra-protocol.md §3).  A change runs on the engine
thread *between two batching steps* and only when every slot is idle;
otherwise it is refused with :class:`Busy` and nothing changes.  While it
runs the engine thread is inside the change, so no slot can start new work:
HTTP and Hydra requests that arrive meanwhile wait in the engine's queue and
then run on the new state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

if TYPE_CHECKING:
    from .engine.engine import Engine

log = logging.getLogger("hydra_trio.control")


class Busy(RuntimeError):
    """Some slots are processing; ``busy_slots`` lists their ids (reply BUSY, 0x04)."""

    def __init__(self, busy_slots: list[int]) -> None:
        super().__init__(f"slots {busy_slots} are processing; retry when every slot is idle")
        self.busy_slots = busy_slots


@attrs.frozen
class Change:
    """One engine-wide change: ``apply(engine)`` runs on the engine thread with every slot idle.

    ``apply`` must leave the engine as it was when it raises.
    """

    name: str
    apply: Callable[[Engine], Any]
    trace_id: str = ""


class ControlChannel:
    """FIFO of :class:`Change` objects consumed by :meth:`run` (one task)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._send, self._recv = trio.open_memory_channel[tuple[Change, dict[str, Any], trio.Event]](math.inf)
        self.applied = 0
        self.refused_busy = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Consume changes one at a time until cancelled."""
        task_status.started()
        async for change, box, done in self._recv:
            try:
                box["value"] = await self.engine.call(lambda e, c=change: self._apply(e, c))
            except BaseException as exc:  # handed back to the submitter
                box["error"] = exc
                if not isinstance(exc, Exception):
                    done.set()
                    raise
            done.set()

    def _apply(self, engine: Engine, change: Change) -> Any:
        busy = [s.id for s in engine.slots if s.is_processing]
        if busy:
            self.refused_busy += 1
            log.info("[%s] %s refused: slots %s busy", change.trace_id, change.name, busy)
            raise Busy(busy)
        result = change.apply(engine)
        self.applied += 1
        log.info("[%s] %s applied", change.trace_id, change.name)
        return result

    async def submit(self, change: Change) -> Any:
        """Queue a change and wait for its result.

        Raises:
            Busy: a slot was processing when the change's turn came.
            EngineNotReady: no model serves yet.
            Exception: whatever ``change.apply`` raised (the engine is unchanged).
        """
        box: dict[str, Any] = {}
        done = trio.Event()
        self._send.send_nowait((change, box, done))
        await done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]
