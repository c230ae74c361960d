"""Speculative decoding, hydra-trio against llama-server: each ``--spec-type``, same model, same flags, same client.

    .venv/bin/python bench/speculative.py [--rounds 1] [--types none,ngram-simple,...] [--turns 20]
                                          [--tokens 96] [--copy-tokens 400] [--server-flags "-fa off"]
                                          [--json out.json]

The anchor is llama-server built by ``bench/build_llama_server.sh`` from the llama.cpp vendored in the
llama-cpp-python sdist (the same CPU flags; built on first use, cached).  For each type, llama-server and
hydra-trio are started with ``-t 2 -np 1 -c 8192`` and ``--spec-type TYPE`` (``none``: no flag;
``draft-simple``: ``-md`` the default model's q8_0, one vocabulary; ``--server-flags``: more flags for
both, split at spaces), one at a time (the order flips every round), and run three workloads, greedy,
through ``/v1/chat/completions``:

  copy    (a) copying: a ~300-token source file to return with one rename, and a text to quote from; each
          answer may run to ``--copy-tokens`` (400: the whole file, 294 tokens, fits; with the agent's 96 the
          file was cut at a third, which measured mostly how fast a drafter ramps up)
  agent   (b) an agent session replayed: TURNS turns of one tool-call loop (read a file, edit it, run the
          tests) over a growing conversation whose tool results repeat earlier files with small changes;
          each turn's request is the conversation so far, answered afresh
  chat    (c) plain chat: short questions with nothing to copy

Each request's decode speed is llama-server's own measure, ``timings.predicted_per_second`` (hydra-trio
reports it the same way), and its drafts ``timings.draft_n`` / ``draft_n_accepted``.  A workload's figure
is the tokens generated over the decode time of all its requests.  Prints a line per workload while it
runs, then the table: tok/s, acceptance rate (accepted / drafted) and mean accepted length (accepted
tokens per verification step, from ``llamacpp:spec_decode_num_*`` of ``/metrics``) per type and server,
with each hydra-trio figure against llama-server with the same type and against hydra-trio without
speculation, and ``suffix`` (hydra-trio's own) against llama-server's best type.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.vs_llama_server import build_anchor  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402
from hydra_trio.testing.spawn import free_port, spawn, wait_healthy  # noqa: E402

LLAMA_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "draft-simple")
TYPES = (*LLAMA_TYPES, "suffix")
WORKLOADS = ("copy", "agent", "chat")

SOURCE = """import csv
import sys
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    count: int
    price: float


def parse_line(line: str) -> Row:
    name, count, price = line.strip().split(",")
    return Row(name=name, count=int(count), price=float(price))


def total(rows: list[Row]) -> float:
    return sum(r.count * r.price for r in rows)


def read_rows(path: str) -> list[Row]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                rows.append(parse_line(line))
    return rows


def report(rows: list[Row]) -> str:
    lines = [f"{r.name:<20} {r.count:>5} {r.price:>8.2f}" for r in rows]
    lines.append(f"{'total':<20} {'':>5} {total(rows):>8.2f}")
    return "\\n".join(lines)


def main() -> None:
    rows = read_rows(sys.argv[1])
    print(report(rows))


if __name__ == "__main__":
    main()
