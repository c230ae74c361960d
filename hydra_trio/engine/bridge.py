"""The one way to run a function on another thread and get its outcome back.

A worker thread (the engine thread, a COMBINED peer's worker) owns a queue of
jobs; :class:`Call` is one job: the worker runs it with :meth:`Call.run`,
which captures the result or the exception with ``outcome.capture`` (trio's
own result type), and the caller gets it back with ``.unwrap()``:

- from trio, :meth:`Call.wait` (the worker wakes the trio task through the
  run's ``TrioToken``);
- from a plain thread, :meth:`Call.wait_blocking` (a ``threading.Event``).

**Cancellation** (as ``trio.to_thread.run_sync`` with ``abandon_on_cancel``):
a trio caller that is cancelled stops waiting at once, but the function still
runs on the worker when its turn comes, and its result is dropped.  So a
function posted this way must leave the worker's state consistent on its own
(every engine-wide change is all or nothing, see :mod:`hydra_trio.engine.tasks`).

**Thread crossings.**  :class:`Call` is the one way trio code gets a result from a thread that owns
a queue (the engine thread, whose work is typed: :mod:`hydra_trio.engine.tasks`; a COMBINED
peer's worker).  The other crossings each do what a ``Call`` cannot, and say so where they are:

- blocking work that needs no particular thread (file I/O, tokenizing and templating, which only
  read the vocabulary, a connect probe) runs in trio's worker threads (``trio.to_thread.run_sync``),
  so it neither blocks the event loop nor waits behind a prefill on the engine thread;
- one-way notices from a thread, with no result to carry back (a request's events,
  :class:`~hydra_trio.engine.requests.JobHandle`; the event bus, :mod:`hydra_trio.observability.events`; the
  engine's "ready") go through ``TrioToken.run_sync_soon``, which never blocks the engine thread;
- the reverse crossing, a thread waiting for trio code (the engine thread dialing a TLS tunnel,
  :meth:`hydra_trio.transport.tunnel.TunnelPool.dial`), is ``trio.from_thread.run``;
- the ggml-RPC pump's two blocking-socket threads per plain connection
  (:mod:`hydra_trio.rpc_backend.pump`) are plain threads for latency, not trio's limited workers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class Call(Generic[T]):
    """``fn()`` to run on a worker thread; its outcome is delivered to whoever waits.

    Create it on the caller's side (from trio: in the trio thread, so it can
    find the run's token), hand it to the worker's queue, then wait.
    """

    def __init__(self, fn: Callable[[], T], *, from_trio: bool = True) -> None:
        self.fn = fn
        self._result: outcome.Outcome[T] | None = None
        self._token = trio.lowlevel.current_trio_token() if from_trio else None
        self._trio_done = trio.Event() if from_trio else None
        self._done = threading.Event()

    def run(self, after: Callable[[], None] | None = None) -> None:
        """Worker side: run the function, keep its outcome, wake the waiter (never raises).

        ``after`` (which must not raise) runs between the function and the wake-up: the engine
        publishes its snapshot there, so the caller's next read sees what the function changed.
        """
        result = outcome.capture(self.fn)
        if after is not None:
            after()
        self._deliver(result)

    def fail(self, exc: BaseException) -> None:
        """Deliver ``exc`` instead of a result (when the worker can never finish the call); no-op once done."""
        self._deliver(outcome.Error(exc))

    def _deliver(self, result: outcome.Outcome[T]) -> None:
        with _deliver_lock:
            if self._done.is_set():
                return
            self._result = result
            self._done.set()
        if self._token is not None and self._trio_done is not None:
            try:
                self._token.run_sync_soon(self._trio_done.set)
            except trio.RunFinishedError:
                pass  # trio is gone: nobody waits

    async def finished(self) -> None:
        """Trio side: wait until the call ran, without taking its outcome (another waiter unwraps it)."""
        assert self._trio_done is not None, "created with from_trio=False"
        await self._trio_done.wait()

    async def wait(self) -> T:
        """Trio side: wait for the outcome and unwrap it (re-raises the function's exception)."""
        assert self._trio_done is not None, "created with from_trio=False"
        await self._trio_done.wait()
        assert self._result is not None
        return self._result.unwrap()

    def wait_blocking(self, timeout: float | None = None) -> T:
        """Thread side: wait (at most ``timeout`` seconds) and unwrap (re-raises the function's exception).

        Raises:
            TimeoutError: no outcome within ``timeout``.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout:g} s")
        assert self._result is not None
        return self._result.unwrap()


_deliver_lock = threading.Lock()


@contextlib.contextmanager
def thread_local_set(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """``local.<name>`` is ``value`` on this thread while the block runs, and what it was afterwards (the
    llama.cpp log tap of a model load, the tokenizer's stop event)."""
    outer = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, outer)
