"""KV cache types and flash attention (the CPU side), on real nodes serving SmolLM2.

Two q8_0 nodes (``-fa on -ctk q8_0 -ctv q8_0``) and the shared f16 node (llama.cpp's default types,
``-fa auto``): the q8_0 cache serves the README question, its KV blob is about half the f16 one, a
prefill/decode move between the two q8_0 nodes gives one node's greedy text, a blob of other types is
refused naming both, and every report (``/props``, ``/slots``, INFO, ``/metrics``, the log) shows the types.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hydra_trio.engine.settings import LlamaOptions, kv_cache_problem
from hydra_trio.errors import ModelLoadError
from hydra_trio.protocol.hydra import DECODE_FLAG_PAD, Op, Status, unpack_decode_frames
from hydra_trio.testing.hydra_wire import Wire

from .conftest import CAPITAL_QUESTION, ROOT, ServerProcess

Q8 = ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")
# SmolLM2-135M: 30 layers, 3 KV heads of 64 values for K and for V
F16_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # 2 bytes a value
Q8_BYTES_PER_TOKEN = 30 * 2 * (3 * 64 // 32) * 34  # 34 bytes a block of 32 values

FILLER = " ".join(f"Line {i}: the weather in town {i} was mild and the market sold apples." for i in range(12))
# greedy, SmolLM2 answers "The secret word is banana." from a q8_0 cache, the likeliest token leading the runner-up
# by at least 0.49 in probability over those tokens on an AVX2-only and an AVX-512 build (with "tangerine" and
# "What is the secret word?" the lead at " t" was 0.13 to 0.22: too close to hold on every CPU's kernels)
NEEDLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": f"{FILLER} The secret word is banana. {FILLER} Which word is the secret word?"},
]
README_QUESTION = CAPITAL_QUESTION


@pytest.fixture(scope="module")
def q8_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two q8_0 nodes with flash attention, 2 slots of 2048 tokens each; the first keeps slot files."""
    d = tmp_path_factory.mktemp("kvtypes")
    (d / "slots").mkdir()
    a = ServerProcess(d / "a.log", *Q8, "--parallel", "2", "--ctx-size", "4096", "--slot-save-path", str(d / "slots"))
    b = ServerProcess(d / "b.log", *Q8, "--parallel", "2", "--ctx-size", "4096")
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        for srv in (a, b):
            code = srv.stop()
            assert code == 0, f"exit code {code}:\n{srv.log()}"


def _prefill(port: int, slot: int, messages: list[dict]) -> tuple[dict, bytes]:
    with Wire(port) as w:
        status, meta, blob = w.call(Op.PREFILL, key=str(slot), payload=json.dumps({"messages": messages}).encode())
    assert status == Status.OK, meta
    assert len(blob) == meta["state_size"]
    return meta, blob


def _decode(w: Wire, slot: int, n: int = 16) -> list[int]:
    """Greedy DECODE continuing the slot's own KV (``messages`` null): the token ids."""
    status, meta, payload = w.call(
        Op.DECODE, key=str(slot), payload=json.dumps({"messages": None, "n_predict": n, "temperature": 0}).encode()
    )
    assert status == Status.OK, meta
    return [f[0] for f in unpack_decode_frames(payload) if not f[2] & DECODE_FLAG_PAD]


def _text(base: str, tokens: list[int]) -> str:
    return httpx.post(base + "/detokenize", json={"tokens": tokens}, timeout=60).json()["content"]


def test_q8_0_cache_with_flash_attention_answers_the_readme_question(q8_nodes) -> None:
    a, _ = q8_nodes
    r = httpx.post(
        a.base + "/v1/chat/completions",
        timeout=120,
        json={"messages": README_QUESTION, "temperature": 0, "max_tokens": 32},
    )
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_the_q8_0_blob_is_about_half_the_f16_one(q8_nodes, server: ServerProcess, record_property) -> None:
    a, _ = q8_nodes
    meta8, blob8 = _prefill(a.port, 1, NEEDLE)
    meta16, blob16 = _prefill(server.port, 3, NEEDLE)
    assert meta8["n_past"] == meta16["n_past"] > 300
    ratio = len(blob8) / len(blob16)
    print(f"\nKV blob of {meta8['n_past']} tokens: q8_0 {len(blob8)} bytes, f16 {len(blob16)} bytes, ratio {ratio:.4f}")
    record_property("q8_0_to_f16_blob_ratio", round(ratio, 4))
    assert ratio < 0.6
    # what the KV part should take: q8_0 34 bytes per 32 values, f16 64
    assert ratio == pytest.approx(Q8_BYTES_PER_TOKEN / F16_BYTES_PER_TOKEN, abs=0.03)


