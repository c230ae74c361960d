"""SWAP_QUANT: swap time and peak RSS, Q4_1 <-> Q8_0 of SmolLM2, with a slot's KV cache kept.

    .venv/bin/python bench/quant_swap.py [--swaps 5]

Starts a node with ``--quant q4=smollm2-135m --quant q8=smollm2-135m-q8``,
fills slot 0 (so every swap moves a KV cache), then swaps back and forth and
reports each direction's ``swap_ms`` (median, min-max) and the node's RSS:
idle on each quant, and the peak while swapping (sampled every 2 ms), next to
"old + new" (the two idle figures added: the most the design allows).  For scale, the
same run times a cold start of a node on each quant (to /health 200).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.hydra.client import HydraClient  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def swap(port: int, key: str) -> dict:
    async with HydraClient("127.0.0.1", port) as c:
        return await c.swap_quant(key, "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swaps", type=int, default=5, help="round trips q4 -> q8 -> q4 (default 5)")
    a = ap.parse_args()
    sizes = {
        k: resolve_model(alias)[0].stat().st_size / 2**20
        for k, alias in (("q4", "smollm2-135m"), ("q8", "smollm2-135m-q8"))
    }
    starts = {}
    for key, alias in (("q4", "smollm2-135m"), ("q8", "smollm2-135m-q8")):
        t0 = time.perf_counter()
        proc, port = spawn("-m", alias, "-np", "1", "-c", "2048", "--log-level", "WARNING", output=subprocess.DEVNULL)
        wait_healthy(port, proc)
        starts[key] = (time.perf_counter() - t0) * 1e3
        proc.terminate()
        proc.wait(30)
    proc, port = spawn(
        "-np",
        "2",
        "-c",
        "2048",
        "--quant",
        "q4=smollm2-135m",
        "--quant",
        "q8=smollm2-135m-q8",
        "--log-level",
        "WARNING",
        output=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, proc)
        httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"prompt": "The lighthouse keeper " * 100, "max_tokens": 0, "id_slot": 0},
        )
        times: dict[str, list[float]] = {"q8": [], "q4": []}
        idle: dict[str, list[float]] = {"q8": [], "q4": []}
        peak = 0.0
        for i in range(a.swaps):
            for key in ("q8", "q4"):
                stop = threading.Event()
                samples: list[float] = []

                def sample() -> None:
                    while not stop.is_set():  # noqa: B023  (called and finished within this iteration)
                        samples.append(rss_mib(proc.pid))  # noqa: B023  (called and finished within this iteration)
                        time.sleep(0.002)

                t = threading.Thread(target=sample)
                t.start()
                meta = trio.run(swap, port, key)
                stop.set()
                t.join()
                assert meta["swapped"] and meta["kv_preserved"], meta
                times[key].append(meta["swap_ms"])
                peak = max(peak, *samples)
                time.sleep(0.2)
                idle[key].append(rss_mib(proc.pid))
                print(
                    f"  swap {i + 1} to {key}: {meta['swap_ms']:7.1f} ms, RSS after {idle[key][-1]:6.1f} MiB",
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait(30)
    for key in ("q8", "q4"):
        ms = times[key]
        print(
            f"swap to {key}: median {statistics.median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f}), a slot's KV "
            f"kept; cold start of a node on {key}: {starts[key]:.0f} ms"
        )
    i4, i8 = statistics.median(idle["q4"]), statistics.median(idle["q8"])
    print(
        f"RSS idle on q4 {i4:.0f} MiB, on q8 {i8:.0f} MiB (files {sizes['q4']:.0f} and {sizes['q8']:.0f} MiB); "
        f"peak while swapping {peak:.0f} MiB, against old + new = {i4 + i8:.0f} MiB"
    )
    print(f"RSS after the first and the last round trip: {idle['q4'][0]:.0f} -> {idle['q4'][-1]:.0f} MiB")


if __name__ == "__main__":
    main()
