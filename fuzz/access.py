"""Fuzzing the access rules of a live node: wrong API keys, refused control ops, wrong tokens.

:class:`AccessMachine` drives a node started with ``--api-key KEY``,
``--control-allow`` a network that does not hold 127.0.0.1, and
``--hydra-token TOKEN`` (point it there with :func:`configure`).  After every
step it checks: nothing answered 500 or broke the framing, every wrong key is
a 401 with llama-server's body, every control op from this untrusted address
(and every wrong token) is a BAD_REQUEST with ``refused`` and **changed
nothing** (the sampling defaults, the mode and each slot's ``n_past`` are as
they were), and ``/health`` is 200.
"""

from __future__ import annotations

import json
import socket

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hydra_trio.http.auth import bearer_key
from hydra_trio.protocol.hydra import Op, Status, encode_request

from . import wire

TIMEOUT = 60.0
TARGET: dict[str, object] = {"port": None, "key": None, "token": None, "n_slots": 2}
UNAUTHORIZED = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
CONTROL = [Op.CONFIGURE, Op.SET_EXPERT_MODE, Op.STATE_PUT, Op.SWAP_QUANT, Op.PIPELINE_ATTACH]

_header_bytes = st.binary(max_size=80).filter(lambda b: not any(c in b for c in b"\r\n\x00"))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def configure(port: int, key: str, token: str, n_slots: int) -> None:
    """Point the machine at a node on 127.0.0.1:``port`` run with ``--api-key key --hydra-token token``
    and a ``--control-allow`` that excludes 127.0.0.1, with ``n_slots`` slots."""
    TARGET.update(port=port, key=key, token=token, n_slots=n_slots)
    wire.configure(port, n_slots)


def count(kind: str) -> None:
    """One more request of ``kind`` in the fuzzer's summary (``fuzz.wire.STATS``), and one more ``access``."""
    wire.STATS["access"] = wire.STATS.get("access", 0) + 1
    wire.STATS[kind] = wire.STATS.get(kind, 0) + 1


def hydra_exchange(op: int, key: str = "", payload: bytes = b"") -> tuple[int, dict, bytes]:
    """One Hydra request on a fresh (untrusted) connection; its reply, checked well-formed (fuzz.live)."""
    reply = wire.hydra_exchange([encode_request(op, key=key, payload=payload, trace_id="fuzz-access")])
    assert reply is not None, f"op 0x{op:02x}: the connection closed instead of replying"
    return reply


def _base() -> str:
    return f"http://127.0.0.1:{TARGET['port']}"


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TARGET['key']}"}


def guarded_state() -> dict:
    """What a refused request must not change: sampling defaults, the mode, every slot's n_past."""
    props = httpx.get(_base() + "/props", headers=_auth(), timeout=TIMEOUT).json()
    slots = httpx.get(_base() + "/slots", headers=_auth(), timeout=TIMEOUT).json()
    _, info, _ = hydra_exchange(Op.INFO)
    return {
        "params": props["default_generation_settings"]["params"],
        "mode": info["mode"],
        "n_past": [s["n_past"] for s in slots],
    }


def raw_http(method: str, path: str, header: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request with ``header`` (a whole ``Name: value`` line, sent as it is) over a raw
    socket, ``Connection: close``; ``(status, body)``.  (httpx refuses to send odd header values.)"""
    with socket.create_connection(("127.0.0.1", int(TARGET["port"])), timeout=TIMEOUT) as s:
        s.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Length: 0\r\n".encode()
            + header
            + b"\r\nConnection: close\r\n\r\n"
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    return int(head.split()[1]), body


class AccessMachine(RuleBasedStateMachine):
    """Hostile credentials and control ops against a node with access rules (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.before = guarded_state()
        self.steps = 0

    @rule(
        key=_header_bytes,
        scheme=st.sampled_from([b"Bearer ", b"bearer ", b"", b"Basic ", b"Bearer  "]),
        path=st.sampled_from(["/v1/models", "/v1/chat/completions", "/slots", "/props", "/metricsx", "/v1/events"]),
    )
    def wrong_api_key(self, key: bytes, scheme: bytes, path: str) -> None:
        if bearer_key([(b"authorization", scheme + key)]) == str(TARGET["key"]).encode():
            return
        count("access_wrong_key")
        status, body = raw_http("GET", path, b"Authorization: " + scheme + key)
        assert status in (400, 401), (path, key, status, body)  # 400: h11 refused the header line itself
        if status == 401:
            assert json.loads(body) == UNAUTHORIZED

    @rule(key=_header_bytes)
    def wrong_x_api_key(self, key: bytes) -> None:
        if bearer_key([(b"x-api-key", key)]) == str(TARGET["key"]).encode():  # "Bearer KEY" is the key too
            return
        count("access_wrong_key")
        status, body = raw_http("POST", "/v1/completions", b"X-Api-Key: " + key)
        assert status in (400, 401), (key, status, body)
        if status == 401:
            assert json.loads(body) == UNAUTHORIZED

    @rule(op=st.sampled_from(CONTROL), payload=st.binary(max_size=4096), key=st.sampled_from(["", "0", "1", "x"]))
    def refused_control_op(self, op: int, payload: bytes, key: str) -> None:
        count("access_refused_control")
        status, meta, body = hydra_exchange(op, key=key, payload=payload)
        assert status == Status.BAD_REQUEST and body == b"", (op, status, meta)
        assert meta.get("refused") in ("not_allowed", "invalid_token") and meta.get("error"), meta

    @rule(
        token=st.one_of(_json_values, st.text(max_size=40)),
        extra=st.dictionaries(
            st.sampled_from(["temperature", "seed", "top_k", "n_ctx", "model", "bogus"]), _json_values, max_size=3
        ),
    )
    def wrong_token(self, token: object, extra: dict) -> None:
        if token == TARGET["token"]:
            return
        count("access_wrong_token")
        payload = json.dumps({"auth": token, **extra}).encode()
        status, meta, _ = hydra_exchange(Op.CONFIGURE, payload=payload)
        assert status == Status.BAD_REQUEST and meta.get("refused") == "invalid_token", meta

    @rule(op=st.sampled_from([Op.INFO, Op.STATE_META]), slot=st.integers(0, 1))
    def read_only_ops_stay_open(self, op: int, slot: int) -> None:
        status, meta, _ = hydra_exchange(op, key=str(slot))
        assert status == Status.OK, meta

    @invariant()
    def nothing_changed(self) -> None:
        self.steps += 1
        wire.STATS["steps"] += 1
        assert httpx.get(_base() + "/health", timeout=TIMEOUT).status_code == 200
        assert guarded_state() == self.before
