"""hydra-trio against llama-server, side by side: same model, same llama.cpp, same flags, same client.

    .venv/bin/python bench/vs_llama_server.py [--rounds 4] [--tokens 128] [--json out.json]

The anchor is llama-server built by ``bench/build_llama_server.sh`` from the
llama.cpp vendored in the llama-cpp-python sdist that hydra-trio runs on, with
the same CPU flags (built on first use, about 10 minutes on 2 cores, cached).

Both servers get ``-t THREADS -np 4 -c 8192 -b 512`` (llama-server also
``-ub 512``, which hydra-trio's single batch size implies).  Each round starts
llama-server, runs every case, stops it, then does the same for hydra-trio
(the order flips every round), so the two never share the CPU and a round's
drift hits both.  Cases, all greedy with ``ignore_eos``:

  chat-1      1 streaming chat request, TOKENS tokens: decode tok/s, TTFT
  text-1      1 streaming completions request: decode tok/s, TTFT
  chat-4      4 concurrent streaming chats: aggregate tok/s, median TTFT
  chat-8      8 concurrent on 4 slots: aggregate tok/s, median TTFT
  long-1500   1 request with a ~1,500-token prompt, 16 tokens: TTFT (prefill)
  prefix-4    4 concurrent chats sharing a ~1,000-token system prompt, with
              different questions, 32 tokens each: wall time as tok/s, TTFT

Prompts carry a per-round, per-case nonce at the start, so no case finds
another's prompt in a cache.  Prints a line per measurement while it runs, then
a table of medians (with min–max) and the ratio hydra-trio / llama-server
(higher is better for tok/s; for TTFT the ratio is llama-server / hydra-trio,
so higher is better there too).  ``--json`` writes every sample and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio._spawn import free_port, spawn, wait_healthy  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402

FILLER = (
    "The lighthouse stood on a rock at the end of the bay, and every night its keeper climbed the "
    "stairs to light the lamp, counting the steps as his father had before him. "
)


def words(n_tokens: int, nonce: str) -> str:
    """About ``n_tokens`` tokens of English prose for SmolLM2's tokenizer, starting with ``nonce``."""
    reps = max(1, n_tokens // 33)  # FILLER is 33 tokens
    return f"[{nonce}] " + FILLER * reps


def build_anchor() -> Path:
    out = subprocess.run([str(ROOT / "bench" / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class Server:
    """One server process under test: ``start()`` waits for ``/health``; ``stop()`` sends SIGTERM."""

    def __init__(self, name: str, argv_fn: Any) -> None:
        self.name, self.argv_fn = name, argv_fn
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> str:
        self.proc, self.port = self.argv_fn()
        wait_healthy(self.port, self.proc, timeout=300)
        return f"http://127.0.0.1:{self.port}"

    def rss_mib(self) -> float:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def llama_server_factory(binary: Path, model: Path, threads: int) -> Any:
    def start() -> tuple[subprocess.Popen, int]:
        port = free_port()
        proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
             "-np", "4", "-c", "8192", "-b", "512", "-ub", "512", "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        return proc, port
    return start


def hydra_factory(threads: int) -> Any:
    def start() -> tuple[subprocess.Popen, int]:
        return spawn("-t", str(threads), "-np", "4", "-c", "8192", "-b", "512", "--log-level", "WARNING",
                     output=subprocess.DEVNULL)
    return start


async def one(client: httpx.AsyncClient, base: str, body: dict[str, Any], chat: bool) -> dict[str, float]:
    """One streaming request; returns send, first-token and end times (perf_counter s) and tokens."""
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = {**body, "stream": True, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or ():
                text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                if text and first is None:
                    first = time.perf_counter()
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"t0": t0, "first": first or end, "end": end, "tokens": tokens}


async def run_case(base: str, case: str, n: int, nonce: str) -> dict[str, float]:
    """Run one case against ``base``; returns its figures (tok/s and TTFT in ms)."""
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        if case in ("chat-1", "text-1"):
            chat = case == "chat-1"
            body = ({"messages": [{"role": "user", "content": f"[{nonce}] Tell me a long story."}]} if chat
                    else {"prompt": f"[{nonce}] Once upon a time"})
            s = await one(client, base, {**body, "max_tokens": n}, chat)
            return {"tok_s": (s["tokens"] - 1) / (s["end"] - s["first"]), "ttft_ms": 1e3 * (s["first"] - s["t0"])}
        if case in ("chat-4", "chat-8"):
            k = int(case[-1])
            results: list[dict[str, float]] = []

            async def go(i: int) -> None:
                msg = [{"role": "user", "content": f"[{nonce}-{i}] Tell me a long story about number {i}."}]
                results.append(await one(client, base, {"messages": msg, "max_tokens": n}, True))

            async with trio.open_nursery() as nursery:
                for i in range(k):
                    nursery.start_soon(go, i)
            wall = max(r["end"] for r in results) - min(r["t0"] for r in results)
            return {"tok_s": sum(r["tokens"] for r in results) / wall,
                    "ttft_ms": 1e3 * statistics.median(r["first"] - r["t0"] for r in results)}
        if case == "long-1500":
            msg = [{"role": "user", "content": words(1500, nonce) + "\nSummarize."}]
            s = await one(client, base, {"messages": msg, "max_tokens": 16}, True)
            return {"ttft_ms": 1e3 * (s["first"] - s["t0"])}
        if case == "prefix-4":
            system = words(1000, nonce)
            results = []

            async def ask(i: int) -> None:
                msg = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: why?"}]
                results.append(await one(client, base, {"messages": msg, "max_tokens": 32}, True))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(ask, i)
            wall = max(r["end"] for r in results) - min(r["t0"] for r in results)
            return {"tok_s": sum(r["tokens"] for r in results) / wall,
                    "ttft_ms": 1e3 * statistics.median(r["first"] - r["t0"] for r in results)}
    raise ValueError(case)


CASES = ["chat-1", "text-1", "chat-4", "chat-8", "long-1500", "prefix-4"]


def measure(server: Server, n: int, round_no: int) -> dict[str, dict[str, float]]:
    base = server.start()
    try:
        out: dict[str, dict[str, float]] = {"rss-idle": {"rss_mib": server.rss_mib()}}
        trio.run(run_case, base, "chat-1", 8, f"warm-{round_no}")  # warm up
        for case in CASES:
            out[case] = trio.run(run_case, base, case, n, f"r{round_no}-{case}")
            shown = "  ".join(f"{k} {v:8.1f}" for k, v in out[case].items())
            print(f"  round {round_no} {server.name:12s} {case:10s} {shown}", flush=True)
        return out
    finally:
        server.stop()


def summarize(samples: dict[str, list[dict[str, dict[str, float]]]]) -> list[dict[str, Any]]:
    rows = []
    for case in ["rss-idle", *CASES]:
        for metric in samples["hydra-trio"][0][case]:
            a = [s[case][metric] for s in samples["llama-server"]]
            b = [s[case][metric] for s in samples["hydra-trio"]]
            ma, mb = statistics.median(a), statistics.median(b)
            better_high = metric == "tok_s"
            ratio = mb / ma if better_high else ma / mb
            rows.append({"case": case, "metric": metric, "llama_server": ma, "llama_server_range": [min(a), max(a)],
                         "hydra_trio": mb, "hydra_trio_range": [min(b), max(b)], "ratio": ratio})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="write samples and table here")
    a = ap.parse_args()
    binary = build_anchor()
    model, _ = resolve_model("smollm2-135m")
    print(f"anchor {binary}\nmodel {model}\n-t {a.threads} -np 4 -c 8192 -b 512, {a.tokens} tokens, "
          f"{a.rounds} rounds", flush=True)
    servers = [Server("llama-server", llama_server_factory(binary, model, a.threads)),
               Server("hydra-trio", hydra_factory(a.threads))]
    samples: dict[str, list[Any]] = {s.name: [] for s in servers}
    for r in range(a.rounds):
        for s in (servers if r % 2 == 0 else servers[::-1]):
            samples[s.name].append(measure(s, a.tokens, r))
    rows = summarize(samples)
    print(f"\n{'case':10s} {'metric':8s} {'llama-server':>22s} {'hydra-trio':>22s} {'ratio':>6s}")
    for row in rows:
        ls, ht = row["llama_server_range"], row["hydra_trio_range"]
        print(f"{row['case']:10s} {row['metric']:8s} {row['llama_server']:8.1f} ({ls[0]:6.1f}-{ls[1]:6.1f}) "
              f"{row['hydra_trio']:8.1f} ({ht[0]:6.1f}-{ht[1]:6.1f}) {row['ratio']:6.2f}")
    print("ratio: hydra-trio / llama-server for tok/s, llama-server / hydra-trio for ttft and rss (higher is better)")
    rss = next(r for r in rows if r["case"] == "rss-idle")
    print(f"idle RSS, 4 slots: hydra-trio {rss['hydra_trio'] - rss['llama_server']:+.0f} MiB against llama-server")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "samples": samples, "table": rows},
                                     indent=1))


if __name__ == "__main__":
    main()
