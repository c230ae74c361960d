"""The serialized control channel (:mod:`hydra_trio.engine.control`) on a real engine (the packaged default model),
in-process: FIFO order across concurrent submitters, a cancelled submitter, a change that raises, BUSY.

The engine thread is held at a gate (a real :class:`~hydra_trio.engine.bridge.Call` that waits on a
``threading.Event``) while the submitters queue, so the order in which changes arrive is fixed by the
test, not by timing.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
import trio.testing

from hydra_trio.engine.control import Change
from hydra_trio.engine.bridge import Call
from hydra_trio.engine.engine import Engine
from hydra_trio.engine.requests import CompletionJob, JobRun
from hydra_trio.errors import Busy

from .conftest import running_engine


class Gate:
    """Holds the engine thread inside a real engine call until :meth:`open`."""

    def __init__(self, engine: Engine) -> None:
        self.entered, self._open = threading.Event(), threading.Event()
        self.call: Call[None] = Call(self._hold)
        engine.post(self.call)

    def _hold(self) -> None:
        self.entered.set()
        assert self._open.wait(300), "the gate was never opened"

    async def wait_entered(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.wait, 300)

    async def open(self) -> None:
        self._open.set()
        await self.call.wait()


def recorder(order: list[str], name: str) -> Change:
    def apply(engine: Engine) -> str:
        assert threading.current_thread() is not threading.main_thread()  # the engine thread, not trio's
        order.append(name)
        return f"result of {name}"
    return Change(name, apply)


async def test_changes_run_first_in_first_out_and_a_cancelled_submitter_does_not_stall_the_rest() -> None:
    async with running_engine(n_ctx=1024) as (engine, control):
        gate = Gate(engine)
        await gate.wait_entered()
        order: list[str] = []
        results: dict[str, Any] = {}
        cancelled_scope = trio.CancelScope()

        async def submit(name: str, scope: trio.CancelScope | None = None) -> None:
            with scope or trio.CancelScope():
                results[name] = await control.submit(recorder(order, name))
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
        assert control.applied == 6 and control.failed == 0 and control.refused_busy == 0


async def test_a_change_that_raises_fails_only_its_submitter() -> None:
    async with running_engine(n_ctx=1024) as (engine, control):
        gate = Gate(engine)
        await gate.wait_entered()
        order: list[str] = []
        outcomes: dict[str, Any] = {}

        def broken(engine: Engine) -> None:
            order.append("broken")
            raise ValueError("this change cannot apply")

        async def submit(name: str, change: Change) -> None:
            try:
                outcomes[name] = await control.submit(change)
            except ValueError as exc:
                outcomes[name] = f"raised {exc}"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, "first", recorder(order, "first"))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(submit, "broken", Change("broken", broken))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(submit, "last", recorder(order, "last"))
            await trio.testing.wait_all_tasks_blocked()
            await gate.open()
        assert order == ["first", "broken", "last"]
        assert outcomes == {"first": "result of first", "broken": "raised this change cannot apply",
                            "last": "result of last"}
        assert control.applied == 2 and control.failed == 1
        # the channel still serves
        assert await control.submit(recorder(order, "after")) == "result of after"


async def test_a_change_while_a_slot_processes_is_refused_busy_and_does_not_run() -> None:
    async with running_engine(n_ctx=1024) as (engine, control):
        job = CompletionJob(prompt_tokens=[1, 2, 3, 4], n_predict=400, ignore_eos=True, id_slot=1)
        ran: list[str] = []
        async with JobRun(engine, job) as run:
            await run.started()  # slot 1 holds the request
            gate = Gate(engine)  # taken at the next step: the 400-token request is still running there
            await gate.wait_entered()
            async with trio.open_nursery() as nursery:
                refused: list[Busy] = []

                async def submit() -> None:
                    with pytest.raises(Busy) as info:
                        await control.submit(recorder(ran, "while busy"))
                    refused.append(info.value)

                nursery.start_soon(submit)
                await trio.testing.wait_all_tasks_blocked()
                await gate.open()
            assert ran == [] and refused[0].busy_slots == [1]
            assert control.refused_busy == 1 and control.applied == 0
        # the request is over (closed): the same change now applies
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(120):
            while any(s.is_processing for s in engine.slots):
                await trio.sleep(0.05)
        assert await control.submit(recorder(ran, "when idle")) == "result of when idle"
        assert ran == ["when idle"]
