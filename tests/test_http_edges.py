"""HTTP/1.1 edge cases a real client or proxy produces, over raw sockets to the real server."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import trio

from .conftest import ServerProcess


def exchange(port: int, data: bytes, timeout: float = 120.0) -> bytes:
    """Send ``data`` on a fresh connection, read until the server closes (requests ask for close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:  # closed with our bytes unread: a reset is a close too
            pass
        return out


def test_empty_lines_before_the_request_line_are_ignored(server: ServerProcess) -> None:
    for lead in (b"\r\n", b"\n", b"\r\n\r\n"):
        out = exchange(server.port, lead + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200 "), (lead, out[:100])
        assert json.loads(out.split(b"\r\n\r\n", 1)[1]) == {"status": "ok", "stage": "ready"}
    # CR/LF followed by something that is no protocol: still closed without a reply
    assert exchange(server.port, b"\r\n\x01\x02") == b""


def test_absolute_form_targets_route_like_origin_form(server: ServerProcess) -> None:
    out = exchange(
        server.port,
        b"GET http://example.invalid:8080/health HTTP/1.1\r\nHost: example.invalid\r\nConnection: close\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    out = exchange(
        server.port,
        b"POST HTTP://x/v1/completions?a=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    assert b'"text_completion"' in out


def test_expect_continue_over_the_cap_is_413_without_100(server: ServerProcess) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n"
    )
    out = exchange(server.port, head % (64 * 1024 * 1024))  # no body sent: the client waits for the 100
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert b" 100 " not in out.split(b"\r\n", 1)[0]
    assert b"limit" in out
    # under the cap, the 100 comes and the request goes through
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(head % len(body) + b"")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 100 "), first
        s.sendall(body)
        rest = s.recv(65536)
        assert rest.startswith(b"HTTP/1.1 200 ") or b"HTTP/1.1 200 " in first + rest


def _read_reply(s: socket.socket) -> tuple[bytes, bytes]:
    """One reply on ``s``: its head (status line and headers, lower-cased) and its body (Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a whole reply head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(line.split(b":", 1)[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    )
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed inside the reply body"
        body += chunk
    return head.lower(), body


@pytest.mark.parametrize("path", ["/infill", "/no/such/route"])
def test_a_reply_before_the_body_is_read_says_connection_close(server: ServerProcess, path: str) -> None:
    """The app answers these without reading the body (501, 404).  hypercorn then closes the connection,
    because the request is unfinished, and before it said nothing: a client that sent its next request on
    that kept connection got no reply (seen in CI as httpx's "Server disconnected without sending a
    response" on ``GET /props`` after a ``POST /props``, whose body is read now).  Now the reply says
    ``Connection: close``, and the close follows it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
            % path.encode()
        )  # the body ({}) is never sent: the reply comes first
        head, body = _read_reply(s)
        assert head.split(b" ", 2)[1] in (b"501", b"404"), head
        assert b"\r\nconnection: close" in head, head
        assert json.loads(body)["error"]["message"]
        assert s.recv(65536) == b""  # and the server closes


@pytest.mark.parametrize(("path", "status"), [("/tokenize", b"200"), ("/props", b"501")])
def test_a_reply_to_a_request_whose_body_was_read_keeps_the_connection(
    server: ServerProcess, path: str, status: bytes
) -> None:
    """``POST /props`` reads its body before it answers (501 without ``--props``), as llama-server's HTTP
    server does, so the connection stays usable."""
    body = json.dumps({"content": "Hello"}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        for _ in range(3):
            s.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
            )
            head, reply = _read_reply(s)
            assert head.startswith(b"http/1.1 " + status + b" ") and b"connection: close" not in head, head
            assert json.loads(reply)


def test_cors(server: ServerProcess, spawn) -> None:
    pre = httpx.options(
        server.base + "/v1/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization",
        },
        timeout=120,
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] in ("*", "http://app.example")
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.get(server.base + "/v1/models", headers={"Origin": "http://app.example"}, timeout=120)
    assert r.headers["access-control-allow-origin"] in ("*", "http://app.example")
    # restricted to one origin
    srv = spawn("--cors-origin", "http://ok.example", "--no-rpc-backend")
    srv.wait_ready()
    ok = httpx.get(srv.base + "/health", headers={"Origin": "http://ok.example"}, timeout=120)
    assert ok.headers["access-control-allow-origin"] == "http://ok.example"
    other = httpx.get(srv.base + "/health", headers={"Origin": "http://evil.example"}, timeout=120)
    assert "access-control-allow-origin" not in other.headers
    pre = httpx.options(
        srv.base + "/v1/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        timeout=120,
    )
    assert pre.status_code == 400


def test_a_connection_the_client_closed_is_closed_at_once(spawn) -> None:
    # was: hypercorn's keep-alive timer held the socket in CLOSE-WAIT for keep_alive_timeout seconds
    node = spawn("--no-model", "--keep-alive-timeout", "600")
    node.wait_ready()
    scrape = httpx.Client(base_url=node.base, timeout=30)  # one kept connection: it counts once

    def open_now() -> float:
        text = scrape.get("/metrics").text
        return float(text.split("\nhydra_trio:connections_open ")[1].split()[0])

    before = open_now()
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", node.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 60  # far below the 600 s keep-alive timeout
    while open_now() > before:
        assert time.monotonic() < deadline, f"closed connections are still held open: {open_now()} > {before}"
        time.sleep(0.1)
    scrape.close()


def test_http2_is_not_offered_on_a_plain_connection(server: ServerProcess) -> None:
    """The node speaks HTTP/1.1 only (its connection handling, caps and timers are for HTTP/1.1): an
    ``Upgrade: h2c`` is ignored and the request answered in HTTP/1.1 (RFC 9110 §7.8 lets a server ignore
    it); HTTP/2 with prior knowledge gets no HTTP/2 and its connection is closed, not held open (it was,
    until shutdown)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        )
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        data = b""
        while chunk := s.recv(4096):  # the server closes the connection
            data += chunk
    assert not data.startswith(b"\x00\x00"), data  # no HTTP/2 SETTINGS frame
    with httpx.Client(http1=False, http2=True, timeout=60) as client:
        try:
            r = client.get(server.base + "/health")
        except httpx.HTTPError:
            pass
        else:
            raise AssertionError(f"HTTP/2 answered: {r.http_version} {r.status_code}")


def test_a_malformed_chunked_body_is_refused_without_an_error_in_the_log(server: ServerProcess) -> None:
    """A chunk ended by a bare LF (found by examples/fuzz_my_node.py): hypercorn answers 400 and closes
    while the app answers the request too (405, 404) or reads its body.  The two sends and the close
    raced on the socket (``BusyResourceError``: an ERROR traceback, no reply at all), and the body
    reader's ``ClientDisconnect`` was a 500 with a traceback.  Now: one reply (or a close) per
    connection, the body reader's request logged as 400, no ERROR line, and the node serves on."""
    before = len(server.log())
    cases = [
        (b"HEAD", b"/slots/0", (b"400", b"405")),
        (b"GET", b"/nope", (b"400", b"404")),
        (b"POST", b"/v1/completions", (b"400",)),
    ]
    for method, target, statuses in cases:
        for _ in range(8):
            out = exchange(
                server.port,
                method + b" " + target + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\n0\r\n\r\n",
                timeout=60,
            )
            assert out == b"" or out.split(b" ", 2)[1] in statuses, (method, target, out[:200])
            assert out.count(b"HTTP/1.1 ") <= 1, out[:400]
    assert httpx.get(server.base + "/health", timeout=60).json() == {"status": "ok", "stage": "ready"}
    deadline = time.monotonic() + 60
    while server.log()[before:].count('"POST /v1/completions HTTP/1.1"') < 8 and time.monotonic() < deadline:
        time.sleep(0.1)  # the app logs a request when its handler returns, which may be after the close
    new = server.log()[before:]
    assert new.count('"POST /v1/completions HTTP/1.1" 400') == 8, new[-4000:]
    assert " ERROR " not in new and "Traceback" not in new, new[-4000:]


BIG = b"x" * (32 << 20)  # more than the kernel buffers on both ends of a loopback connection hold


async def _big_reply(scope, receive, send) -> None:  # a plain ASGI app: one 32 MiB reply
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(BIG)).encode())]})
    await send({"type": "http.response.body", "body": BIG})


