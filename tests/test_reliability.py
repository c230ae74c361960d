"""Unattended use: long requests, vanished clients, hostile parameters, corrupt KV blobs, shutdown during load.

Every test runs against real server processes on loopback with the real
model.  Nothing here depends on how fast the machine is: short server-side
timeouts make the slow paths happen, and waits are generous polls.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import time
from collections.abc import Callable

import httpx
import pytest

from hydra_trio.engine.kv.state import HEADER_SIZE, StateError, parse_header, verify_checksum
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import wait_for

LONG = 120.0  # seconds: an upper bound no healthy step comes near, even on a busy machine


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def raw_http(port: int, request: bytes, timeout: float = LONG) -> bytes:
    """Send one raw request on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def post_then_close(port: int, body: dict, after: Callable[[], None]) -> None:
    """POST ``body`` to /v1/completions on a raw socket, call ``after()``, then close without reading."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=LONG)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    try:
        after()
    finally:
        s.close()


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=LONG).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def slot_busy(base: str, id_slot: int = 0) -> bool:
    return httpx.get(base + "/slots", timeout=LONG).json()[id_slot]["is_processing"]


# --------------------------------------------------------------------------- 1. long requests
def test_requests_outlive_every_client_timeout(spawn) -> None:
    """A request runs as long as it needs: timeouts only bound the time the server waits for the client."""
    srv = spawn("-np", "1", "-c", "2048", "--timeout", "0.1", "--keep-alive-timeout", "0.1")
    srv.wait_ready()
    n = 300  # far more than 0.1 s of work on any machine (the server's own timings prove it below)
    body = {"prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True, "temperature": 0}
    lines: list[str] = []
    import threading

    def stream() -> None:
        with httpx.stream("POST", srv.base + "/v1/completions", json={**body, "stream": True}, timeout=LONG) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: slot_busy(srv.base), timeout=LONG, what="the stream to start")
    # queued behind the stream on the one slot, then run: silent for the whole time
    r = httpx.post(srv.base + "/v1/completions", json=body, timeout=10 * LONG)  # silent until both are done
    t.join(10 * LONG)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["completion_tokens"] == n
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["timings"]["predicted_ms"] > 2 * 100, (
        "the request must outlast the timeouts for this test to mean anything"
    )
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["timings"]["predicted_n"] == n
    assert chunks[-1]["timings"]["predicted_ms"] > 2 * 100
    assert "client went away" not in srv.log()


def test_client_timeouts_still_apply_while_waiting_for_the_client(spawn) -> None:
    srv = spawn("-np", "1", "--timeout", "0.5", "--keep-alive-timeout", "0.5")
    srv.wait_ready()
    # a body that stalls: 408, connection closed
    with socket.create_connection(("127.0.0.1", srv.port), timeout=LONG) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt":'
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"stalled" in data
    # headers that never finish: closed by the keep-alive timer
    with socket.create_connection(("127.0.0.1", srv.port), timeout=LONG) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert s.recv(65536) == b""
    # an idle keep-alive connection is closed after its request
    with socket.create_connection(("127.0.0.1", srv.port), timeout=LONG) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 ")


def test_a_connection_kept_alive_after_a_streamed_reply_is_timed_and_drained(spawn) -> None:
    """After a streamed reply the connection's keep-alive timer runs as after any other: an idle client is
    closed after ``--keep-alive-timeout``, and a stop (SIGTERM) closes such a connection at once instead of
    waiting out the shutdown grace (600 s here).  (Starlette's streaming response cancels the task that
    sent the stream's end, and with it the timer that task was starting: ``hydra_trio/http/_hyper.py``.)"""
    srv = spawn("-np", "1", "-c", "2048", "--keep-alive-timeout", "0.5", "--shutdown-grace", "600")
    srv.wait_ready()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    def streamed(s: socket.socket) -> bytes:
        s.sendall(request)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk: the reply is whole
            chunk = s.recv(65536)
            assert chunk, data[-200:]
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in data, data[:300]
        return data

    with socket.create_connection(("127.0.0.1", srv.port), timeout=LONG) as s:
        streamed(s)
        assert s.recv(65536) == b""  # idle for the keep-alive timeout: the server closed it
    srv2 = spawn("-np", "1", "-c", "2048", "--shutdown-grace", "600")
    srv2.wait_ready()
    with socket.create_connection(("127.0.0.1", srv2.port), timeout=LONG) as s:
        streamed(s)
        streamed(s)  # kept alive: a second streamed reply on it
        assert srv2.stop(timeout=LONG) == 0
        assert s.recv(65536) == b""
    assert "grace period" not in srv2.log(), srv2.log()[-2000:]
    # a stream in flight when the stop comes ends whole, and its connection closes with it: the node exits
    # then, not at the end of its 600 s grace
    srv3 = spawn("-np", "1", "-c", "2048", "--shutdown-grace", "600")
    srv3.wait_ready()
    long = json.dumps({"prompt": "Once upon a time", "n_predict": 150, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", srv3.port), timeout=LONG) as s:
        s.sendall(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(long), long)
        )
        data = s.recv(65536)
        assert data.startswith(b"HTTP/1.1 200 "), data[:200]
        srv3.proc.send_signal(signal.SIGTERM)
        while chunk := s.recv(65536):
            data += chunk
        assert data.endswith(b"0\r\n\r\n") and b'"stop":true' in data, data[-300:]
    assert srv3.stop(timeout=LONG) == 0
    assert "grace period" not in srv3.log(), srv3.log()[-2000:]


# --------------------------------------------------------------------------- 2. every way a request ends
def test_every_way_a_request_ends_releases_its_connection(spawn) -> None:
    """finished, failed, cancelled while running or queued, client gone: fds and --max-connections come back."""
    srv = spawn("-np", "1", "--max-connections", "3")
    srv.wait_ready()
    pid, port, base = srv.proc.pid, srv.port, srv.base

    def headroom() -> None:
        """All 3 connections are free: 3 concurrent requests are each answered."""
        socks = [socket.create_connection(("127.0.0.1", port), timeout=LONG) for _ in range(3)]
        try:
            for s in socks:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            for s in socks:
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                assert data.startswith(b"HTTP/1.1 200 "), data[:100]
        finally:
            for s in socks:
                s.close()
        with Wire(port) as w:
            status, meta, _ = w.call(Op.INFO)
            assert status == Status.OK and meta["slots_processing"] == []

    raw_http(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    baseline = open_fds(pid)

    def no_leak(how: str) -> None:
        wait_for(lambda: not slot_busy(base), timeout=LONG, what=f"the slot to be free after: {how}")
        wait_for(
            lambda: open_fds(pid) <= baseline,
            timeout=LONG,
            what=f"fds back to {baseline} after: {how} (now {open_fds(pid)})",
        )
        headroom()
        wait_for(
            lambda: open_fds(pid) <= baseline,
            timeout=LONG,
            what=f"fds back to {baseline} after the headroom check ({how})",
        )

    long_body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    # three times: a non-streamed request whose client leaves after 0.5 s
    for i in range(3):
        post_then_close(port, long_body, lambda: time.sleep(0.5))
        no_leak(f"client gone from a non-streamed request ({i + 1})")
    # finished: non-streamed and streamed
    r = httpx.post(
        base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers={"Connection": "close"}, timeout=LONG
    )
    assert r.status_code == 200
    no_leak("finished")
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 4, "stream": True},
        headers={"Connection": "close"},
        timeout=LONG,
    ) as r:
        assert "data: [DONE]" in list(r.iter_lines())
    no_leak("finished stream")
    # failed: refused before it runs (prompt too long for the slot)
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": list(range(9000)), "max_tokens": 1},
        headers={"Connection": "close"},
        timeout=LONG,
    )
    assert r.status_code == 400
    no_leak("failed")
    # cancelled while running: the client leaves once its request holds the slot
    post_then_close(port, long_body, lambda: wait_for(lambda: slot_busy(base), timeout=LONG, what="the request to run"))
    no_leak("cancelled while running")
    # streamed, client gone mid-stream
    with httpx.stream("POST", base + "/v1/completions", json={**long_body, "stream": True}, timeout=LONG) as r:
        next(r.iter_lines())
    no_leak("client gone mid-stream")

    # cancelled while queued: a stream holds the one slot, a second request waits, then leaves
    import threading

    holder_done = threading.Event()

    def holder() -> None:
        with httpx.stream(
            "POST", base + "/v1/completions", json={**long_body, "max_tokens": 100000, "stream": True}, timeout=LONG
        ) as r:
            for _ in r.iter_lines():
                if holder_done.is_set():
                    break

    t = threading.Thread(target=holder)
    t.start()
    try:
        wait_for(lambda: slot_busy(base), timeout=LONG, what="the holder to run")
        post_then_close(
            port,
            long_body,
            lambda: wait_for(
                lambda: metric(base, "llamacpp:requests_deferred") == 1, timeout=LONG, what="the second request to wait"
            ),
        )
        wait_for(
            lambda: metric(base, "llamacpp:requests_deferred") == 0,
            timeout=LONG,
            what="the queued request to be dropped",
        )
    finally:
        holder_done.set()
        t.join(LONG)
    no_leak("cancelled while queued")
    assert srv.proc.poll() is None


