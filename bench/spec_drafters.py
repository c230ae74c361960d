"""Micro-bench of the model-free drafters on a replayed agent session (no model decode: the "target" is the
recorded text, so a drafted token is accepted when it is the recorded one: oracle acceptance).

    .venv/bin/python bench/spec_drafters.py [--turns 24] [--types ngram-simple,...,suffix] [--ints]

The session: a system prompt with tool definitions, then turns of (user asks, assistant calls a tool with
JSON arguments, the tool answers with a file's lines, the assistant answers by quoting and editing those
lines); files are re-read with small edits, so text repeats across turns as agent traffic does.  It is
tokenized with the default model's vocabulary (``--ints``: random ints from the same generator instead).
Each turn is one request on slot 0: ``begin(prompt)``, then steps of draft -> accept until the recorded
answer is consumed (each step takes the accepted tokens plus one), then ``end``.

Prints per type: µs per step (draft + accept; all steps, the steps past 15k tokens of history, the 99th
percentile), mean
draft length, oracle acceptance (accepted / drafted tokens) and tokens per step (accepted + 1: the
speed-up over plain decoding if verifying were free), and the mean time of a turn's begin + end (the
prompt taken in, the finished request handed over).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.engine.speculative.base import SlotDraft  # noqa: E402
from hydra_trio.engine.speculative.combine import Speculative, make_speculative  # noqa: E402
from hydra_trio.engine.speculative.settings import SpecSettings, apply_option  # noqa: E402

WORDS = (
    "value",
    "count",
    "items",
    "result",
    "config",
    "path",
    "name",
    "index",
    "total",
    "buffer",
    "state",
    "token",
    "slot",
    "batch",
    "cache",
    "limit",
    "offset",
    "request",
    "reply",
    "error",
)


def _file(rng: random.Random, n_lines: int) -> list[str]:
    lines = []
    for i in range(n_lines):
        a, b, c = rng.sample(WORDS, 3)
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(f"def {a}_{b}({c}, {a}=None):")
        elif kind == 1:
            lines.append(f"    {a} = {b}.get('{c}', {rng.randrange(100)})")
        elif kind == 2:
            lines.append(f"    if {a} > {b}: return {c} + {rng.randrange(10)}")
        else:
            lines.append(f"    # {a} {b} {c} for line {i}")
    return lines


def session(turns: int, seed: int = 7) -> list[tuple[str, str]]:
    """``(prompt text added this turn, assistant answer)`` for each turn."""
    rng = random.Random(seed)
    files = {f"src/{w}.py": _file(rng, 30) for w in WORDS[:6]}
    tools = (
        '{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", '
        '"properties": {"path": {"type": "string"}, "offset": {"type": "integer"}}}}}\n'
        '{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", '
        '"properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}\n'
    )
    out = [("system: You are a coding agent. Tools:\n" + tools, "I will read the files first.\n")]
    for t in range(turns):
        path = rng.choice(list(files))
        lines = files[path]
        call = f'{{"name": "read_file", "arguments": {{"path": "{path}", "offset": 0}}}}\n'
        result = "tool: " + "\n".join(lines) + "\n"
        j = rng.randrange(len(lines))  # the edit the assistant makes
        a, b = rng.sample(WORDS, 2)
        edited = lines[:j] + [f"    {a} = {b}  # fixed in turn {t}"] + lines[j + 1 :]
        answer = (
            f'{{"name": "write_file", "arguments": {{"path": "{path}", "content": "'
            + "\\n".join(edited)
            + '"}}\n'
            + f"Done: changed line {j} of {path}.\n"
        )
        files[path] = edited
        out.append((f"user: fix {a} in {path}\nassistant: {call}{result}", answer))
    return out


def tokenizer(ints: bool):
    if ints:
        table: dict[str, int] = {}
        return lambda text: [table.setdefault(w, len(table)) for w in text.replace("\n", " \n ").split(" ")]
    from llama_cpp import Llama

    from hydra_trio.models.presets import DEFAULT_ALIAS, resolve_model

    llm = Llama(model_path=str(resolve_model(DEFAULT_ALIAS)[0]), vocab_only=True, verbose=False)
    return lambda text: llm.tokenize(text.encode(), add_bos=False, special=False)


def replay(spec: Speculative, turns: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    hist: list[int] = []
    steps = late_steps = drafted = accepted = 0
    t_all = t_late = 0.0
    times: list[float] = []
    t_turn = 0.0
    for prompt_add, answer in turns:
        hist += prompt_add
        t0 = time.perf_counter()
        spec.begin(0, hist[:-1])
        t_turn += time.perf_counter() - t0
        pos, id_last = 0, hist[-1]
        tokens = hist[:-1]
        while pos < len(answer):
            sd = SlotDraft(0, spec.n_max, len(tokens) + 1, id_last, tokens)
            t0 = time.perf_counter()
            spec.draft([sd])
            n_acc = 0
            while n_acc < len(sd.result) and pos + n_acc < len(answer) and sd.result[n_acc] == answer[pos + n_acc]:
                n_acc += 1
            if sd.result:
                spec.accept(0, n_acc)
            dt = time.perf_counter() - t0
            steps += 1
            t_all += dt
            times.append(dt)
            if len(tokens) > 15000:
                late_steps += 1
                t_late += dt
            drafted += len(sd.result)
            accepted += n_acc
            tokens.append(id_last)
            tokens += answer[pos : pos + n_acc]
            pos += n_acc
            if pos < len(answer):
                id_last = answer[pos]
                pos += 1
        tokens.append(id_last)
        t0 = time.perf_counter()
        spec.end(0, tokens)
        t_turn += time.perf_counter() - t0
        hist = tokens
    times.sort()
    return {
        "steps": steps,
        "us": 1e6 * t_all / max(1, steps),
        "us_late": 1e6 * t_late / max(1, late_steps),
        "p99": 1e6 * times[int(0.99 * (len(times) - 1))] if times else 0.0,
        "late": late_steps,
        "turn_ms": 1e3 * t_turn / max(1, len(turns)),
        "draft": drafted / max(1, steps),
        "acc": accepted / max(1, drafted),
        "tps": (accepted + steps) / max(1, steps),
        "n_tokens": len(hist),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument(
        "--types", default="ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache,suffix,suffix+ngram-mod"
    )
    ap.add_argument("--ints", action="store_true", help="word ids instead of the model's tokenizer")
    args = ap.parse_args()
    tok = tokenizer(args.ints)
    turns = [(tok(p), tok(a)) for p, a in session(args.turns)]
    total = sum(len(p) + len(a) for p, a in turns)
    print(f"session: {len(turns)} turns, {total} tokens ({sum(len(a) for _, a in turns)} of them answers, replayed)")
    print(
        f"{'type':24s} {'steps':>6s} {'us/step':>8s} {'us>15k':>8s} {'p99 us':>8s} {'draft':>6s} "
        f"{'oracle acc':>10s} {'tok/step':>8s} {'begin+end ms':>12s}"
    )
    for spec_type in args.types.split(","):
        settings = SpecSettings()
        for name in spec_type.split("+"):
            settings = apply_option(settings, "--spec-type", name)
        spec = make_speculative(settings, 1)
        assert spec is not None
        r = replay(spec, turns)
        print(
            f"{spec_type:24s} {r['steps']:6.0f} {r['us']:8.1f} {r['us_late']:8.1f} {r['p99']:8.1f} {r['draft']:6.2f} "
            f"{r['acc']:10.3f} {r['tps']:8.2f} {r['turn_ms']:12.2f}"
        )


if __name__ == "__main__":
    main()
