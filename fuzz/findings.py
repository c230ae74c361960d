"""Timeouts in the live fuzzer are findings with their example, not flaky failures."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import httpx

FINDINGS: list[dict[str, object]] = []
"""Steps that timed out: each with its rule, its arguments, how long it took and the error."""


class StepTimeout(AssertionError):
    """An exchange took longer than the fuzzer's step timeout."""


def timeouts_are_findings(fn: Callable[..., None]) -> Callable[..., None]:
    """Rule decorator (under ``@rule``): a step that times out is recorded in FINDINGS with its example.

    A hang is a finding to report with the input that caused it; raising it
    would make hypothesis replay the example, and a timing that does not
    repeat turns into a FlakyFailure that hides the input.
    """

    @functools.wraps(fn)
    def step(self: object, **kwargs: object) -> None:
        t0 = time.monotonic()
        try:
            fn(self, **kwargs)
        except (StepTimeout, httpx.TimeoutException, TimeoutError) as exc:
            FINDINGS.append(
                {
                    "rule": fn.__name__,
                    "example": {k: repr(v)[:300] for k, v in kwargs.items()},
                    "seconds": round(time.monotonic() - t0, 1),
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )

    return step
