"""A second quantization of the default model, made on first use with llama.cpp's quantizer."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import gguf
import httpx

from hydra_trio.models.presets import resolve_model

from .conftest import CAPITAL_QUESTION, ROOT, ServerProcess, streaming, wait_for

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
]


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
    assert sum(t.tensor_type.name == "F32" for t in r4.tensors) > 10  # the loop below checks some
    for t in r4.tensors:  # F32 norms are copied as they are
        if t.tensor_type.name == "F32":
            assert types8[t.name] == "F32"
    ftype = r8.fields["general.file_type"].contents()
    assert ftype == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    listed = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "models"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert "smollm2-135m-q8" in listed.stdout


def _next_token_probs(base: str, tokens: list[int], n: int) -> dict[int, float]:
    """The ``n`` likeliest tokens to follow ``tokens`` and their probabilities (``/completion``'s ``n_probs``)."""
    r = httpx.post(
        base + "/completion", json={"prompt": tokens, "n_predict": 1, "temperature": 0, "n_probs": n}, timeout=120
    )
    assert r.status_code == 200, r.text
    return {t["id"]: math.exp(t["logprob"]) for t in r.json()["completion_probabilities"][0]["top_logprobs"]}


def test_q8_output_is_close_to_the_q4_1_output(server: ServerProcess, spawn) -> None:
    """ "Close": along the first 4 tokens of the Q4_1 model's greedy continuation of each prompt (the same
    tokens fed to both models), the Q8_0 model gives each of those tokens a probability within 0.15 of the Q4_1
    model's (they were at most 0.09 apart, on an AVX2-only and an AVX-512 build; the Q4_1 model is sure of 3 of
    those tokens, above 0.9, so other weights would fail); and the chat answer is right.  Not the same greedy
    text: there the likeliest token leads the next by less than 0.07 somewhere on 4 of the 5 prompts (0.008 at
    the least), and such a near tie may fall either way between the two quantizations and between CPUs."""
    q8 = spawn("-m", "smollm2-135m-q8", "-np", "1", "-c", "1024")
    q8.wait_ready()
    for prompt in PROMPTS:
        tokens = httpx.post(server.base + "/tokenize", json={"content": prompt}, timeout=60).json()["tokens"]
        for _ in range(4):
            q4_probs, q8_probs = _next_token_probs(server.base, tokens, 1), _next_token_probs(q8.base, tokens, 10)
            ((token, p4),) = q4_probs.items()
            assert abs(q8_probs.get(token, 0.0) - p4) < 0.15, (prompt, tokens, token, p4, q8_probs)
            tokens.append(token)
    r = httpx.post(
        q8.base + "/v1/chat/completions",
        timeout=120,
        json={"messages": CAPITAL_QUESTION, "temperature": 0, "max_tokens": 16},
    )
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert r.json()["model"] == "smollm2-135m-q8"


def test_kv_moves_between_quants_when_the_node_allows_it(server: ServerProcess, spawn) -> None:
    """Prefill on the Q4_1 node, STATE_GET, STATE_PUT on a Q8_0 node: applied with
    --allow-cross-model-kv (same KV identity, another file), refused without it; a blob whose
    KV identity differs is refused naming the fact."""
    import json
    import struct

    from hydra_trio.engine.kv.state import blob_checksum
    from hydra_trio.protocol.hydra import Op, Status
    from hydra_trio.testing.hydra_wire import Wire

    q8 = spawn("-m", "smollm2-135m-q8", "-np", "2", "-c", "2048", "--allow-cross-model-kv")
    strict = spawn("-m", "smollm2-135m-q8", "-np", "1", "-c", "1024")
    q8.wait_ready()
    strict.wait_ready()
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write one sentence about the sea."},
    ]
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
    own = httpx.post(
        q8.base + "/v1/chat/completions", json={**body, "id_slot": 1, "cache_prompt": False}, timeout=120
    ).json()
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


def _swap(port: int, key: str, pattern: str = "") -> tuple[int, dict]:
    import struct

    from hydra_trio.protocol.hydra import Op
    from hydra_trio.testing.hydra_wire import Wire

    k = key.encode()
    with Wire(port) as w:
        status, meta, _ = w.call(Op.SWAP_QUANT, payload=struct.pack("<H", len(k)) + k + pattern.encode())
    return status, meta


def _info(port: int) -> dict:
    from hydra_trio.protocol.hydra import Op
    from hydra_trio.testing.hydra_wire import Wire

    with Wire(port) as w:
        return w.call(Op.INFO)[1]


