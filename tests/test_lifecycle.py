"""Start-up stages seen from a client started before the model loads; shutdown by signal."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time

import httpx

from hydra_trio.engine.kv.state import verify_checksum
from hydra_trio.protocol.hydra import Op, Status, encode_request
from hydra_trio.testing.hydra_wire import Wire

from .conftest import wait_for


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
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 60,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
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
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hydra_trio",
                "run",
                "--port",
                str(port),
                "-np",
                "1",
                "-c",
                "512",
                "--shutdown-grace",
                "5",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # its own process group, as a service has
        try:
            wait_healthy(port, proc, timeout=120)
            # a stream in flight keeps the node in its grace, where the child's end is seen
            body = json.dumps(
                {"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "stream": True}
            ).encode()
            with socket.create_connection(("127.0.0.1", port)) as held:
                held.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
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


def _read_stream(base: str, path: str, body: dict, out: dict, key: str) -> None:
    """POST ``body`` and keep the reply as ``out[key]``: ``(status, [data payloads])`` for a stream,
    ``(status, JSON body)`` otherwise, or the transport error that ended it."""
    try:
        with httpx.stream("POST", base + path, json=body, timeout=300) as r:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                out[key] = (r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")])
            else:
                raw = r.read()
                out[key] = (r.status_code, json.loads(raw) if raw else (r.headers, raw))
    except httpx.HTTPError as exc:
        out[key] = exc


def _stopping_error(error: dict) -> None:
    """llama-server's error object for a request the node ended as it stopped: 503, unavailable_error."""
    assert error["code"] == 503 and error["type"] == "unavailable_error", error
    assert "the node is stopping" in error["message"] and "grace" in error["message"], error


def test_requests_in_flight_at_the_end_of_the_grace_are_told_the_node_is_stopping(spawn) -> None:
    """At the end of --shutdown-grace every stream still running ends with an OpenAI error event (llama-server's
    ``data: {"error": {...}}``) and its chunked body ends properly; a reply not yet sent is a 503 with OpenAI's
    error body; a streamed Hydra DECODE delivers exactly its payload_len, the rest padded with the error flag.
    The requests never end by themselves (n_predict -1, ignore_eos, context shift), so each is in flight then."""
    from hydra_trio.protocol.hydra import DECODE_FLAG_PAD, Op, Status, decode_stop_reason, unpack_decode_frames

    srv = spawn("-np", "5", "-c", "2560", "--context-shift", "--shutdown-grace", "1")
    srv.wait_ready()
    endless = {"n_predict": -1, "ignore_eos": True}
    chat = [{"role": "user", "content": "Tell me a story."}]
    requests = {
        "completions": ("/v1/completions", {"prompt": "Once upon a time", "stream": True, **endless}),
        "chat": ("/v1/chat/completions", {"messages": chat, "stream": True, **endless}),
        "native": ("/completion", {"prompt": "Once upon a time", "stream": True, **endless}),
        "whole": ("/v1/completions", {"prompt": "Once upon a time", **endless}),
    }
    out: dict = {}
    threads = [
        threading.Thread(target=_read_stream, args=(srv.base, path, body, out, key))
        for key, (path, body) in requests.items()
    ]
    for t in threads:
        t.start()
    decode = Wire(srv.port, timeout=300)
    decode.send(
        encode_request(
            Op.DECODE, key="4", payload=json.dumps({"messages": chat, "n_predict": 8192, "ignore_eos": True}).encode()
        )
    )
    busy = lambda: sum(s["is_processing"] for s in httpx.get(srv.base + "/slots", timeout=60).json()) == 5  # noqa: E731
    wait_for(busy, timeout=120, what="five requests generating")
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(300)
    status, meta, payload = decode.read_reply()  # raises if the connection closed short of payload_len
    decode.close()
    assert srv.proc.wait(120) == 0, srv.log()
    assert "grace period of 1.0 s over" in srv.log()
    for key in ("completions", "chat", "native"):
        assert not isinstance(out[key], Exception), (key, out[key])  # the chunked body ended properly
        code, events = out[key]
        assert code == 200 and events, (key, out[key])
        assert "[DONE]" not in events, (key, events[-3:])
        last = json.loads(events[-1])
        _stopping_error(last["error"])
        assert all("error" not in json.loads(e) for e in events[:-1]), key  # tokens until then
    assert not isinstance(out["whole"], Exception), out["whole"]
    code, body = out["whole"]
    assert code == 503, body
    _stopping_error(body["error"])
    # the DECODE: exactly 9 x budget bytes, generated frames then PAD frames, the first carrying "error"
    assert status == Status.OK and len(payload) == 9 * meta["n_predict"] == 9 * 8192
    frames = unpack_decode_frames(payload)
    first_pad = next(i for i, f in enumerate(frames) if f[2] & DECODE_FLAG_PAD)
    end = frames[first_pad - 1 if first_pad else 0]  # FINAL, or the first PAD frame when no token came
    assert decode_stop_reason(end[2]) == "error", end
    assert all(f[2] & DECODE_FLAG_PAD for f in frames[first_pad:])
