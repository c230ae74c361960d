"""The Hydra binary protocol against live server processes with the real model."""

from __future__ import annotations

import json
import struct
import time
import uuid

import httpx
import pytest

from hydra_trio.engine.kv.state import HEADER_SIZE, blob_checksum
from hydra_trio.protocol.hydra import (
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_PAD_TOKEN,
    DECODE_STOP_FLAGS,
    Op,
    Status,
    decode_stop_reason,
    encode_request,
    encode_request_header,
    unpack_decode_frames,
)
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess, streaming, wait_for

CORE_INFO_KEYS = {
    "engine",
    "version",
    "capabilities",
    "preset_aliases",
    "solo_active",
    "rpc_backend_active",
    "mode",
    "peer_addr",
    "peer_reachable",
    "layer_split",
    "combined_head_attached",
    "pipeline_capable",
}
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def chat_on_slot(base: str, slot: int, messages: list[dict] = MESSAGES, max_tokens: int = 24) -> dict:
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": messages, "temperature": 0, "max_tokens": max_tokens, "id_slot": slot},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_info_has_core_keys(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        status, meta, payload = w.call(Op.INFO, key="rtx")
    assert status == Status.OK and payload == b""
    assert meta.keys() >= CORE_INFO_KEYS
    assert meta["engine"] == "hydra-trio" and meta["mode"] == "solo" and meta["solo_active"] is True
    assert "smollm2-135m" in meta["preset_aliases"]
    assert meta["n_slots"] == 4 and meta["n_ctx_slot"] == 2048
    assert len(meta["model_hash"]) == 64 and meta["model_alias"] == "smollm2-135m"
    assert "hydra" in meta["protocols"]


def test_unknown_and_store_opcodes_keep_connection(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        status, meta, _ = w.call(0x7A, payload=b"x" * 100_000)
        assert status == Status.NOT_IMPLEMENTED and "0x7a" in meta["error"]
        status, meta, _ = w.call(0x05, key="some-store-key", payload=b"abc")
        assert status == Status.NOT_IMPLEMENTED and "Store" in meta["error"]
        status, meta, _ = w.call(Op.INFO)
        assert status == Status.OK and meta["engine"] == "hydra-trio"


def test_flags_key_rules_and_not_implemented_ops(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        w.send(encode_request(Op.INFO, flags=0x01, payload=b"zz"))
        status, meta, _ = w.read_reply()
        assert status == Status.BAD_REQUEST and "flags" in meta["error"]
        assert w.call(Op.STATE_META, key="abc")[0] == Status.BAD_REQUEST
        status, meta, _ = w.call(Op.STATE_META, key="4")
        assert status == Status.NOT_FOUND and "slot 4" in meta["error"]
        assert w.call(Op.STATE_META, key="-1")[0] == Status.NOT_FOUND
        status, meta, _ = w.call(Op.SWAP_QUANT, payload=struct.pack("<H", 4) + b"q8_0" + b"ffn_.*")
        assert status == Status.BAD_REQUEST and "not one of this node's quants" in meta["error"]
        status, meta, _ = w.call(
            Op.PIPELINE_ATTACH, payload=json.dumps({"peer": "127.0.0.1:1", "ot_split": "x"}).encode()
        )
        assert status == Status.OK and meta["success"] is False and "does not answer" in meta["fallback_reason"]
        assert meta["mode"] == "solo"
        status, meta, _ = w.call(Op.STATE_META, key="0")
        assert status == Status.OK and {"slot_id", "n_past", "state_size", "is_processing", "model_hash"} <= meta.keys()


def test_bad_magic_closes_without_reply(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        w.send(b"YX" + b"\0" * 14)
        assert w.closed_by_server()


def test_oversize_payload_gets_bad_request_then_close(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        w.send(encode_request_header(Op.CONFIGURE, payload_len=65 * 1024 * 1024))
        status, meta, _ = w.read_reply()
        assert status == Status.BAD_REQUEST and "payload" in meta["error"]
        assert w.closed_by_server()


def test_set_expert_mode_busy_while_streaming(server: ServerProcess) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "id_slot": 0}
    with Wire(server.port) as w:
        with streaming(server.base, body):
            info_before = w.call(Op.INFO)[1]
            status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo")
            assert status == Status.BUSY
            assert meta["success"] is False and meta["busy_slots"] == [0] and meta["error"]
            info_after = w.call(Op.INFO)[1]
            for k in CORE_INFO_KEYS:
                assert info_after[k] == info_before[k]
        # the stream is closed: its slot frees at the engine's next step (a busy machine may take a while)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo")
            if status != Status.BUSY:
                break
            time.sleep(0.05)
        assert status == Status.OK and meta == {"success": True, "mode": "solo", "peer": None}


def test_set_expert_mode_forms(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        status, meta, _ = w.call(
            Op.SET_EXPERT_MODE, payload=json.dumps({"mode": "combined", "peer": "127.0.0.1:9504"}).encode()
        )
        assert status == Status.OK and meta["mode"] == "solo" and meta["fallback_reason"]
        status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"{not json")
        assert status == Status.BAD_REQUEST and meta["error"]
        status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"turbo")
        assert status == Status.BAD_REQUEST
        assert w.call(Op.INFO)[1]["mode"] == "solo"


def test_configure_tiers(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        status, meta, _ = w.call(
            Op.CONFIGURE, payload=json.dumps({"top_k": 30, "state_chunk_size": 1, "bogus_key": 1}).encode()
        )
        assert status == Status.OK, meta
        assert meta["success"] is True and meta["tier"] == 1
        assert meta["params_applied"]["top_k"] == 30
        assert meta["state_chunk_size_applied"] == 64 * 1024
        assert meta["unrecognized_keys"] == ["bogus_key"]
        assert w.call(Op.INFO)[1]["sampling_defaults"]["top_k"] == 30
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"temperature": "hot"}).encode())
        assert status == Status.BAD_REQUEST and "temperature" in meta["error"]
        w.call(Op.CONFIGURE, payload=json.dumps({"top_k": 40, "state_chunk_size": 256 * 1024}).encode())


