"""Typed engine work (:mod:`hydra_trio.engine.tasks`), slot states
(:class:`~hydra_trio.engine.batching.slots.SlotState`)
and CONFIGURE's tier-1 defaults swapped in whole, in-process on a real engine (the packaged default model)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import ClassVar

import attrs
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from hydra_trio import EngineConfig, resolve_model
from hydra_trio.engine.batching.slots import SlotState
from hydra_trio.engine.engine import Engine
from hydra_trio.engine.requests import CompletionJob, JobRun
from hydra_trio.engine.settings import RequestDefaults
from hydra_trio.engine.tasks import EngineTask, EraseSlot, Reconfigure, RestoreSlot, SaveSlot, SetExpertMode
from hydra_trio.errors import Busy, InvalidRequest
from hydra_trio.service.metrics import NodeMetrics

from .conftest import running_engine


@attrs.frozen
class ReadSlot(EngineTask):
    """The slot's state and derived flags, as the engine thread sees them between two steps."""

    kind: ClassVar[str] = "read_slot"
    id_slot: int

    def run(self, engine: Engine) -> tuple[SlotState, bool, bool, int]:
        assert threading.current_thread() is not threading.main_thread()  # the engine thread, not trio's
        s = engine.slots[self.id_slot]
        return s.state, s.is_processing, s.generating, s.n_decoded


def _samples(engine: Engine) -> dict[str, float]:
    body, _ = NodeMetrics(engine=engine).render()
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    return {s.labels["type"]: s.value for s in fams["hydra_trio:engine_tasks"].samples}


async def test_slot_tasks_are_typed_dispatched_by_type_and_counted() -> None:
    async with running_engine() as engine:
        async with JobRun(
            engine, CompletionJob(prompt_tokens=[1, 504, 3458, 314, 4649, 253], n_predict=4, id_slot=0)
        ) as run:
            await run.result()
        n_past, blob = await engine.run_task(SaveSlot(0))
        assert n_past == engine.snapshot.slot(0).n_past > 6  # prompt + generated tokens
        task = RestoreSlot(1, blob)
        assert f"<{len(blob)} bytes>" in repr(task) and "RestoreSlot(id_slot=1" in repr(task)  # loggable
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            task.id_slot = 0  # type: ignore[misc]
        done = await engine.run_task(task)
        assert done.n_past == n_past == engine.snapshot.slot(1).n_past
        assert await engine.run_task(EraseSlot(1)) == n_past
        assert engine.snapshot.slot(1).n_past == 0
        with pytest.raises(InvalidRequest, match="no longer exists"):
            await engine.run_task(SaveSlot(7))  # a task's own error reaches its caller
        # a change (an exclusive task: the serialized control channel) is dispatched and counted the same way
        meta = await engine.run_task(SetExpertMode("solo"))
        assert meta["mode"] == "solo"
        # a completion's start is a task too (its cancel is not queued: the request had ended)
        assert engine.stats.tasks == {
            "completion": 1,
            "save_slot": 2,
            "restore_slot": 1,
            "erase_slot": 1,
            "set_expert_mode": 1,
        }
        assert _samples(engine) == {
            "completion": 1.0,
            "erase_slot": 1.0,
            "restore_slot": 1.0,
            "save_slot": 2.0,
            "set_expert_mode": 1.0,
        }


