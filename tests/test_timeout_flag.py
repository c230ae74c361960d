"""``-to/--timeout`` with llama-server's meaning of every value.

llama-server reads ``--timeout N`` as an integer (``std::stoi``) and gives it to cpp-httplib as the read
and write timeout, which waits on the socket with ``poll(N * 1000 ms)``: ``N > 0`` waits at most N
seconds, ``0`` does not wait at all (a read finds only what the client has already sent), and a negative
``N`` waits forever (``tools/server/server-http.cpp`` and ``vendor/cpp-httplib`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors).  Its default is 3600 s (``common/common.h``).
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from hydra_trio import cli
from hydra_trio.http.settings import HttpSettings

from .test_http_edges import BIG, _serve_one

LONG = 120.0


def _settings(*argv: str) -> tuple[float | None, float | None]:
    """(body_timeout, write_timeout) of a command line, as ``run`` builds its HttpSettings."""
    args = cli.parse_args(list(argv), environ={})
    if args.timeout is None:
        d = HttpSettings()
        return d.body_timeout, d.write_timeout
    v = None if args.timeout < 0 else args.timeout
    return v, v


def test_every_timeout_llama_server_starts_with_parses_with_its_meaning() -> None:
    assert _settings() == (3600.0, 3600.0)  # llama-server's default read and write timeout
    assert _settings("--timeout", "1800") == (1800.0, 1800.0)
    assert _settings("-to", "0") == (0.0, 0.0)  # no waiting
    assert _settings("-to", "-1") == (None, None)  # no limit
    assert _settings("--timeout", "-3600") == (None, None)
    assert cli.parse_args([], environ={"LLAMA_ARG_TIMEOUT": "0"}).timeout == 0.0


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=LONG) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_timeout_0_serves_what_has_arrived_and_waits_for_nothing(spawn) -> None:
    srv = spawn("-np", "1", "-c", "1024", "--timeout", "0", "--no-rpc-backend")
    srv.wait_ready()
    # a request whose body came with its headers is served whole (one write: a client that sends its body
    # later, as most send headers and body in two writes, may find it cut, as llama-server's -to 0 does)
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    data = _raw(
        srv.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] > 0
    # a body that is not there yet is not waited for: 408 at once, the connection closed
    data = _raw(
        srv.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt":',
    )
    assert data.startswith(b"HTTP/1.1 408 "), data[:300]
    assert b"no data waiting (--timeout 0: no waiting)" in data
    assert httpx.get(srv.base + "/health", timeout=LONG).status_code == 200  # the node serves on


def test_a_negative_timeout_waits_for_a_slow_body(spawn) -> None:
    srv = spawn("-np", "1", "-c", "1024", "--timeout", "-1", "--no-rpc-backend")
    srv.wait_ready()
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=LONG) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body[:10])
        )
        s.settimeout(3)  # the body's rest comes 3 s later: no 408 meanwhile
        with pytest.raises(TimeoutError):
            s.recv(1)
        s.settimeout(LONG)
        s.sendall(body[10:])
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]


async def test_a_write_timeout_of_0_waits_for_no_client() -> None:
    """cpp-httplib's ``poll(0)``: a reply the socket cannot take at once closes the connection."""

    def stall(sock: socket.socket, ended: threading.Event) -> int:
        ended.wait(120)  # read nothing until the server gave up on this connection (or 120 s)
        n = 0
        try:
            while chunk := sock.recv(1 << 20):
                n += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return n

    ended, received = await _serve_one(0, stall)
    assert ended, "a client that read nothing kept its connection with a write timeout of 0"
    assert received < len(BIG)


async def test_a_write_timeout_of_0_sends_what_the_socket_takes_at_once() -> None:
    """A reply that fits the socket's buffers goes out whole with a write timeout of 0 (a poll(0) finds the
    socket writable)."""
    import trio

    from hydra_trio.http._hyper import HttpHandler

    reply = b"y" * 4096

    async def small(scope, receive, send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(reply)).encode())]}
        )
        await send({"type": "http.response.body", "body": reply})

    handler = HttpHandler(small, HttpSettings(write_timeout=0))
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]

    def client() -> bytes:
        return _raw(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")

    async def serve() -> None:
        await handler(await listener.accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        data = await trio.to_thread.run_sync(client)
        nursery.cancel_scope.cancel()
    await listener.aclose()
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(reply), data[:200]