"""

TEXT = (
    "The harbour was quiet in the early morning. Fishing boats rocked gently against the pier, and the "
    "gulls waited on the posts for the first catch to come in.\n\n"
    "By seven the market opened. Traders set out crates of mackerel and herring, and the smell of salt "
    "and diesel hung over the stalls while buyers argued about the price of the day.\n\n"
    "In the afternoon the wind turned, and the boats that had stayed out came back early, their crews "
    "tired and wet, to tie up before the storm reached the coast."
)

SYSTEM = "You are a helpful assistant. Follow the instructions exactly."


def copy_requests() -> list[list[dict[str, str]]]:
    return [
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Here is a file:\n\n{SOURCE}\nRename the function parse_line to parse_row "
                "everywhere. Reply with the whole file and nothing else.",
            },
        ],
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{TEXT}\n\nQuote the second paragraph of the text above exactly."},
        ],
    ]


def agent_session(turns: int) -> list[list[dict[str, str]]]:
    """The conversation before each of ``turns`` assistant turns of a read-edit-test loop; the tool results
    repeat the file with one more change each time."""
    messages: list[dict[str, str]] = [
        {
            "role": "system",
            "content": SYSTEM + " You work on a repository with tools. Call one tool per turn as "
            'JSON: {"tool": NAME, "args": {...}}.',
        },
        {"role": "user", "content": "Make report() print the rows sorted by name, then run the tests."},
    ]
    out = []
    source = SOURCE
    for t in range(turns):
        out.append(list(messages))
        step = t % 3
        if step == 0:
            call = {"tool": "read_file", "args": {"path": "report.py"}}
            result = source
        elif step == 1:
            old = '    lines = [f"{r.name:<20} {r.count:>5} {r.price:>8.2f}" for r in rows]'
            new = old.replace("for r in rows]", f"for r in sorted(rows, key=lambda r: r.name)]  # pass {t}")
            source = source.replace(old, new) if old in source else source + f"\n# pass {t}\n"
            call = {"tool": "edit_file", "args": {"path": "report.py", "old": old, "new": new}}
            result = "ok"
        else:
            call = {"tool": "run_tests", "args": {"path": "tests/"}}
            result = f"collected 12 items\n\ntests/test_report.py ....F.......\n\nFAILED test_sorted (turn {t})"
        messages.append({"role": "assistant", "content": json.dumps(call)})
        messages.append({"role": "user", "content": f"Tool result:\n{result}"})
    return out


CHAT = [
    "What is the capital of France? Answer in one word.",
    "Name three colours.",
    "Why is the sky blue? One sentence.",
    "Write a haiku about autumn.",
]


def workload(name: str, turns: int) -> list[list[dict[str, str]]]:
    """The requests of workload ``name`` (one of :data:`WORKLOADS`).  Raises ValueError: another name."""
    if name == "copy":
        return copy_requests()
    if name == "agent":
        return agent_session(turns)
    if name == "chat":
        return [[{"role": "user", "content": q}] for q in CHAT]
    raise ValueError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")


def names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    """The comma list ``text`` (empty items dropped).  Raises argparse.ArgumentTypeError: a name not in
    ``known``, or none at all."""
    got = [t for t in text.split(",") if t]
    bad = [t for t in got if t not in known]
    if bad or not got:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad) or '(none given)'}: one of {', '.join(known)}"
        )
    return got


def spec_args(kind: str, draft: Path) -> list[str]:
    if kind == "none":
        return []
    if kind == "draft-simple":
        return ["--spec-type", "draft-simple", "-md", str(draft)]
    return ["--spec-type", kind]


def start_llama(binary: Path, model: Path, kind: str, draft: Path, flags: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "2",
            "-np",
            "1",
            "-c",
            "8192",
            "--no-webui",
            "--metrics",
            *spec_args(kind, draft),
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_healthy(port, proc, timeout=300)
    return proc, port


def start_hydra(entry: str, draft: Path, flags: list[str]) -> tuple[subprocess.Popen, int]:
    """hydra-trio with ``entry``'s type and, after a ``:``, its own flags (``suffix:--spec-budget-row-cost 0``)."""
    kind, _, extra = entry.partition(":")
    proc, port = spawn(
        "-t",
        "2",
        "-np",
        "1",
        "-c",
        "8192",
        "--no-rpc-backend",
        "--log-level",
        "WARNING",
        *spec_args(kind, draft),
        *flags,
        *extra.split(),
        output=subprocess.DEVNULL,
    )
    wait_healthy(port, proc, timeout=300)
    return proc, port


