"""Progress of long work (model build, hashing, loading, warm-up, peer attach): a bar or log lines.

One API for every step that can take more than a second::

    from hydra_trio.observability import progress

    with progress.step("hashing model", total=size, unit="B") as p:
        for block in blocks:
            p.advance(len(block))          # or p.update(done_so_far)

Where it shows:

* **stderr is a terminal**: a `rich.progress <https://rich.readthedocs.io/en/stable/progress.html>`_
  bar per running step (name, bar, percentage, bytes or count, elapsed).  A
  finished step stays on screen as its last bar at 100 %.  While a bar is live,
  the records of every ``logging.StreamHandler`` on stderr go through rich's
  :class:`rich.file_proxy.FileProxy` (what ``rich.live.Live(redirect_stderr=True)``
  does for ``sys.stderr``), so log lines print above the bar instead of
  tearing it.
* **otherwise** (a file, a pipe, journald): INFO lines on the
  ``hydra_trio.observability.progress`` logger: ``NAME: started`` (with the total), a
  progress line at most every :data:`LOG_EVERY_S` seconds and each 25 % of the
  total (every 30 s at least while it moves), and ``NAME: done in N ms``
  (``failed after N ms: ERROR`` when the block raises).  A step shorter than
  2 s logs its start and its end only.

Every update also goes to the listeners (:func:`add_listener`), e.g. a live
event stream.  Steps may run on any thread and several at once; all of this
is thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("hydra_trio.progress")

Listener = Callable[[str, float, "float | None", bool], None]
"""``fn(name, done, total, finished)``: a step's name, units done, its total (None: unknown), whether it ended."""

LOG_EVERY_S = 2.0
"""Without a terminal: the least time between two progress lines of one step (seconds)."""
LOG_EVERY_FRACTION = 0.25
"""Without a terminal: the least part of the total done between two progress lines of one step..."""
LOG_ALIVE_S = 30.0
"""... unless this many seconds passed: a slow step still logs a line now and then."""

_listeners: tuple[Listener, ...] = ()
_listeners_lock = threading.Lock()


def add_listener(fn: Listener) -> None:
    """Call ``fn(name, done, total, finished)`` on every update of every step (from the updating thread).

    ``fn`` must be cheap and must not block; an exception it raises is logged
    (DEBUG) and ignored.  Adding the same function twice calls it twice.
    """
    global _listeners
    with _listeners_lock:
        _listeners = (*_listeners, fn)


def remove_listener(fn: Listener) -> None:
    """Stop calling ``fn`` (one registration of it); unknown functions are ignored."""
    global _listeners
    with _listeners_lock:
        found = list(_listeners)
        if fn in found:
            found.remove(fn)
            _listeners = tuple(found)


def _notify(name: str, done: float, total: float | None, finished: bool) -> None:
    for fn in _listeners:
        try:
            fn(name, done, total, finished)
        except Exception:  # a listener never breaks the work it watches
            log.debug("progress listener %r failed", fn, exc_info=True)


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        for scale, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if value >= scale:
                return f"{value / scale:.1f} {suffix}"
        return f"{value:.0f} B"
    return f"{value:g}{' ' + unit if unit else ''}"


class Step:
    """One step in progress (made by :func:`step`); :meth:`advance` / :meth:`update` may be called from any thread.

    Attributes:
        name: what the step does ("loading model").
        total: units to do, or None when unknown (the bar pulses).
        unit: ``"B"`` shows bytes (kB / MB / GB); anything else is shown after the numbers.
        done: units done so far.
    """

    def __init__(self, name: str, total: float | None, unit: str) -> None:
        self.name, self.total, self.unit = name, total, unit
        self.done = 0.0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._last_log = self.started
        self._last_logged_done = 0.0
        self._task: Any = None  # the rich task id while a bar shows this step

    @property
    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.started) * 1e3

    def advance(self, amount: float = 1) -> None:
        """Add ``amount`` units to :attr:`done`."""
        with self._lock:
            self.done += amount
            done = self.done
        self._changed(done)

    def update(self, done: float, total: float | None = None) -> None:
        """Set :attr:`done` (and the total, if given) to an absolute value."""
        with self._lock:
            self.done = done
            if total is not None:
                self.total = total
        self._changed(done)

    def _changed(self, done: float) -> None:
        if self._task is not None:
            _display.update(self)
        else:
            self._maybe_log(done)
        _notify(self.name, done, self.total, False)

    def _maybe_log(self, done: float) -> None:
        now = time.monotonic()
        with self._lock:
            if self.total and done >= self.total:
                return  # the "done in" line follows
            since = now - self._last_log
            moved = (done - self._last_logged_done) / self.total if self.total else 1.0
            if since < LOG_EVERY_S or (moved < LOG_EVERY_FRACTION and since < LOG_ALIVE_S):
                return
            self._last_log, self._last_logged_done = now, done
        if self.total:
            log.info(
                "%s: %3.0f%% (%s of %s)",
                self.name,
                100 * done / self.total,
                _amount(done, self.unit),
                _amount(self.total, self.unit),
            )
        else:
            log.info("%s: %s", self.name, _amount(done, self.unit) if done else "working")


