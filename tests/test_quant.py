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
