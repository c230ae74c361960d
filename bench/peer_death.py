"""SOLO decode speed of a COMBINED head before and after its peer dies in the middle of a decode.

    .venv/bin/python bench/peer_death.py [--tokens 64] [--runs 5]

Starts a compute-only node B, a head A with the test MoE (``smollm2-135m-moe``,
``-t 2``) and ``--rpc-engine B``, and a reference head R with the same model
and flags and no peer.  Rounds before: A in SOLO (a flip; the COMBINED model
stays attached), then R, one after the other.  Then A flips to COMBINED, a
long completion starts there, and B is killed (SIGKILL) once it has produced
tokens: the request fails and A falls back to SOLO.  Rounds after: A, then R
again.

A's worker thread stays inside that decode for good (ggml-RPC's dispatcher
aborted); before it frees its OpenMP team (``engine/llama/openmp.py``), libgomp
counts two teams on 2 cores and throttles every barrier of SOLO's.  The row
compares A's speed relative to R after the death with the same before it, so
the machine's drift between the two halves cancels; the target is 0.95.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._decode import tok_s  # noqa: E402
from bench._table import Row, print_table  # noqa: E402
from bench.combined import set_mode, start, wait_combined  # noqa: E402

MOE = ("-m", "smollm2-135m-moe", "-np", "1", "-c", "2048", "--no-rpc-backend", "-t", "2")


def rounds(a: int, r: int, tokens: int, runs: int) -> tuple[list[float], list[float]]:
    """``runs`` rounds of A then R: each head's decode tokens/s."""
    ours, ref = [], []
    for i in range(runs):
        ours.append(tok_s(a, tokens))
        ref.append(tok_s(r, tokens))
        print(f"  round {i + 1}/{runs}: head {ours[-1]:.1f} tok/s, reference {ref[-1]:.1f} tok/s", flush=True)
    return ours, ref


def kill_mid_decode(a: int, peer) -> None:
    """A long completion on A; once A's slot has decoded a token, SIGKILL the peer; wait for the reply."""
    done = threading.Event()

    def run() -> None:
        try:
            httpx.post(
                f"http://127.0.0.1:{a}/v1/completions",
                timeout=300,
                json={"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True},
            )
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 120
    while not any(
        s["is_processing"] and s["n_decoded"] > 0 for s in httpx.get(f"http://127.0.0.1:{a}/slots", timeout=30).json()
    ):
        if time.monotonic() > deadline:
            raise TimeoutError("the COMBINED request produced no token")
        time.sleep(0.05)
    peer.send_signal(signal.SIGKILL)
    if not done.wait(300):
        raise TimeoutError("the request on the dead peer never ended")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    procs = []
    try:
        b, b_port = start("--no-model")
        procs.append(b)
        head, a = start(*MOE, "--rpc-engine", f"127.0.0.1:{b_port}")
        procs.append(head)
        ref, r = start(*MOE)
        procs.append(ref)
        wait_combined(a)
        tok_s(a, 8)  # COMBINED once: the peer worker builds its OpenMP team
        assert set_mode(a, "solo")["mode"] == "solo"
        print("before the peer's death:", flush=True)
        ours_before, ref_before = rounds(a, r, args.tokens, args.runs)
        assert set_mode(a, "combined")["mode"] == "combined"
        print("killing the peer in the middle of a COMBINED decode", flush=True)
        kill_mid_decode(a, b)
        while set_mode(a, "solo")["mode"] != "solo":
            time.sleep(0.5)
        print("after it:", flush=True)
        ours_after, ref_after = rounds(a, r, args.tokens, args.runs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    before = [o / f for o, f in zip(ours_before, ref_before, strict=False)]
    after = [o / f for o, f in zip(ours_after, ref_after, strict=False)]
    print_table(
        [
            Row(
                "peer death",
                "SOLO tok/s (head / reference head), after the peer died mid-decode vs before",
                "x",
                after,
                before,
                target=0.95,
            ),
            Row("peer death", "head SOLO after vs before (raw, drift included)", "tok/s", ours_after, ours_before),
        ],
        "bench/peer_death.py " + " ".join(sys.argv[1:]),
    )
    print(
        f"\nreference head: {statistics.median(ref_before):.1f} tok/s before, {statistics.median(ref_after):.1f} after"
    )


if __name__ == "__main__":
    main()
