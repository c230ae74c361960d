"""A second quantization of the default model, made on first use with llama.cpp's quantizer."""

from __future__ import annotations

import subprocess
import sys

import gguf
import httpx

from hydra_trio.models.presets import resolve_model

from .conftest import ROOT, ServerProcess

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "Water boils at"]


def test_the_q8_preset_is_a_q8_0_requantization_of_the_packaged_model() -> None:
    q4, _ = resolve_model("smollm2-135m")
    q8, alias = resolve_model("smollm2-135m-q8")  # made on first use, cached afterwards
    assert alias == "smollm2-135m-q8" and q8.is_file()
    r4, r8 = gguf.GGUFReader(str(q4)), gguf.GGUFReader(str(q8))
    types4 = {t.name: t.tensor_type.name for t in r4.tensors}
    types8 = {t.name: t.tensor_type.name for t in r8.tensors}
    assert types4.keys() == types8.keys()  # the same tensors, other types
    assert sum(v == "Q4_1" for v in types4.values()) > 200
    assert "Q4_1" not in types8.values() and sum(v == "Q8_0" for v in types8.values()) > 200
    for t in r4.tensors:  # F32 norms are copied as they are
        if t.tensor_type.name == "F32":
            assert types8[t.name] == "F32"
    ftype = r8.fields["general.file_type"].contents()
    assert ftype == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    listed = subprocess.run([sys.executable, "-m", "hydra_trio", "models"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert "smollm2-135m-q8" in listed.stdout


def test_q8_output_is_close_to_the_q4_1_output(server: ServerProcess, spawn) -> None:
    """"Close": the first 4 greedy tokens agree on each prompt, and the chat answer is right."""
    q8 = spawn("-m", "smollm2-135m-q8", "-np", "1", "-c", "1024")
    q8.wait_ready()

    def first_tokens(base: str, prompt: str) -> str:
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    for prompt in PROMPTS:
        assert first_tokens(q8.base, prompt) == first_tokens(server.base, prompt), prompt
    r = httpx.post(q8.base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 16})
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert r.json()["model"] == "smollm2-135m-q8"


def test_kv_moves_between_quants_when_the_node_allows_it(server: ServerProcess, spawn) -> None:
    """Prefill on the Q4_1 node, STATE_GET, STATE_PUT on a Q8_0 node: applied with
    --allow-cross-model-kv (same KV identity, another file), refused without it; a blob whose
    KV identity differs is refused naming the fact."""
    import json
    import struct

    from hydra_trio.engine.state import blob_checksum
    from hydra_trio.protocol.hydra import Op, Status

    from .hydra_wire import Wire

    q8 = spawn("-m", "smollm2-135m-q8", "-np", "2", "-c", "2048", "--allow-cross-model-kv")
    strict = spawn("-m", "smollm2-135m-q8", "-np", "1", "-c", "1024")
    q8.wait_ready()
    strict.wait_ready()
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write one sentence about the sea."}]
    with Wire(server.port) as w:
        status, pre, blob = w.call(Op.PREFILL, key="1", payload=json.dumps({"messages": messages}).encode())
        assert status == Status.OK
        info4 = w.call(Op.INFO)[1]
    with Wire(q8.port) as w:
        info8 = w.call(Op.INFO)[1]
        assert info8["model_hash"] != info4["model_hash"]
        assert info8["kv_identity_hash"] == info4["kv_identity_hash"] and len(info8["kv_identity_hash"]) == 64
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=bytes(blob))
        assert status == Status.OK, meta
        assert meta["n_past"] == pre["n_past"]
        assert meta["model_hash_match"] is False and meta["kv_identity_match"] is True
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    moved = httpx.post(q8.base + "/v1/chat/completions", json={**body, "id_slot": 0}, timeout=120).json()
    assert moved["timings"]["cache_n"] == pre["n_past"] - 1  # decoded on the moved KV, not evaluated again
    own = httpx.post(q8.base + "/v1/chat/completions", json={**body, "id_slot": 1, "cache_prompt": False},
                     timeout=120).json()
    # "close" as in test_q8_output_is_close_to_the_q4_1_output: the first tokens agree
    first = lambda r: r["choices"][0]["message"]["content"].split()[:3]  # noqa: E731
    assert first(moved) == first(own) and first(own)

    with Wire(strict.port) as w:  # the same blob on a node that does not allow it
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=bytes(blob))
        assert status == Status.ERROR and "--allow-cross-model-kv" in meta["error"]
        assert meta["expected_hash"] == info8["model_hash"] and meta["got_hash"] == info4["model_hash"]
        assert meta["kv_identity_match"] is True
        assert w.call(Op.STATE_META, key="0")[1]["n_past"] == 0  # unchanged
        # CONFIGURE turns the policy on at run time
        status, meta, _ = w.call(Op.CONFIGURE, payload=b'{"allow_cross_model_kv": true}')
        assert status == Status.OK and meta["params_applied"]["allow_cross_model_kv"] is True
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=bytes(blob))
        assert status == Status.OK and meta["kv_identity_match"] is True

    # another KV layout (n_layer altered in the blob's identity, checksum made valid again): always refused
    bad = bytearray(blob)
    at = bad.index(b'"n_layer":30')
    bad[at : at + 12] = b'"n_layer":31'
    struct.pack_into("<Q", bad, 52, blob_checksum(bad))
    with Wire(q8.port) as w:
        before = w.call(Op.STATE_META, key="1")[1]["n_past"]
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=bytes(bad))
        assert status == Status.ERROR and "n_layer: this node 30, the blob 31" in meta["error"]
        assert meta["kv_identity_match"] is False
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == before