class _Display:
    """The rich bars on stderr, shared by every step (one ``Progress``, live while a step runs)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._console: Any = None
        self._decided = False
        self._progress: Any = None
        self._running = 0
        self._swapped: list[tuple[logging.StreamHandler, Any]] = []

    def terminal(self) -> bool:
        """Whether stderr is a terminal that can draw bars (decided once per process)."""
        with self._lock:
            if not self._decided:
                self._decided = True
                try:
                    if not sys.stderr.isatty():  # the common case for a service: no need to import rich
                        return False
                    from rich.console import Console

                    console = Console(stderr=True)
                    if console.is_terminal and not console.is_dumb_terminal:
                        self._console = console
                except Exception:  # no rich, or an odd stream: log lines it is
                    self._console = None
            return self._console is not None

    def _make_progress(self) -> Any:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        return Progress(
            # markup=False: names hold file names and peer addresses, shown as they are ("[/x]" is not a tag)
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[amount]}", markup=False),
            TimeElapsedColumn(),
            console=self._console,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    def start(self, s: Step) -> None:
        with self._lock:
            if self._progress is None:
                self._progress = self._make_progress()
            if self._running == 0:
                self._route_logs()
                self._progress.start()
            self._running += 1
            s._task = self._progress.add_task(s.name, total=s.total, amount=self._fields(s))

    def update(self, s: Step) -> None:
        with self._lock:
            if self._progress is not None and s._task is not None:
                self._progress.update(s._task, completed=s.done, total=s.total, amount=self._fields(s))

    def finish(self, s: Step, ok: bool) -> None:
        with self._lock:
            p, task = self._progress, s._task
            s._task = None
            if p is None or task is None:
                return
            if ok:  # a finished step shows a full bar; a failed one where it stopped
                s.done = s.total if s.total is not None else s.done
                p.update(task, total=s.total or s.done or 1, completed=s.total or s.done or 1, amount=self._fields(s))
            else:
                p.update(task, description=f"{s.name} (failed)")
            p.stop_task(task)
            last = [t for t in p.tasks if t.id == task]
            p.console.print(p.make_tasks_table(last))  # the step's last bar stays on screen
            p.remove_task(task)
            self._running -= 1
            if self._running == 0:
                p.stop()
                self._restore_logs()

    @staticmethod
    def _fields(s: Step) -> str:
        if s.total is None:
            return _amount(s.done, s.unit) if s.done else ""
        if s.unit == "B":
            return f"{_amount(s.done, 'B')} / {_amount(s.total, 'B')}"
        return f"{s.done:g}/{s.total:g}{' ' + s.unit if s.unit else ''}"

    def _route_logs(self) -> None:
        """Send stderr log handlers through the console while bars show (``Live``'s redirect, for handlers)."""
        from rich.file_proxy import FileProxy

        stderr_streams = {id(sys.stderr), id(sys.__stderr__)}
        handlers = list(logging.getLogger().handlers)
        for name in list(logging.Logger.manager.loggerDict):
            logger = logging.getLogger(name)
            handlers.extend(h for h in logger.handlers if h not in handlers)
        for h in handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in stderr_streams:
                old = h.setStream(FileProxy(self._console, h.stream))
                self._swapped.append((h, old))

    def _restore_logs(self) -> None:
        for h, old in self._swapped:
            proxy = h.setStream(old)
            if proxy is not None:
                proxy.flush()
        self._swapped.clear()


_display = _Display()


@contextlib.contextmanager
def step(name: str, total: float | None = None, unit: str = "") -> Iterator[Step]:
    """Show the progress of the work in the ``with`` block (see the module's docstring).

    Args:
        name: what is being done, e.g. ``"loading model"`` (a bar's label, the log lines' prefix).
        total: units of work, or None when unknown.
        unit: ``"B"`` for bytes; another word (``"tensors"``) is printed after the counts.

    Yields the :class:`Step`; an exception in the block ends the step as failed
    (listeners get ``finished=True``) and propagates.
    """
    s = Step(name, total, unit)
    bar = _display.terminal()
    if bar:
        _display.start(s)
    else:
        log.info("%s: started%s", name, f" ({_amount(total, unit)})" if total else "")
    _notify(name, 0.0, total, False)
    ok = False
    try:
        yield s
        ok = True
    except BaseException as exc:
        if not bar:
            log.info("%s: failed after %.0f ms: %s", name, s.elapsed_ms, exc or type(exc).__name__)
        raise
    finally:
        if bar:
            _display.finish(s, ok)
        if ok:
            if s.total is not None:
                s.done = s.total
            if not bar:
                amount = (
                    f" ({_amount(s.total, unit)})" if s.total else (f" ({_amount(s.done, unit)})" if s.done else "")
                )
                log.info("%s: done in %.0f ms%s", name, s.elapsed_ms, amount)
        _notify(name, s.done, s.total, True)


@contextlib.contextmanager
def polling(s: Step, read_done: Callable[[], float], every: float = 0.25) -> Iterator[None]:
    """While the block runs, set ``s``'s progress to ``read_done()`` every ``every`` seconds (a helper thread),
    for work that reports nothing itself (e.g. a C call writing a file: poll the file's size)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            try:
                s.update(read_done())
            except OSError:  # e.g. the file does not exist yet
                pass

    t = threading.Thread(target=run, name=f"progress-{s.name}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