def test_a_prefill_decode_move_between_q8_0_nodes_gives_one_nodes_text(q8_nodes) -> None:
    a, b = q8_nodes
    pre, blob = _prefill(a.port, 0, NEEDLE)
    with Wire(a.port) as wa, Wire(b.port) as wb:
        status, put, _ = wb.call(Op.STATE_PUT, key="0", payload=blob)
        assert status == Status.OK, put
        assert put["n_past"] == pre["n_past"] and put["model_hash_match"] is True and put["kv_identity_match"]
        # the same types move byte-equal (the cells name their slot: the same slot id on both nodes)
        status, _meta, moved_blob = wb.call(Op.STATE_GET, key="0")
        assert status == Status.OK and moved_blob == blob
        moved = _decode(wb, 0)
        one_node = _decode(wa, 0)  # A goes on from its own prefill
    assert moved == one_node and moved
    text = _text(a.base, moved)
    print(f"\nP/D move of {pre['n_past']} tokens: {text!r}")
    assert "banana" in text  # the needle, found from the moved KV


def test_a_blob_of_other_cache_types_is_refused_naming_both(q8_nodes, server: ServerProcess) -> None:
    a, _ = q8_nodes
    _, blob16 = _prefill(server.port, 2, README_QUESTION)
    pre8, blob8 = _prefill(a.port, 1, README_QUESTION)
    with Wire(a.port) as w:
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=blob16)
        assert status == Status.BAD_REQUEST, meta
        assert meta["error"] == "KV cache types differ: blob K f16 / V f16, this node K q8_0 / V q8_0"
        assert meta["kv_identity_match"] is False
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == pre8["n_past"]  # the slot untouched
    with Wire(server.port) as w:  # and the other way round
        before = w.call(Op.STATE_META, key="2")[1]["n_past"]
        status, meta, _ = w.call(Op.STATE_PUT, key="2", payload=blob8)
        assert status == Status.BAD_REQUEST
        assert meta["error"] == "KV cache types differ: blob K q8_0 / V q8_0, this node K f16 / V f16"
        assert w.call(Op.STATE_META, key="2")[1]["n_past"] == before
    # a slot file from the f16 node: HTTP 400, the slot untouched
    (_slot_dir(a) / "f16.bin").write_bytes(blob16)
    r = httpx.post(a.base + "/slots/1?action=restore", json={"filename": "f16.bin"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "KV cache types differ: blob K f16 / V f16, this node K q8_0 / V q8_0" in r.json()["error"]["message"]
    with Wire(a.port) as w:
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == pre8["n_past"]


def _slot_dir(srv: ServerProcess) -> Path:
    return srv.log_path.parent / "slots"


def test_the_cache_types_are_reported_everywhere(q8_nodes, server: ServerProcess) -> None:
    a, _ = q8_nodes
    want = {"type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on"}
    props = httpx.get(a.base + "/props", timeout=60).json()
    assert props["kv_cache"] == want
    cells = props["total_slots"] * props["default_generation_settings"]["n_ctx"]
    assert props["memory"]["CPU"]["kv"] == cells * Q8_BYTES_PER_TOKEN  # the memory check's figure, exact
    assert props["memory"]["CPU"]["weights"] > 50 * 2**20 and props["memory"]["CPU"]["compute"] > 0
    slots = httpx.get(a.base + "/slots", timeout=60).json()
    assert len(slots) == 2 and all(s["kv_cache"] == want for s in slots)
    with Wire(a.port) as w:
        info = w.call(Op.INFO)[1]
    assert info["kv_cache"] == want and info["memory"] == props["memory"]
    text = httpx.get(a.base + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [sample] = families["hydra_trio:kv_cache_info"].samples
    assert sample.labels == want and sample.value == 1
    mem = {(s.labels["device"], s.labels["kind"]): s.value for s in families["hydra_trio:memory_bytes"].samples}
    assert mem[("CPU", "kv")] == cells * Q8_BYTES_PER_TOKEN
    assert f"KV {cells * Q8_BYTES_PER_TOKEN / 2**20:.1f} MiB" in a.log()
    assert "KV cache K q8_0, V q8_0" in a.log() and "flash attention on" in a.log()

    # the f16 node: llama.cpp's default types; -fa auto reports what llama.cpp chose on this machine
    props = httpx.get(server.base + "/props", timeout=60).json()
    assert props["kv_cache"]["type_k"] == props["kv_cache"]["type_v"] == "f16"
    assert props["kv_cache"]["flash_attn"] in ("on", "off")
    cells = props["total_slots"] * props["default_generation_settings"]["n_ctx"]
    assert props["memory"]["CPU"]["kv"] == cells * F16_BYTES_PER_TOKEN


def test_a_quantized_v_cache_without_flash_attention_exits_2() -> None:
    message = kv_cache_problem("off", "f16", "q8_0")
    assert message is not None and "-ctv/--cache-type-v q8_0" in message and "flash attention" in message
    proc = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "run", "-ctv", "q8_0", "-fa", "off", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "loading" not in proc.stderr.lower()  # refused before anything loads
    # embedders: the same text from the engine's settings
    with pytest.raises(ModelLoadError) as exc:
        LlamaOptions(flash_attn="off", cache_type_v="q8_0")
    assert str(exc.value) == message
    # what llama.cpp allows: a quantized K without flash attention, a quantized V with it on or auto
    for fa, k, v in (("off", "q8_0", "f16"), ("off", "f16", "bf16"), ("on", "q4_0", "q4_0"), ("auto", "f16", "q8_0")):
        assert kv_cache_problem(fa, k, v) is None
        LlamaOptions(flash_attn=fa, cache_type_k=k, cache_type_v=v)