# --------------------------------------------------------------------------- 3. hostile parameters
HOSTILE = [
    # llama-server's hard limits (tools/server/server-schema.cpp, set_hard_limits): a 400 outside them
    ({"repeat_last_n": -2}, "repeat_last_n"),  # -1: the slot's context (earlier llama-server versions' meaning)
    ({"repeat_last_n": 2**63 + 5}, "repeat_last_n"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"min_keep": -1}, "min_keep"),
    ({"n_keep": -2}, "n_keep"),
    ({"adaptive_decay": 1.5}, "adaptive_decay"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"n_predict": -2}, "n_predict"),
    ({"max_completion_tokens": -2}, "max_completion_tokens"),  # -1 is llama-server's "no limit"
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["y" * 513]}, "stop[0]"),
    # what llama.cpp's common_sampler_init refuses (common/sampling.cpp): penalties that are not finite
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": 1e-39}, "repeat_penalty"),  # 1/value is not a finite float
    ({"frequency_penalty": "1e999"}, "frequency_penalty"),  # sent as the JSON number 1e999: parses as infinity
    ({"presence_penalty": 1e39}, "presence_penalty"),  # beyond the largest 32-bit float
]


@pytest.mark.parametrize(("fields", "name"), HOSTILE, ids=[f"{n}={list(f.values())[-1]!r:.20}" for f, n in HOSTILE])
def test_out_of_bounds_parameters_are_400_naming_the_field(http: httpx.Client, fields: dict, name: str) -> None:
    body = {"prompt": "The cat sat on the mat.", "max_tokens": 8, **fields}
    r = http.post("/v1/completions", content=json.dumps(body).replace('"1e999"', "1e999"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith(name + ":"), err["message"]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["repeat_penalty", "temperature", "top_p", "min_p", "presence_penalty"])
def test_non_finite_numbers_are_refused(http: httpx.Client, field: str, literal: str) -> None:
    raw = '{"prompt": "Hi", "max_tokens": 1, "%s": %s}' % (field, literal)
    r = http.post(
        "/v1/chat/completions", content=raw.replace('"prompt": "Hi"', '"messages": [{"role": "user", "content": "Hi"}]')
    )
    assert r.status_code == 400, r.text
    r = http.post("/v1/completions", content=raw)
    assert r.status_code == 400, r.text


def test_bounded_parameters_at_their_edges_run(http: httpx.Client) -> None:
    """The largest values llama-server accepts run and answer: the penalty window is clamped to the slot's
    context (llama.cpp would allocate the whole window), ``top_k`` clamped into its soft limits, ``seed``
    taken modulo 2**32, a huge temperature read as the largest 32-bit float."""
    edges = {
        "repeat_penalty": 1.3,
        "repeat_last_n": 2**31 - 1,
        "top_k": 2**40,
        "seed": 2**63,
        "stop": ["z" * 512] * 16,
        "temperature": 0,
    }
    r = http.post("/v1/completions", json={"prompt": "The cat sat on the mat.", "max_tokens": 8, **edges})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    r = http.post(
        "/v1/completions",
        json={
            "prompt": "The cat sat on the mat.",
            "max_tokens": 8,
            "dry_multiplier": 0.8,
            "dry_penalty_last_n": 2**31 - 1,
            "temperature": 1e300,
            "seed": -1,
            "repeat_last_n": -1,
            "repeat_penalty": 1.3,
        },
    )
    assert r.status_code == 200, r.text


def test_configure_bounds(server) -> None:
    with Wire(server.port) as w:
        # CONFIGURE refuses what the engine cannot run, where a request's value would be clamped or wrapped
        for params, name in [
            ({"repeat_last_n": -2}, "repeat_last_n"),
            ({"top_k": 2**40}, "top_k"),
            ({"seed": 2**32 + 1}, "seed"),
            ({"n_predict": 2**31}, "n_predict"),
            ({"repeat_penalty": 0.0}, "repeat_penalty"),
            ({"temperature": "1e999"}, "temperature"),
            ({"temperature": -0.5}, "temperature"),
            ({"top_p": 1.5}, "top_p"),
            ({"n_ctx": 2**40}, "n_ctx"),
            ({"n_parallel": 2**40}, "n_parallel"),
        ]:
            status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps(params).replace('"1e999"', "1e999").encode())
            assert status == Status.BAD_REQUEST, (params, meta)
            assert name in meta["error"], meta
        status, meta, _ = w.call(Op.INFO)
        assert status == Status.OK and meta["sampling_defaults"]["repeat_last_n"] == 64


