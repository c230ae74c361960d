"""One port, first-byte classification: real sockets against a real server process."""

from __future__ import annotations

import socket
import time

import httpx

from .conftest import ServerProcess


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def _metric(http: httpx.Client, protocol: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f'hydra_trio:connections_total{{protocol="{protocol}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_unknown_first_byte_is_closed_and_http_unaffected(server: ServerProcess, http: httpx.Client) -> None:
    before = _metric(http, "unknown")
    with httpx.Client(base_url=server.base) as keepalive:
        assert keepalive.get("/health").status_code == 200
        with _connect(server) as bad:
            bad.sendall(b"\x00\x01garbage")
            assert _closed_by_peer(bad)
        assert keepalive.get("/health").status_code == 200  # same keep-alive connection
    assert _metric(http, "unknown") == before + 1


def test_hydra_and_rpc_bytes_are_classified(server: ServerProcess, http: httpx.Client) -> None:
    before = _metric(http, "ggml_rpc")
    with _connect(server) as s:
        # RPC_CMD_HELLO with protocol 7's 24 bytes of transport caps: the ggml-RPC backend answers
        s.sendall(b"\x0e" + (24).to_bytes(8, "little") + bytes(24))
        reply = b""
        while len(reply) < 8 + 28:
            chunk = s.recv(64)
            assert chunk, reply
            reply += chunk
        assert int.from_bytes(reply[:8], "little") == 28 and reply[8] == 7  # version 7.x.y
    assert _metric(http, "ggml_rpc") == before + 1
    before = _metric(http, "hydra")
    with _connect(server) as s:
        s.sendall(b"YH")
        s.shutdown(socket.SHUT_WR)  # a truncated Hydra header, then EOF: closed, no reply
        assert _closed_by_peer(s)
    assert _metric(http, "hydra") == before + 1


def test_silent_connection_closed_after_classify_timeout(server: ServerProcess, http: httpx.Client) -> None:
    before = _metric(http, "timeout")
    # t0 before the connect: the node's timer starts at its accept, which comes after this in every
    # interleaving (read after the connect, a client preempted between the two could see less than 1 s)
    t0 = time.monotonic()
    with _connect(server) as s:
        s.settimeout(120)  # a busy machine is slow, never wrong: the close must come, and not before its time
        assert _closed_by_peer(s)
        waited = time.monotonic() - t0
    assert 0.8 <= waited < 120, waited  # the fixture runs with --classify-timeout 1
    assert _metric(http, "timeout") == before + 1
    assert http.get("/health").status_code == 200


def test_split_http_request_line(server: ServerProcess) -> None:
    with _connect(server) as s:
        s.sendall(b"G")
        time.sleep(0.3)
        s.sendall(b"ET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    assert b'"status":"ok"' in data
