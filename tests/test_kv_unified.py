"""``--kv-unified`` as llama-server serves it: one KV cache shared by every slot, a slot may fill all of
it (``n_ctx_slot`` is the whole cache, capped by ``--kv-unified-per-slot`` and the training context),
and a full cache makes room the way llama-server's ``update_slots`` does.

Expected values are llama-server's (``tools/server/server-context.cpp`` and ``server.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors): with ``-c 1024 -np 2 -kvu`` its log says
``n_ctx_slot = 1024, kv_unified = 'true'``; without ``-kvu`` a slot holds 512; a slot context above the
model's training context is capped with a warning, not refused; a batch that finds no room first frees
an idle slot's cells (``try_clear_idle_slots``), then halves, and a one-token batch without room fails
every processing request with "Context size has been exceeded." (HTTP 500).  Real server, real SmolLM2.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess, wait_for

N_CTX = 1024
PROMPT = 700  # tokens: one prompt fits in the shared cache, two do not


def token_prompt(seed: int, n: int = PROMPT) -> list[int]:
    """``n`` token ids of SmolLM2's vocabulary (a prompt of exactly ``n`` tokens, no BOS added to ids)."""
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 20000) for _ in range(n)]


def complete(base: str, prompt: list[int], id_slot: int, **kw: object) -> httpx.Response:
    body = {"prompt": prompt, "id_slot": id_slot, "n_predict": 4, "temperature": 0, "cache_prompt": True, **kw}
    return httpx.post(base + "/completion", json=body, timeout=300)


def n_past(base: str) -> list[int]:
    return [s["n_past"] for s in httpx.get(base + "/slots", timeout=30).json()]


@pytest.fixture(scope="module")
def unified(tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("kvu") / "kvu.log", "-kvu", "-np", "2", "-c", str(N_CTX), "--no-rpc-backend"
    )
    with srv.serving(180):
        yield srv


def test_each_slot_may_hold_the_whole_unified_cache(unified: ServerProcess) -> None:
    slots = httpx.get(unified.base + "/slots", timeout=30).json()
    assert [s["n_ctx"] for s in slots] == [N_CTX, N_CTX]
    props = httpx.get(unified.base + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX
    with Wire(unified.port) as w:
        status, info, _ = w.call(Op.INFO)
    assert status == Status.OK and (info["n_ctx"], info["n_ctx_slot"]) == (N_CTX, N_CTX)
    assert f"initializing, n_slots = 2, n_ctx_slot = {N_CTX}, kv_unified = 'true'" in unified.log()
    # a prompt longer than n_ctx / n_parallel is served (a split cache would refuse it: 512 a slot)
    r = complete(unified.base, token_prompt(1), 0)
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["prompt_n"] == PROMPT and n_past(unified.base)[0] >= PROMPT


def test_a_full_cache_frees_an_idle_slot_and_its_conversation_comes_back_from_the_prompt_cache(
    unified: ServerProcess,
) -> None:
    a, b = token_prompt(11), token_prompt(12)
    assert complete(unified.base, a, 0).status_code == 200
    # slot 1's prompt does not fit beside slot 0's idle tokens: slot 0 is freed (its state kept in RAM)
    r = complete(unified.base, b, 1)
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["prompt_n"] == PROMPT
    held = n_past(unified.base)
    assert held[0] == 0 and held[1] >= PROMPT
    assert "the KV cache is full: slot 0's" in unified.log()
    # slot 0's conversation returns: restored from the host-RAM prompt cache (slot 1 freed for it)
    again = complete(unified.base, a, 0)
    assert again.status_code == 200, again.text
    assert again.json()["timings"]["cache_n"] >= PROMPT - 1
    assert n_past(unified.base)[1] == 0


def test_a_kv_blob_lands_in_a_full_unified_cache(unified: ServerProcess) -> None:
    words = " ".join(f"item{i}" for i in range(150))
    body = {"messages": [{"role": "user", "content": f"Remember these: {words}"}], "max_tokens": 0}
    with Wire(unified.port) as w:
        status, meta, blob = w.call(Op.PREFILL, key="0", payload=json.dumps(body).encode())
        assert status == Status.OK, meta
        assert meta["n_past"] > N_CTX // 2  # two such conversations do not fit together
        other = {"messages": [{"role": "user", "content": f"Forget these: {words}"}], "max_tokens": 0}
        status, meta1, _ = w.call(Op.PREFILL, key="1", payload=json.dumps(other).encode())
        assert status == Status.OK, meta1
        assert n_past(unified.base)[0] == 0  # slot 0 was freed for slot 1
        # the blob goes back into slot 0: slot 1's idle cells make the room, nothing is refused
        status, put, _ = w.call(Op.STATE_PUT, key="0", payload=blob)
        assert status == Status.OK, put
        assert put["n_past"] == meta["n_past"]
    assert n_past(unified.base) == [meta["n_past"], 0]


def test_two_prompts_that_cannot_fit_together_fail_as_llama_servers_do(unified: ServerProcess) -> None:
    """Both slots processing, their prompts together larger than the cache, neither done in time:
    llama-server halves the batch down to one token, then fails every processing request with
    "Context size has been exceeded." (HTTP 500) and clears their slots; the node serves on."""
    for i in range(2):
        assert httpx.post(f"{unified.base}/slots/{i}?action=erase", timeout=30).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(complete, unified.base, token_prompt(20 + i), i, n_predict=400, ignore_eos=True)
            for i in range(2)
        ]
        replies = [f.result() for f in futures]
    for r in replies:
        assert r.status_code == 500, r.text
        assert r.json()["error"]["message"] == "Context size has been exceeded."
    assert wait_for(lambda: n_past(unified.base) == [0, 0], 60, "both slots cleared")
    ok = complete(unified.base, token_prompt(30, 100), 0)
    assert ok.status_code == 200, ok.text


def test_per_slot_cap_training_cap_and_a_split_cache(spawn) -> None:
    # --kv-unified-per-slot without -c sizes the pool to n_parallel x N, each slot capped at N
    capped = spawn("-kvu", "-np", "2", "--kv-unified-per-slot", "600", "--no-rpc-backend")
    # a context above the training context (8192 for SmolLM2) starts, its slot capped with a warning
    big = spawn("-np", "1", "-c", "16384", "--no-rpc-backend")
    split = spawn("-np", "2", "-c", str(N_CTX), "--no-rpc-backend")
    for node in (capped, big, split):
        node.wait_ready(180)
    with Wire(capped.port) as w:
        status, info, _ = w.call(Op.INFO)
    # the pool is 2 x 600 tokens, which llama.cpp rounds up to a multiple of 256 cells
    assert status == Status.OK and (info["n_ctx"], info["n_ctx_slot"]) == (1280, 600)
    assert "capping per-slot context (1280) to --kv-unified-per-slot (600)" in capped.log()
    assert [s["n_ctx"] for s in httpx.get(big.base + "/slots", timeout=30).json()] == [8192]
    assert "the slot context (16384) exceeds the training context of the model (8192) - capping" in big.log()
    assert [s["n_ctx"] for s in httpx.get(split.base + "/slots", timeout=30).json()] == [N_CTX // 2] * 2
    r = complete(split.base, token_prompt(40), 0)
    assert r.status_code == 400 and "a slot's context holds 512" in r.json()["error"]["message"]