class _HoldAtStart(logging.Handler):
    """Holds the engine thread where the scheduler logs slot 0's start (``Scheduler._start``, inside the
    step that assigns the slot, before that step feeds the prompt's first chunk) until :attr:`go_on` is set."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.held, self.go_on = threading.Event(), threading.Event()  # (Handler.release is its lock's)

    def handle(self, record: logging.LogRecord) -> bool:
        # without Handler.handle's lock: while the engine thread is held here, other threads' records pass
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if not self.held.is_set() and record.getMessage().startswith("slot 0: start,"):
            self.held.set()
            assert self.go_on.wait(300), "never let go on"


@contextlib.contextmanager
def _held_at_slot_start() -> Iterator[_HoldAtStart]:
    """A :class:`_HoldAtStart` on the ``hydra_trio.engine`` logger (at DEBUG) for the block."""
    engine_log = logging.getLogger("hydra_trio.engine")
    hold, level = _HoldAtStart(), engine_log.level
    engine_log.setLevel(logging.DEBUG)
    engine_log.addHandler(hold)
    try:
        yield hold
    finally:
        hold.go_on.set()
        engine_log.removeHandler(hold)
        engine_log.setLevel(level)


async def test_a_slot_moves_through_its_states_in_order() -> None:
    order = list(SlotState)
    with _held_at_slot_start() as hold:
        async with running_engine(n_batch=32) as engine:
            assert await engine.run_task(ReadSlot(0)) == (SlotState.IDLE, False, False, 0)
            prompt = [1, *range(1000, 1300)]  # 301 tokens: ten 32-token steps of prompt processing
            seen: list[tuple[SlotState, bool, bool, int]] = []
            async with JobRun(engine, CompletionJob(prompt_tokens=prompt, n_predict=2000, ignore_eos=True, id_slot=0)):
                # the first read is queued while the step that assigns the slot is held, so it runs right
                # after that step (one 32-token chunk fed) however slowly this thread runs; queued after the
                # assignment, it could come after all ten prompt steps on a busy machine (GENERATING only)
                assert await trio.to_thread.run_sync(hold.held.wait, 300), "slot 0 never started"
                first: list[tuple[SlotState, bool, bool, int]] = []

                async def read_first() -> None:
                    first.append(await engine.run_task(ReadSlot(0)))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_first)
                    await trio.testing.wait_all_tasks_blocked()  # the read waits in the engine's inbox
                    hold.go_on.set()
                seen.append(first[0])
                assert seen[0] == (SlotState.PROCESSING_PROMPT, True, False, 0), seen
                while seen[-1][0] is not SlotState.GENERATING:
                    seen.append(await engine.run_task(ReadSlot(0)))
                states = [s for s, *_ in seen]
                # between two steps the engine is never in the middle of a state change: the states come in order
                assert [order.index(s) for s in states] == sorted(order.index(s) for s in states)
                for state, processing, generating, n_decoded in seen:
                    assert processing == (state is not SlotState.IDLE)
                    assert generating == (state is SlotState.GENERATING)
                    assert (n_decoded > 0) == (state is SlotState.GENERATING)
                assert engine.snapshot.slot(0).is_processing
            with trio.fail_after(120):  # the closed run's slot frees at the engine's next step
                while (await engine.run_task(ReadSlot(0)))[0] is not SlotState.IDLE:
                    await trio.sleep(0.01)
            assert await engine.run_task(ReadSlot(0)) == (SlotState.IDLE, False, False, 0)
            assert not engine.snapshot.slot(0).is_processing
            assert engine.stats.tasks["read_slot"] >= len(seen) + 2


async def test_a_step_is_published_before_its_tokens_reach_trio() -> None:
    """A client that got a step's tokens reads its slot as of that step or later (``/slots`` right after a
    stream's first chunk shows the prompt processed): at each delta, the snapshot counts every token delivered
    so far, or shows the request ended."""
    async with running_engine() as engine:
        job = CompletionJob(prompt_tokens=[1, 504, 3458, 314, 4649, 253], n_predict=64, ignore_eos=True, id_slot=0)
        got = 0
        async with JobRun(engine, job) as run:
            async for delta in run:
                got += len(delta.tokens)
                s = engine.snapshot.slot(0)
                assert s is not None
                if s.is_processing:
                    assert s.n_decoded >= got, (s.n_decoded, got)
                    assert s.n_prompt_processed + s.n_prompt_cache == 6, s
                else:
                    assert s.n_past >= 6 + got - 1, s
            assert (await run.result()).predicted_n == got == 64


@attrs.frozen
class Hold(EngineTask):
    """Keeps the engine thread until ``go_on`` is set (``held`` says it is held)."""

    kind: ClassVar[str] = "hold"
    held: threading.Event = attrs.field(eq=False)
    go_on: threading.Event = attrs.field(eq=False)

    def run(self, engine: Engine) -> None:
        self.held.set()
        assert self.go_on.wait(300), "never let go on"


async def test_a_change_is_busy_while_a_request_waits_for_a_slot_and_the_request_runs_as_it_was_made() -> None:
    """The serialized control channel changes the engine only when every slot is idle and no request waits
    for one: a request queued just before a change (every slot idle, the request not yet on one) was made
    for the model as it is, and a change would run it on another model (or context) with its old name."""
    async with running_engine() as engine:
        hold = Hold(threading.Event(), threading.Event())
        refused: list[Busy] = []

        async def change() -> None:
            with pytest.raises(Busy) as info:
                await engine.run_task(Reconfigure(n_ctx=1024))
            refused.append(info.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_task, hold)
            assert await trio.to_thread.run_sync(hold.held.wait, 300)
            async with JobRun(engine, CompletionJob(prompt_tokens=[1, 504, 3458], n_predict=4)) as run:
                nursery.start_soon(change)
                await trio.testing.wait_all_tasks_blocked()  # the change waits in the inbox, after the request
                hold.go_on.set()
                assert (await run.result()).predicted_n == 4
        assert refused[0].busy_slots == [] and refused[0].requests_waiting == 1
        assert refused[0].wire_meta() == {"busy_slots": [], "requests_waiting": 1}
        assert engine.snapshot.n_ctx == 2048  # nothing changed
        assert (await engine.run_task(Reconfigure(n_ctx=1024)))["n_ctx"] == 1024  # idle now: applied


def test_configure_tier_1_swaps_one_immutable_defaults_object() -> None:
    path, alias = resolve_model("smollm2-135m")
    engine = Engine(EngineConfig(path, alias))  # no model loaded: tier 1 touches no llama.cpp state
    first = engine.request_defaults
    assert isinstance(first, RequestDefaults)
    assert (engine.defaults, engine.default_n_predict) == (first.sampling, first.n_predict)

    engine.set_defaults(temperature=0.25, n_predict=25)
    second = engine.request_defaults
    assert second is not first and (first.sampling.temperature, first.n_predict) != (0.25, 25)  # old one unchanged
    assert (second.sampling.temperature, second.n_predict) == (0.25, 25)
    assert (engine.defaults.temperature, engine.default_n_predict) == (0.25, 25)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        second.n_predict = 1  # type: ignore[misc]
    with pytest.raises(InvalidRequest, match="n_predict"):
        engine.set_defaults(temperature=0.5, n_predict=-2)
    assert engine.request_defaults is second  # a refused change changes nothing, not even the temperature

    # a thread that builds jobs reads the pair while CONFIGURE changes it: every read is one whole pair
    stop, torn, reads = threading.Event(), [], [0]

    def reader() -> None:
        while not stop.is_set():
            d = engine.request_defaults
            if round(d.sampling.temperature * 100) != d.n_predict:
                torn.append((d.sampling.temperature, d.n_predict))
            reads[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(20000):
            n = 1 + i % 150
            engine.set_defaults(temperature=n / 100, n_predict=n)
    finally:
        stop.set()
        t.join()
    assert reads[0] > 0 and torn == []
    assert engine.request_defaults.n_predict == 1 + 19999 % 150
