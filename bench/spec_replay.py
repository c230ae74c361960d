"""Speculative decoding replayed: the node's drafters and draft budget over recorded greedy answers, timed
with this machine's measured decode cost, against what no cut and a perfect cut would give, and the most any
drafter that copies earlier text could give.

    .venv/bin/python bench/spec_replay.py [--types ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,suffix]
                                          [--workloads copy,agent,chat] [--keep DIR] [-fa on|off]

``bench/speculative.py`` times both servers end to end, and its copy and chat workloads are a few seconds
each (about +-10 % between runs).  This bench separates the two things a draft's speed-up is made of, so
that a change to a drafter or to the budget can be judged without that noise:

1. **Answers** (``record``): one hydra-trio node without speculation answers ``bench/speculative.py``'s
   workloads greedily; each request's prompt tokens and answer tokens are kept.  Greedy output is the same
   with and without speculation (tests/test_speculative.py), so these are the tokens every type must
   produce.
2. **Cost** (``cost``): the decode time of a batch of ``R`` rows (logits at every row, as a verification
   asks) after ``N`` tokens of context, for ``R`` up to 65 and ``N`` up to 4,096, on the default model
   (SmolLM2-135M, ``-t 2``, the ``-fa`` given), median of 7 (as ``bench/verify_cost.py``, on a grid).
3. **Replay**: each request is decoded again on paper, step by step as the scheduler does
   (engine/batching/scheduler.py ``_drafts``): the type's drafters (the node's own classes) are asked for
   a draft with the slot's tokens, the draft is cut by the policy, its tokens are compared with the
   recorded answer (the accepted prefix), the drafters and the budget hear the result, and the step costs
   the measured time of its rows at its context (interpolated linearly).  Tokens over the summed time give
   a modelled decode speed; each figure is printed against no speculation on the same model:

   - ``whole``: every draft verified whole (llama-server's way; its own n-gram drafters are the same
     algorithms, so this is also what llama-server's type gains here);
   - ``budget``: cut by the node's draft budget as ``--spec-budget-row-cost auto`` sets it for the ``-fa``
     given (engine/speculative/budget.py);
   - ``perfect``: cut exactly at the first token the target rejects (what the best possible budget gets from
     the type's drafts; no budget can know where that is);
   - ``any copy``, per workload: a drafter that, at every step, drafts the longest continuation of the answer
     found anywhere in the earlier text (the prompt, the answer so far, the earlier requests), cut
     perfectly: more than any drafter that copies earlier text can get on this machine.

The modelled speeds leave out what is not decoding (sampling, drafting, the HTTP round trip): on this
machine they come within about 10 % of ``bench/speculative.py``'s measured ones, closer for the ratios.
``--keep DIR`` writes ``answers.json`` and ``cost-fa-on.json`` (or ``-off``) there and reuses on the next run
what fits its options (the answers of each workload recorded with the same ``--turns`` and max_tokens; a
whole table); what does not fit or does not parse is made again.  A replay from kept files takes seconds.
The cost table needs a quiet machine: the bench warns when the load average is above half the CPUs, and
exits with status 1, keeping nothing, when the table shows a step measured faster than one with fewer rows
or a shorter context by more than a quarter.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.speculative import WORKLOADS, names, workload  # noqa: E402
from hydra_trio.engine.settings import LlamaOptions  # noqa: E402
from hydra_trio.engine.speculative import budget as B  # noqa: E402
from hydra_trio.engine.speculative.base import SlotDraft  # noqa: E402
from hydra_trio.engine.speculative.build import draft_budget  # noqa: E402
from hydra_trio.engine.speculative.combine import Speculative, make_speculative  # noqa: E402
from hydra_trio.engine.speculative.settings import SpecSettings  # noqa: E402
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402

N_CTX = 8192
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 40, 49, 65)
CONTEXTS = (128, 512, 1024, 2048, 3072, 4096)


def record(workloads: list[str], tokens: dict[str, int], turns: int) -> dict[str, list[dict[str, Any]]]:
    """Each workload's requests answered greedily (max_tokens ``tokens[workload]``) by a node without
    speculation: ``prompt`` and ``answer`` tokens."""
    proc, port = spawn(
        "-t", "2", "-np", "1", "-c", str(N_CTX), "--no-rpc-backend", "--log-level", "WARNING",
        output=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        wait_healthy(port, proc, timeout=300)
        with httpx.Client(base_url=base, timeout=600) as c:
            for w in workloads:
                reqs = []
                for messages in workload(w, turns):
                    text = c.post("/apply-template", json={"messages": messages}).json()["prompt"]
                    prompt = c.post(
                        "/tokenize", json={"content": text, "add_special": True, "parse_special": True}
                    ).json()["tokens"]
                    got = c.post(
                        "/completion",
                        json={"prompt": prompt, "n_predict": tokens[w], "temperature": 0, "return_tokens": True},
                    ).json()
                    reqs.append({"prompt": prompt, "answer": got["tokens"]})
                out[w] = reqs
                print(f"answers: {w}: {len(reqs)} requests, {sum(len(r['answer']) for r in reqs)} tokens", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def measure_cost(flash_attn: str, reps: int = 7) -> dict[str, Any]:
    """``{"rows": [...], "contexts": [...], "seconds": [[per row count] per context]}``."""
    from bench.verify_cost import StepTimer

    timer = StepTimer(2, flash_attn)
    seconds = []
    for n, line in zip(CONTEXTS, timer.table(list(CONTEXTS), list(ROWS), reps), strict=True):
        seconds.append(line)
        shown = " ".join(f"{r}:{t * 1e3:.1f}" for r, t in zip(ROWS, line, strict=True))
        print(f"cost: {n} tokens: {shown} ms", flush=True)
    timer.close()
    return {"rows": list(ROWS), "contexts": list(CONTEXTS), "seconds": seconds, "flash_attn": flash_attn}


class Cost:
    """Seconds of one decode step of ``rows`` rows after ``n_past`` tokens, interpolated in the table."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.rows, self.contexts, self.seconds = table["rows"], table["contexts"], table["seconds"]

    @staticmethod
    def _lerp(xs: list[int], x: float) -> tuple[int, float]:
        j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        return j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])

    def __call__(self, rows: int, n_past: int) -> float:
        n_past = min(max(n_past, self.contexts[0]), self.contexts[-1])
        jc, fc = self._lerp(self.contexts, n_past)
        jr, fr = self._lerp(self.rows, rows)

        def at(c: int) -> float:
            line = self.seconds[c]
            return line[jr - 1] + (line[jr] - line[jr - 1]) * fr

        return at(jc - 1) + (at(jc) - at(jc - 1)) * fc


