"""A short budget of the live stateful fuzzer (fuzz/live.py) against the shared server; `python -m fuzz` runs longer."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from fuzz import live

from .conftest import ServerProcess


def test_live_fuzz_short_budget(server: ServerProcess) -> None:
    live.configure(server.port, n_slots=4)
    test = live.LiveServerMachine.TestCase
    test.settings = settings(
        max_examples=6, stateful_step_count=12, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    test("runTest").runTest()
    assert live.STATS["steps"] > 0
    assert live.FINDINGS == [], f"steps that hung: {live.FINDINGS}"
    assert server.proc.poll() is None
