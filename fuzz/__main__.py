"""``python -m fuzz``: start real servers, fuzz them live with hypothesis, print a summary.

    .venv/bin/python -m fuzz --examples 50          # short run (CI runs a small budget in tests)
    .venv/bin/python -m fuzz --minutes 30           # long run, for people
    .venv/bin/python -m fuzz --port 8080 --slots 4  # against a server you started (plus the access node)
    .venv/bin/python -m fuzz --no-access            # only the protocol machine

Two nodes: the **main node** (no access rules: the protocol
machine, :mod:`fuzz.live`, needs its control ops to work) and the **access
node**, which has TLS (certificates made at start with ``trustme``, a test
extra), ``--tls-required``, an API key, ``--control-allow 10.0.0.0/8``, a
Hydra token and ``--rpc-allow 127.0.0.0/8``; :mod:`fuzz.access` (wrong keys
and tokens, refused control ops) and :mod:`fuzz.tls` (bad TLS, plaintext
where TLS is required, bad credentials over TLS) run against it.  The access
node listens on ``0.0.0.0`` when this machine has a non-loopback address, so
that plain from that address meets ``--tls-required``.

Failing examples are saved in ``.fuzz-failures/`` (hypothesis' example
database) and replayed first by the next run.  The summary gives examples and
steps run, requests per protocol and per rule family, failures, hangs, and
for each node its open file descriptors, threads and RSS before and after; a
node whose open sockets do not come back (to what it had before, +2) within
30 s of the end is a failure.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from hydra_trio.testing.spawn import ROOT, SHARED_MACHINE_ENV, spawn, wait_healthy

from . import access, live, tls


def proc_stats(pid: int) -> dict[str, int]:
    """Open fds (and of them sockets), threads and RSS (KiB) of a process, from /proc."""
    targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "fds": len(targets),
        "sockets": sum(t.startswith("socket:") for t in targets),
        "threads": int(fields["Threads"]),
        "rss_kib": int(fields["VmRSS"].split()[0]),
    }


_EXAMPLES_PER_RUN = 3  # with --minutes: hypothesis runs this short, so the time limit is checked often


class AccessNode:
    """The access node (see the module docstring): its process, port, key, token and certificates."""

    def __init__(self, slots: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hydra-fuzz-tls-"))
        self.certs = tls.make_certs(self.dir)
        self.key, self.token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        self.own = tls.own_address()
        self.slots = slots
        log = open(ROOT / ".fuzz-access-server.log", "wb")
        self.proc, self.port = spawn(
            "--host",
            "0.0.0.0" if self.own else "127.0.0.1",
            "-np",
            str(slots),
            "-c",
            "2048",
            "--timeout",
            "5",
            *tls.server_flags(self.certs, self.key, self.token),
            output=log,
            env=SHARED_MACHINE_ENV,
        )

    def point(self) -> None:
        """Aim fuzz.access and fuzz.tls at this node."""
        tls.configure(self.port, self.key, self.token, self.slots, self.certs, self.own)


def _run(machine: type, examples: int, steps: int) -> None:
    """One hypothesis run of a state machine (raises its failure)."""
    test = machine.TestCase
    test.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=DirectoryBasedExampleDatabase(str(ROOT / ".fuzz-failures")),
        suppress_health_check=list(HealthCheck),
    )
    test("runTest").runTest()


def _sockets_back(proc: subprocess.Popen | None, before: dict[str, int], wait: float = 30.0) -> dict[str, int]:
    """The node's stats once its open sockets are back to ``before`` (+2), or after ``wait`` seconds."""
    if proc is None or proc.poll() is not None:
        return {}
    deadline = time.monotonic() + wait
    while True:
        now = proc_stats(proc.pid)
        if now["sockets"] <= before["sockets"] + 2 or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--examples", type=int, default=None, help="hypothesis examples (state machine runs)")
    budget.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="keep going until this much time has passed (the example in progress finishes: a minute more at most)",
    )
    ap.add_argument("--steps", type=int, default=25, help="steps per example (default 25)")
    ap.add_argument("--port", type=int, default=None, help="fuzz a server already running on this port")
    ap.add_argument("--slots", type=int, default=2, help="slots of that server (default 2)")
    ap.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds one exchange may take before it is reported as a hang (default 60)",
    )
    ap.add_argument(
        "--no-access",
        action="store_true",
        help="no access node: skip the TLS, API key and allow-list rules (fuzz.access, fuzz.tls)",
    )
    a = ap.parse_args(argv)

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    proc = None
    port = a.port
    if port is None:
        log = open(ROOT / ".fuzz-server.log", "wb")
        # a short body timeout: long requests must still run to their end (fuzz.hostile)
        proc, port = spawn(
            "-np",
            str(a.slots),
            "-c",
            "4096",
            "--classify-timeout",
            "2",
            "--timeout",
            "1",
            output=log,
            env=SHARED_MACHINE_ENV,
        )
    node = None if a.no_access else AccessNode(slots=2)
    if proc is not None:
        wait_healthy(port, proc)
    if node is not None:
        wait_healthy(node.port, node.proc)
    procs = {"main": proc, "access": node.proc if node else None}
    before = {name: proc_stats(p.pid) for name, p in procs.items() if p is not None}
    examples = a.examples if a.examples is not None else (10**9 if a.minutes else 50)
    end = time.monotonic() + 60 * a.minutes if a.minutes else None
    failures = 0
    runs = 0
    t0 = time.monotonic()
    try:
        while True:
            runs += 1
            n = min(examples, _EXAMPLES_PER_RUN) if end else examples
            try:
                live.configure(port, a.slots, a.step_timeout)
                _run(live.LiveServerMachine, n, a.steps)
                if node is not None:  # the access rules: as many examples (a fifth with --examples), 2 at least,
                    node.point()  # as hypothesis' first example of a run is its simplest (the first rule only)
                    live.configure(node.port, node.slots, a.step_timeout)
                    k = max(2, n if end else n // 5)
                    _run(access.AccessMachine, k, a.steps)
                    _run(tls.TlsMachine, k, a.steps)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop, still print the summary
                print("interrupted: stopping after the examples so far", flush=True)
                break
            except Exception:
                failures += 1
                traceback.print_exc()
                break
            print(
                f"[{time.monotonic() - t0:5.0f} s] run {runs}: {live.STATS['examples']} examples, "
                f"{live.STATS['steps']} steps checked, 0 failures",
                flush=True,
            )
            if end is None or time.monotonic() > end:
                break
    finally:
        time.sleep(7)  # let connections in their classify timeout and HTTP keep-alive (5 s) close
        after = {name: _sockets_back(p, before[name]) for name, p in procs.items() if p is not None}
        codes = {}
        for name, p in procs.items():
            if p is not None:
                p.send_signal(signal.SIGTERM)
                codes[name] = p.wait(30)
    leaks = [name for name, stats in after.items() if not stats or stats["sockets"] > before[name]["sockets"] + 2]
    print("\n== fuzz summary ==")
    print(
        f"time {time.monotonic() - t0:.0f} s, examples {live.STATS['examples']} (in {runs} hypothesis runs), "
        f"steps checked {live.STATS['steps']}"
    )
    print(
        "requests: "
        + ", ".join(
            f"{k} {v}" for k, v in live.STATS.items() if k not in ("steps", "examples") and not k.endswith("_ms")
        )
    )
    if "tls_slowest_close_ms" in live.STATS:
        print(
            f"bad TLS: slowest close {live.STATS['tls_slowest_close_ms']} ms (classify timeout "
            f"{tls.CLASSIFY_TIMEOUT * 1e3:.0f} ms)"
        )
    print(f"failures {failures}")
    print(f"hangs (steps past --step-timeout or the classify timeout) {len(live.FINDINGS)}")
    for f in live.FINDINGS:
        print(f"  {f}")
    for name in before:
        print(f"{name} node before: {before[name]}")
        print(f"{name} node after:  {after.get(name)}  exit code after SIGTERM: {codes.get(name)}")
    if leaks:
        print(f"sockets not back within 30 s: {', '.join(leaks)}")
    bad_exit = any(code != 0 for code in codes.values())
    return 1 if failures or live.FINDINGS or leaks or bad_exit else 0


if __name__ == "__main__":
    sys.exit(main())