class _Whole(B.DraftBudget):
    """Every draft verified whole (the budget's bookkeeping kept, so that the drafters hear the same)."""

    def cap(self, id_slot: int, n_max: int, n_past: int = 0, key: str = "") -> int:
        return n_max


def replay(
    reqs: list[dict[str, Any]], n_predict: int, kind: str, cost: Cost, policy: str, flash_attn: str = "on"
) -> dict[str, float]:
    """Decode ``reqs`` (recorded with max_tokens ``n_predict``) again on paper with ``kind``'s drafters cut by
    ``policy`` (``none``, ``whole``, ``budget``, ``perfect``); returns modelled ``tok_s``, ``steps``,
    ``drafted``, ``accepted``."""
    spec: Speculative | None = None
    if policy != "none":
        spec = make_speculative(SpecSettings(types=("none", kind)), 1)
        assert spec is not None
        # the node's own choice for --spec-budget-row-cost auto, a model on the CPU
        cpu = LlamaOptions(n_gpu_layers=0)
        spec.budget = draft_budget(SpecSettings(), cpu, flash_attn) if policy == "budget" else _Whole(1.0)
    seconds = 0.0
    n_tokens = steps = drafted = accepted = 0
    for req in reqs:
        prompt, answer = req["prompt"], req["answer"]
        if spec is not None:
            spec.begin(0, prompt)
            assert spec.budget is not None
            spec.budget.reset(0)
        i = 0  # answer[i] was sampled last and is not decoded yet (the scheduler's last_token)
        while i < len(answer) - 1:
            draft: list[int] = []
            if spec is not None:
                n_max = min(spec.n_max, N_CTX - (len(prompt) + i) - 3, n_predict - (i + 1) - 1)
                if n_max >= 1:
                    sd = SlotDraft(0, n_max, len(prompt) + i, answer[i], prompt + answer[:i])
                    spec.draft([sd])
                    draft = list(sd.result)
            k = 0
            while k < len(draft) and i + 1 + k < len(answer) and draft[k] == answer[i + 1 + k]:
                k += 1
            if policy == "perfect":
                draft = draft[:k]
            seconds += cost(1 + len(draft), len(prompt) + i)
            steps += 1
            if spec is not None and draft:
                drafted += len(draft)
                accepted += k
                assert spec.budget is not None
                spec.budget.observe_verify(0, len(draft), k, spec.last_drafter(0))
                spec.accept(0, k)
            i += k + 1
        n_tokens += len(answer) - 1
        if spec is not None:
            spec.end(0, prompt + answer)
    return {"tok_s": n_tokens / seconds, "steps": steps, "drafted": drafted, "accepted": accepted}


