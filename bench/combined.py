"""COMBINED vs SOLO on one head, same run: decode speed and the flip latency.

    .venv/bin/python bench/combined.py [--tokens 64] [--runs 3] [--passive none|peer|head|both]

Starts a compute-only node B and a head A with the test MoE
(``smollm2-135m-moe``) and ``--rpc-engine B``; measures greedy decode tokens/s
in COMBINED (experts computed on B over ggml-RPC) and in SOLO, and the
``switch_ms`` of SET_EXPERT_MODE flips with both models resident.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio._spawn import spawn, wait_healthy  # noqa: E402
from hydra_trio.hydra.client import HydraClient  # noqa: E402

from bench._decode import tok_s  # noqa: E402


def start(*args: str, passive: bool = False) -> tuple[subprocess.Popen, int]:
    proc, port = spawn("--log-level", "WARNING", *args, env={"OMP_WAIT_POLICY": "PASSIVE"} if passive else None)
    wait_healthy(port, proc)
    return proc, port


async def mode(port: int, m: str) -> dict:
    async with HydraClient("127.0.0.1", port) as c:
        return await c.set_expert_mode(m)


def main() -> None:
    import trio

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--passive", choices=["none", "peer", "head", "both"], default="none",
                    help="which node's environment sets OMP_WAIT_POLICY=PASSIVE (default: none; the peer's "
                         "ggml-RPC child waits passively anyway, see hydra_trio.ggml_rpc.supervisor.CHILD_ENV)")
    a = ap.parse_args()
    b, bport = start("--no-model", passive=a.passive in ("peer", "both"))
    h, hport = start("-m", "smollm2-135m-moe", "-np", "1", "-c", "2048", "--no-rpc-backend",
                     "--rpc-engine", f"127.0.0.1:{bport}", passive=a.passive in ("head", "both"))
    try:
        while trio.run(mode, hport, "combined")["mode"] != "combined":
            time.sleep(0.5)
        tok_s(hport, 8)
        comb = statistics.median(tok_s(hport, a.tokens) for _ in range(a.runs))
        flips = []
        for _ in range(5):
            flips.append(trio.run(mode, hport, "solo").get("switch_ms", 0.0))
            flips.append(trio.run(mode, hport, "combined")["switch_ms"])
        trio.run(mode, hport, "solo")
        tok_s(hport, 8)
        solo = statistics.median(tok_s(hport, a.tokens) for _ in range(a.runs))
    finally:
        for p in (h, b):
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    print(f"decode, {a.tokens} tokens, median of {a.runs}, OMP_WAIT_POLICY=PASSIVE on {a.passive}: COMBINED {comb:.1f} tok/s | SOLO {solo:.1f} tok/s | "
          f"ratio COMBINED/SOLO {comb / solo:.2f}")
    combined_flips = flips[1::2]
    print(f"flip to COMBINED with both models resident: median {statistics.median(combined_flips):.2f} ms "
          f"(max {max(combined_flips):.2f} ms over {len(combined_flips)})")


if __name__ == "__main__":
    main()
