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
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra_trio.protocol.hydra import (
    DECODE_STOP_FLAGS,
    Op,
    PayloadChunk,
    ResponseEnded,
    ResponseStarted,
    Status,
    encode_request,
    unpack_decode_frames,
)
from hydra_trio.testing.hydra_wire import Wire

from .conftest import listening_pid, wait_for
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


ONE_MODEL = """\
version = 1
[smollm2-135m]
model = smollm2-135m
c = 2048
np = 1
stop-timeout = 5
"""


def child_pid(port: int) -> int:
    """The pid of the child node listening on ``port``."""
    return listening_pid(port)


def read_streamed(w: Wire, once_started: Callable[[], None]) -> tuple[int, dict, bytes]:
    """Read a streamed reply, calling ``once_started`` when its header and first payload bytes are in."""
    status, meta, body, called = None, None, bytearray(), False
    while True:
        data = w.sock.recv(1 << 16)
        assert data, "the router closed the connection"
        for ev in w.dec.feed(data):
            if isinstance(ev, ResponseStarted):
                status, meta = ev.header.status, ev.meta
            elif isinstance(ev, PayloadChunk):
                body += ev.data
            elif isinstance(ev, ResponseEnded):
                assert status is not None and meta is not None
                return status, meta, bytes(body)
        if body and not called:
            called = True
            once_started()


def new_port(r: Any) -> int:
    """The port of the child of the router's model ``smollm2-135m``."""
    args = r.models()["smollm2-135m"]["status"]["args"]
    return int(args[args.index("--port") + 1])


