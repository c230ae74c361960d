"""The host-RAM prompt cache, same run: more chat users than slots, with the cache and without it.

    .venv/bin/python bench/prompt_cache.py [--users 3] [--slots 1] [--turns 3] [--doc-words 40]

Two nodes, one with the default ``--cache-ram`` and one with ``--cache-ram 0``,
serve the same conversations one after the other: each user opens with a
document of their own, then asks short follow-ups, the whole conversation
resent every turn (as chat clients do).  Prints, for each node, the median
time to the first token of returning turns (streamed, measured by the
client), the mean cached tokens of returning turns and the total time, and
the ratios cache-on / cache-off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402

WORDS = ("ship", "lamp", "oak", "river", "stone", "cloud", "wheel", "bell", "glass", "wool", "salt", "rope")


def document(user: int, n: int) -> str:
    w = WORDS[user % len(WORDS)]
    return (
        f"{w.capitalize()} log of user {user}: "
        + " ".join(f"the {w} number {i} rests by the north gate" for i in range(n))
        + " Summarize it."
    )


def turn(c: httpx.Client, messages: list[dict]) -> tuple[float, int, str]:
    """One streamed turn: (seconds to the first content, cached prompt tokens, the reply's text)."""
    t0 = time.perf_counter()
    first, parts, cached = None, [], 0
    body = {
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                if ch["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(ch["delta"]["content"])
            if chunk.get("usage"):
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return (first or time.perf_counter()) - t0, cached, "".join(parts)


def run(base: str, users: int, turns: int, words: int) -> dict:
    convs = [[{"role": "user", "content": document(u, words)}] for u in range(users)]
    ttft, cached, texts = [], [], []
    t0 = time.perf_counter()
    with httpx.Client(base_url=base, timeout=600) as c:
        for t in range(turns):
            for u in range(users):
                s, n, text = turn(c, convs[u])
                texts.append(text)
                if t:
                    ttft.append(s)
                    cached.append(n)
                convs[u] += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    return {
        "ttft_ms": statistics.median(ttft) * 1e3,
        "cached": statistics.mean(cached),
        "total_s": time.perf_counter() - t0,
        "texts": texts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--doc-words", type=int, default=40, help="phrases in each user's opening document")
    a = ap.parse_args()
    results = {}
    for name, extra in (("cache on", ()), ("cache off", ("--cache-ram", "0"))):
        proc, port = spawn(
            "--log-level", "WARNING", "--no-rpc-backend", "-np", str(a.slots), "-c", str(2048 * a.slots), *extra
        )
        try:
            wait_healthy(port, proc, 180)
            results[name] = run(f"http://127.0.0.1:{port}", a.users, a.turns, a.doc_words)
        finally:
            proc.terminate()
            proc.wait(60)
    on, off = results["cache on"], results["cache off"]
    print(f"{a.users} users, {a.slots} slot(s), {a.turns} turns")
    for name, r in results.items():
        print(
            f"  {name:9}  returning-turn TTFT {r['ttft_ms']:8.1f} ms  cached {r['cached']:6.1f} tokens  "
            f"total {r['total_s']:6.2f} s"
        )
    print(
        f"  on/off     TTFT {on['ttft_ms'] / off['ttft_ms']:.2f}x  total {on['total_s'] / off['total_s']:.2f}x  "
        f"same texts: {on['texts'] == off['texts']}"
    )


if __name__ == "__main__":
    main()