def any_copy(reqs: list[dict[str, Any]], cost: Cost) -> float:
    """Modelled tok/s of a drafter that drafts, at every step, the longest continuation of the answer found
    anywhere in the earlier text, cut perfectly."""
    earlier: list[int] = []
    seconds, n_tokens = 0.0, 0
    for req in reqs:
        prompt, answer = req["prompt"], req["answer"]
        before = "," + ",".join(map(str, earlier + prompt))
        i = 0
        while i < len(answer) - 1:
            seen = before + "," + ",".join(map(str, answer[: i + 1])) + ","
            k = 0
            while i + 1 + k < len(answer) and ("," + ",".join(map(str, answer[i + 1 : i + 2 + k])) + ",") in seen:
                k += 1
            seconds += cost(1 + k, len(prompt) + i)
            i += k + 1
        n_tokens += len(answer) - 1
        earlier += prompt + answer
    return n_tokens / seconds


def _write(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read(path: Path) -> Any:
    """``path``'s JSON, or None (with a line saying why) when it is missing or does not parse."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"{path}: not readable ({exc}): made again", flush=True)
        return None


def _answers_fit(got: Any, turns: int, n_predict: int) -> bool:
    """A kept workload's answers were recorded with these settings and have the expected shape."""
    try:
        return (
            got["turns"] == turns
            and got["n_predict"] == n_predict
            and all(
                all(isinstance(t, int) for t in r["prompt"]) and all(isinstance(t, int) for t in r["answer"])
                for r in got["requests"]
            )
        )
    except (KeyError, TypeError):
        return False


def answers_for(keep: Path | None, workloads: list[str], tokens: dict[str, int], turns: int) -> dict[str, Any]:
    """Each workload's recorded answers (:func:`record`), from ``keep/answers.json`` where it holds them for
    the same ``--turns`` and max_tokens; the others are recorded now (and kept)."""
    kept = _read(keep / "answers.json") if keep is not None else None
    kept = kept if isinstance(kept, dict) else {}
    fit = {w: kept[w] for w in workloads if _answers_fit(kept.get(w), turns, tokens[w])}
    if fit:
        print(f"reusing the answers of {', '.join(fit)} from {keep}", flush=True)
    missing = [w for w in workloads if w not in fit]
    if missing:
        got = record(missing, tokens, turns)
        for w in missing:
            fit[w] = kept[w] = {"turns": turns, "n_predict": tokens[w], "requests": got[w]}
        if keep is not None:
            _write(keep / "answers.json", kept)
    return {w: fit[w]["requests"] for w in workloads}


def disturbed(table: dict[str, Any]) -> str:
    """Why ``table`` cannot be a quiet machine's (a step with more rows, or a longer context, measured
    faster by more than a quarter: something else ran), or "" when it can."""
    seconds = table["seconds"]
    for n, line in zip(table["contexts"], seconds, strict=True):
        for (r0, t0), (r1, t1) in itertools.pairwise(zip(table["rows"], line, strict=True)):
            if t1 < 0.75 * t0:
                return f"at {n} tokens {r1} rows took {t1 * 1e3:.1f} ms, {r0} rows {t0 * 1e3:.1f} ms"
    for (n0, a), (n1, b) in itertools.pairwise(zip(table["contexts"], seconds, strict=True)):
        if b[0] < 0.75 * a[0]:
            return f"one row took {b[0] * 1e3:.1f} ms at {n1} tokens, {a[0] * 1e3:.1f} ms at {n0}"
    return ""


def cost_for(keep: Path | None, flash_attn: str) -> dict[str, Any]:
    """The cost table (:func:`measure_cost`), from ``keep/cost-fa-{on,off}.json`` when it holds a whole
    one, else measured now (and kept).  Exits with status 1 when the measurement was disturbed."""
    path = keep / f"cost-fa-{flash_attn}.json" if keep is not None else None
    table = _read(path) if path is not None else None
    try:
        whole = table is not None and table["rows"] == list(ROWS) and table["contexts"] == list(CONTEXTS)
        if whole and all(len(line) == len(ROWS) and all(t > 0 for t in line) for line in table["seconds"]):
            print(f"reusing {path}", flush=True)
            return table
    except (KeyError, TypeError):
        pass
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {load:.1f} on {os.cpu_count()} CPUs: the timings need a quiet machine", flush=True
        )
    table = measure_cost(flash_attn)
    why = disturbed(table)
    if why:
        sys.exit(f"the cost table was disturbed ({why}): run again on a quiet machine")
    if path is not None:
        _write(path, table)
    return table