def test_swap_quant_keeps_the_slots_kv_and_is_whole_or_nothing(spawn, tmp_path) -> None:
    from hydra_trio.protocol.hydra import Status

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(4000))
    srv = spawn(
        "-np",
        "2",
        "-c",
        "2048",
        "--quant",
        "q4=smollm2-135m",
        "--quant",
        "q8=smollm2-135m-q8",
        "--quant",
        f"bad={broken}",
    )
    srv.wait_ready()
    info = _info(srv.port)
    assert info["quants"] == ["q4", "q8", "bad"] and info["quant"] == "q4" and "quant_swap" in info["capabilities"]
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write one sentence about the sea."},
    ]
    body = {"messages": messages, "temperature": 0}
    chat = lambda **kw: httpx.post(srv.base + "/v1/chat/completions", json={**body, **kw}, timeout=120).json()  # noqa: E731
    pre = chat(max_tokens=0, id_slot=0)
    n_prompt = pre["usage"]["prompt_tokens"]
    prompt_cache = lambda: httpx.get(srv.base + "/slots", timeout=60).json()[0]["prompt_cache"]  # noqa: E731
    wait_for(lambda: prompt_cache()["entries"] == 1, what="the idle slot kept in the host-RAM prompt cache")

    status, meta = _swap(srv.port, "q8")
    assert status == Status.OK, meta
    assert meta["swapped"] is True and meta["quant"] == "q8" and meta["kv_preserved"] is True
    assert meta["slots_preserved"] == 1 and meta["bytes"] > 100_000_000 and meta["swap_ms"] > 0
    after = _info(srv.port)
    assert after["quant"] == "q8" and after["model_hash"] != info["model_hash"]
    assert after["kv_identity_hash"] == info["kv_identity_hash"] and after["model_alias"] == "smollm2-135m-q8"
    assert prompt_cache()["entries"] == 0  # the prompt cache held the old model's KV: dropped (slots move)
    moved = chat(max_tokens=8, id_slot=0)
    assert moved["timings"]["cache_n"] == n_prompt - 1  # decoded on the KV made by Q4_1, not evaluated again
    own = chat(max_tokens=8, id_slot=1, cache_prompt=False)
    first = lambda r: r["choices"][0]["message"]["content"].split()[:3]  # noqa: E731
    assert first(moved) == first(own) and first(own)  # "close", as test_q8_output_is_close_to_the_q4_1_output

    assert _swap(srv.port, "q8")[1]["swapped"] is False  # already there
    assert _swap(srv.port, "nope")[0] == Status.BAD_REQUEST
    status, meta = _swap(srv.port, "q4", r"ffn_.*")
    assert status == Status.NOT_IMPLEMENTED and "whole model" in meta["error"]
    status, meta = _swap(srv.port, "bad")  # a file that does not load: the old model still serves
    assert status == Status.ERROR and "did not load" in meta["error"] and meta["quant"] == "q8"
    assert _info(srv.port)["quant"] == "q8" and chat(max_tokens=4)["choices"][0]["message"]["content"]

    with streaming(srv.base, {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}):
        status, meta = _swap(srv.port, "q4")
        assert status == Status.BUSY and meta["busy_slots"] and meta["swapped"] is False
        assert _info(srv.port)["quant"] == "q8"
    # the closed stream's slot frees once the node has seen the client go and the engine has taken its next
    # step: polled with a deadline (fifty quick retries could all come before that on a busy machine)
    status, meta = wait_for(
        lambda: (r := _swap(srv.port, "q4"))[0] != Status.BUSY and r,
        timeout=120,
        what="the swap past the closed stream",
        every=0.05,
    )
    assert status == Status.OK and meta["quant"] == "q4"


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_swapping_back_and_forth_does_not_grow_memory(spawn) -> None:
    from hydra_trio.protocol.hydra import Status

    srv = spawn("-np", "1", "-c", "1024", "--quant", "q4=smollm2-135m", "--quant", "q8=smollm2-135m-q8")
    srv.wait_ready()
    rss = []
    for _i in range(10):
        for key in ("q8", "q4"):
            status, meta = _swap(srv.port, key)
            assert status == Status.OK and meta["swapped"] is True, meta
        rss.append(_rss_kib(srv.proc.pid))
    assert rss[-1] <= rss[0] * 1.10, rss


