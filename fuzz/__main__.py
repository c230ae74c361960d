"""``python -m fuzz``: start a real server, fuzz it live with hypothesis, print a summary.

    .venv/bin/python -m fuzz --examples 50          # short run (CI runs a small budget in tests)
    .venv/bin/python -m fuzz --minutes 30           # long run, for people
    .venv/bin/python -m fuzz --port 8080 --slots 4  # against a server you started

Failing examples are saved in ``.fuzz-failures/`` (hypothesis' example
database) and replayed first by the next run.  The summary gives examples and
steps run, requests per protocol, failures, and the server's open file
descriptors, threads and RSS before and after.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from hydra_trio._spawn import ROOT, SHARED_MACHINE_ENV, spawn, wait_healthy

from . import live



def proc_stats(pid: int) -> dict[str, int]:
    """Open fds, threads and RSS (KiB) of a process, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"fds": fds, "threads": int(fields["Threads"]), "rss_kib": int(fields["VmRSS"].split()[0])}


_EXAMPLES_PER_RUN = 3  # with --minutes: hypothesis runs this short, so the time limit is checked often


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--examples", type=int, default=None, help="hypothesis examples (state machine runs)")
    budget.add_argument("--minutes", type=float, default=None,
                        help="keep going until this much time has passed (the example in progress finishes: "
                             "a minute more at most)")
    ap.add_argument("--steps", type=int, default=25, help="steps per example (default 25)")
    ap.add_argument("--port", type=int, default=None, help="fuzz a server already running on this port")
    ap.add_argument("--slots", type=int, default=2, help="slots of that server (default 2)")
    ap.add_argument("--step-timeout", type=float, default=60.0,
                    help="seconds one exchange may take before it is reported as a hang (default 60)")
    a = ap.parse_args(argv)

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    proc = None
    port = a.port
    if port is None:
        log = open(ROOT / ".fuzz-server.log", "wb")
        # a short body timeout: long requests must still run to their end (fuzz.hostile)
        proc, port = spawn("-np", str(a.slots), "-c", "4096", "--classify-timeout", "2", "--timeout", "1", output=log,
                           env=SHARED_MACHINE_ENV)
        wait_healthy(port, proc)
    live.configure(port, a.slots, a.step_timeout)
    pid = proc.pid if proc else None
    before = proc_stats(pid) if pid else {}
    examples = a.examples if a.examples is not None else (10**9 if a.minutes else 50)
    end = time.monotonic() + 60 * a.minutes if a.minutes else None
    failures = 0
    runs = 0
    t0 = time.monotonic()
    try:
        while True:
            runs += 1
            test = live.LiveServerMachine.TestCase
            test.settings = settings(
                max_examples=min(examples, _EXAMPLES_PER_RUN) if end else examples,
                stateful_step_count=a.steps,
                deadline=None,
                database=DirectoryBasedExampleDatabase(str(ROOT / ".fuzz-failures")),
                suppress_health_check=list(HealthCheck),
            )
            try:
                test("runTest").runTest()
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop, still print the summary
                print("interrupted: stopping after the examples so far", flush=True)
                break
            except Exception:
                failures += 1
                traceback.print_exc()
                break
            print(f"[{time.monotonic() - t0:5.0f} s] run {runs}: {live.STATS['examples']} examples, "
                  f"{live.STATS['steps']} steps checked, 0 failures", flush=True)
            if end is None or time.monotonic() > end:
                break
    finally:
        time.sleep(7)  # let connections in their classify timeout and HTTP keep-alive (5 s) close
        after = proc_stats(pid) if pid and proc.poll() is None else {}
        if pid and proc.poll() is None:
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            sockets = sum(t.startswith("socket:") for t in targets)
            print(f"server fds after: {len(targets)} ({sockets} sockets)")
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
        else:
            code = None
    print("\n== fuzz summary ==")
    print(f"time {time.monotonic() - t0:.0f} s, examples {live.STATS['examples']} (in {runs} hypothesis runs), "
          f"steps checked {live.STATS['steps']}")
    print("requests: " + ", ".join(f"{k} {v}" for k, v in live.STATS.items() if k not in ("steps", "examples")))
    print(f"failures {failures}")
    print(f"hangs (steps past --step-timeout) {len(live.FINDINGS)}")
    for f in live.FINDINGS:
        print(f"  {f}")
    if before:
        print(f"server before: {before}")
        print(f"server after:  {after}")
        print(f"server exit code after SIGTERM: {code}")
    return 1 if failures or live.FINDINGS or (code not in (0, None)) else 0


if __name__ == "__main__":
    sys.exit(main())
