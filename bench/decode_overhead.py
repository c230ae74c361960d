"""Per-token overhead of a decode: this tree against another commit of hydra-trio, same run.

    .venv/bin/python bench/decode_overhead.py [--against main] [--rounds 3] [--clients 4] [--tokens 128]

Starts a node of this working tree and one of ``--against`` (a git ref, checked
out with ``git archive`` into a temporary folder), one after the other with
``-t 2 -np 4 -c 8192 -b 512``, alternating the order each round, and runs
``--clients`` concurrent streaming chats of ``--tokens`` tokens (greedy,
``ignore_eos``) on each.  Per node and round it prints:

  tok/s      aggregate decode speed the clients saw
  decode %   the share of the run's wall time the engine spent inside
             ``llama_decode`` (``/metrics``: ``prompt_seconds`` +
             ``tokens_predicted_seconds``, which time the call itself); the
             rest is per-step work outside it (sampling, the hand-over to
             trio, waiting for the GIL after the call)
  cpu ms/tok the node process's CPU time (user + system, all threads) per
             generated token; the ``llama_decode`` work is the same for both
             trees, so the difference is overhead
  trio ms/tok the same for the main thread alone (the trio loop: HTTP, SSE
             framing, events), which competes with decode for the cores

then medians and the ratios (this tree / the other).  CPU time per token is
the steadiest figure on a machine other work loads (wall-clock figures move
with the load); servers run with ``OMP_WAIT_POLICY=PASSIVE`` (see
:data:`hydra_trio.testing.spawn.SHARED_MACHINE_ENV`) unless ``--spin``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.testing.spawn import SHARED_MACHINE_ENV, free_port, wait_healthy  # noqa: E402


def cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from a ``/proc/PID/stat`` (or ``/proc/PID/task/TID/stat``) file."""
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid``: all its threads, and its main thread (trio's: HTTP, SSE, events)."""
    return cpu_seconds(f"/proc/{pid}/stat"), cpu_seconds(f"/proc/{pid}/task/{pid}/stat")


def decode_seconds(base: str) -> float:
    """Seconds the engine spent in ``llama_decode`` so far (``/metrics``, prompt + predicted)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    total = 0.0
    for name in ("llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"):
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        total += float(m.group(1)) if m else 0.0
    return total


async def chats(base: str, k: int, n: int, nonce: str) -> tuple[float, int]:
    """``k`` concurrent streaming chats of ``n`` tokens; returns (wall seconds, tokens generated)."""
    done: list[int] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"[{nonce}-{i}] Tell me a long story about number {i}."}],
            "max_tokens": n,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        done.append(usage["completion_tokens"])

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client, trio.open_nursery() as nursery:
        for i in range(k):
            nursery.start_soon(one, client, i)
    return time.perf_counter() - t0, sum(done)


def tree_of(ref: str, into: Path) -> Path:
    """Commit ``ref`` of this repository, unpacked into ``into`` (``git archive``)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_node(tree: Path, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), **({} if args.spin else SHARED_MACHINE_ENV)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hydra_trio",
            "run",
            "--port",
            str(port),
            "-t",
            str(args.threads),
            "-np",
            "4",
            "-c",
            "8192",
            "-b",
            "512",
            "--log-level",
            "WARNING",
        ],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(port, proc, timeout=300)
        trio.run(chats, base, args.clients, 8, f"warm{round_no}")
        d0, (c0, t0) = decode_seconds(base), cpu(proc.pid)
        wall, tokens = trio.run(chats, base, args.clients, args.tokens, f"r{round_no}")
        d1, (c1, t1) = decode_seconds(base), cpu(proc.pid)
        return {
            "tok_s": tokens / wall,
            "decode_pct": 100 * (d1 - d0) / wall,
            "cpu_ms_tok": 1e3 * (c1 - c0) / tokens,
            "trio_ms_tok": 1e3 * (t1 - t0) / tokens,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="main", help="git ref to compare with (default main)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--spin", action="store_true", help="leave OpenMP's default (spinning) wait policy")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hydra-bench-") as tmp:
        trees = {"this tree": ROOT, args.against: tree_of(args.against, Path(tmp))}
        print(f"{args.clients} clients x {args.tokens} tokens, -t {args.threads}, {args.rounds} rounds", flush=True)
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        order = list(trees)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                s = run_node(trees[name], args, r)
                samples[name].append(s)
                print(f"  round {r} {name:12s} " + "  ".join(f"{k} {v:7.2f}" for k, v in s.items()), flush=True)
    mine, other = samples["this tree"], samples[args.against]
    print(f"\n{'metric':10s} {args.against:>10s} {'this tree':>10s} {'ratio':>6s}")
    for metric in mine[0]:
        a = statistics.median(s[metric] for s in other)
        b = statistics.median(s[metric] for s in mine)
        print(f"{metric:11s} {a:10.2f} {b:10.2f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