def test_decode_frames_exact_length_and_padding(server: ServerProcess) -> None:
    body = {"messages": MESSAGES, "n_predict": 64, "temperature": 0}
    with Wire(server.port) as w:
        status, meta, payload = w.call(Op.DECODE, key="2", payload=json.dumps(body).encode())
        assert status == Status.OK and meta["n_predict"] == 64
        assert len(payload) == 9 * 64
        frames = unpack_decode_frames(payload)
        real = [f for f in frames if not f[2] & DECODE_FLAG_PAD]
        assert real and real[-1][2] == DECODE_FLAG_FINAL | DECODE_STOP_FLAGS["eos"]  # ended by end of generation
        assert decode_stop_reason(real[-1][2]) == "eos"
        assert all(f[2] == 0 for f in real[:-1])
        assert all(lp <= 0.0 for _, lp, _ in real)
        pads = frames[len(real) :]
        assert all(f == (DECODE_PAD_TOKEN, 0.0, DECODE_FLAG_PAD) for f in pads)
        # greedy: the same tokens as the HTTP API generates for the same chat, whose usage counts the
        # end-of-generation token too (llama-server's way; DECODE flags the last real frame instead)
        http = chat_on_slot(server.base, 3, max_tokens=64)
        assert len(real) + 1 == http["usage"]["completion_tokens"]
        assert w.call(Op.INFO)[0] == Status.OK  # the connection is still in sync


def _blob(w: Wire, slot: int) -> tuple[dict, bytes]:
    status, meta, payload = w.call(Op.STATE_GET, key=str(slot))
    assert status == Status.OK, meta
    assert meta["state_size"] == len(payload)
    return meta, payload


