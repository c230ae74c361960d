"""Decode throughput of hydra-trio against llama-cpp-python's own ``Llama`` (the peer), same run, same model.

    .venv/bin/python bench/throughput.py [--tokens 128] [--clients 4]

Measures, for greedy generation of N tokens with ignore_eos:
  1. single stream: one HTTP request to a hydra-trio server vs. one
     ``Llama.create_completion`` call in this process;
  2. C concurrent clients: C HTTP streams at once (continuous batching) vs.
     C ``Llama`` calls one after another (the peer has no batching).
Prints tokens/s for each and the ratio hydra-trio / peer.  The server and the
peer run one at a time, so they never share the CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio._spawn import spawn, wait_healthy  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper."


def one_request(base: str, n: int) -> int:
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False},
        timeout=600,
    )
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def bench_server(n: int, clients: int, threads: int) -> tuple[float, float]:
    proc, port = spawn("-np", str(clients), "-t", str(threads), "--log-level", "WARNING")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(port, proc)
        one_request(base, 8)  # warm up
        t0 = time.perf_counter()
        got = one_request(base, n)
        single = got / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            total = sum(pool.map(lambda _: one_request(base, n), range(clients)))
        multi = total / (time.perf_counter() - t0)
        return single, multi
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def bench_peer(n: int, clients: int, threads: int) -> tuple[float, float]:
    import llama_cpp

    path, _ = resolve_model("smollm2-135m")
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, verbose=False)

    eog = {t: -1e30 for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)}

    def run() -> int:  # logit_bias bans end-of-generation, like the server's ignore_eos
        out = llm.create_completion(PROMPT, max_tokens=n, temperature=0, logit_bias=eog)
        return out["usage"]["completion_tokens"]

    llm.create_completion(PROMPT, max_tokens=8, temperature=0)  # warm up
    t0 = time.perf_counter()
    single = run() / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    total = sum(run() for _ in range(clients))
    multi = total / (time.perf_counter() - t0)
    return single, multi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    s1, sm = bench_server(a.tokens, a.clients, a.threads)
    p1, pm = bench_peer(a.tokens, a.clients, a.threads)
    print(f"model smollm2-135m, {a.tokens} tokens per request, {a.threads} threads")
    print(f"single stream : hydra-trio {s1:7.1f} tok/s | llama-cpp-python Llama {p1:7.1f} tok/s | ratio {s1 / p1:.2f}")
    print(
        f"{a.clients} clients     : hydra-trio {sm:7.1f} tok/s | Llama, sequential  {pm:7.1f} tok/s | ratio {sm / pm:.2f}"
    )


if __name__ == "__main__":
    main()