def test_a_swap_back_serves_the_model_kept_without_its_context(spawn, tmp_path) -> None:
    """The quantization a SWAP_QUANT leaves is kept without its context when its weights are its file's mapped
    pages: a swap back loads no file, and serves as it did (greedy: the same tokens); a file changed on disk
    since is loaded again; a model read into memory (``-lm none``) is not kept."""
    import shutil

    from hydra_trio.models.presets import resolve_model
    from hydra_trio.protocol.hydra import Status

    q8 = tmp_path / "q8.gguf"
    shutil.copyfile(resolve_model("smollm2-135m-q8")[0], q8)
    srv = spawn("-np", "1", "-c", "1024", "--quant", "q4=smollm2-135m", "--quant", f"q8={q8}")
    srv.wait_ready()
    body = {"prompt": "The sea is", "max_tokens": 12, "temperature": 0, "cache_prompt": False}
    tokens = lambda: httpx.post(srv.base + "/completion", json={**body, "return_tokens": True}, timeout=120).json()[  # noqa: E731
        "tokens"
    ]
    before = tokens()
    swaps = lambda: [line for line in srv.log().splitlines() if "SWAP_QUANT to" in line]  # noqa: E731
    for key in ("q8", "q4", "q8"):
        status, meta = _swap(srv.port, key)
        assert status == Status.OK and meta["swapped"] is True, meta
    lines = swaps()
    assert "(load " in lines[0] and "a new context for the standby" in lines[1] and "for the standby" in lines[2]
    assert "kept without its context" in srv.log()
    assert _swap(srv.port, "q4")[0] == Status.OK and tokens() == before  # the kept model serves as before
    os.utime(q8, ns=(q8.stat().st_atime_ns, q8.stat().st_mtime_ns + 10**9))  # the file changed on disk
    assert _swap(srv.port, "q8")[0] == Status.OK and "(load " in swaps()[-1]

    plain = spawn("-np", "1", "-c", "1024", "-lm", "none", "--quant", "q4=smollm2-135m", "--quant", f"q8={q8}")
    plain.wait_ready()
    for key in ("q8", "q4"):
        assert _swap(plain.port, key)[0] == Status.OK
    assert "kept without its context" not in plain.log()
    assert all("(load " in line for line in plain.log().splitlines() if "SWAP_QUANT to" in line)


def test_a_combined_head_swaps_only_the_experts_on_its_peer(spawn) -> None:
    """SWAP_QUANT with the COMBINED pattern: the peer's expert tensors come from the Q8_0 MoE, the
    head's own tensors (and its SOLO model) stay Q4_1; any other subset is NOT_IMPLEMENTED."""
    from hydra_trio.protocol.hydra import Status

    from .conftest import wait_for
    from .test_combined import complete, rpc_bytes

    b = spawn("--no-model")
    b.wait_ready()
    a = spawn(
        "-m",
        "smollm2-135m-moe",
        "-np",
        "1",
        "-c",
        "1024",
        "--no-rpc-backend",
        "--rpc-engine",
        f"127.0.0.1:{b.port}",
        "--quant",
        "q4=smollm2-135m-moe",
        "--quant",
        "q8=smollm2-135m-moe-q8",
    )
    a.wait_ready()
    wait_for(lambda: _info(a.port)["mode"] == "combined")
    before_text = complete(a.base)
    solo_hash = _info(a.port)["model_hash"]
    uploaded = rpc_bytes(b.port)
    status, meta = _swap(a.port, "q8", "ffn_(up|down|gate)_exps")
    assert status == Status.OK, meta
    assert meta["swapped"] is True and meta["quant"] == "q8" and meta["mode"] == "combined"
    q8_experts = meta["bytes"]
    assert rpc_bytes(b.port) - uploaded >= q8_experts > 300_000_000  # Q8_0 experts: larger than the Q4_1 ones
    info = _info(a.port)
    assert info["mode"] == "combined" and info["expert_quant"] == "q8"
    assert info["quant"] == "q4" and info["model_hash"] == solo_hash  # the head's own model is as it was
    after_text = complete(a.base)
    # close: both begin " Paris." (there the likeliest token leads the runner-up by 0.27 or more in probability,
    # in the whole Q4_1 and the whole Q8_0 model, on AVX2-only and AVX-512 builds alike); the next words are near
    # ties (" The" after "\n\n" leads by 0.09), and further on the Q8_0 experts answer otherwise than the Q4_1 ones
    assert after_text.split()[:1] == before_text.split()[:1] == ["Paris."] and after_text != before_text
    status, meta = _swap(a.port, "q8", r"blk\.0\.")  # some other subset
    assert status == Status.NOT_IMPLEMENTED and "on its peer" in meta["error"]


def test_a_blob_whose_identity_nests_too_deep_is_refused_and_the_connection_lives(server: ServerProcess) -> None:
    import struct

    from hydra_trio.engine.kv.state import HEADER_SIZE, blob_checksum, parse_header
    from hydra_trio.protocol.hydra import Op, Status
    from hydra_trio.testing.hydra_wire import Wire

    with Wire(server.port) as w:
        status, meta, blob = w.call(Op.STATE_GET, key="3")
        assert status == Status.OK
        header = parse_header(blob)
        deep = b"[" * 30000 + b"]" * 30000
        bad = bytearray(blob[: HEADER_SIZE + 32]) + struct.pack("<I", len(deep)) + deep + blob[header.tokens_at :]
        struct.pack_into("<Q", bad, 52, blob_checksum(bad))
        status, meta, _ = w.call(Op.STATE_PUT, key="3", payload=bytes(bad))
        assert status == Status.ERROR and "not a JSON object" in meta["error"]
        assert w.call(Op.STATE_META, key="3")[0] == Status.OK  # same connection, still served
