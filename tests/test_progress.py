"""Progress of long start-up work (hydra_trio.observability.progress): log lines without a terminal, rich bars on one,
listeners."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from hydra_trio.models.moe import make_test_moe
from hydra_trio.models.presets import resolve_model
from hydra_trio.observability import progress
from hydra_trio.testing import spawn as _spawn

from .conftest import ROOT, ServerProcess, free_port, wait_for


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float | None, bool]] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, done: float, total: float | None, finished: bool) -> None:
        with self.lock:
            self.calls.append((name, done, total, finished))


@pytest.fixture
def recorder(monkeypatch):
    """Records every listener call; in-process steps log lines even under ``pytest -s`` on a terminal."""
    plain = progress._Display()
    plain._decided = True  # no console: log lines
    monkeypatch.setattr(progress, "_display", plain)
    rec = Recorder()
    progress.add_listener(rec)
    yield rec
    progress.remove_listener(rec)


def test_step_logs_start_and_end_and_calls_listeners_from_many_threads(recorder, caplog, monkeypatch) -> None:
    def broken(*_args) -> None:
        raise RuntimeError("a listener that fails")

    # no progress line between start and end however long the 4,000 advances take on a busy machine
    # (at the default 2 s one would come between them: lines per time are the next test's subject)
    monkeypatch.setattr(progress, "LOG_EVERY_S", float("inf"))
    progress.add_listener(broken)
    try:
        with caplog.at_level(logging.INFO, logger="hydra_trio.progress"):
            with progress.step("counting", total=4000, unit="items") as p:
                threads = [threading.Thread(target=lambda: [p.advance() for _ in range(1000)]) for _ in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            with pytest.raises(ValueError), progress.step("failing", total=10) as p:
                p.update(3)
                raise ValueError("boom")
    finally:
        progress.remove_listener(broken)
    lines = [r.getMessage() for r in caplog.records if r.name == "hydra_trio.progress"]
    assert lines[0] == "counting: started (4000 items)"
    assert re.fullmatch(r"counting: done in \d+ ms \(4000 items\)", lines[1]), lines  # no line between
    assert re.fullmatch(r"failing: failed after \d+ ms: boom", lines[-1]), lines
    counting = [c for c in recorder.calls if c[0] == "counting"]
    assert counting[0] == ("counting", 0.0, 4000, False) and counting[-1] == ("counting", 4000, 4000, True)
    assert len(counting) == 4002  # start, each advance, end: the failing listener stopped none of them
    assert recorder.calls[-1] == ("failing", 3, 10, True)


def test_a_long_step_logs_at_most_every_two_seconds_and_each_quarter(recorder, caplog, monkeypatch) -> None:
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    with (
        caplog.at_level(logging.INFO, logger="hydra_trio.progress"),
        progress.step("copying", total=100 * 2**20, unit="B") as p,
    ):
        for _ in range(100):
            p.advance(2**20)
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "hydra_trio.progress"]
    middle = lines[1:-1]
    assert 1 <= len(middle) <= 3, lines  # a line per quarter at most, none at 100 % (the "done" line follows)
    assert all(re.fullmatch(r"copying: +\d+% \([\d.]+ MB of 104.9 MB\)", m) for m in middle), middle


def test_server_log_has_the_start_up_steps_with_elapsed_ms(server: ServerProcess) -> None:
    log = server.log()
    for name in ("loading model", "hashing model", "warm-up"):
        assert re.search(rf"hydra_trio\.progress: {name}: started", log), log[-3000:]
        assert re.search(rf"hydra_trio\.progress: {name}: done in \d+ ms", log), log[-3000:]
    assert re.search(r"loading model: done in \d+ ms \([\d.]+ MB\)", log)


def test_test_moe_build_reports_the_bytes_it_writes(recorder, tmp_path: Path) -> None:
    dst = make_test_moe(resolve_model("smollm2-135m")[0], tmp_path / "moe.gguf")
    calls = [c for c in recorder.calls if c[0].startswith("building test MoE")]
    _name, done, total, finished = calls[-1]
    assert finished and total and done == total
    assert 0.9 * dst.stat().st_size < total < dst.stat().st_size  # the tensors are most of the file
    dones = [c[1] for c in calls]
    assert dones == sorted(dones) and len(calls) > 300  # one update per tensor written


def test_combined_attach_logs_the_upload(spawn) -> None:
    peer = spawn("--no-model")
    peer.wait_ready()
    head = spawn(
        "-m", "smollm2-135m-moe", "-np", "1", "-c", "1024", "--no-rpc-backend", "--rpc-engine", f"127.0.0.1:{peer.port}"
    )
    head.wait_ready()
    line = wait_for(
        lambda: re.search(
            rf"attaching peer 127\.0\.0\.1:{peer.port}: uploading tensors: done in \d+ ms \(([\d.]+) MB\)", head.log()
        ),
        timeout=120.0,
        what="the attach's done line",
    )
    assert float(line.group(1)) > 100  # the expert tensors of the test MoE: about 170 MB
    assert f"attaching peer 127.0.0.1:{peer.port}: uploading tensors: started" in head.log()


def test_run_on_a_terminal_draws_bars_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """``hydra-trio run`` with a pseudo-terminal as stdin/stdout/stderr, as a person starts it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 40 rows, 160 columns
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydra_trio", "run", "--port", str(port), "-np", "1", "-c", "1024"],
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
        env={**os.environ, **_spawn.SHARED_MACHINE_ENV, "TERM": "xterm-256color", "COLUMNS": "160"},
    )
    os.close(slave)
    screen = bytearray()

    def read() -> None:  # keep draining the terminal, or the node blocks writing to it
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            screen.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _spawn.wait_healthy(port, proc, timeout=120)
        text = lambda: re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))  # noqa: E731
        # a finished step's last bar: name, bar characters, percentage, bytes, elapsed
        wait_for(
            lambda: re.search(r"loading model ━+ 100% [\d.]+ MB / [\d.]+ MB \d+:\d\d:\d\d", text()),
            timeout=30,
            what="the loading bar",
        )
        wait_for(
            lambda: re.search(r"hashing model ━+ 100% [\d.]+ MB / [\d.]+ MB", text()),
            timeout=30,
            what="the hashing bar",
        )
        wait_for(lambda: re.search(r"warm-up ━+ 100%", text()), timeout=30, what="the warm-up bar")
        assert "hydra_trio.progress:" not in text()  # bars instead of progress log lines
        # other logs still show, whole (the engine logs "stage ready" as /health turns 200: wait for the
        # line to come through the terminal)
        wait_for(
            lambda: re.search(r"INFO +hydra_trio\.engine: stage ready", text()),
            timeout=60,
            what="the 'stage ready' log line",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        os.close(master)
    (tmp_path / "terminal.txt").write_bytes(bytes(screen))


def test_a_step_name_is_shown_as_it_is_never_as_rich_markup() -> None:
    """Step names carry file names and peer addresses; ``[/x]`` in one raised rich's MarkupError in the
    bar's refresh, ``[blink]`` styled it: the bar shows the name literally."""
    from rich.console import Console

    display = progress._Display()
    display._console = Console(width=200, record=True, file=io.StringIO(), force_terminal=True)
    bars = display._make_progress()
    bars.add_task("quantizing [/x] [blink]m.gguf", total=10, amount="")
    display._console.print(bars.make_tasks_table(bars.tasks))
    assert "quantizing [/x] [blink]m.gguf" in display._console.export_text()