async def _serve_one(write_timeout: float, client) -> tuple[bool, int]:
    """HttpHandler (hypercorn's per-connection server, as the front door runs it) on one real loopback
    connection; ``client(sock, ended)`` runs in a thread and returns the bytes it received (``ended``: a
    threading.Event set when the handler has returned by itself).  Returns (handler ended, bytes)."""
    from hydra_trio.http._hyper import HttpHandler
    from hydra_trio.http.settings import HttpSettings

    handler = HttpHandler(_big_reply, HttpSettings(write_timeout=write_timeout))
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    ended = threading.Event()

    def run_client() -> int:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(120)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            return client(sock, ended)

    async def serve() -> None:
        stream = await listener.accept()
        await handler(stream)
        ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        received = await trio.to_thread.run_sync(run_client)
        nursery.cancel_scope.cancel()
    await listener.aclose()
    return ended.is_set(), received


def _read_all(sock: socket.socket, _ended: threading.Event | None = None) -> int:
    n = 0
    try:
        while n < len(BIG) and (chunk := sock.recv(1 << 20)):
            n += len(chunk)
    except (ConnectionResetError, TimeoutError):
        pass
    return n


async def test_a_client_that_reads_nothing_loses_its_connection_after_the_write_timeout() -> None:
    def stall(sock: socket.socket, ended: threading.Event) -> int:
        ended.wait(120)  # read nothing until the server gave up on this connection (or 120 s)
        return _read_all(sock)

    ended, received = await _serve_one(0.5, stall)
    assert ended, "a client that read nothing kept its connection past the write timeout"
    assert received < len(BIG)  # the reply was cut: the connection closed with most of it unsent


async def test_a_client_that_reads_gets_the_whole_reply_under_the_write_timeout() -> None:
    _ended, received = await _serve_one(60.0, _read_all)
    assert received >= len(BIG)  # the status line, the headers and the whole body