# --------------------------------------------------------------------------- 5. KV blobs
def _fill(base: str, id_slot: int, text: str) -> None:
    r = httpx.post(base + "/v1/completions", json={"prompt": text, "max_tokens": 0, "id_slot": id_slot}, timeout=LONG)
    assert r.status_code == 200, r.text


def test_corrupt_blobs_are_refused_and_the_slot_is_unchanged(server) -> None:
    _fill(server.base, 2, "The quick brown fox jumps over the lazy dog.")
    with Wire(server.port) as w:
        status, meta, blob = w.call(Op.STATE_GET, key="2")
        assert status == Status.OK
        n_past = meta["n_past"]
        n_tokens = struct.unpack_from("<I", blob, 8)[0]
        assert n_tokens == n_past > 5
        tokens_at = parse_header(blob).tokens_at
        kv_at = tokens_at + 4 * n_tokens
        positions = {
            "a KV byte": kv_at + (len(blob) - kv_at) // 2,
            "the last KV byte": len(blob) - 1,
            "a token id": tokens_at + 4,
            "the KV identity": HEADER_SIZE + 40,
            "n_tokens": 8,
            "the model hash": 20,
            "the checksum": 55,
        }
        for what, pos in positions.items():
            bad = bytearray(blob)
            bad[pos] ^= 0x10
            status, meta, _ = w.call(Op.STATE_PUT, key="2", payload=bytes(bad))
            assert status == Status.ERROR, (what, meta)
            # a changed length no longer matches the blob's size; any other flip fails the checksum
            assert ("length" if what == "n_tokens" else "corrupt") in meta["error"], (what, meta)
            status, after, again = w.call(Op.STATE_GET, key="2")
            assert status == Status.OK and after["n_past"] == n_past and again == blob, what
        # the intact blob still restores
        status, meta, _ = w.call(Op.STATE_PUT, key="2", payload=blob)
        assert status == Status.OK and meta["n_past"] == n_past


