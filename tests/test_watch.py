"""``hydra-trio watch``: JSON lines for scripts, the live table read off a real terminal (tmux), reconnects,
API keys and TLS, all against real nodes."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hydra_trio.client.watch import WatchState, render, summary

from .conftest import ROOT, ServerProcess, streaming, wait_for
from .test_tls import Certs


class Watch:
    """``python -m hydra_trio watch ADDRESS --json ...`` in a subprocess; stdout and stderr collected by threads."""

    def __init__(self, port: int, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hydra_trio", "watch", f"127.0.0.1:{port}", "--json", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.errors), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines)]

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120) -> dict[str, Any]:
        return wait_for(
            lambda: next((e for e in self.events if pred(e)), None),
            timeout=timeout,
            what=f"{what}; stderr: {''.join(self.errors)[-2000:]}",
        )

    def stop(self) -> int:
        """SIGINT, as Ctrl-C; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        for t in self._threads:
            t.join(10)
        return code


@pytest.fixture
def watch() -> Iterator[Callable[..., Watch]]:
    started: list[Watch] = []

    def start(port: int, *args: str) -> Watch:
        w = Watch(port, *args)
        started.append(w)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


# ------------------------------------------------------------------ --json
def test_json_lines_show_a_completion(server: ServerProcess, watch) -> None:
    w = watch(server.port, "--types", "slot")
    hello = w.wait_for(lambda e: e["type"] == "hello", "hello")
    assert hello["model"] == "smollm2-135m" and hello["n_slots"] == 4
    reply = httpx.post(
        server.base + "/v1/completions",
        json={"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=120,
    ).json()
    rid = reply["id"]
    done = w.wait_for(lambda e: e["type"] == "slot.finished" and e.get("trace_id") == rid, "slot.finished")
    assert done["timings"]["predicted_n"] == 5 and done["slot"] == reply["id_slot"]
    assert w.stop() == 0, "".join(w.errors)
    lines = list(w.lines)
    assert all(line.endswith("\n") and "\n" not in line[:-1] for line in lines)  # one object per line
    kinds = [e["type"] for e in w.events if e.get("trace_id") == rid]
    assert kinds == ["slot.assigned", "slot.first_token", "slot.finished"]
    assert {e["type"].split(".")[0] for e in w.events} <= {"hello", "dropped", "slot"}  # --types passed through


# ------------------------------------------------------------------ the live table, on a real terminal
class Tmux:
    """A detached tmux session of a fixed size on its own server socket (``-L``), killed on close."""

    def __init__(self, command: str, width: int = 120, height: int = 40) -> None:
        self.sock = f"hydra-watch-{uuid.uuid4().hex[:8]}"
        self._tmux("new-session", "-d", "-s", "w", "-x", str(width), "-y", str(height), "-c", str(ROOT), command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.sock, *args], check=True, capture_output=True, text=True, timeout=30
        ).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "w")

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "w", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


SLOT_ROW = re.compile(r"│\s+(\d+) │ (processing|idle)\s+│\s+(\d+) │\s+(\d+) │")


