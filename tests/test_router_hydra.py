"""Router mode's Hydra and ggml-RPC (docs/router.md "Hydra and ggml-RPC"), on real sockets: the router process,
its children serving the real SmolLM2 (Q4_1 and Q8_0).

llama-server's router carries neither protocol; the expected values are a node's own (docs/hydra-protocol.md):
INFO with a node's keys plus ``models``, an op relayed to the child its ``model`` (or key ``SLOT@MODEL``)
names answered as that child answers it straight, BAD_REQUEST / NOT_FOUND / BUSY for what the router refuses,
the child's own KV identity check for a blob of another model, and ggml-RPC's HELLO answered with the
protocol version of the llama.cpp that llama-cpp-python 0.3.36 vendors (7).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

from hydra_trio.protocol.hydra import Op, Status, unpack_decode_frames
from hydra_trio.testing.hydra_wire import Wire

from .test_router import TWO_MODELS, router

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def until_served(wire: Wire, op: int, key: str, payload: bytes, timeout: float = 600) -> tuple[int, dict, bytes]:
    """Send the request again while the router answers BUSY (the model is loading); the first other reply."""
    deadline = time.monotonic() + timeout
    while True:
        status, meta, body = wire.call(op, key, payload)
        if status != Status.BUSY or time.monotonic() > deadline:
            return status, meta, body
        time.sleep(0.5)


def prefill_decode(wire: Wire, key: str, **model: Any) -> tuple[int, list[int]]:
    """PREFILL then DECODE (8 tokens, greedy, no prompt cache) on ``key``: (PREFILL's n_past, the tokens)."""
    body = {"messages": MESSAGES, "temperature": 0, "cache_prompt": False, **model}
    status, meta, blob = wire.call(Op.PREFILL, key, json.dumps(body).encode())
    assert status == Status.OK, meta
    assert blob[:4] == b"HYKV" and meta["n_past"] > 0
    n_past = meta["n_past"]
    status, meta, frames = wire.call(Op.DECODE, key, json.dumps({**body, "n_predict": 8}).encode())
    assert status == Status.OK, meta
    assert len(frames) == 9 * 8
    return n_past, [tok for tok, _, flags in unpack_decode_frames(frames) if not flags & 0x02]


def test_hydra_on_the_router_port_addresses_one_model_and_relays_to_its_child(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--models-max", "2", "--no-rpc-backend") as r, Wire(r.port, 300) as w:
        # INFO: a node's keys, the router's role, every model with its status
        status, info, _ = w.call(Op.INFO)
        assert status == Status.OK
        assert info["engine"] == "hydra-trio" and info["role"] == "router" and "capabilities" in info
        assert info["protocols"] == ["http", "hydra"] and info["rpc_backend_active"] is False
        assert [(m["id"], m["aliases"], m["status"]) for m in info["models"]] == [
            ("smollm2-135m", ["small"], "unloaded"),
            ("smollm2-135m-q8", [], "unloaded"),
        ]
        body = json.dumps({"messages": MESSAGES}).encode()
        # no model named, two models, none running: BAD_REQUEST naming why
        status, meta, _ = w.call(Op.PREFILL, "0", body)
        assert status == Status.BAD_REQUEST and "model name is missing" in meta["error"], meta
        # an unknown model, by the payload or by the key: NOT_FOUND
        status, meta, _ = w.call(Op.PREFILL, "0", json.dumps({"messages": MESSAGES, "model": "nope"}).encode())
        assert (status, meta["error"]) == (Status.NOT_FOUND, "model 'nope' not found")
        status, meta, _ = w.call(Op.STATE_META, "0@nope")
        assert (status, meta["error"]) == (Status.NOT_FOUND, "model 'nope' not found")
        # a model named by its alias, not running: its load starts (autoload), BUSY while it loads
        named = json.dumps({"messages": MESSAGES, "model": "small"}).encode()
        status, meta, _ = w.call(Op.PREFILL, "0", named)
        assert status == Status.BUSY and meta["model"] == "smollm2-135m", meta
        assert r.status("smollm2-135m") == "loading"
        status, meta, _ = w.call(Op.STATE_META, "0@small")
        assert status == Status.BUSY and meta["model"] == "smollm2-135m", meta
        status, meta, _ = until_served(w, Op.PREFILL, "0", named)
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m" and not meta["model_fallback"], meta
        # one model running: INFO is its own with `models`; an op without a model goes to it
        status, info, _ = w.call(Op.INFO)
        assert info["model_alias"] == "smollm2-135m" and info["n_slots"] == 1 and info["role"] == "router"
        assert [m["status"] for m in info["models"]] == ["loaded", "unloaded"]
        child_port = info["models"][0]["port"]
        status, meta, _ = w.call(Op.STATE_META, "0")
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m", meta
        # PREFILL + DECODE through the router = the same straight to the child
        via_router = prefill_decode(w, "0")
        with Wire(child_port, 300) as direct:
            assert prefill_decode(direct, "0") == via_router
        # a KV blob of model A never lands in model B: B's own identity check refuses it
        status, meta, blob = w.call(Op.STATE_GET, "0@smollm2-135m")
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m" and meta["n_past"] > 0, meta
        status, meta, _ = until_served(w, Op.STATE_META, "0@smollm2-135m-q8", b"")
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m-q8", meta
        status, meta, _ = w.call(Op.STATE_PUT, "0@smollm2-135m-q8", blob)
        assert status == Status.ERROR and meta["expected_hash"] != meta["got_hash"], meta
        status, meta, _ = w.call(Op.STATE_META, "0@smollm2-135m-q8")
        assert meta["n_past"] == 0  # nothing applied
        # the same blob back into model A restores
        status, meta, _ = w.call(Op.STATE_PUT, "0@small", blob)
        assert status == Status.OK and meta["restored"] is True, meta
        # two running, none named: BAD_REQUEST naming them
        status, meta, _ = w.call(Op.STATE_META, "0")
        assert status == Status.BAD_REQUEST and "2 models are running" in meta["error"], meta


def test_ggml_rpc_on_the_router_port_is_the_routers_own_backend(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS) as r:
        with socket.create_connection(("127.0.0.1", r.port), timeout=120) as s:
            s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))  # RPC_CMD_HELLO
            reply = b""
            while len(reply) < 8 + 28:
                chunk = s.recv(8 + 28 - len(reply))
                assert chunk, f"closed after {len(reply)} bytes"
                reply += chunk
        assert struct.unpack("<Q", reply[:8])[0] == 28 and reply[8] == 7  # RPC_PROTO_MAJOR_VERSION
        with Wire(r.port) as w:
            status, info, _ = w.call(Op.INFO)
        assert status == Status.OK and info["protocols"] == ["http", "hydra", "ggml_rpc"]
        assert info["rpc_backend_active"] is True and info["rpc_backend"]["connections"] >= 1
        assert all(m["status"] == "unloaded" for m in info["models"])  # no model loaded for it
