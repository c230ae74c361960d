"""Start-up stages seen from a client started before the model loads; shutdown by signal."""

from __future__ import annotations

import signal
import threading
import time

import httpx


def test_health_stages_before_ready(spawn) -> None:
    srv = spawn()
    seen: list[tuple[int, dict]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = httpx.get(srv.base + "/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.005)
            continue
        seen.append((r.status_code, r.json()))
        if r.status_code == 200:
            break
    assert seen[-1] == (200, {"status": "ok", "stage": "ready"})
    loading = [body for code, body in seen if code == 503]
    assert loading, "no loading stage observed before ready"
    assert all(b["status"] == "loading" and 0.0 <= b["progress"] <= 1.0 for b in loading)
    stages = [b["stage"] for b in loading]
    assert set(stages) <= {"starting", "loading_model", "hashing_model", "warmup"}
    order = ["starting", "loading_model", "hashing_model", "warmup"]
    assert [order.index(s) for s in stages] == sorted(order.index(s) for s in stages)
    # a completion while loading would have been a 503; now it works
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    log = srv.log()
    for stage in ("loading_model", "warmup"):
        assert f"stage {stage} done in" in log


def test_sigterm_mid_stream_exits_zero(spawn) -> None:
    srv = spawn("--shutdown-grace", "1")
    srv.wait_ready()
    got_first = threading.Event()
    outcome: list[str] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got_first.set()
            outcome.append("ended")
        except httpx.HTTPError as exc:
            outcome.append(type(exc).__name__)
        got_first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert got_first.wait(60)
    t0 = time.monotonic()
    code = srv.stop(signal.SIGTERM)
    t.join(30)
    assert code == 0, srv.log()
    assert time.monotonic() - t0 < 15
    assert outcome  # the stream ended (closed by the server), no hang
    assert "SIGTERM received" in srv.log()
    assert "grace period of 1.0 s over" in srv.log()


def test_sigterm_lets_requests_in_flight_finish(spawn) -> None:
    srv = spawn("--shutdown-grace", "30")
    srv.wait_ready()
    got_first = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    got_first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert got_first.wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # no new connections once the shutdown began
        httpx.get(srv.base + "/health", timeout=2)
        refused = False
    except httpx.ConnectError:
        refused = True
    t.join(60)
    assert srv.proc.wait(30) == 0
    assert refused
    assert lines[-1] == "data: [DONE]"  # the request in flight finished whole
    assert len(lines) >= 60