def slot_rows(screen: str) -> dict[int, tuple[str, int, int]]:
    """The slots table on the screen: ``{id: (state, prompt tokens, generated tokens)}``."""
    return {int(m[1]): (m[2], int(m[3]), int(m[4])) for m in SLOT_ROW.finditer(screen)}


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_live_table_in_tmux_shows_a_busy_slot_then_idle_and_exits_0_on_ctrl_c(
    server: ServerProcess, tmp_path: Path
) -> None:
    # the terminal's own size: under pytest the pane inherits COLUMNS=80/LINES=24, which rich would obey
    cmd = f"env -u COLUMNS -u LINES {shlex.quote(sys.executable)} -m hydra_trio watch 127.0.0.1:{server.port}"
    term = Tmux(f"{cmd}; echo EXIT=$?; sleep 600")
    try:
        wait_for(lambda: len(slot_rows(term.screen())) == 4, timeout=120, what="the slots table")
        screen = term.screen()
        assert "connected" in screen and "smollm2-135m" in screen and "mode         solo" in screen
        body = {"prompt": "Count to one thousand:", "max_tokens": 4000, "ignore_eos": True}
        with streaming(server.base, body):
            busy = wait_for(
                lambda: [(i, r) for i, r in slot_rows(term.screen()).items() if r[0] == "processing" and r[2] > 0],
                timeout=120,
                what="a busy slot with generated tokens",
            )
            _slot, (_, n_prompt, n_generated) = busy[0]
            assert n_prompt > 0 and n_generated > 0
            (tmp_path / "busy.txt").write_text(term.screen())
            assert "slot.assigned" in term.screen() and re.search(r"\d+\.\d tok/s", term.screen())
        wait_for(
            lambda: (
                (rows := slot_rows(term.screen()))
                and all(r[0] == "idle" for r in rows.values())
                and "slot.cancelled" in term.screen()
            ),
            timeout=120,
            what="every slot idle and the cancel in the events list",
        )
        (tmp_path / "idle.txt").write_text(term.screen())
        term.send("C-c")
        wait_for(lambda: "EXIT=" in term.screen(), timeout=60, what="the watch to exit")
        assert "EXIT=0" in term.screen(), term.screen()
    finally:
        term.close()


# ------------------------------------------------------------------ reconnects
def test_reconnects_when_the_node_restarts(spawn, watch) -> None:
    a = spawn()
    a.wait_ready()
    w = watch(a.port)
    w.wait_for(lambda e: e["type"] == "stats" and len(e["slots"]) == 4, "node A's stats")
    assert a.stop() == 0, a.log()
    wait_for(
        lambda: any("disconnected" in line and "retrying" in line for line in w.errors),
        timeout=60,
        what="a disconnected line",
    )
    wait_for(
        lambda: sum("retrying" in line for line in w.errors) >= 2, timeout=60, what="a second attempt"
    )  # it keeps trying
    b = spawn("--port", str(a.port), "--parallel", "2")  # the last --port wins: node A's
    b.port, b.base = a.port, a.base
    b.wait_ready()

    def node_b_stats() -> bool:  # a second hello (it may come while B still loads), then B's 2 slots
        events = w.events
        hellos = [i for i, e in enumerate(events) if e["type"] == "hello"]
        return len(hellos) >= 2 and any(e["type"] == "stats" and len(e["slots"]) == 2 for e in events[hellos[1] :])

    wait_for(node_b_stats, timeout=120, what=f"node B's hello and stats; stderr: {''.join(w.errors)[-2000:]}")
    assert w.proc.poll() is None  # it kept running through the restart
    delays = [float(m[1]) for line in w.errors if (m := re.search(r"retrying in ([\d.]+) s", line))]
    assert delays[0] == 0.5 and all(d <= 5.0 for d in delays)
    assert all(b2 >= b1 for b1, b2 in itertools.pairwise(delays))  # backing off, capped at 5 s
    assert w.stop() == 0


# ------------------------------------------------------------------ API keys and TLS
def test_api_key_and_tls(spawn, watch, tmp_path: Path) -> None:
    certs = Certs(tmp_path)
    node = spawn("--api-key", "sk-watch", *certs.tls_flags())
    node.wait_ready()
    tls = ["--tls", "--tls-ca", str(certs.ca_pem)]
    no_key = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "watch", f"127.0.0.1:{node.port}", "--json", *tls],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "HYDRA_TRIO_API_KEY"},
    )
    assert no_key.returncode == 1 and not no_key.stdout, no_key.stderr
    assert no_key.stderr.startswith("hydra-trio watch: the node refused the connection (HTTP 401)"), no_key.stderr
    assert "API key" in no_key.stderr and "Traceback" not in no_key.stderr
    untrusted = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_trio",
            "watch",
            f"127.0.0.1:{node.port}",
            "--json",
            "--api-key",
            "sk-watch",
            "--tls",
            "--tls-ca",
            str(certs.other_ca_pem),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert untrusted.returncode == 1 and "certificate does not verify" in untrusted.stderr, untrusted.stderr
    assert "Traceback" not in untrusted.stderr
    w = watch(node.port, "--api-key", "sk-watch", *tls)
    w.wait_for(lambda e: e["type"] == "stats", "stats over wss:// with the key")
    assert w.stop() == 0