def test_kv_transfer_between_two_servers(server: ServerProcess, spawn) -> None:
    b = spawn("--parallel", "2", "--ctx-size", "4096")
    b.wait_ready()
    a = server
    prefill_body = {"messages": MESSAGES, "temperature": 0}
    with Wire(a.port) as wa, Wire(b.port) as wb:
        status, meta, blob = wa.call(Op.PREFILL, key="0", payload=json.dumps(prefill_body).encode(), trace_id="xfer-1")
        assert status == Status.OK, meta
        assert meta["n_past"] > 10 and meta["tokens_processed"] + meta["cache_n"] == meta["n_past"]
        assert meta["model_fallback"] is False and meta["prefill_ms"] > 0
        assert len(blob) == meta["state_size"]
        meta_get, blob_get = _blob(wa, 0)
        assert blob_get == blob and meta_get["n_past"] == meta["n_past"]
        assert wa.call(Op.STATE_META, key="0")[1]["state_size"] == len(blob)  # what a STATE_GET returns
        status, put, _ = wb.call(Op.STATE_PUT, key="1", payload=blob)
        assert status == Status.OK, put
        assert put["restored"] is True and put["bytes"] == len(blob) and put["n_past"] == meta["n_past"]
        status, bmeta, _ = wb.call(Op.STATE_META, key="1")
        assert bmeta["n_past"] == meta["n_past"]
    on_b = chat_on_slot(b.base, 1)
    on_a = chat_on_slot(a.base, 0)
    assert on_b["choices"][0]["message"]["content"] == on_a["choices"][0]["message"]["content"]
    assert on_b["timings"]["cache_n"] == meta["n_past"] - 1  # all but the last prompt token reused
    assert "xfer-1" in a.log()


def test_state_put_refuses_other_model_and_partial_uploads(server: ServerProcess) -> None:
    reference = chat_on_slot(server.base, 1, max_tokens=8)
    with Wire(server.port) as w:
        before = w.call(Op.STATE_META, key="1")[1]
        _, blob = _blob(w, 1)
        # another model's blob: the same bytes with a different model hash
        other = bytearray(blob)
        other[12:44] = bytes(32)
        other[52:60] = blob_checksum(other).to_bytes(8, "little")  # what that model's node would have sealed
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=bytes(other))
        assert status == Status.ERROR
        assert meta["expected_hash"] == before["model_hash"] and meta["got_hash"] == "00" * 32
        # a whole frame whose blob is cut short
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=blob[: len(blob) // 2])
        assert status == Status.ERROR and "length" in meta["error"]
        # garbage
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=b"\x00" * (HEADER_SIZE + 10))
        assert status == Status.ERROR
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == before["n_past"]
    # an upload cut off midway: the client disconnects after half the payload
    trace = f"cut-{uuid.uuid4().hex[:12]}"
    with Wire(server.port) as w:
        w.send(
            encode_request_header(Op.STATE_PUT, key="1", trace_id=trace, payload_len=len(blob)) + blob[: len(blob) // 2]
        )
    # the node has seen the cut (and says nothing was applied) before the slot is looked at
    wait_for(
        lambda: f"[{trace}] hydra: peer closed mid-request (op 0x31); nothing applied" in server.log(),
        timeout=120,
        what="the node logs the cut-off upload",
    )
    with Wire(server.port) as w:
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == before["n_past"]
    again = chat_on_slot(server.base, 1, max_tokens=8)
    assert again["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    assert again["timings"]["cache_n"] > 0


@pytest.mark.slow
def test_configure_t2_rebuilds_context(spawn) -> None:
    srv = spawn("--parallel", "2", "--ctx-size", "2048")
    srv.wait_ready()
    with Wire(srv.port) as w:
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"n_ctx": 4096}).encode())
        assert status == Status.OK, meta
        assert meta["tier"] == 2 and meta["deferred_keys"] == [] and meta["params_applied"]["n_ctx"] == 4096
        assert w.call(Op.INFO)[1]["n_ctx_slot"] == 2048
    slots = httpx.get(srv.base + "/slots").json()
    assert [s["n_ctx"] for s in slots] == [2048, 2048]
    assert "Paris" in chat_on_slot(srv.base, 0, max_tokens=24)["choices"][0]["message"]["content"]