def test_every_single_bit_flip_is_caught(server) -> None:
    """verify_checksum (what STATE_PUT runs first) refuses a flip of any bit of a real blob."""
    _fill(server.base, 3, "Hello there")
    with Wire(server.port) as w:
        status, _, blob = w.call(Op.STATE_GET, key="3")
    assert status == Status.OK
    header = verify_checksum(blob)
    assert header.version == 3 and header.tokens_at > HEADER_SIZE + 36
    # bytes no structural check reads (the model hash, the checksum field, the KV identity's hash, tokens and
    # KV): only the checksum can catch a flip there, and it must be what says so
    checksum_only = {
        *range(12, 44),
        *range(52, 60),
        *range(HEADER_SIZE, HEADER_SIZE + 32),
        *range(header.tokens_at, len(blob)),
    }
    caught = 0
    by_checksum = 0
    for pos in range(len(blob)):
        for bit in (0, 3, 7):
            bad = bytearray(blob)
            bad[pos] ^= 1 << bit
            with pytest.raises(StateError) as info:
                verify_checksum(bad)
            caught += 1
            assert str(info.value), pos
            if pos in checksum_only:
                assert "checksum" in str(info.value), (pos, bit, str(info.value))
                meta = info.value.wire_meta()
                assert meta["expected_checksum"] != meta["got_checksum"], (pos, bit)
                by_checksum += 1
    assert caught == 3 * len(blob) and by_checksum == 3 * len(checksum_only)


