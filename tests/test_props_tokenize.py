"""llama-server's GET /props, POST /tokenize and POST /detokenize against a real server and the real SmolLM2."""

from __future__ import annotations

import gguf
import httpx
import pytest

from hydra_trio.models.presets import resolve_model

from .conftest import ServerProcess

SMOLLM2_VOCAB = 49152


def test_props_has_llama_servers_shape_and_real_values(http: httpx.Client) -> None:
    props = http.get("/props")
    assert props.status_code == 200
    p = props.json()
    path, alias = resolve_model("smollm2-135m")
    assert p["model_path"] == str(path) and p["model_alias"] == alias == "smollm2-135m"
    assert len(p["model_hash"]) == 64
    assert p["total_slots"] == 4  # the shared server's -np 4
    settings = p["default_generation_settings"]
    assert settings["n_ctx"] == 8192 // 4  # -c 8192 split over 4 slots, as llama-server does
    params = settings["params"]
    assert params["temperature"] == 0.8 and params["top_k"] == 40 and params["top_p"] == 0.95
    assert params["min_p"] == 0.05 and params["repeat_last_n"] == 64 and params["n_predict"] == -1
    assert params["seed"] == -1
    # llama-server's other samplers at llama.cpp's defaults (common/common.h; task_params::to_json lists them)
    assert params["typical_p"] == 1.0 and params["mirostat"] == 0 and params["dynatemp_range"] == 0.0
    assert params["xtc_probability"] == 0.0 and params["dry_multiplier"] == 0.0 and params["top_n_sigma"] == -1.0
    assert params["n_keep"] == 0 and params["min_keep"] == 0
    # ... so a client that sends them back as they are is accepted
    off = {
        k: params[k]
        for k in (
            "typical_p",
            "mirostat",
            "dynatemp_range",
            "xtc_probability",
            "dry_multiplier",
            "top_n_sigma",
            "n_keep",
            "min_keep",
            "samplers",
            "dry_sequence_breakers",
        )
    }
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **off})
    assert r.status_code == 200, r.text
    # the GGUF's own template, as the GGUF stores it
    template = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()
    assert p["chat_template"] == template and "<|im_start|>" in template
    assert p["bos_token"] == "<|im_start|>" and p["eos_token"] == "<|im_end|>"
    assert p["modalities"] == {"vision": False, "video": False, "audio": False}
    assert p["endpoint_slots"] is True and p["endpoint_metrics"] is True and p["is_sleeping"] is False
    version = http.get("/version").json()
    assert p["build_info"] == f"hydra-trio {version['version']} (llama-cpp-python {version['llama_cpp_python']})"
    assert http.post("/props", json={}).status_code == 501  # llama-server without --props


def test_tokenize_known_ids_and_pieces(http: httpx.Client) -> None:
    assert http.post("/tokenize", json={"content": " Paris"}).json() == {"tokens": [7042]}
    with_pieces = http.post("/tokenize", json={"content": " Paris", "with_pieces": True}).json()
    assert with_pieces == {"tokens": [{"id": 7042, "piece": " Paris"}]}
    # parse_special (default true) turns special-token text into the token; off, it is plain text
    assert http.post("/tokenize", json={"content": "<|im_end|>"}).json()["tokens"] == [2]
    plain = http.post("/tokenize", json={"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert len(plain) > 1 and 2 not in plain
    # SmolLM2 adds no BOS (add_bos is false), so add_special changes nothing here
    assert http.post("/tokenize", json={"content": " Paris", "add_special": True}).json() == {"tokens": [7042]}
    assert http.post("/tokenize", json={}).json() == {"tokens": []}  # no content: no tokens (llama-server)


def test_tokenize_then_detokenize_round_trips(http: httpx.Client) -> None:
    text = "The capital of France is Paris. Ünïcödé, 日本語 and 🦙 too.\n"
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert all(isinstance(t, int) and 0 <= t < SMOLLM2_VOCAB for t in tokens) and len(tokens) > 10
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
    # pieces: concatenated, they are the text's UTF-8 bytes; a piece that is part of a character
    # comes as its byte values (llama-server's shape)
    pieces = http.post("/tokenize", json={"content": "🦙", "with_pieces": True}).json()["tokens"]
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw == "🦙".encode()
    assert any(isinstance(p["piece"], list) for p in pieces)
    # special tokens detokenize as their text (common_token_to_piece with special=true)
    assert http.post("/detokenize", json={"tokens": [1, 7042, 2]}).json() == {"content": "<|im_start|> Paris<|im_end|>"}
    assert http.post("/detokenize", json={}).json() == {"content": ""}


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("/detokenize", {"tokens": [7042, SMOLLM2_VOCAB]}, "token id 49152 is out of the vocabulary (0..49151)"),
        ("/detokenize", {"tokens": [-1]}, "token id -1 is out of the vocabulary"),
        ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
        ("/detokenize", {"tokens": "7042"}, "tokens"),
        ("/tokenize", {"content": 7042}, "content"),
        ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ],
)
def test_tokenize_detokenize_bad_bodies_are_400(http: httpx.Client, route: str, body: dict, needle: str) -> None:
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert http.post(route, content=b"{not json").status_code == 400
    assert http.get(route).status_code == 405


def test_compute_only_node_has_no_props(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    for method, route in (("GET", "/props"), ("POST", "/tokenize"), ("POST", "/detokenize")):
        r = httpx.request(method, node.base + route, json={}, timeout=30)
        assert r.status_code == 501 and "compute-only" in r.json()["error"]["message"]


def test_usage_prompt_tokens_match_tokenize(server: ServerProcess, http: httpx.Client) -> None:
    """The chat prompt as the GGUF template renders it, tokenized by /tokenize, is what the engine ran."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    rendered = (
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    )
    tokens = http.post("/tokenize", json={"content": rendered}).json()["tokens"]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == len(tokens)
