"""The serialized control channel on a real engine (the packaged default model), in-process: exclusive
tasks (:attr:`hydra_trio.engine.tasks.EngineTask.exclusive`) on the engine's one inbox run first in, first
out across concurrent submitters, a cancelled submitter does not stall the rest, a task that raises fails
only its submitter, and a slot that processes makes an exclusive task BUSY without running it.

The engine thread is held at a gate (a real task whose ``run`` waits on a ``threading.Event``) while the
submitters queue, so the order in which tasks arrive is fixed by the test, not by timing.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import attrs
import pytest
import trio
import trio.testing

from hydra_trio.engine.engine import Engine
from hydra_trio.engine.requests import CompletionJob, JobRun
from hydra_trio.engine.tasks import EngineTask
from hydra_trio.errors import Busy

from .conftest import running_engine


@attrs.frozen
class Hold(EngineTask):
    """Holds the engine thread until ``go`` is set (not exclusive: it runs whatever the slots do)."""

    kind: ClassVar[str] = "test_hold"
    entered: threading.Event = attrs.field(factory=threading.Event, eq=False)
    go: threading.Event = attrs.field(factory=threading.Event, eq=False)

    def run(self, engine: Engine) -> None:
        self.entered.set()
        assert self.go.wait(300), "the gate was never opened"


class Gate:
    """Holds the engine thread inside a real engine task until :meth:`open`."""

    def __init__(self, engine: Engine, nursery: trio.Nursery) -> None:
        self.task = Hold()
        self.done = trio.Event()
        nursery.start_soon(self._run, engine)

    async def _run(self, engine: Engine) -> None:
        await engine.run_task(self.task)
        self.done.set()

    async def wait_entered(self) -> None:
        assert await trio.to_thread.run_sync(self.task.entered.wait, 300)

    async def open(self) -> None:
        self.task.go.set()
        await self.done.wait()


@attrs.frozen
class Record(EngineTask):
    """An exclusive task that notes its name, on the engine thread, and returns it; ``fail``: raises."""

    kind: ClassVar[str] = "test_record"
    exclusive: ClassVar[bool] = True
    name: str
    order: list[str] = attrs.field(eq=False)
    fail: bool = False

    def label(self) -> str:
        return self.name

    def run(self, engine: Engine) -> str:
        assert threading.current_thread() is not threading.main_thread()  # the engine thread, not trio's
        self.order.append(self.name)
        if self.fail:
            raise ValueError("this change cannot apply")
        return f"result of {self.name}"


def counts(engine: Engine) -> dict[str, int]:
    return dict(engine.stats.control)


async def test_changes_run_first_in_first_out_and_a_cancelled_submitter_does_not_stall_the_rest() -> None:
    async with running_engine(n_ctx=1024) as engine, trio.open_nursery() as outer:
        gate = Gate(engine, outer)
        await gate.wait_entered()
        order: list[str] = []
        results: dict[str, Any] = {}
        cancelled_scope = trio.CancelScope()

        async def submit(name: str, scope: trio.CancelScope | None = None) -> None:
            with scope or trio.CancelScope():
                results[name] = await engine.run_task(Record(name, order))
                return
            results[name] = "cancelled while waiting"

        names = [f"change {i}" for i in range(6)]
        async with trio.open_nursery() as nursery:
            for name in names:  # each submitter queues before the next one starts
                nursery.start_soon(submit, name, cancelled_scope if name == "change 2" else None)
                await trio.testing.wait_all_tasks_blocked()
            assert order == []  # the engine thread is at the gate: nothing ran yet
            cancelled_scope.cancel()  # the third submitter gives up while its change waits
            await trio.testing.wait_all_tasks_blocked()
            assert results == {"change 2": "cancelled while waiting"}
            await gate.open()
        # every change ran, in the order submitted; the cancelled submitter's change ran in its turn
        assert order == names
        assert results == {n: ("cancelled while waiting" if n == "change 2" else f"result of {n}") for n in names}
        assert counts(engine) == {"applied": 6, "failed": 0, "refused_busy": 0}


async def test_a_change_that_raises_fails_only_its_submitter() -> None:
    async with running_engine(n_ctx=1024) as engine, trio.open_nursery() as outer:
        gate = Gate(engine, outer)
        await gate.wait_entered()
        order: list[str] = []
        outcomes: dict[str, Any] = {}

        async def submit(name: str, change: Record) -> None:
            try:
                outcomes[name] = await engine.run_task(change)
            except ValueError as exc:
                outcomes[name] = f"raised {exc}"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, "first", Record("first", order))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(submit, "broken", Record("broken", order, fail=True))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(submit, "last", Record("last", order))
            await trio.testing.wait_all_tasks_blocked()
            await gate.open()
        assert order == ["first", "broken", "last"]
        assert outcomes == {
            "first": "result of first",
            "broken": "raised this change cannot apply",
            "last": "result of last",
        }
        assert counts(engine) == {"applied": 2, "failed": 1, "refused_busy": 0}
        # the inbox still serves
        assert await engine.run_task(Record("after", order)) == "result of after"


async def test_a_change_while_a_slot_processes_is_refused_busy_and_does_not_run() -> None:
    async with running_engine(n_ctx=1024) as engine, trio.open_nursery() as outer:
        job = CompletionJob(prompt_tokens=[1, 2, 3, 4], n_predict=400, ignore_eos=True, id_slot=1)
        ran: list[str] = []
        async with JobRun(engine, job) as run:
            await run.started()  # slot 1 holds the request
            gate = Gate(engine, outer)  # taken at the next step: the 400-token request is still running there
            await gate.wait_entered()
            async with trio.open_nursery() as nursery:
                refused: list[Busy] = []

                async def submit() -> None:
                    with pytest.raises(Busy) as info:
                        await engine.run_task(Record("while busy", ran))
                    refused.append(info.value)

                nursery.start_soon(submit)
                await trio.testing.wait_all_tasks_blocked()
                await gate.open()
            assert ran == [] and refused[0].busy_slots == [1]
            assert counts(engine) == {"applied": 0, "failed": 0, "refused_busy": 1}
        # the request is over (closed): the same change now applies
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(120):
            while any(s.is_processing for s in engine.slots):
                await trio.sleep(0.05)
        assert await engine.run_task(Record("when idle", ran)) == "result of when idle"
        assert ran == ["when idle"]