def spec_counters(base: str) -> tuple[float, float]:
    """``(verification steps, accepted tokens)`` from ``/metrics`` (0s where the server has none)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    got = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("llamacpp:spec_decode_num_") and "{" not in line
    }
    return (
        got.get("llamacpp:spec_decode_num_drafts_total", got.get("llamacpp:spec_decode_num_drafts", 0.0)),
        got.get(
            "llamacpp:spec_decode_num_accepted_tokens_total", got.get("llamacpp:spec_decode_num_accepted_tokens", 0.0)
        ),
    )


def run_workload(base: str, requests: list[list[dict[str, str]]], tokens: int) -> dict[str, float]:
    n = ms = draft_n = accepted = 0.0
    steps0, acc0 = spec_counters(base)
    with httpx.Client(timeout=600) as client:
        for messages in requests:
            r = client.post(
                base + "/v1/chat/completions", json={"messages": messages, "max_tokens": tokens, "temperature": 0}
            )
            r.raise_for_status()
            t = r.json()["timings"]
            n += t["predicted_n"]
            ms += t["predicted_ms"]
            draft_n += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
    steps1, acc1 = spec_counters(base)
    steps = steps1 - steps0
    return {
        "tok_s": 1e3 * n / ms if ms else 0.0,
        "tokens": n,
        "draft_n": draft_n,
        "accepted": accepted,
        "acceptance": accepted / draft_n if draft_n else 0.0,
        "mean_accepted": (acc1 - acc0) / steps if steps else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--types",
        default=",".join(TYPES),
        help="comma-separated; a type may carry hydra-trio flags after a colon, e.g. "
        "'suffix:--spec-budget-row-cost 0' (hydra-trio only)",
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda t: names(t, WORKLOADS, "workload"))
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens of the agent and chat requests")
    ap.add_argument("--copy-tokens", type=int, default=400, help="max_tokens of the copy requests")
    ap.add_argument("--server-flags", default="", help="more flags for both servers, e.g. '-fa off'")
    ap.add_argument("--json")
    args = ap.parse_args()
    flags = args.server_flags.split()
    types = [t for t in args.types.split(",") if t]
    unknown = [t for t in types if t.partition(":")[0] not in TYPES]
    if unknown or not types:
        ap.error(f"--types: unknown type {', '.join(unknown) or '(none given)'}: one of {', '.join(TYPES)}")
    model, draft = resolve_model("smollm2-135m")[0], resolve_model("smollm2-135m-q8")[0]
    binary = build_anchor()
    loads = {w: workload(w, args.turns) for w in args.workloads}
    samples: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for rnd in range(args.rounds):
        for kind in types:
            servers = [("hydra-trio", lambda k=kind: start_hydra(k, draft, flags))]
            if kind in LLAMA_TYPES:  # (an entry with hydra-trio's own flags is not one)
                servers.append(("llama-server", lambda k=kind: start_llama(binary, model, k, draft, flags)))
            if rnd % 2:
                servers.reverse()
            for name, start in servers:
                proc, port = start()
                base = f"http://127.0.0.1:{port}"
                try:
                    for w, requests in loads.items():
                        t0 = time.monotonic()
                        got = run_workload(base, requests, args.copy_tokens if w == "copy" else args.tokens)
                        samples.setdefault((kind, name, w), []).append(got)
                        print(
                            f"round {rnd + 1} {kind:<14} {name:<12} {w:<6} {got['tok_s']:7.1f} tok/s  "
                            f"accepted {got['accepted']:.0f}/{got['draft_n']:.0f}  "
                            f"({time.monotonic() - t0:.0f} s)",
                            flush=True,
                        )
                finally:
                    proc.terminate()
                    proc.wait(60)
    med = {k: {f: statistics.median(s[f] for s in v) for f in v[0]} for k, v in samples.items()}
    print(f"\n`bench/speculative.py {' '.join(sys.argv[1:])}` (median of rounds; tok/s: tokens over decode time)\n")
    print(
        "| workload | type | hydra-trio tok/s | llama-server tok/s | vs llama-server | vs no speculation "
        "| acceptance (h / l) | mean accepted (h / l) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for w in loads:
        none = med.get(("none", "hydra-trio", w), {}).get("tok_s")
        for kind in types:
            h = med.get((kind, "hydra-trio", w))
            ll = med.get((kind, "llama-server", w))
            if h is None:
                continue
            vs_l = f"{h['tok_s'] / ll['tok_s']:.2f}" if ll and ll["tok_s"] else ""
            vs_n = f"{h['tok_s'] / none:.2f}" if none else ""
            acc = f"{h['acceptance']:.2f} / {ll['acceptance']:.2f}" if ll else f"{h['acceptance']:.2f} / -"
            mean = f"{h['mean_accepted']:.2f} / {ll['mean_accepted']:.2f}" if ll else f"{h['mean_accepted']:.2f} / -"
            print(
                f"| {w} | {kind} | {h['tok_s']:.1f} | {ll['tok_s']:.1f} | {vs_l} | {vs_n} | {acc} | {mean} |"
                if ll
                else f"| {w} | {kind} | {h['tok_s']:.1f} | - | - | {vs_n} | {acc} | {mean} |"
            )
        best = max(
            (
                med[(k, "llama-server", w)]["tok_s"]
                for k in LLAMA_TYPES
                if k != "none" and (k, "llama-server", w) in med
            ),
            default=None,
        )
        suffix = med.get(("suffix", "hydra-trio", w))
        if best and suffix:
            print(
                f"| {w} | suffix vs llama-server's best type | {suffix['tok_s']:.1f} | {best:.1f} | "
                f"{suffix['tok_s'] / best:.2f} | | | |"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "samples": {"|".join(k): v for k, v in samples.items()},
                    "median": {"|".join(k): v for k, v in med.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
