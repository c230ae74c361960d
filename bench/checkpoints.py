"""Context checkpoints on a hybrid model: a multi-turn chat with and without ``--ctx-checkpoints``.

    .venv/bin/python bench/checkpoints.py [--turns 6] [--doc-items 200]

Starts two nodes on the generated random-weight LFM2 hybrid
(:mod:`hydra_trio.models.hybrid`), one with checkpoints (llama-server's
default, 32) and one with ``--ctx-checkpoints 0`` (the behaviour before them:
every turn's prompt diverges from the slot's cache inside the last reply, so
the whole conversation is evaluated again), and runs the same chat on each,
one after the other: a long first user message, then short follow-ups, the
whole conversation resent each turn, greedy.  Reports per node the prompt
tokens evaluated on returning turns and their prompt time (median), and the
ratio of the two; and checks that both nodes wrote the same replies.  The
model is tiny, so absolute times are small; the tokens evaluated carry over
to a real hybrid model, where each costs far more.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.models.hybrid import ensure_test_hybrid  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402


def run_chat(base: str, turns: int, doc: str) -> tuple[list[str], list[dict]]:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read this: " + doc}]
    replies, timings = [], []
    with httpx.Client(base_url=base, timeout=600) as c:
        for t in range(turns):
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
            j = r.json()
            text = j["choices"][0]["message"]["content"]
            replies.append(text)
            timings.append(j["timings"])
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Question {t}: why?"}]
    return replies, timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--doc-items", type=int, default=200, help="length of the first message (about 11 tokens each)")
    a = ap.parse_args()
    model = ensure_test_hybrid(resolve_model("smollm2-135m")[0])
    doc = " ".join(f"Item {i} of the list is worth a note;" for i in range(a.doc_items))
    results = {}
    for name, extra in (("checkpoints", ()), ("none", ("--ctx-checkpoints", "0"))):
        proc, port = spawn(
            "-m", str(model), "-np", "1", "-c", "8192", "--log-level", "WARNING", *extra, output=subprocess.DEVNULL
        )
        try:
            wait_healthy(port, proc)
            results[name] = run_chat(f"http://127.0.0.1:{port}", a.turns, doc)
        finally:
            proc.terminate()
            proc.wait(30)
    same = results["checkpoints"][0] == results["none"][0]
    print(f"{a.turns} turns, first prompt {results['none'][1][0]['prompt_n']} tokens; same replies: {same}")
    print(f"{'node':<12} {'returning-turn prompt tokens (sum)':>36} {'prompt ms (median)':>20}")
    figures = {}
    for name, (_, timings) in results.items():
        back = timings[1:]
        n = sum(t["prompt_n"] for t in back)
        ms = statistics.median(t["prompt_ms"] for t in back)
        figures[name] = (n, ms)
        print(f"{name:<12} {n:>36} {ms:>20.1f}")
    (n1, ms1), (n0, ms0) = figures["checkpoints"], figures["none"]
    print(f"ratio none/checkpoints: tokens {n0 / n1:.1f}x, prompt time {ms0 / ms1:.1f}x")
    if not same:
        sys.exit("the two nodes wrote different replies")


if __name__ == "__main__":
    main()