def test_an_empty_slots_state_empties_a_full_slot(server) -> None:
    with Wire(server.port) as w:
        status, _, _ = w.call(Op.STATE_PUT, key="1", payload=b"")  # not a blob: refused
        assert status == Status.ERROR
        r = httpx.post(server.base + "/slots/1?action=erase", timeout=LONG)
        assert r.status_code == 200
        status, meta, empty = w.call(Op.STATE_GET, key="1")
        assert status == Status.OK and meta["n_past"] == 0 and meta["state_size"] == len(empty)
        _fill(server.base, 1, "Some tokens to forget about.")
        status, meta, _ = w.call(Op.STATE_META, key="1")
        assert meta["n_past"] > 0
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=empty)
        assert status == Status.OK, meta
        assert meta["restored"] is True and meta["n_past"] == 0
        status, meta, again = w.call(Op.STATE_GET, key="1")
        assert meta["n_past"] == 0 and again == empty
    # the emptied slot really starts from nothing
    r = httpx.post(
        server.base + "/v1/completions",
        json={"prompt": "Some tokens to forget about.", "max_tokens": 1, "id_slot": 1},
        timeout=LONG,
    )
    assert r.json()["timings"]["cache_n"] == 0


# --------------------------------------------------------------------------- 6. shutdown and start-up
def test_sigterm_while_the_model_loads_exits_zero_quietly(spawn) -> None:
    for _attempt in range(5):
        srv = spawn()
        caught = False
        deadline = time.monotonic() + LONG
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                r = httpx.get(srv.base + "/health", timeout=LONG)
            except httpx.TransportError:
                time.sleep(0.002)
                continue
            if r.status_code == 503:
                srv.proc.send_signal(signal.SIGTERM)
                caught = True
            break
        code = srv.stop(timeout=LONG)
        log = srv.log()
        assert code == 0, log
        assert "fatal" not in log and "Traceback" not in log, log
        if caught and "stage ready" not in log:
            assert "model load stopped" in log or "engine stopped" in log, log
            return
    pytest.fail("the model always finished loading before SIGTERM arrived (5 tries)")


def test_a_configure_waits_for_the_queued_requests_and_they_run_as_they_were_made(spawn) -> None:
    """A CONFIGURE that would shrink the slots is BUSY while a request waits for a slot, not only while one
    runs: the queued request (a prompt that fits the slots it was queued for, not the smaller ones) runs on
    the context it was made for and answers 200, and the CONFIGURE lands once the queue is empty.  Four
    clients send it all along, so one lands in the moment between the running request's end and the
    queued one's start if anything lets it (it once did: the queued request then got a 400)."""
    import threading

    srv = spawn("-np", "1", "-c", "4096")
    srv.wait_ready()
    long_prompt = "word " * 3000  # about 3,000 tokens: fits a 4,096-token slot, not a 2,048-token one
    replies: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        replies[name] = httpx.post(srv.base + "/v1/completions", json=body, timeout=300)

    deferred = _metric(srv.base, "llamacpp:requests_deferred")
    running = threading.Thread(
        target=post,
        args=("running", {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 0}),
    )
    running.start()
    wait_for(lambda: httpx.get(srv.base + "/slots").json()[0]["is_processing"], timeout=120.0)
    queued = threading.Thread(target=post, args=("queued", {"prompt": long_prompt, "max_tokens": 4}))
    queued.start()
    wait_for(lambda: _metric(srv.base, "llamacpp:requests_deferred") > deferred, timeout=120.0)
    applied = threading.Event()
    refusals: list[dict] = []

    def configure() -> None:
        with Wire(srv.port) as w:
            while not applied.is_set():
                status, meta, _ = w.call(Op.CONFIGURE, payload=b'{"n_ctx": 2048}')
                if status == Status.OK:
                    applied.set()
                else:
                    assert status == Status.BUSY, meta
                    refusals.append(meta)

    hammers = [threading.Thread(target=configure) for _ in range(4)]
    for t in hammers:
        t.start()
    for t in (running, queued, *hammers):
        t.join(300)
    r = replies["queued"]
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 2048, r.text  # on the slots it had
    assert applied.is_set() and httpx.get(srv.base + "/props").json()["default_generation_settings"]["n_ctx"] == 2048
    assert any(m.get("requests_waiting") == 1 for m in refusals), refusals[:3]  # refused for the waiting one
    assert httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing")