def test_decode_against_the_orchestrators_expectations(server: ServerProcess) -> None:
    """messages null continues the slot; n_predict 0 is refused; the stop reason and final counts are reported."""
    with Wire(server.port) as w:
        # PREFILL then DECODE with "messages": null (what the orchestrator sends with no body)
        status, pre, _ = w.call(Op.PREFILL, key="1", payload=json.dumps({"messages": MESSAGES}).encode())
        assert status == Status.OK
        status, meta, payload = w.call(
            Op.DECODE, key="1", payload=json.dumps({"messages": None, "n_predict": 4, "temperature": 0}).encode()
        )
        assert status == Status.OK, meta
        assert meta["n_past"] == pre["n_past"] and meta["stream"] is True
        frames = [f for f in unpack_decode_frames(payload) if not f[2] & DECODE_FLAG_PAD]
        assert len(frames) == 4 and decode_stop_reason(frames[-1][2]) == "length"
        # the same tokens as the full conversation gives
        status, _meta_full, payload_full = w.call(
            Op.DECODE, key="2", payload=json.dumps({"messages": MESSAGES, "n_predict": 4, "temperature": 0}).encode()
        )
        assert [f[0] for f in unpack_decode_frames(payload_full)] == [f[0] for f in frames]
        # an empty slot has nothing to continue from
        assert httpx.post(server.base + "/slots/3?action=erase", timeout=60).status_code == 200
        status, meta, _ = w.call(Op.DECODE, key="3", payload=b'{"n_predict": 4}')
        assert status == Status.BAD_REQUEST and "holds no tokens" in meta["error"]
        # n_predict 0 would announce payload_len 0, which a streaming reader takes as "until close"
        for body in ({"messages": MESSAGES, "n_predict": 0}, {"messages": MESSAGES, "max_tokens": 0}):
            status, meta, payload = w.call(Op.DECODE, key="1", payload=json.dumps(body).encode())
            assert status == Status.BAD_REQUEST and "at least one token" in meta["error"] and payload == b""
        status, meta, _ = w.call(Op.DECODE, key="1", payload=b'{"messages": []}')
        assert status == Status.BAD_REQUEST
        # "stream": false: the whole reply at once, with its final meta
        status, meta, payload = w.call(
            Op.DECODE,
            key="2",
            payload=json.dumps({"messages": MESSAGES, "n_predict": 64, "temperature": 0, "stream": False}).encode(),
        )
        assert status == Status.OK and meta["stream"] is False
        frames = unpack_decode_frames(payload)
        assert meta["tokens_generated"] == len(frames) > 3
        assert meta["stop_reason"] == "eos" and decode_stop_reason(frames[-1][2]) == "eos"
        status, slot_meta, _ = w.call(Op.STATE_META, key="2")
        assert meta["n_past"] == slot_meta["n_past"]
        status, meta, payload = w.call(
            Op.DECODE, key="2", payload=json.dumps({"messages": MESSAGES, "n_predict": 3, "stream": False}).encode()
        )
        assert meta["tokens_generated"] == 3 and meta["stop_reason"] == "length" and len(payload) == 27
        assert w.call(Op.INFO)[0] == Status.OK  # in sync


def test_info_uses_the_cpp_engines_capability_names(spawn) -> None:
    fresh = spawn("-np", "1", "--no-rpc-backend")  # a node that never had a peer
    fresh.wait_ready()
    with Wire(fresh.port) as w:
        _status, meta, _ = w.call(Op.INFO)
    assert {"state_transfer", "expert_mode", "preset", "model_hash", "prefill", "decode"} <= set(meta["capabilities"])
    assert {"quant_swap", "pipeline_attach", "kv_identity"} <= set(meta["capabilities"])
    assert meta["peer_addr"] == ""  # no peer: an empty string (docs/hydra-protocol.md §3, INFO)
