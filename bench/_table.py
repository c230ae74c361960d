"""The one table format of the data-path benches (bench/combined.py, bench/tls.py, bench/rpc_passthrough.py).

Each row compares a figure with its reference *measured in the same run*
(interleaved rounds where the two can alternate, so that a busy machine's
drift hits both): ``ratio`` is figure / reference for speeds and reference /
figure for times, so higher is better in every row; ``target`` is the
bound the project sets on that ratio, when there is one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs


@attrs.frozen
class Row:
    """One comparison: ``ours`` against ``reference`` (lists of per-round values, same unit)."""

    bench: str
    case: str
    unit: str
    ours: Sequence[float]
    reference: Sequence[float]
    higher_is_better: bool = True
    target: float | None = None

    @property
    def ratios(self) -> list[float]:
        """Per round (rounds paired in the order measured); higher is better."""
        return [(o / r if self.higher_is_better else r / o) for o, r in zip(self.ours, self.reference, strict=False)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def _fig(xs: Sequence[float]) -> str:
    m = statistics.median(xs)
    f = (lambda v: f"{v:,.1f}") if m < 1000 else (lambda v: f"{v:,.0f}")
    return f"{f(m)} ({f(min(xs))}-{f(max(xs))})" if len(xs) > 1 else f(m)


def print_table(rows: Sequence[Row], command: str) -> None:
    """A Markdown table (medians, min-max over rounds), the command that made it first."""
    print(f"\n`{command}` (median of rounds, min-max; ratio: higher is better, per round then median)\n")
    print("| bench | case | unit | hydra-trio | reference | ratio (min-max) | target | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rs = r.ratios
        tgt = "" if r.target is None else f"≥ {r.target:.2f}"
        ok = "" if r.target is None else ("yes" if r.ratio >= r.target else "NO")
        print(
            f"| {r.bench} | {r.case} | {r.unit} | {_fig(r.ours)} | {_fig(r.reference)} | "
            f"{r.ratio:.2f} ({min(rs):.2f}-{max(rs):.2f}) | {tgt} | {ok} |"
        )
