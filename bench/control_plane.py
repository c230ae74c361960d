"""Control-plane latency during a long prefill: status reads must not wait for the engine.

    .venv/bin/python bench/control_plane.py [--tokens 4000] [--ctx 8192] [--rounds 1]
    .venv/bin/python bench/control_plane.py --server-cwd /path/to/other/checkout   # the same bench, another tree

Starts a node (``-c 8192 -np 2``), puts a short prompt in slot 1 (so it has
its own ``n_past``), then sends a ``--tokens``-token prompt to slot 0
(``n_predict`` 1, ``cache_prompt`` false) and, until that completion returns,
polls round-robin over persistent connections: ``GET /slots``,
``GET /slots/1/state/meta``, ``GET /health``, ``GET /props``, Hydra INFO and
Hydra STATE_META of slot 1; meanwhile another thread repeats Hydra
STATE_GET of slot 1 on its own connection (an op that needs the engine
thread: it waits for the current batch, so its figure is about one batch's
time, not a snapshot read).  Prints p50 / p99 / max per endpoint (ms),
and the prefill's own time.  The server runs with the benches' environment
(llama.cpp threads spin, as in production), not the tests' passive waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.protocol.hydra import Op  # noqa: E402
from hydra_trio.testing.hydra_wire import Wire  # noqa: E402
from hydra_trio.testing.spawn import free_port, wait_healthy  # noqa: E402

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "bright jovial nymphs near misty harbours and old lanterns glow "
).split()


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def make_prompt(http: httpx.Client, n_tokens: int) -> tuple[str, int]:
    """A text of about ``n_tokens`` tokens (counted by the node's tokenizer) and its exact count."""
    n_words = n_tokens
    for _ in range(6):
        text = " ".join(WORDS[i % len(WORDS)] for i in range(n_words))
        n = len(http.post("/tokenize", json={"content": text}).json()["tokens"])
        if abs(n - n_tokens) <= 16:
            return text, n
        n_words = max(1, int(n_words * n_tokens / n))
    return text, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000, help="prompt tokens on slot 0 (default 4000)")
    ap.add_argument("--ctx", type=int, default=8192, help="-c (default 8192; two slots)")
    ap.add_argument("--rounds", type=int, default=1, help="prefills to measure (default 1)")
    ap.add_argument("--interval", type=float, default=0.005, help="pause between polling rounds, s (default 0.005)")
    ap.add_argument("--server-cwd", type=Path, default=ROOT, help="checkout whose hydra_trio the node runs")
    ap.add_argument("--passive", action="store_true", help="run the node with the tests' OMP_WAIT_POLICY=PASSIVE")
    a = ap.parse_args()

    port = free_port()
    env = {**os.environ, **({"OMP_WAIT_POLICY": "PASSIVE"} if a.passive else {})}
    log_path = Path(tempfile.gettempdir()) / "hydra-bench-control-plane.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hydra_trio",
            "run",
            "--port",
            str(port),
            "-c",
            str(a.ctx),
            "-np",
            "2",
            "--log-level",
            "WARNING",
        ],
        cwd=a.server_cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(port, proc)
        http = httpx.Client(base_url=base, timeout=300)
        text, n_prompt = make_prompt(http, a.tokens)
        print(
            f"node on :{port} (cwd {a.server_cwd}, log {log_path}); "
            f"prompt {n_prompt} tokens on slot 0, -c {a.ctx} -np 2",
            flush=True,
        )
        r = http.post(
            "/completion", json={"prompt": "A short note in slot one.", "n_predict": 4, "id_slot": 1, "temperature": 0}
        )
        r.raise_for_status()
        n_past_1 = http.get("/slots/1/state/meta").json()["n_past"]

        lat: dict[str, list[float]] = {
            k: []
            for k in (
                "GET /slots",
                "GET /slots/1/state/meta",
                "GET /health",
                "GET /props",
                "Hydra INFO",
                "Hydra STATE_META 1",
                "Hydra STATE_GET 1 (engine thread)",
            )
        }
        errors: list[str] = []
        prefill_s: list[float] = []
        wire: Wire | None = None

        def timed(name: str, fn) -> None:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # reported, not fatal
                errors.append(f"{name}: {exc!r}")
                return
            lat[name].append((time.perf_counter() - t0) * 1e3)

        def check_http(path: str, want: int = 200):
            def go() -> None:
                resp = http.get(path)
                assert resp.status_code == want, (path, resp.status_code, resp.text[:200])
                if path == "/slots/1/state/meta":
                    assert resp.json()["n_past"] == n_past_1, resp.json()

            return go

        def check_hydra(op: int, key: str = ""):
            def go() -> None:
                nonlocal wire
                if wire is None:  # reconnect after an error
                    wire = Wire(port, timeout=300)
                try:
                    status, meta, _ = wire.call(op, key=key)
                except OSError:
                    wire.close()
                    wire = None
                    raise
                assert status == 0, (op, status, meta)
                if op == Op.STATE_META:
                    assert meta["n_past"] == n_past_1 and not meta["is_processing"], meta

            return go

        for rnd in range(a.rounds):
            done = threading.Event()
            result: dict = {}

            def prefill() -> None:
                t0 = time.perf_counter()
                with httpx.Client(base_url=base, timeout=600) as c:
                    resp = c.post(
                        "/completion",
                        json={"prompt": text, "n_predict": 1, "id_slot": 0, "cache_prompt": False, "temperature": 0},
                    )
                result["status"] = resp.status_code  # noqa: B023  (called and finished within this iteration)
                result["s"] = time.perf_counter() - t0  # noqa: B023  (called and finished within this iteration)
                done.set()  # noqa: B023  (called and finished within this iteration)

            t = threading.Thread(target=prefill)
            t.start()
            # wait until slot 0 is processing (the snapshot says so), then poll until the prefill returns
            while not done.is_set() and not http.get("/slots").json()[0]["is_processing"]:
                time.sleep(0.002)

            def state_gets() -> None:  # on its own connection and thread: it waits for a batch each time
                with Wire(port, timeout=300) as w2:
                    while not done.is_set():  # noqa: B023  (called and finished within this iteration)
                        t0 = time.perf_counter()
                        status, meta, _ = w2.call(Op.STATE_GET, key="1")
                        if status == 0:
                            lat["Hydra STATE_GET 1 (engine thread)"].append((time.perf_counter() - t0) * 1e3)
                        else:
                            errors.append(f"STATE_GET: {status} {meta}")
                        time.sleep(a.interval)

            getter = threading.Thread(target=state_gets)
            getter.start()
            polls = 0
            wire = Wire(port, timeout=300)
            t_start = t_line = time.monotonic()
            while not done.is_set():
                timed("GET /slots", check_http("/slots"))
                timed("GET /slots/1/state/meta", check_http("/slots/1/state/meta"))
                timed("GET /health", check_http("/health"))
                timed("GET /props", check_http("/props"))
                timed("Hydra INFO", check_hydra(Op.INFO))
                timed("Hydra STATE_META 1", check_hydra(Op.STATE_META, "1"))
                polls += 1
                if time.monotonic() - t_line >= 5:
                    t_line = time.monotonic()
                    n_past_0 = http.get("/slots").json()[0]["n_past"]
                    print(
                        f"round {rnd + 1}/{a.rounds}: {t_line - t_start:5.1f} s, {polls} polling rounds, "
                        f"slot 0 n_past {n_past_0}",
                        flush=True,
                    )
                time.sleep(a.interval)
            t.join()
            getter.join()
            assert result.get("status") == 200, result
            prefill_s.append(result["s"])
            if wire is not None:
                wire.close()
                wire = None

        print(
            f"\nprefill of {n_prompt} tokens: {', '.join(f'{s:.2f} s' for s in prefill_s)} "
            f"({n_prompt / statistics.median(prefill_s):.0f} tok/s)"
        )
        print(f"{'endpoint':<36}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
        summary = {}
        for name, xs in lat.items():
            if not xs:
                print(f"{name:<36}{0:>6}")
                continue
            p50, p99, mx = percentile(xs, 0.5), percentile(xs, 0.99), max(xs)
            summary[name] = {"n": len(xs), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "max_ms": round(mx, 2)}
            print(f"{name:<36}{len(xs):>6}{p50:>10.2f}{p99:>10.2f}{mx:>10.2f}")
        if errors:
            print(f"\n{len(errors)} errors; first: {errors[:3]}")
        print("\n" + json.dumps({"prompt_tokens": n_prompt, "prefill_s": prefill_s, "endpoints": summary}))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":
    main()
