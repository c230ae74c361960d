"""What verifying a draft costs on this machine: the target's decode time against the rows of its batch, at
several context lengths, and the speed-up speculative decoding can reach at most with it.

    .venv/bin/python bench/verify_cost.py [--contexts 256,2048,6144] [--rows 1,2,4,8,16,24] [--reps 7] [-t 2]
                                          [-fa on|off|auto]

Loads the default model (SmolLM2-135M, ``-c 8192``), fills one sequence with ``N`` tokens for each context
length, then times ``llama_decode`` of a batch of ``R`` rows at the next positions (logits at every row, as a
verification asks) and removes them again, ``--reps`` times per size (the median counts).  Per context it
fits ``seconds ≈ c0 + c1 × rows`` (least squares) and prints ``r = c1 / c0``, the figure
``--spec-budget-row-cost`` stands for (engine/speculative/budget.py), and the ceiling of a draft's speed-up
over decoding one token at a time for a drafted token's acceptance chance ``a``:
``max over L of (1 + a + ... + a^L) × (c0 + c1) / (c0 + c1 × (L + 1))`` — what a drafter whose tokens are
accepted with chance ``a`` each (given the ones before were) gains at best when every step drafts.  Run on a
quiet machine: the figures are wall-clock times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio.engine.llama.model import FLASH_ATTN_TYPE, init_backend  # noqa: E402
from hydra_trio.models.presets import resolve_model  # noqa: E402


def ceiling(r: float, a: float, n_max: int = 64) -> tuple[float, int]:
    """``(speed-up, L)``: the best draft length's tokens per unit of cost over plain decoding's."""
    best, best_l, gain, term = 1.0, 0, 1.0, 1.0
    for length in range(1, n_max + 1):
        term *= a
        gain += term
        rate = gain * (1 + r) / (1 + r * (length + 1))
        if rate > best:
            best, best_l = rate, length
    return best, best_l


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    c1 = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - c1 * sx) / n, c1


class StepTimer:
    """The default model (SmolLM2-135M) on one sequence of an ``-c 8192`` context (``n_batch`` 512), to time
    ``llama_decode`` of batches: ``threads`` CPU threads, ``flash_attn`` ``on``/``off``/``auto``."""

    def __init__(self, threads: int, flash_attn: str) -> None:
        self.path, _ = resolve_model("smollm2-135m")
        init_backend()  # llama.cpp's log lines go to Python logging (its per-tensor chatter at DEBUG: unshown)
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 8192, 512, 512
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = FLASH_ATTN_TYPE[flash_attn]
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(self, tokens: list[int], pos0: int, logits_all: bool) -> float:
        """Seconds of one ``llama_decode`` of ``tokens`` (at most 512) at positions ``pos0``, ``pos0 + 1``, ...
        (logits at every row with ``logits_all``, else at the last).  Raises RuntimeError: it failed."""
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = logits_all or i == len(tokens) - 1
        t0 = time.perf_counter()
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - t0

    def drop(self, p0: int) -> None:
        """Remove the positions from ``p0`` on."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), 0, p0, -1)

    def table(self, contexts: list[int], rows: list[int], reps: int) -> Iterator[list[float]]:
        """For each context length of ``contexts`` (ascending; the sequence is filled up to it with random
        tokens), the median seconds of ``reps`` decodes of each row count of ``rows`` there (logits at every
        row, as a verification asks; removed again after each), yielded as each context is done."""
        rng, filled = random.Random(5), 0
        for n in contexts:
            while filled < n:
                chunk = [rng.randrange(1000, 40000) for _ in range(min(512, n - filled))]
                self.decode(chunk, filled, False)
                filled += len(chunk)
            line = []
            for r in rows:
                times = []
                for _ in range(reps):
                    times.append(self.decode([rng.randrange(1000, 40000) for _ in range(r)], n, True))
                    self.drop(n)
                line.append(statistics.median(times))
            yield line

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="256,2048,6144")
    ap.add_argument("--rows", default="1,2,4,8,16,24")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-fa", "--flash-attn", choices=("on", "off", "auto"), default="auto")
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    if len(set(rows)) < 2 or min(rows) < 1 or max(rows) > 512:
        ap.error("--rows: at least two different row counts, each 1 to 512 (a line is fitted through them)")
    timer = StepTimer(a.threads, a.flash_attn)
    print(f"model {timer.path.name}, -t {a.threads}, -fa {a.flash_attn}, rows {rows}, {a.reps} reps each", flush=True)
    print(f"{'context':>8} {'c0 ms':>7} {'c1 ms':>7} {'r':>6}   ceiling at a=0.5 / 0.7 / 0.9 (best L)")
    for n, line in zip(sorted(contexts), timer.table(sorted(contexts), rows, a.reps), strict=True):
        points = list(zip(rows, line, strict=True))
        c0, c1 = fit(points)
        ratio = c1 / c0 if c0 > 0 else float("inf")
        ceil = "  ".join(f"{s:.2f}x (L={length})" for s, length in (ceiling(ratio, p) for p in (0.5, 0.7, 0.9)))
        shown = " ".join(f"{r}:{t * 1000:.1f}" for r, t in points)
        print(f"{n:>8} {c0 * 1000:7.2f} {c1 * 1000:7.2f} {ratio:6.3f}   {ceil}   [{shown} ms]", flush=True)
    timer.close()


if __name__ == "__main__":
    main()
