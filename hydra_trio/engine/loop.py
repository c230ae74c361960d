"""The engine thread: it loads the model, then drains the one inbox and runs the batching steps.

Work reaches the thread only through :class:`EngineLoop`'s inbox (a ``queue.SimpleQueue``): typed tasks
(:mod:`~hydra_trio.engine.tasks`) queued without a waiter (a completion's start and cancel, the stop)
and the :class:`~hydra_trio.engine.bridge.Call` of a task whose caller waits for its result.  Between two
inbox drains the scheduler runs one step; after every step and every waited-for task the loop publishes
the engine's snapshot (:mod:`~hydra_trio.engine.snapshot`), which any thread reads without waiting.
As llama-server's ``server_queue::start_loop`` (``tools/server/server-queue.cpp`` of the llama.cpp
that llama-cpp-python 0.3.36 vendors): process the new tasks, then update the slots.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable
from typing import Any

from ..errors import EngineFailure
from .lifecycle import ModelLifecycle, Stage
from .requests import StepHandOff
from .snapshot import EMPTY, EngineSnapshot, next_snapshot
from .tasks import EngineTask, StartCompletion

log = logging.getLogger("hydra_trio.engine")


class EngineLoop:
    """The engine thread's loop over ``models`` (the :class:`~hydra_trio.engine.lifecycle.ModelLifecycle`).

    Args:
        models: the model and its scheduler; the loop loads it, steps its scheduler and closes it.
        execute: runs one task on the engine thread (:meth:`Engine.execute
            <hydra_trio.engine.engine.Engine.execute>`).
        n_decode_total: the decode steps so far, for the snapshot.
        hand_off: the jobs' token events; a step's events reach trio after the snapshot that shows the step
            is published, so a client that read a step's token reads its slot as of that step (None: at once).
    """

    def __init__(
        self,
        models: ModelLifecycle,
        execute: Callable[[EngineTask], Any],
        n_decode_total: Callable[[], int],
        hand_off: StepHandOff | None = None,
    ) -> None:
        self.models, self.execute, self.n_decode_total = models, execute, n_decode_total
        self.hand_off = hand_off
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """Tasks and task calls for the engine thread, in the order they were queued (any thread puts)."""
        self.stopping = False
        """Set when the node stops: a load in progress aborts, the loop ends after the current inbox item."""
        self.snapshot: EngineSnapshot = EMPTY
        """The slots and queue as of the engine's last step (:mod:`~hydra_trio.engine.snapshot`): the engine
        thread swaps a new immutable object in after every step and call; any thread reads it without waiting."""
        self._state_sizes: dict[int, tuple[tuple[int, int], int]] = {}  # slot id -> ((model id, n_past), size)
        models.publish = self.publish_quietly

    def stop(self) -> None:
        """Leave the loop after the current inbox item (the :class:`~hydra_trio.engine.tasks.Stop` task's work)."""
        self.stopping = True

    def run(self, on_ready: Callable[[], None]) -> None:
        """The engine thread's body: load the model (:meth:`ModelLifecycle.load`), publish, call ``on_ready``,
        serve until :meth:`stop`, then close the model.

        Raises:
            Exception: the model did not load (the lifecycle's stage is ``error``).
        """
        if not self.models.load(lambda: self.stopping):
            return
        try:
            if not self.stopping:
                self.publish()
                self.models.set_stage(Stage.READY)
                on_ready()
                self._serve()
        finally:
            self.models.close()
            log.info("engine stopped")

    def _serve(self) -> None:
        while not self.stopping:
            sched = self.models.scheduler  # a reconfigure may have built a new one
            assert sched is not None
            self._drain_inbox(block=not sched.busy)
            if self.stopping:
                return
            sched = self.models.scheduler
            assert sched is not None
            if not sched.busy and not sched.pending:
                continue  # nothing to do: the inbox's items published what they changed
            with self.hand_off.collect() if self.hand_off is not None else contextlib.nullcontext():
                try:
                    sched.step()
                except Exception as exc:  # never let one bad job take the engine down
                    log.exception("engine step failed; failing the jobs in flight")
                    sched.fail_all(EngineFailure(f"engine error: {exc}"))
                self.publish()  # before the step's events are handed over (the block's end)
            if not sched.busy and not sched.pending:  # the last job finished: every slot idle
                self.models.at_idle()

    def _drain_inbox(self, block: bool) -> None:
        """Take everything in the inbox: new jobs join the queue, waited-for tasks run (each publishes
        :attr:`snapshot` before its caller hears back, so a caller's next read sees its change)."""
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        queued = False
        while True:
            if isinstance(item, EngineTask):  # queued without a waiter: a completion's start or cancel, the stop
                self.execute(item)
                queued = queued or isinstance(item, StartCompletion)
            else:  # a Call of run_task: published before its caller hears back
                item.run(after=self.publish_quietly)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
        if queued:
            self.publish_quietly()

    def publish(self) -> None:
        """Engine thread: swap a new :attr:`snapshot` in (one atomic assignment; :func:`next_snapshot`)."""
        self.snapshot = next_snapshot(
            self.snapshot, self.models.scheduler, self.models.model, self.n_decode_total(), self._state_sizes
        )

    def publish_quietly(self) -> None:
        """:meth:`publish`, logging instead of raising (a failed publication keeps the previous snapshot)."""
        try:
            self.publish()
        except Exception:
            log.exception("publishing the engine's snapshot failed")
