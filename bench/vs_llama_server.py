"""hydra-trio against llama-server, side by side: same model, same llama.cpp, same flags, same client.

    .venv/bin/python bench/vs_llama_server.py [--rounds 4] [--tokens 128]
        [--case decode|multiturn|all|idle|vision] [--json out.json]

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

``--case multiturn`` (``all``: both sets) runs chat traffic instead: users who
each open with a ~330-token document of their own (generated, different per
user and round) and then ask short follow-ups, the whole conversation resent
each turn through ``/v1/chat/completions`` (greedy, 24-token replies, 1 opening
and 3 returning turns per user); a client takes its users in turn, so another
user's turn comes between two of one user's:

  multiturn-3   3 users, 1 client, 4 slots (fewer users than slots)
  multiturn-12  12 users, 4 clients of 3 users each, 4 slots (more users than slots)

with total time, the median TTFT of opening and of returning turns, and the
median cached prompt tokens of returning turns (``usage.prompt_tokens_details.cached_tokens``,
else ``timings.cache_n``) with their median and smallest share of the prompt.
llama-server runs with its defaults there too: its host-RAM prompt cache
(``--cache-ram``, 8 GiB) is on.

``--case vision`` serves the generated vision-language pair ``tiny-vision`` (its language model and its
projector, ``-m FILE --mmproj FILE`` for llama-server, ``-m tiny-vision`` for hydra-trio) and runs
:data:`VISION_USERS` users, each sending one picture (448x448, 256 image tokens, different per user and
round) with a short question, then returning with the whole conversation and a follow-up on the same
picture (streaming, greedy, 16-token replies): the median TTFT of the opening and of the returning turn,
and the returning turn's cached prompt tokens (``timings.cache_n``: the picture served from the cache).

``--case idle`` runs no case: each server's VmRSS when it first answers
``/health`` (the ``rss-idle`` row every run has) and again 2 s after one short
chat request (``rss-post-req``), with llama-server / hydra-trio as the ratio
(the target is at least 0.91: hydra-trio within 1.1x of llama-server); a few
seconds per round.  It then splits the gap: this interpreter's RSS alone and
after importing its serving libraries (trio, hypercorn, starlette; a subprocess, no
hydra-trio code), less llama-server's own code that a node does not map
(its binary, ``libllama-common``, ``libllama-server-impl``, ``libmtmd``).

Prompts carry a per-round, per-case nonce at the start, so no case finds
another's prompt in a cache.  Prints a line per measurement while it runs, then
a table of medians (with min–max) and the ratio hydra-trio / llama-server
(higher is better for tok/s and cached tokens; for times the ratio is
llama-server / hydra-trio, so higher is better there too).  ``--json`` writes every sample and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.models.presets import resolve_model  # noqa: E402
from hydra_trio.testing.spawn import SHARED_MACHINE_ENV, free_port, spawn, wait_healthy  # noqa: E402

FILLER = (
    "The lighthouse stood on a rock at the end of the bay, and every night its keeper climbed the "
    "stairs to light the lamp, counting the steps as his father had before him. "
)


def words(n_tokens: int, nonce: str) -> str:
    """About ``n_tokens`` tokens of English prose for SmolLM2's tokenizer, starting with ``nonce``."""
    reps = max(1, n_tokens // 33)  # FILLER is 33 tokens
    return f"[{nonce}] " + FILLER * reps


def build_anchor() -> Path:
    out = subprocess.run([str(ROOT / "bench" / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE, text=True)
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


def llama_server_factory(
    binary: Path, model: Path, threads: int, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()
) -> Any:
    def start() -> tuple[subprocess.Popen, int]:
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
                str(threads),
                "-np",
                "4",
                "-c",
                "8192",
                "-b",
                "512",
                "-ub",
                "512",
                "--no-webui",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env} if env else None,
        )
        return proc, port

    return start


def hydra_factory(threads: int, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> Any:
    def start() -> tuple[subprocess.Popen, int]:
        return spawn(
            "-t",
            str(threads),
            "-np",
            "4",
            "-c",
            "8192",
            "-b",
            "512",
            "--log-level",
            "WARNING",
            *extra,
            output=subprocess.DEVNULL,
            env=env,
        )

    return start


async def sse_events(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST ``body`` to ``url`` and yield each SSE ``data:`` event as parsed JSON (not the ``[DONE]`` line).
    Raises httpx.HTTPStatusError for a non-2xx reply."""
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def one(client: httpx.AsyncClient, base: str, body: dict[str, Any], chat: bool) -> dict[str, float]:
    """One streaming request; returns send, first-token and end times (perf_counter s) and tokens."""
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = {**body, "stream": True, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async for ev in sse_events(client, url, body):
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
            body = (
                {"messages": [{"role": "user", "content": f"[{nonce}] Tell me a long story."}]}
                if chat
                else {"prompt": f"[{nonce}] Once upon a time"}
            )
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
            return {
                "tok_s": sum(r["tokens"] for r in results) / wall,
                "ttft_ms": 1e3 * statistics.median(r["first"] - r["t0"] for r in results),
            }
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
            return {
                "tok_s": sum(r["tokens"] for r in results) / wall,
                "ttft_ms": 1e3 * statistics.median(r["first"] - r["t0"] for r in results),
            }
    raise ValueError(case)


CASES = ["chat-1", "text-1", "chat-4", "chat-8", "long-1500", "prefix-4"]

# ------------------------------------------------------------------ multi-turn chat
VISION_USERS = 4
"""``--case vision``: users per round, one after another."""


async def run_vision(base: str, nonce: str) -> dict[str, float]:
    """:data:`VISION_USERS` users, each an opening turn with a picture and a returning turn on it."""
    import base64

    from hydra_trio.models.tiny_vision import png_image

    opening, back, cached = [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for user in range(VISION_USERS):
            seed = abs(hash((nonce, user))) % 100_000
            url = "data:image/png;base64," + base64.b64encode(png_image(seed, 448, 448)).decode()
            messages: list[dict[str, Any]] = [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": f"({nonce}) What is in this picture?"},
                    ],
                }
            ]
            for turn in range(2):
                body = {"messages": messages, "max_tokens": 16, "stream": True, "temperature": 0, "ignore_eos": True}
                t0, first, text, timings = time.perf_counter(), None, [], {}
                async for ev in sse_events(client, base + "/v1/chat/completions", body):
                    for ch in ev.get("choices") or ():
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            text.append(piece)
                    timings = ev.get("timings") or timings
                ttft = ((first or time.perf_counter()) - t0) * 1000
                if turn == 0:
                    opening.append(ttft)
                    messages = [
                        *messages,
                        {"role": "assistant", "content": "".join(text)},
                        {"role": "user", "content": "And what colour is it?"},
                    ]
                else:
                    back.append(ttft)
                    cached.append(float(timings.get("cache_n", 0)))
    return {
        "ttft_open_ms": statistics.median(opening),
        "ttft_back_ms": statistics.median(back),
        "cached_back": statistics.median(cached),
    }


MULTITURN = {"multiturn-3": (3, 1), "multiturn-12": (12, 4)}
"""Multi-turn cases: (users, clients)."""
TURNS = 4
REPLY_TOKENS = 24
SYSTEM = "You are a helpful assistant. Answer briefly and to the point."  # the same for every user
FOLLOW_UPS = ("What is the main point of the document?", "Who is mentioned in it?", "Give one more detail from it.")
_WORDS = (
    "river harbor market winter garden letter engine village teacher bridge forest station captain "
    "silver morning window doctor island mountain lantern baker orchard council tower museum ferry "
    "valley meadow farmer painter signal library kitchen journey mirror cottage canal festival "
    "storm sailor clock bakery quarry miller weaver chapel pasture glacier beacon merchant"
).split()
_VERBS = "opened carried found repaired painted counted watched built visited crossed measured planted".split()


def document(user: int, nonce: str) -> str:
    """About 330 tokens (SmolLM2's tokenizer) of plain sentences, the same for the same user and nonce,
    different for another (a seeded pseudo-random text)."""
    rng = random.Random(f"{nonce}-{user}")
    sentences = []
    for _ in range(35):
        a, b, c = rng.sample(_WORDS, 3)
        sentences.append(f"The {a} {rng.choice(_VERBS)} the {b} near the {c}.")
    return f"Document {nonce}-{user}: " + " ".join(sentences)


async def chat_turn(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed, greedy chat turn: times (perf_counter s), the reply text, prompt and cached tokens.

    Sent again (timed afresh) when the server closed the pooled keep-alive connection just as it was
    reused (llama-server's HTTP library closes idle ones after 5 s): no byte of a reply had come.
    """
    try:
        return await _chat_turn(client, base, messages)
    except httpx.RemoteProtocolError:
        return await _chat_turn(client, base, messages)


async def _chat_turn(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "messages": messages,
        "max_tokens": REPLY_TOKENS,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, text, prompt, cached = None, [], 0, None
    async for ev in sse_events(client, base + "/v1/chat/completions", body):
        for ch in ev.get("choices") or ():
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
        if ev.get("timings") and cached is None:
            cached = ev["timings"].get("cache_n")
        if ev.get("usage"):
            prompt = ev["usage"]["prompt_tokens"]
            details = ev["usage"].get("prompt_tokens_details") or {}
            if "cached_tokens" in details:
                cached = details["cached_tokens"]
    end = time.perf_counter()
    return {"t0": t0, "first": first or end, "end": end, "text": "".join(text), "prompt": prompt, "cached": cached or 0}


async def run_multiturn(base: str, case: str, nonce: str, progress: str) -> dict[str, float]:
    """Run a multi-turn case against ``base``; its figures (times in ms, cached tokens, shares in %)."""
    n_users, n_clients = MULTITURN[case]
    convs = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": document(u, nonce) + "\n\nSummarize this document in one sentence."},
        ]
        for u in range(n_users)
    ]
    turns: list[tuple[int, dict[str, Any]]] = []
    done = [0]
    tty = sys.stdout.isatty()

    async def client_loop(client: httpx.AsyncClient, users: list[int]) -> None:
        for t in range(TURNS):
            for u in users:
                if t > 0:
                    convs[u].append({"role": "user", "content": FOLLOW_UPS[(t - 1) % len(FOLLOW_UPS)]})
                s = await chat_turn(client, base, convs[u])
                convs[u].append({"role": "assistant", "content": s["text"]})
                turns.append((t, s))
                done[0] += 1
                if tty:
                    print(f"\r  {progress} {case}: {done[0]}/{n_users * TURNS} turns", end="", flush=True)
                elif done[0] % n_users == 0:
                    print(f"  {progress} {case}: {done[0]}/{n_users * TURNS} turns", flush=True)

    t0 = time.perf_counter()
    async with (
        httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=16)) as client,
        trio.open_nursery() as nursery,
    ):
        for c in range(n_clients):
            nursery.start_soon(client_loop, client, list(range(c, n_users, n_clients)))
    total = time.perf_counter() - t0
    if tty:
        print("\r", end="")
    first = [s for t, s in turns if t == 0]
    back = [s for t, s in turns if t > 0]
    shares = [100 * s["cached"] / s["prompt"] for s in back if s["prompt"]]
    return {
        "total_s": total,
        "ttft_first_ms": 1e3 * statistics.median(s["first"] - s["t0"] for s in first),
        "ttft_back_ms": 1e3 * statistics.median(s["first"] - s["t0"] for s in back),
        "cached_back": statistics.median(s["cached"] for s in back),
        "cached_pct": statistics.median(shares) if shares else 0.0,
        "cached_min_pct": min(shares) if shares else 0.0,
    }


STACK_IMPORTS = (
    "import trio, h11, attrs, cattrs, jinja2, prometheus_client, hypercorn.config, "
    "hypercorn.app_wrappers, hypercorn.trio.tcp_server, starlette.applications, starlette.routing, "
    "starlette.responses"
)
"""The serving libraries (trio, hypercorn, starlette) as a node imports them (no hydra-trio code, no llama.cpp)."""

LLAMA_SERVER_OWN = ("llama-server", "libllama-common", "libllama-server-impl", "libmtmd")
"""Mapped files of llama-server's own code, which a hydra-trio node does not map (it shares libllama and ggml)."""


def python_floor_mib() -> tuple[float, float]:
    """VmRSS (MiB) of this interpreter doing nothing, and after importing :data:`STACK_IMPORTS`: the part of
    a hydra-trio node's memory that comes with its runtime and serving libraries before any of its own code."""
    probe = (
        "def rss():\n for l in open('/proc/self/status'):\n  if l.startswith('VmRSS'): return l.split()[1]\n"
        f"a = rss()\n{STACK_IMPORTS}\nprint(a, rss())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]) / 1024, int(out[1]) / 1024


def mapped_rss_mib(pid: int, names: tuple[str, ...]) -> float:
    """Resident MiB of ``pid``'s mappings of files whose base name starts with one of ``names``."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if "-" in first[0] and len(first) >= 5 and ":" in first[3]:  # a mapping's header line
                counting = len(first) > 5 and os.path.basename(first[5].strip()).startswith(names)
            elif counting and first[0] == "Rss:":
                total += int(first[1])
    return total / 1024


OWN_CODE_MIB: list[float] = []
"""llama-server's :data:`LLAMA_SERVER_OWN` resident MiB at idle, per round (``--case idle``)."""

IDLE_SETTLE_S = 2.0
"""``--case idle``: seconds between the warm-up request's end and the second RSS reading."""

HIGHER_IS_BETTER = {"tok_s", "cached_back", "cached_pct", "cached_min_pct"}  # (vision's cached_back too)
"""Metrics whose ratio is hydra-trio / llama-server; the others (times, RSS) are llama-server / hydra-trio."""


def measure(server: Server, n: int, round_no: int, cases: list[str]) -> dict[str, dict[str, float]]:
    base = server.start()
    try:
        out: dict[str, dict[str, float]] = {"rss-idle": {"rss_mib": server.rss_mib()}}
        if "idle" in cases and server.name == "llama-server" and server.proc is not None:
            OWN_CODE_MIB.append(mapped_rss_mib(server.proc.pid, LLAMA_SERVER_OWN))
        if "vision" in cases:
            trio.run(run_vision, base, f"warm-{round_no}")  # warm up (the projector's first encode)
        else:
            trio.run(run_case, base, "chat-1", 8, f"warm-{round_no}")  # warm up
        if "idle" in cases:  # idle again after one request: what a request leaves behind
            time.sleep(IDLE_SETTLE_S)
            out["rss-post-req"] = {"rss_mib": server.rss_mib()}
            print(
                f"  round {round_no} {server.name:12s} rss idle {out['rss-idle']['rss_mib']:.1f} MiB, "
                f"after a request {out['rss-post-req']['rss_mib']:.1f} MiB",
                flush=True,
            )
        for case in cases:
            if case == "idle":
                continue
            if case in MULTITURN:
                out[case] = trio.run(run_multiturn, base, case, f"r{round_no}", f"round {round_no} {server.name}")
            elif case == "vision":
                out[case] = trio.run(run_vision, base, f"r{round_no}")
            else:
                out[case] = trio.run(run_case, base, case, n, f"r{round_no}-{case}")
            shown = "  ".join(f"{k} {v:8.1f}" for k, v in out[case].items())
            print(f"  round {round_no} {server.name:12s} {case:12s} {shown}", flush=True)
        return out
    finally:
        server.stop()


def summarize(samples: dict[str, list[dict[str, dict[str, float]]]]) -> list[dict[str, Any]]:
    rows = []
    for case in samples["hydra-trio"][0]:
        for metric in samples["hydra-trio"][0][case]:
            a = [s[case][metric] for s in samples["llama-server"]]
            b = [s[case][metric] for s in samples["hydra-trio"]]
            ma, mb = statistics.median(a), statistics.median(b)
            if metric in HIGHER_IS_BETTER:
                ratio = mb / ma if ma else float("inf") if mb else 1.0
            else:
                ratio = ma / mb if mb else float("inf")
            rows.append(
                {
                    "case": case,
                    "metric": metric,
                    "llama_server": ma,
                    "llama_server_range": [min(a), max(a)],
                    "hydra_trio": mb,
                    "hydra_trio_range": [min(b), max(b)],
                    "ratio": ratio,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--case",
        choices=["decode", "multiturn", "all", "idle", "vision", *CASES, *MULTITURN],
        default="decode",
        help="the decode cases (default), the multi-turn chat cases, all, one case, or idle: only the "
        "resident memory, at start and again after one short request",
    )
    ap.add_argument(
        "--shared-machine",
        action="store_true",
        help="both servers wait passively at OpenMP barriers (OMP_WAIT_POLICY=PASSIVE): for a machine "
        "other work loads, where spinning threads collapse decode",
    )
    ap.add_argument("--json", type=Path, help="write samples and table here")
    a = ap.parse_args()
    env = SHARED_MACHINE_ENV if a.shared_machine else None
    cases = {"decode": CASES, "multiturn": list(MULTITURN), "all": [*CASES, *MULTITURN]}.get(a.case, [a.case])
    binary = build_anchor()
    model, _ = resolve_model("tiny-vision" if a.case == "vision" else "smollm2-135m")
    ls_extra: tuple[str, ...] = ()
    ht_extra: tuple[str, ...] = ()
    if a.case == "vision":
        from hydra_trio.models.presets import PRESETS

        ls_extra, ht_extra = ("--mmproj", str(PRESETS["tiny-vision"].projector())), ("-m", "tiny-vision")
    print(
        f"anchor {binary}\nmodel {model}\n-t {a.threads} -np 4 -c 8192 -b 512, {a.tokens} tokens, "
        f"{a.rounds} rounds, cases {' '.join(cases)}{', OMP_WAIT_POLICY=PASSIVE' if env else ''}",
        flush=True,
    )
    servers = [
        Server("llama-server", llama_server_factory(binary, model, a.threads, env, ls_extra)),
        Server("hydra-trio", hydra_factory(a.threads, env, ht_extra)),
    ]
    samples: dict[str, list[Any]] = {s.name: [] for s in servers}
    for r in range(a.rounds):
        for s in servers if r % 2 == 0 else servers[::-1]:
            samples[s.name].append(measure(s, a.tokens, r, cases))
    rows = summarize(samples)
    print(f"\n{'case':12s} {'metric':14s} {'llama-server':>22s} {'hydra-trio':>22s} {'ratio':>6s}")
    for row in rows:
        ls, ht = row["llama_server_range"], row["hydra_trio_range"]
        print(
            f"{row['case']:12s} {row['metric']:14s} {row['llama_server']:8.1f} ({ls[0]:6.1f}-{ls[1]:6.1f}) "
            f"{row['hydra_trio']:8.1f} ({ht[0]:6.1f}-{ht[1]:6.1f}) {row['ratio']:6.2f}"
        )
    print(
        "ratio: hydra-trio / llama-server for tok/s and cached tokens, llama-server / hydra-trio for times and rss "
        "(higher is better)"
    )
    for case, when in (("rss-idle", "idle"), ("rss-post-req", "idle after a request")):
        rss = next((r for r in rows if r["case"] == case), None)
        if rss is not None:
            print(
                f"{when} RSS, 4 slots: hydra-trio {rss['hydra_trio']:.1f} MiB, llama-server "
                f"{rss['llama_server']:.1f} MiB ({rss['hydra_trio'] - rss['llama_server']:+.1f} MiB), "
                f"llama-server / hydra-trio {rss['ratio']:.3f} (target >= 0.91, i.e. at most 1.1x)"
            )
    idle = next((r for r in rows if r["case"] == "rss-idle"), None)
    if idle is not None and OWN_CODE_MIB:
        bare, stack = python_floor_mib()
        own = statistics.median(OWN_CODE_MIB)
        allowed = 0.1 * idle["llama_server"]
        print(
            f"where the idle gap comes from: this Python alone {bare:.1f} MiB, with its serving "
            f"libraries {stack:.1f} MiB (no hydra-trio code, no llama.cpp); llama-server's own code that a node "
            f"does not map ({', '.join(LLAMA_SERVER_OWN)}) {own:.1f} MiB; so the runtime and libraries take "
            f"{stack - own:+.1f} MiB net of the {allowed:.1f} MiB that 1.1x allows, leaving "
            f"{allowed - (stack - own):.1f} MiB for hydra-trio's own modules and data "
            f"(the rest of the gap: {idle['hydra_trio'] - idle['llama_server'] - (stack - own):.1f} MiB)"
        )
    if a.json:
        a.json.write_text(
            json.dumps({"args": vars(a) | {"json": str(a.json)}, "samples": samples, "table": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