def replayable(text: str) -> list[str]:
    """``--types``: each a model-free type the node builds without a model (draft-simple and draft-mtp
    draft with a model, which a replay does not run).  Raises argparse.ArgumentTypeError."""
    got = [t for t in text.split(",") if t]
    for t in got or [""]:
        try:
            ok = make_speculative(SpecSettings(types=("none", t)), 1) is not None
        except (ValueError, OSError):
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"{t or '(none given)'}: not a model-free type ({', '.join(REPLAYABLE)})")
    return got


REPLAYABLE = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--types",
        default="ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,suffix",
        type=replayable,
        help=f"comma list of {', '.join(REPLAYABLE)}",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        type=lambda t: names(t, WORKLOADS, "workload"),
        help=f"comma list of {', '.join(WORKLOADS)} (bench/speculative.py's)",
    )
    ap.add_argument("--turns", type=int, default=20, help="turns of the agent session")
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens of the agent and chat requests")
    ap.add_argument("--copy-tokens", type=int, default=400, help="max_tokens of the copy requests")
    ap.add_argument("-fa", "--flash-attn", choices=("on", "off"), default="on", help="as -fa auto sets it here: on")
    ap.add_argument(
        "--keep",
        type=Path,
        help="a folder: keep answers.json and cost-fa-{on,off}.json there, and reuse what fits these options",
    )
    a = ap.parse_args()
    if a.keep is not None:
        if a.keep.exists() and not a.keep.is_dir():
            ap.error(f"--keep {a.keep}: not a folder")
        a.keep.mkdir(parents=True, exist_ok=True)
    workloads = a.workloads
    tokens = {w: a.copy_tokens if w == "copy" else a.tokens for w in workloads}
    answers = answers_for(a.keep, workloads, tokens, a.turns)
    cost = Cost(cost_for(a.keep, a.flash_attn))
    print(f"\n`bench/spec_replay.py {' '.join(sys.argv[1:])}` (modelled decode speed, against no speculation)\n")
    print("| workload | type | whole | budget | perfect | drafted / accepted (budget) |")
    print("|---|---|---|---|---|---|")
    for w in workloads:
        reqs = answers[w]
        none = replay(reqs, tokens[w], "none", cost, "none")["tok_s"]
        for kind in a.types:
            got = {p: replay(reqs, tokens[w], kind, cost, p, a.flash_attn) for p in ("whole", "budget", "perfect")}
            print(
                f"| {w} | {kind} | {got['whole']['tok_s'] / none:.2f} | {got['budget']['tok_s'] / none:.2f} | "
                f"{got['perfect']['tok_s'] / none:.2f} | {got['budget']['drafted']} / {got['budget']['accepted']} |",
                flush=True,
            )
        print(
            f"| {w} | any copy | | | {any_copy(reqs, cost) / none:.2f} | no speculation: {none:.1f} tok/s |", flush=True
        )


if __name__ == "__main__":
    main()