# ------------------------------------------------------------------ rendering, in-process
def test_render_and_summary_without_a_node() -> None:
    state = WatchState("h:1")
    state.on_event({"ts": 1.0, "type": "hello", "version": "x", "model": "m", "n_slots": 1})
    state.on_event(
        {
            "ts": 2.0,
            "type": "stats",
            "mode": "solo",
            "stage": "ready",
            "queue": 3,
            "tok_s": 1.5,
            "connections": {"http": 2},
            "slots": [
                {
                    "id": 0,
                    "state": "processing",
                    "n_prompt": 7,
                    "n_decoded": 9,
                    "tok_s": 4.0,
                    "n_past": 16,
                    "n_ctx": 512,
                    "trace_id": "t-1",
                }
            ],
        }
    )
    state.on_event(
        {
            "ts": 3.0,
            "type": "slot.finished",
            "trace_id": "t-1",
            "slot": 0,
            "finish_reason": "length",
            "stop_reason": "length",
            "timings": {"prompt_n": 7, "cache_n": 0, "predicted_n": 9, "predicted_per_second": 4.0},
        }
    )
    assert state.stats is not None and [e["type"] for e in state.events] == ["slot.finished"]
    assert summary(state.events[0]) == "slot 0, finish_reason length, prompt 7 (cached 0), generated 9, 4.0 tok/s"
    from rich.console import Console

    console = Console(width=120, record=True, file=io.StringIO())
    state.connected = True
    console.print(render(state, 0.0, 120))
    text = console.export_text()
    assert slot_rows(text) == {0: ("processing", 7, 9)} and "queue 3" in text and "http 2" in text
    assert "stage ready" in text
    state.connected, state.status, state.retry_at = False, "disconnected (gone), retrying{wait}…", 2.0
    console.print(render(state, 1.0, 120))
    text = console.export_text()
    assert "disconnected (gone), retrying in 1.0 s…" in text
    assert "stage ? (last seen: ready)" in text  # not shown as if it were known now


def test_text_from_clients_is_shown_as_it_is_never_as_rich_markup() -> None:
    """Trace ids (a Hydra client chooses them), peers, models and error texts reach the table: ``[/x]``
    must not crash the watch (rich's MarkupError) nor ``[blink]`` style it; they show literally."""
    from rich.console import Console

    evil = "[/nope] [blink]x[link=file:///etc/passwd]y"
    state = WatchState("h:1")
    state.connected = True
    state.on_event({"ts": 1.0, "type": "hello", "version": evil, "model": evil, "n_slots": 1})
    state.on_event(
        {
            "ts": 2.0,
            "type": "stats",
            "mode": evil,
            "peer": evil,
            "stage": evil,
            "connections": {evil: 1},
            "slots": [{"id": 0, "state": evil, "trace_id": evil}],
        }
    )
    state.on_event({"ts": 3.0, "type": evil, "trace_id": evil, "error": evil})
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(state, 0.0, 400))
    text = console.export_text()
    assert text.count("[/nope] [blink]x[link=file:///etc/passwd]y") >= 6, text  # markup would eat the tags


def test_tls_files_without_tls_are_a_usage_error_in_every_client() -> None:
    """``hydra-trio watch`` and the Hydra commands share one set of TLS options and one rule (a CA or a client
    certificate without ``--tls`` is a mistake, said before anything connects)."""
    for argv in (["watch", "127.0.0.1:1", "--tls-ca", "ca.pem"], ["info", "127.0.0.1:1", "--tls-cert", "c.pem"]):
        r = subprocess.run(
            [sys.executable, "-m", "hydra_trio", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert r.returncode != 0 and "--tls-ca/--tls-cert/--tls-key need --tls" in r.stderr, (argv, r.stderr)
