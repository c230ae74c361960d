"""Start-up stages seen from a client started before the model loads; shutdown by signal."""

from __future__ import annotations

import json
import sys
import signal
import socket
import threading
import time

import httpx

from hydra_trio.engine.state import verify_checksum
from hydra_trio.protocol.hydra import Op, Status, encode_request

from .hydra_wire import Wire


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
    code = srv.stop(signal.SIGTERM, timeout=120)
    t.join(120)
    assert code == 0, srv.log()
    assert time.monotonic() - t0 < 120  # a hang would be never: a bound of minutes, the grace period's 1 s is logged
    assert outcome  # the stream ended (closed by the server), no hang
    assert "SIGTERM received" in srv.log()
    assert "grace period of 1.0 s over" in srv.log()


def test_sigterm_lets_requests_in_flight_finish(spawn) -> None:
    srv = spawn("--shutdown-grace", "60")
    srv.wait_ready()
    got_first = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    got_first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert got_first.wait(120)
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    refused = False
    while time.monotonic() < deadline:  # soon no new connection is accepted (the stream goes on)
        try:
            httpx.get(srv.base + "/health", timeout=120)
        except httpx.ConnectError:
            refused = True
            break
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            # a poll that raced the shutdown: its connection sat in the listen backlog when the listener
            # closed (reset), or was accepted just before and closed unanswered as an idle connection;
            # the next poll must be refused
            pass
        time.sleep(0.02)
    t.join(120)
    assert srv.proc.wait(120) == 0
    assert refused
    # the request in flight finished whole: the final chunk, usage, then [DONE]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 60
    assert json.loads(lines[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert "grace period" not in srv.log()  # nothing was cut


def test_sigterm_delivers_a_state_get_in_flight_whole(spawn) -> None:
    """A STATE_GET blob being streamed when SIGTERM arrives reaches its last byte; idle connections close."""
    srv = spawn("-np", "1", "-c", "8192", "--shutdown-grace", "60")
    srv.wait_ready()
    prompt = "word " * 1500  # about 35 MB of KV state
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": prompt, "max_tokens": 0}, timeout=120)
    assert r.status_code == 200
    idle = Wire(srv.port)
    assert idle.call(Op.INFO)[0] == Status.OK
    with Wire(srv.port) as w:
        # tens of MB: far more than the socket buffers hold, so the reply is in flight at SIGTERM
        w.send(encode_request(Op.STATE_GET, key="0"))
        head = w.sock.recv(12, socket.MSG_WAITALL)
        status, meta_len, payload_len = head[0], int.from_bytes(head[1:4], "little"), int.from_bytes(head[4:], "little")
        assert status == Status.OK and payload_len > 1_000_000
        srv.proc.send_signal(signal.SIGTERM)
        assert idle.closed_by_server()  # the idle Hydra connection closes between requests
        got = bytearray()
        while len(got) < meta_len + payload_len:
            chunk = w.sock.recv(1 << 16)
            assert chunk, f"cut after {len(got)} of {meta_len + payload_len} bytes"
            got += chunk
        meta = json.loads(got[:meta_len])
        assert meta["state_size"] == payload_len
        verify_checksum(bytes(got[meta_len:]))  # whole and intact
        assert w.closed_by_server()  # then the connection closes
    idle.close()
    assert srv.proc.wait(120) == 0


def test_sigterm_to_the_process_group_stops_the_rpc_child_with_the_node(tmp_path) -> None:
    """systemd's default (KillMode=control-group) and a launcher that stops its child's group send SIGTERM to
    the node and its ggml-RPC child at once: the child's end is part of the stop, not a crash to restart."""
    import os
    import subprocess

    from hydra_trio.testing.spawn import wait_healthy
    from .conftest import ROOT, free_port

    port = free_port()
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hydra_trio", "run", "--port", str(port), "-np", "1", "-c", "512",
                                 "--shutdown-grace", "5"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, as a service has
        try:
            wait_healthy(port, proc, timeout=120)
            # a stream in flight keeps the node in its grace, where the child's end is seen
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True,
                               "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", port)) as held:
                held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                got = b""
                while b"data: " not in got:  # streaming
                    chunk = held.recv(65536)
                    assert chunk, got
                    got += chunk
                os.killpg(proc.pid, signal.SIGTERM)
                code = proc.wait(120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = log_path.read_text(errors="replace")
    assert code == 0, log
    assert "SIGTERM received" in log
    assert "ggml-RPC backend" in log and "crashed" not in log and "restarting" not in log, log
    assert log.count("ggml-RPC backend serving") == 1, log
