"""Fuzz a node with the project's hypothesis strategies, from your own test.

Run it with pytest from the repository root (``fuzz`` is importable from there),
against a node you started::

    HYDRA_NODE=127.0.0.1:8080 .venv/bin/python -m pytest examples/fuzz_my_node.py -q
    HYDRA_NODE=127.0.0.1:8080 HYDRA_FUZZ_EXAMPLES=500 .venv/bin/python -m pytest examples/fuzz_my_node.py -q

The strategies are the ones ``python -m fuzz`` runs (``fuzz/strategies.py``):
well-formed Hydra requests, Hydra requests with one field off, and raw HTTP
requests, valid or broken in one way.  Each example goes on its own
connection; every test checks what any node owes its clients: a well-formed
reply or a close, no hang, and ``/health`` still 200 afterwards.
"""

from __future__ import annotations

import os
import socket

import httpx
from hypothesis import HealthCheck, given, settings

from fuzz.strategies import Mutant, Req, http_requests, nearly_valid_requests, valid_requests
from hydra_trio.protocol.hydra import ResponseDecoder, ResponseEnded, ResponseStarted, Status

HOST, _, PORT = os.environ.get("HYDRA_NODE", "127.0.0.1:8080").rpartition(":")
TIMEOUT = 60.0  # seconds: generous, so that only a hang fails
fuzz = settings(
    max_examples=int(os.environ.get("HYDRA_FUZZ_EXAMPLES", "25")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def exchange(data: bytes) -> bytes:
    """Send ``data``, end our side (EOF), read until the node closes; everything it sent."""
    with socket.create_connection((HOST, int(PORT)), timeout=TIMEOUT) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the node closed first (e.g. bad magic): a close is an answer
        out = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except ConnectionResetError:
            pass
        return bytes(out)  # socket.timeout (a hang) propagates and fails the test


def hydra_replies(data: bytes) -> list[tuple[int, dict]]:
    """The (status, meta) of each whole reply in ``data``; a malformed reply raises ProtocolError."""
    replies, started = [], None
    for event in ResponseDecoder().feed(data):
        if isinstance(event, ResponseStarted):
            started = (event.header.status, event.meta)
        elif isinstance(event, ResponseEnded):
            replies.append(started)
    return replies


def still_healthy() -> None:
    assert httpx.get(f"http://{HOST}:{PORT}/health", timeout=TIMEOUT).status_code == 200


@fuzz
@given(valid_requests(max_payload=256))
def test_every_well_formed_hydra_request_gets_one_reply(req: Req) -> None:
    replies = hydra_replies(exchange(req.encode()))
    assert len(replies) == 1, replies
    status, meta = replies[0]
    assert status in set(Status)
    assert status == Status.OK or meta.get("error"), meta  # a refusal says why
    still_healthy()


@fuzz
@given(nearly_valid_requests())
def test_a_request_with_one_field_off_gets_an_error_or_a_close(mutant: Mutant) -> None:
    replies = hydra_replies(exchange(mutant.data))  # whatever comes back is well-formed
    assert len(replies) <= 1, replies
    still_healthy()


@fuzz
@given(http_requests())
def test_raw_http_gets_a_status_line_or_a_close(data: bytes) -> None:
    reply = exchange(data)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 "), reply[:200]
    still_healthy()
