"""Slow clients vs. normal ones, same run: latency of /health and of a short completion.

    .venv/bin/python bench/slow_clients.py [--idle 1000] [--trickle 100]

Measures a baseline, then opens ``--idle`` connections that send nothing and
``--trickle`` connections that send one byte a second (half HTTP, half Hydra),
and measures again while they are open.  Prints both latencies and the ratio.
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402


def measure(base: str, n: int = 10) -> tuple[float, float]:
    health, chat = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        assert httpx.get(base + "/health", timeout=60).status_code == 200
        health.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200
        chat.append(time.perf_counter() - t0)
    return statistics.median(health) * 1e3, statistics.median(chat) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--trickle", type=int, default=100)
    a = ap.parse_args()
    proc, port = spawn(
        "--log-level", "WARNING", "--max-connections", "4096", "--classify-timeout", "30", "--no-rpc-backend"
    )
    base = f"http://127.0.0.1:{port}"
    socks: list[socket.socket] = []
    stop = threading.Event()
    try:
        wait_healthy(port, proc)
        before = measure(base)
        for _ in range(a.idle):
            socks.append(socket.create_connection(("127.0.0.1", port)))
        trickle = [socket.create_connection(("127.0.0.1", port)) for _ in range(a.trickle)]
        payloads = [
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" if i % 2 else b"YH" + bytes(40) for i in range(a.trickle)
        ]

        def drip() -> None:
            i = 0
            while not stop.is_set():
                for s, p in zip(trickle, payloads, strict=True):
                    try:
                        s.send(p[i % len(p) : i % len(p) + 1])
                    except OSError:
                        pass
                i += 1
                stop.wait(1.0)

        t = threading.Thread(target=drip, daemon=True)
        t.start()
        time.sleep(2)
        during = measure(base)
        stop.set()
        socks += trickle
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(f"{a.idle} silent + {a.trickle} one-byte-a-second connections open:")
    print(f"  /health        {during[0]:7.2f} ms (baseline {before[0]:.2f} ms, ratio {during[0] / before[0]:.2f})")
    print(f"  4-token reply  {during[1]:7.2f} ms (baseline {before[1]:.2f} ms, ratio {during[1] / before[1]:.2f})")


if __name__ == "__main__":
    main()
