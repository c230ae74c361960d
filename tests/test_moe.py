"""The test MoE made from SmolLM2: Mixtral layout, and greedy output equal to the dense model's."""

from __future__ import annotations

import gguf
import httpx

from hydra_trio.models.moe import ensure_test_moe
from hydra_trio.models.presets import resolve_model

from .conftest import ServerProcess


def test_moe_layout() -> None:
    reader = gguf.GGUFReader(str(ensure_test_moe(resolve_model("smollm2-135m")[0])))
    assert reader.fields["llama.expert_count"].contents() == 4
    assert reader.fields["llama.expert_used_count"].contents() == 2
    names = {t.name: t for t in reader.tensors}
    assert "blk.0.ffn_gate.weight" not in names
    exps = names["blk.0.ffn_up_exps.weight"]
    assert list(exps.shape) == [576, 1536, 4]  # ggml order: n_embd, n_ff, n_expert
    assert list(names["blk.29.ffn_gate_inp.weight"].shape) == [576, 4]


def test_moe_greedy_output_equals_dense(server: ServerProcess, spawn) -> None:
    moe = spawn("-m", "smollm2-135m-moe", "-np", "1", "-c", "2048")
    moe.wait_ready()
    body = {"prompt": "The capital of France is", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    dense_text = httpx.post(server.base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    r = httpx.post(moe.base + "/v1/completions", json=body, timeout=120).json()
    assert r["model"] == "smollm2-135m-moe"
    assert r["choices"][0]["text"] == dense_text
    assert "Paris" in dense_text