def unread_by(port: int) -> bool:
    """Whether a connection to ``port`` on the loopback holds bytes its listener's process has not read."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01" and int(fields[4].split(":")[1], 16):
            return True
    return False


def long_decode(n_predict: int = 1500) -> bytes:
    return json.dumps(
        {"messages": MESSAGES, "n_predict": n_predict, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
    ).encode()


def test_the_only_model_is_addressed_without_a_name_and_a_child_that_goes_ends_the_decode(tmp_path: Path) -> None:
    """``--models-max 1``, one model, none loaded: a request without ``model`` (as a single node's client sends)
    loads it (BUSY until it serves), then is served.  A client that leaves a DECODE stops it in the child; a
    child killed during a DECODE ends its frames with the error flag, the payload still whole."""
    with router(tmp_path, ONE_MODEL, "--models-max", "1", "--no-rpc-backend") as r, Wire(r.port, 300) as w:
        status, meta, _ = w.call(Op.PREFILL, "0", json.dumps({"messages": MESSAGES}).encode())
        assert status == Status.BUSY and meta["model"] == "smollm2-135m", meta
        status, meta, _ = until_served(w, Op.PREFILL, "0", json.dumps({"messages": MESSAGES}).encode())
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m", meta
        port = new_port(r)
        # the client leaves a DECODE: its connection to the child closes, the child stops the work
        with Wire(r.port, 300) as leaving:
            leaving.send(encode_request(Op.DECODE, "0", long_decode(), trace_id="leaves"))
            wait_for(
                lambda: r.http.get("/slots", params={"model": "smollm2-135m"}).json()[0]["is_processing"],
                300,
                "the slot works",
            )
        wait_for(
            lambda: "[leaves] hydra: the peer closed the connection during DECODE" in r.log(),
            300,
            "the child stops the DECODE",
        )
        # the child is killed during a DECODE (its frames have begun): they end with the error flag, padded
        w.send(encode_request(Op.DECODE, "0", long_decode(), trace_id="killed"))
        status, meta, frames = read_streamed(w, lambda: os.kill(child_pid(port), signal.SIGKILL))
        assert status == Status.OK and len(frames) == 9 * 1500, meta
        flags = [f for _, _, f in unpack_decode_frames(frames)]
        assert any(f & DECODE_STOP_FLAGS["error"] for f in flags), flags[-3:]
        assert flags[-1] & 0x02  # padding to the end
        r.wait_status("smollm2-135m", "unloaded")
        assert r.models()["smollm2-135m"]["status"]["exit_code"] == 128 + signal.SIGKILL
        # the same client connection: the model loads again for it
        status, meta, _ = until_served(w, Op.STATE_META, "0", b"")
        assert status == Status.OK and meta["n_past"] == 0, meta
        # a child that goes before its reply (stopped, then killed, with the request sent): an ERROR reply
        port = new_port(r)
        pid = child_pid(port)
        os.kill(pid, signal.SIGSTOP)
        w.send(encode_request(Op.STATE_META, "0", b""))
        wait_for(lambda: unread_by(port), 300, "the request waits in the stopped child's socket")
        os.kill(pid, signal.SIGKILL)
        status, meta, _ = w.read_reply()
        assert status == Status.ERROR and meta["error"].startswith("proxy error: model smollm2-135m"), meta
        assert meta["model"] == "smollm2-135m"


def test_a_load_that_fails_is_told_once_then_tried_again(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is no GGUF file")
    with router(tmp_path, f"[broken]\nmodel = {broken}\nc = 256\n", "--no-rpc-backend") as r, Wire(r.port) as w:
        status, meta, _ = until_served(w, Op.STATE_META, "0", b"")
        assert status == Status.ERROR and meta["error"] == "model name=broken failed to load", meta
        assert meta["exit_code"] != 0 and meta["model"] == "broken"
        status, meta, _ = w.call(Op.STATE_META, "0")  # the next request loads it again
        assert status == Status.BUSY and meta["model"] == "broken", meta


def test_the_routers_access_rules_and_autoload_off(tmp_path: Path) -> None:
    """The router applies ``--hydra-token`` itself (its children do not get it); without autoload a model not
    running is BAD_REQUEST; CONFIGURE's ``model`` addresses a model, ``model_path`` is refused."""
    args = ("--no-models-autoload", "--hydra-token", "s3cret", "--no-rpc-backend")
    with router(tmp_path, TWO_MODELS, *args) as r, Wire(r.port) as w:
        status, meta, _ = w.call(Op.PREFILL, "0", json.dumps({"messages": MESSAGES, "model": "small"}).encode())
        assert (status, meta["error"], meta["model"]) == (Status.BAD_REQUEST, "model is not loaded", "smollm2-135m")
        configure = json.dumps({"model": "small", "temperature": 0.5}).encode()
        status, meta, _ = w.call(Op.CONFIGURE, "", configure)
        assert status == Status.BAD_REQUEST and meta["refused"] == "not_allowed", meta
        status, meta, _ = w.call(Op.CONFIGURE, "", json.dumps({"auth": "s3cret"}).encode())
        assert status == Status.OK and meta["trusted"] is True, meta
        assert r.http.post("/models/load", json={"model": "small"}).json() == {"success": True}
        assert "--hydra-token" not in r.models()["smollm2-135m"]["status"]["args"]
        status, meta, _ = until_served(w, Op.CONFIGURE, "", configure)
        assert status == Status.OK and meta["params_applied"] == {"temperature": 0.5}, meta
        for params in ({"model": "small", "model_path": "x"}, {"model_path": "x"}):
            status, meta, _ = w.call(Op.CONFIGURE, "", json.dumps(params).encode())
            assert status == Status.BAD_REQUEST and "model_path" in meta["error"], meta
        status, meta, _ = w.call(Op.STATE_META, "0@small")  # nothing reloaded
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m", meta
        status, meta, _ = w.call(Op.STATE_META, "0@small", b"")
        assert status == Status.OK and meta["model_alias"] == "smollm2-135m", meta
        # the key and the payload naming two models
        status, meta, _ = w.call(Op.PREFILL, "0@smollm2-135m-q8", json.dumps({"model": "small"}).encode())
        assert status == Status.BAD_REQUEST, meta


def test_a_child_lives_as_long_as_the_router_not_the_thread_that_forked_it(tmp_path: Path) -> None:
    """A child dies with the router (``PR_SET_PDEATHSIG``), which Linux ties to the thread that forked it: a
    child forked in a worker thread of trio's cache got SIGTERM when that thread retired, 10 s idle later."""
    preset = ONE_MODEL + "load-on-startup = true\n"
    with router(tmp_path, preset, "--no-rpc-backend") as r:
        r.wait_status("smollm2-135m", "loaded")
        pid = child_pid(new_port(r))
        time.sleep(15)  # past trio's thread-cache idle timeout (10 s)
        assert r.status("smollm2-135m") == "loaded", r.log()[-2000:]
        with Wire(r.port) as w:
            status, meta, _ = w.call(Op.STATE_META, "0")
        assert status == Status.OK and child_pid(new_port(r)) == pid, meta


def test_open_ggml_rpc_on_a_public_address_warns_once_as_a_nodes(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--host", "0.0.0.0") as r:
        assert r.log().count("ggml-RPC is open to every peer") == 1
    with router(tmp_path, TWO_MODELS, "--host", "0.0.0.0", "--rpc-allow", "10.0.0.0/8") as r:
        assert "ggml-RPC is open to every peer" not in r.log()
