"""The engine thread's hand-over to trio: one per step (StepHandOff), reading what arrived together
(JobRun.ready), and llama_decode running without the GIL."""

from __future__ import annotations

import sys
import threading
import time

import llama_cpp
import pytest
import trio

from hydra_trio.engine.requests import (
    CompletionJob,
    Failed,
    Finished,
    JobHandle,
    JobRun,
    SlotAssigned,
    StepHandOff,
    TextDelta,
)
from hydra_trio.errors import Cancelled


def _finished(n: int) -> Finished:
    return Finished(
        finish_reason="length",
        id_slot=0,
        n_prompt=1,
        cache_n=0,
        prompt_n=1,
        prompt_ms=1.0,
        predicted_n=n,
        predicted_ms=1.0,
    )


class _Engine:
    """A Submitter whose "engine" is a real thread emitting through a StepHandOff."""

    def __init__(self, hand_off: StepHandOff, token: trio.lowlevel.TrioToken) -> None:
        self.hand_off, self.token = hand_off, token
        self.handles: list[JobHandle] = []

    def submit(self, job: CompletionJob) -> JobHandle:
        h = JobHandle(job, self.token, self.hand_off)
        self.handles.append(h)
        return h

    def cancel(self, handle: JobHandle) -> None:
        handle.cancelled = True


def test_a_steps_events_reach_trio_together_and_in_order() -> None:
    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        hand_off = StepHandOff()
        engine = _Engine(hand_off, token)
        job = CompletionJob(prompt_tokens=(1,))
        inside = threading.Event()
        release = threading.Event()

        def engine_thread(a: JobHandle, b: JobHandle) -> None:
            a.emit(SlotAssigned(0, 1, 0))  # outside a step: at once
            with hand_off.collect():
                with hand_off.collect():  # nested: the outer block hands over
                    a.emit(TextDelta("x", (5,)))
                    b.emit(TextDelta("y", (6,)))
                inside.set()
                release.wait(30)
                a.emit(TextDelta("z", (7,)))
                a.emit(_finished(2))
            b.emit(Failed(Cancelled("gone")))  # after the step: after what it held

        async with JobRun(engine, job) as ra, JobRun(engine, job) as rb:
            assert ra.handle is not None and rb.handle is not None
            thread = threading.Thread(target=engine_thread, args=(ra.handle, rb.handle))
            thread.start()
            assert (await ra.started()).id_slot == 0
            await trio.to_thread.run_sync(inside.wait, 30)
            await trio.sleep(0.2)  # the held events would have arrived by now if they were not held
            assert list(ra.ready()) == [] and list(rb.ready()) == []
            release.set()
            await trio.to_thread.run_sync(thread.join, 30)
            first = await ra.__aiter__().__anext__()
            assert first.text == "x"
            assert [d.text for d in ra.ready()] == ["z"]  # already there: read without waiting
            assert ra.finished is not None and ra.finished.predicted_n == 2
            assert list(ra.ready()) == []  # the request ended
            got = []
            with pytest.raises(Cancelled):
                async for d in rb:
                    got.append(d.text)
            assert got == ["y"]

    trio.run(main)


def test_ready_leaves_a_failure_to_the_next_read() -> None:
    """Deltas that arrived together with a failure are all readable before the failure is raised."""

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        hand_off = StepHandOff()
        engine = _Engine(hand_off, token)
        async with JobRun(engine, CompletionJob(prompt_tokens=(1,))) as run:
            assert run.handle is not None

            def step(h: JobHandle) -> None:
                with hand_off.collect():
                    h.emit(TextDelta("a", (1,)))
                    h.emit(TextDelta("b", (2,)))
                    h.emit(Failed(Cancelled("stopped")))

            await trio.to_thread.run_sync(step, run.handle)
            it = run.__aiter__()
            assert (await it.__anext__()).text == "a"
            assert [d.text for d in run.ready()] == ["b"]
            assert list(run.ready()) == []
            with pytest.raises(Cancelled, match="stopped"):
                await it.__anext__()

    trio.run(main)


def test_emit_outside_a_step_goes_at_once_and_after_trio_ends_is_dropped() -> None:
    """Without a collect block each event is handed over by itself; once trio's run is over, emitting
    is a no-op (the engine may still be stopping)."""
    kept: list[StepHandOff] = []
    tokens: list[trio.lowlevel.TrioToken] = []

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        hand_off = StepHandOff()
        kept.append(hand_off)
        tokens.append(token)
        handle = JobHandle(CompletionJob(prompt_tokens=(1,)), token, hand_off)
        await trio.to_thread.run_sync(handle.emit, TextDelta("a", (1,)))
        assert (await handle.events.receive()).text == "a"

    trio.run(main)
    handle = JobHandle(CompletionJob(prompt_tokens=(1,)), tokens[0], kept[0])
    handle.emit(TextDelta("late", (1,)))  # trio is gone: nothing raises
    with kept[0].collect():
        handle.emit(TextDelta("late", (1,)))


def test_llama_decode_lets_other_python_threads_run() -> None:
    """llama-cpp-python's bindings are ctypes.CDLL functions, which release the GIL for the call: a
    Python thread keeps running while the engine thread is inside llama_decode (a 200-token prompt).

    The switch interval is made long, so the only way the other thread runs while this one holds the
    GIL is this thread letting it go: the count is 0 unless the call released it."""
    from hydra_trio.engine.llama.model import LoadedModel
    from hydra_trio.models.presets import smollm2_path

    m = LoadedModel(smollm2_path(), n_ctx=512, n_parallel=1, n_batch=256, n_threads=1)
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1
            time.sleep(0)  # lets the GIL go each time round, so the test thread gets it back at once

    spinner = threading.Thread(target=spin)
    interval = sys.getswitchinterval()
    n = 200
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    try:
        for i in range(n):
            batch.token[i] = 100 + i
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == n - 1 else 0
        batch.n_tokens = n
        sys.setswitchinterval(30.0)
        spinner.start()
        while counter[0] < 10:
            time.sleep(0.01)
        before = counter[0]
        assert llama_cpp.llama_decode(m.ctx, batch) == 0
        during = counter[0] - before  # read at once, still holding the GIL: what ran during the call
        assert during > 10, f"the other thread ran {during} times during llama_decode: the call held the GIL"
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        if spinner.is_alive():
            spinner.join()
        llama_cpp.llama_batch_free(batch)
        m.close()
