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


def test_tls_and_access_fuzz_short_budget(spawn, tmp_path) -> None:
    """fuzz/tls.py against an access node made as `python -m fuzz` makes it (TLS with trustme certificates,
    --tls-required, an API key, --control-allow without loopback, a Hydra token): bad TLS closes within the
    classify timeout, bad credentials over TLS are refused, nothing changes, no step hangs."""
    from fuzz import tls

    certs = tls.make_certs(tmp_path)
    own = tls.own_address()  # plain from it meets --tls-required; None: that rule is skipped (and counted)
    node = spawn(
        "--host",
        "0.0.0.0" if own else "127.0.0.1",
        "-np",
        "2",
        "-c",
        "2048",
        "--timeout",
        "5",
        *tls.server_flags(certs, "fuzz-key", "fuzz-token"),
    )
    node.wait_ready()
    tls.configure(node.port, "fuzz-key", "fuzz-token", 2, certs, own)
    findings = len(live.FINDINGS)
    tls_before = live.STATS.get("tls", 0)
    test = tls.TlsMachine.TestCase
    test.settings = settings(
        max_examples=4, stateful_step_count=10, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    test("runTest").runTest()
    assert live.STATS.get("tls", 0) > tls_before
    assert live.FINDINGS[findings:] == [], f"steps that hung: {live.FINDINGS[findings:]}"
    assert node.proc.poll() is None
    assert "Traceback" not in node.log()
