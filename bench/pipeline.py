"""PIPELINE_ATTACH: decode with the upper half of SmolLM2's layers on a peer, against local, same run.

    .venv/bin/python bench/pipeline.py [--tokens 64] [--runs 3]

Starts a compute-only node B and a dense head A (the default model); measures
greedy decode tokens/s on A alone, then with ``blk.15``-``blk.29`` on B
(PIPELINE_ATTACH over ggml-RPC on loopback), then alone again after the
detach, and prints the ratio.  Both nodes share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._decode import tok_s  # noqa: E402
from hydra_trio.hydra.client import HydraClient  # noqa: E402
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402

UPPER_HALF = r"blk\.(1[5-9]|2[0-9])\."


async def attach(port: int, body: dict) -> dict:
    async with HydraClient("127.0.0.1", port) as c:
        return await c.pipeline_attach(body.get("peer", ""), body.get("ot_split", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    b, bport = spawn("--no-model", "--log-level", "WARNING", output=subprocess.DEVNULL)
    h, hport = spawn("-np", "1", "-c", "2048", "--no-rpc-backend", "--log-level", "WARNING", output=subprocess.DEVNULL)
    try:
        wait_healthy(bport, b)
        wait_healthy(hport, h)
        tok_s(hport, 8)
        local = statistics.median(tok_s(hport, a.tokens) for _ in range(a.runs))
        meta = trio.run(attach, hport, {"peer": f"127.0.0.1:{bport}", "ot_split": UPPER_HALF})
        assert meta["mode"] == "pipeline", json.dumps(meta)
        print(f"attached in {meta['switch_ms']:.0f} ms", flush=True)
        tok_s(hport, 8)
        piped = statistics.median(tok_s(hport, a.tokens) for _ in range(a.runs))
        trio.run(attach, hport, {"peer": ""})
        tok_s(hport, 8)
        again = statistics.median(tok_s(hport, a.tokens) for _ in range(a.runs))
    finally:
        for p in (h, b):
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    print(
        f"decode, {a.tokens} tokens, median of {a.runs}: local {local:.1f} tok/s | layers 15-29 on a loopback "
        f"peer {piped:.1f} tok/s | local after detach {again:.1f} tok/s | ratio pipeline/local "
        f"{piped / ((local + again) / 2):.2f}"
    )


if __name__ == "__main__":
    main()
