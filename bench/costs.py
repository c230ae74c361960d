"""What refusing costs.

    .venv/bin/python bench/costs.py [--ctx 8192]

Starts a node (1 slot) and prints: the time to refuse the 100M-minItems schema
and the node's RSS before/after; then for chat bodies of 10k/20k/40k one-word
messages (over the message limit or the slot's context: each a 400) the time
per request and per message, and the same on the engine's tokenizer alone
(10k/20k/40k messages rendered and tokenized without a limit), to show that
the cost grows linearly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    proc, port = spawn("-np", "1", "-c", str(args.ctx), output=open(ROOT / ".bench-costs.log", "wb"))
    try:
        wait_healthy(port, proc)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=600) as c:
            msgs = [{"role": "user", "content": "x"}]
            c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
            schema = {"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000}
            before = rss(proc.pid)
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "json_schema": schema})
            dt = time.perf_counter() - t0
            print(
                f"minItems 100M schema: {r.status_code} in {dt * 1e3:.1f} ms, RSS {before / 2**20:.0f} -> "
                f"{rss(proc.pid) / 2**20:.0f} MiB (delta {(rss(proc.pid) - before) / 2**20:+.1f} MiB): "
                f"{r.json()['error']['message']}"
            )
            for n in (5_000, 10_000, 20_000, 40_000):
                body = {"messages": [{"role": "user", "content": "hi"}] * n, "max_tokens": 1}
                t0 = time.perf_counter()
                r = c.post("/v1/chat/completions", json=body)
                dt = time.perf_counter() - t0
                print(
                    f"{n:6d} messages: {r.status_code} in {dt * 1e3:7.1f} ms ({dt / n * 1e6:6.1f} us/message): "
                    f"{r.json()['error']['message'][:90]}"
                )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    # the tokenizer alone, no limit: linear in the messages
    from hydra_trio.engine.llama.model import LoadedModel
    from hydra_trio.engine.llama.tokenize import tokenize_bytes
    from hydra_trio.models.presets import smollm2_path

    m = LoadedModel(smollm2_path(), n_ctx=256, n_parallel=1, n_batch=32, n_threads=1)
    m.special_tokens  # noqa: B018  (read once, as the first request does)
    for n in (10_000, 20_000, 40_000):
        prompt, _ = m.apply_chat_template([{"role": "user", "content": "hi"}] * n)
        t0 = time.perf_counter()
        toks = m.chat_prompt_tokens(prompt)
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        single = tokenize_bytes(m.vocab, prompt.encode(), False, True) if n <= 20_000 else None
        ds = time.perf_counter() - t0
        same = (
            ""
            if single is None
            else f", one llama_tokenize call {ds:6.2f} s (same tokens: {single == toks[-len(single) :]})"
        )
        print(f"tokenize {n:6d} messages ({len(toks)} tokens): {dt:6.2f} s ({dt / n * 1e6:5.1f} us/message){same}")
    m.close()


if __name__ == "__main__":
    main()
