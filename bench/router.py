"""Router mode against llama-server's router, side by side: the same preset file, the same client.

    .venv/bin/python bench/router.py [--rounds 3] [--threads 1] [--settle 0] [--json out.json]

The preset names three models by their GGUF files (llama-server reads files): ``q4`` (``smollm2-135m``, the
project's default model), ``q8`` (its Q8_0) and ``moe`` (the test MoE made from it), with ``c = 2048`` and
``np = 1`` for all; both routers run with ``--models-max 1``.  The anchor is llama-server built by
``bench/build_llama_server.sh`` from the llama.cpp vendored in the llama-cpp-python sdist that hydra-trio runs
on (built on first use, cached).

Each round starts one router, measures, stops it, then does the same with the other (the order flips every
round, so a busy machine's drift hits both):

  load                 ``POST /models/load`` of ``q4`` until ``GET /models`` says ``loaded``
  unload               ``POST /models/unload`` until ``unloaded`` (``q4``, then ``moe`` at the end)
  autoload             a streaming chat for ``q4`` while nothing runs: time to its first token
  switch q4→q8 (load)  ``POST /models/load`` of the other quantization while one is loaded, until ``loaded``
                       (hydra-trio: SWAP_QUANT in the running child; llama-server: stop the child, start another);
                       the child's first switch to that file
  switch back (load)   the same, back to ``q4``: a quantization the child served before (hydra-trio keeps it
                       without its context, so the switch loads no file)
  switch q4↔q8 (chat)  the same switch by a streaming chat for the other one (both served before): time to its
                       first token
  switch moe (chat)    a streaming chat for ``moe`` while ``q4`` is loaded: both restart (another model)

Each chat's prompt starts with a nonce (no prompt cache helps either side) and asks for 4 tokens.

``--settle S`` leaves both routers idle S seconds after they start and after each case (default 0: the cases
back to back).  hydra-trio's router forks each child from its warm fork server (``cli/fork_server.py``), ready
again right after each fork, so settled and back to back should measure alike.

``GET /models`` is polled every 5 ms.  Prints a line per measurement while it runs (a bar on a terminal), then
the medians (min-max) with llama-server / hydra-trio as the ratio (a speedup: higher is better); the in-place
switch's target is 3x.  A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._table import Row, print_table  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402
from hydra_trio.observability import progress  # noqa: E402
from hydra_trio.testing.spawn import SHARED_MACHINE_ENV, free_port, spawn, wait_healthy  # noqa: E402

POLL_S = 0.005
MODELS = {"q4": "smollm2-135m", "q8": "smollm2-135m-q8", "moe": "smollm2-135m-moe"}
CASES = (
    "load",
    "unload",
    "autoload",
    "switch q4→q8 (load)",
    "switch back (load)",
    "switch q4↔q8 (chat)",
    "switch moe (chat)",
)
TARGETS = {"switch q4→q8 (load)": 3.0, "switch back (load)": 3.0, "switch q4↔q8 (chat)": 3.0}


def preset_text() -> str:
    sections = "".join(f"[{name}]\nmodel = {resolve_model(alias)[0]}\n\n" for name, alias in MODELS.items())
    return f"version = 1\n\n[*]\nc = 2048\nnp = 1\n\n{sections}"


def build_anchor() -> Path:
    out = subprocess.run([str(ROOT / "bench" / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class RouterUnderTest:
    """One router process: ``hydra-trio`` (``python -m hydra_trio``) or ``llama-server``, on a free port."""

    def __init__(self, name: str, preset: Path, threads: int, anchor: Path) -> None:
        self.name = name
        flags = ["--models-preset", str(preset), "--models-max", "1", "-t", str(threads)]
        if name == "hydra-trio":
            self.proc, self.port = spawn(*flags, output=subprocess.DEVNULL, env=SHARED_MACHINE_ENV)
        else:
            self.port = free_port()
            self.proc = subprocess.Popen(
                [str(anchor), "--host", "127.0.0.1", "--port", str(self.port), *flags],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        # a connection per request: llama-server's router closed a request sent on a connection kept alive
        # after a streamed reply without answering it
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}", timeout=300, limits=httpx.Limits(max_keepalive_connections=0)
        )
        wait_healthy(self.port, self.proc, timeout=300)

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def status(self, model: str) -> str:
        data = self.http.get("/models").json()["data"]
        return str(next(m for m in data if m["id"] == model)["status"]["value"])

    def wait_status(self, model: str, value: str, t0: float) -> float:
        """Milliseconds from ``t0`` until ``model``'s status is ``value``."""
        while self.status(model) != value:
            if time.perf_counter() - t0 > 300:
                raise TimeoutError(f"{self.name}: {model} not {value} after 300 s")
            time.sleep(POLL_S)
        return (time.perf_counter() - t0) * 1e3

    def post(self, path: str, model: str) -> None:
        r = self.http.post(path, json={"model": model})
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: {path} {model}: {r.status_code} {r.text}")

    def load(self, model: str) -> float:
        t0 = time.perf_counter()
        self.post("/models/load", model)
        return self.wait_status(model, "loaded", t0)

    def unload(self, model: str) -> float:
        t0 = time.perf_counter()
        self.post("/models/unload", model)
        return self.wait_status(model, "unloaded", t0)

    def first_token(self, model: str, nonce: str) -> float:
        """Milliseconds from a streaming chat for ``model`` to its first content token (the reply read to its end)."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"[{nonce}] Say hello."}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        t0 = time.perf_counter()
        first = None
        with self.http.stream("POST", "/v1/chat/completions", json=body) as s:
            if s.status_code != 200:
                raise RuntimeError(f"{self.name}: chat {model}: {s.status_code} {s.read()!r}")
            for line in s.iter_lines():
                if (
                    first is None
                    and line.startswith("data: {")
                    and json.loads(line[6:])["choices"][0]["delta"].get("content")
                ):
                    first = (time.perf_counter() - t0) * 1e3
        if first is None:
            raise RuntimeError(f"{self.name}: chat {model}: no token")
        return first


def one_round(
    name: str, preset: Path, threads: int, anchor: Path, r: int, say: Any, settle: float = 0.0
) -> dict[str, list[float]]:
    """Every case once on a fresh router, ``settle`` seconds idle before each; ``{case: [ms, ...]}``."""
    out: dict[str, list[float]] = {c: [] for c in CASES}
    router = RouterUnderTest(name, preset, threads, anchor)
    try:

        def note(case: str, ms: float, what: str) -> None:
            out[case].append(ms)
            say(f"round {r + 1} {name:>12}: {case:<14} {ms:8.1f} ms  ({what})")
            time.sleep(settle)

        time.sleep(settle)

        note("load", router.load("q4"), "q4")
        note("unload", router.unload("q4"), "q4")
        note("autoload", router.first_token("q4", f"{r}-a"), "q4, nothing running")
        note("switch q4→q8 (load)", router.load("q8"), "q4 -> q8, until loaded")
        note("switch back (load)", router.load("q4"), "q8 -> q4, until loaded")
        note("switch q4↔q8 (chat)", router.first_token("q8", f"{r}-b"), "q4 -> q8, first token")
        note("switch q4↔q8 (chat)", router.first_token("q4", f"{r}-c"), "q8 -> q4, first token")
        note("switch moe (chat)", router.first_token("moe", f"{r}-d"), "q4 -> moe, first token")
        note("unload", router.unload("moe"), "moe")
    finally:
        router.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per router (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="-t of every child (default 1)")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds both routers stay idle after starting and after each case (default 0: back to back)",
    )
    ap.add_argument("--json", type=Path, help="write every sample and the table's figures here")
    a = ap.parse_args()
    anchor = build_anchor()
    samples: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CASES} for n in ("hydra-trio", "llama-server")}
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "models.ini"
        preset.write_text(preset_text())
        with progress.step("router bench", total=2 * a.rounds, unit="runs") as bar:
            for r in range(a.rounds):
                order = ("hydra-trio", "llama-server") if r % 2 == 0 else ("llama-server", "hydra-trio")
                for name in order:
                    for case, values in one_round(name, preset, a.threads, anchor, r, print, a.settle).items():
                        samples[name][case] += values
                    bar.advance()
    rows = [
        Row(
            "router",
            case,
            "ms",
            samples["hydra-trio"][case],
            samples["llama-server"][case],
            higher_is_better=False,
            target=TARGETS.get(case),
        )
        for case in CASES
        if samples["hydra-trio"][case] and samples["llama-server"][case]
    ]
    print_table(rows, "bench/router.py " + " ".join(sys.argv[1:]))
    if a.json:
        a.json.write_text(json.dumps({"samples": samples, "ratios": {r.case: r.ratio for r in rows}}, indent=1))


if __name__ == "__main__":
    main()
