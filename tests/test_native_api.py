"""llama-server's native HTTP surface against a real server and the real SmolLM2: POST /completion (whole and
streamed, n_probs, response_fields, return_tokens, timings_per_token, t_max_predict_ms), the request fields
samplers / logit_bias forms / mixed prompts / min_keep, a body of llama-server's own defaults,
/apply-template, POST /props, /v1/health, GET/PUT /slots/{id}/state, and the 501 endpoints."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess, streaming

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0}

# llama-server's defaults for every request field (tools/server/README.md "POST /completion" and
# task_params::to_json / common/common.h at the version this package runs)
LLAMA_SERVER_DEFAULTS = {
    "temperature": 0.8,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "n_predict": -1,
    "n_indent": 0,
    "n_keep": 0,
    "n_discard": 0,
    "n_cache_reuse": 0,
    "stream": False,
    "stop": [],
    "typical_p": 1.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "top_n_sigma": -1.0,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
    "grammar": "",
    "seed": -1,
    "ignore_eos": False,
    "logit_bias": [],
    "n_probs": 0,
    "min_keep": 0,
    "t_max_predict_ms": 0,
    "id_slot": -1,
    "cache_prompt": True,
    "return_tokens": False,
    "return_progress": False,
    "timings_per_token": False,
    "post_sampling_probs": False,
    "lora": [],
    "n_cmpl": 1,
    "backend_sampling": False,
    "grammar_lazy": False,
    "grammar_triggers": [],
    "preserved_tokens": [],
    "samplers": ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
}


def completion(http: httpx.Client, **body) -> dict:
    r = http.post("/completion", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + "/completion", json={"prompt": PROMPT, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert "data: [DONE]" not in lines  # llama-server's native stream ends without it
    return [json.loads(line[6:]) for line in lines]


def test_completion_equals_openai_completion(server: ServerProcess, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    oa = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=0)
    n = completion(http, n_predict=16, return_tokens=True, **GREEDY)
    assert n["content"] == oa.choices[0].text and n["content"]
    assert n["tokens_predicted"] == oa.usage.completion_tokens == 16 == len(n["tokens"])
    assert n["tokens_evaluated"] == oa.usage.prompt_tokens
    assert n["stop"] is True and n["stop_type"] == "limit" and n["stopping_word"] == ""
    assert n["truncated"] is False and n["index"] == 0 and n["model"] == "smollm2-135m"
    assert n["prompt"] == PROMPT  # SmolLM2 adds no BOS
    assert n["tokens_cached"] == n["tokens_evaluated"] + 16 - 1  # the last token is sampled, not yet decoded
    assert isinstance(n["id_slot"], int) and 0 <= n["id_slot"] < 4
    assert (
        n["timings"]["predicted_n"] == 16
        and n["timings"]["prompt_n"] + n["timings"]["cache_n"] == n["tokens_evaluated"]
    )
    assert n["has_new_line"] == ("\n" in n["content"])
    gs = n["generation_settings"]
    assert gs["n_predict"] == 16 and gs["temperature"] == 0 and gs["samplers"][0] == "penalties"
    assert "completion_probabilities" not in n
    text = http.post("/detokenize", json={"tokens": n["tokens"]}).json()["content"]
    assert text == n["content"]
    # without return_tokens the field is there and empty (llama-server)
    assert completion(http, n_predict=2, **GREEDY)["tokens"] == []
    # /completions is the native route too (llama-server's; /v1/completions is OpenAI's)
    r = http.post("/completions", json={"prompt": PROMPT, "n_predict": 16, **GREEDY}).json()
    assert r["content"] == n["content"] and "choices" not in r


def test_stop_types_eos_and_word(http: httpx.Client) -> None:
    chat = http.post("/apply-template", json={"messages": [{"role": "user", "content": "Say hello."}]}).json()
    eos = http.post("/completion", json={"prompt": chat["prompt"], "n_predict": 200, **GREEDY}).json()
    assert eos["stop_type"] == "eos" and eos["tokens_predicted"] < 200 and eos["stopping_word"] == ""
    full = completion(http, n_predict=16, **GREEDY)["content"]
    word = full.split()[2][:3]  # a piece of the third word, e.g. "Uni"
    first = full.find(word)
    w = completion(http, n_predict=16, stop=["@@never@@", word], **GREEDY)
    assert w["stop_type"] == "word" and w["stopping_word"] == word
    assert w["content"] == full[:first]


def test_n_probs(http: httpx.Client) -> None:
    n = completion(http, n_predict=6, n_probs=5, return_tokens=True, **GREEDY)
    probs = n["completion_probabilities"]
    assert len(probs) == n["tokens_predicted"] == 6
    for entry, tok in zip(probs, n["tokens"], strict=True):
        assert entry["id"] == tok and set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 5
        assert entry["top_logprobs"][0]["id"] == tok  # greedy takes the most likely token
        assert sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1.0 + 1e-6
        assert bytes(entry["bytes"]).decode() == entry["token"]
        logprobs = [t["logprob"] for t in entry["top_logprobs"]]
        assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)
    assert "".join(e["token"] for e in probs) == n["content"]


def test_stream_matches_whole_reply(server: ServerProcess, http: httpx.Client) -> None:
    whole = completion(http, n_predict=12, **GREEDY)
    evs = events(server.base, {"n_predict": 12, "n_probs": 2, "timings_per_token": True, **GREEDY})
    parts, last = evs[:-1], evs[-1]
    assert parts and all(e["stop"] is False for e in parts)
    assert "".join(e["content"] for e in parts) == whole["content"]
    assert [e["tokens_predicted"] for e in parts] == list(range(1, 13))  # one event per token here
    assert all(len(e["tokens"]) == 1 and len(e["completion_probabilities"]) == 1 for e in parts)
    assert all(e["timings"]["predicted_n"] == e["tokens_predicted"] for e in parts)
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert last["tokens_predicted"] == 12 and last["stop_type"] == "limit"
    assert "completion_probabilities" not in last and last["timings"]["predicted_n"] == 12


def test_response_fields(http: httpx.Client) -> None:
    n = completion(http, n_predict=3, response_fields=["content", "generation_settings/n_predict", "nope/x"], **GREEDY)
    assert set(n) == {"content", "generation_settings/n_predict"} and n["generation_settings/n_predict"] == 3


def test_mixed_prompt_and_token_prompt(http: httpx.Client) -> None:
    head = http.post("/tokenize", json={"content": "The capital"}).json()["tokens"]
    base = completion(http, n_predict=8, **GREEDY)
    mixed = http.post("/completion", json={"prompt": [*head, " of France is"], "n_predict": 8, **GREEDY}).json()
    assert mixed["content"] == base["content"] and mixed["tokens_evaluated"] == base["tokens_evaluated"]
    ids = http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    by_ids = http.post("/completion", json={"prompt": ids, "n_predict": 8, **GREEDY}).json()
    assert by_ids["content"] == base["content"]
    many = http.post("/completion", json={"prompt": ["a", "b"], "n_predict": 1})
    assert many.status_code == 400 and "one prompt per request" in many.json()["error"]["message"]


def test_logit_bias_forms(server: ServerProcess, http: httpx.Client) -> None:
    base = completion(http, n_predict=4, return_tokens=True, **GREEDY)
    first = base["tokens"][0]
    text = http.post("/detokenize", json={"tokens": [first]}).json()["content"]
    for bias in ([[first, False]], [[text, False]], [[text, -100]], {text: -100}, {str(first): -100}):
        r = completion(http, n_predict=4, return_tokens=True, logit_bias=bias, **GREEDY)
        assert r["tokens"][0] != first, bias
    # a text stands for every token of its tokenization (no BOS, special text not parsed)
    r = completion(http, n_predict=1, logit_bias=[["<|im_end|>", -1]], **GREEDY)
    assert len(r["generation_settings"]["logit_bias"]) > 1
    # the same forms through the OpenAI client
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    oa = client.completions.create(
        model="smollm2-135m", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"logit_bias": [[text, False]]}
    )
    assert not oa.choices[0].text.startswith(text)
    bad = http.post("/completion", json={"prompt": PROMPT, "logit_bias": [[1]]})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_samplers_order(http: httpx.Client) -> None:
    greedy = completion(http, n_predict=12, **GREEDY)["content"]
    hot = {"temperature": 2.0, "top_k": 1, "seed": 1234, "n_predict": 12}
    # top_k 1 in the chain keeps only the most likely token, whatever the temperature: greedy
    for order in (["top_k", "temperature"], ["temperature", "top_k"], "kt", ["TOP-K", "temp"]):
        r = completion(http, samplers=order, **hot)
        assert r["content"] == greedy, order
    assert completion(http, samplers="kt", **hot)["generation_settings"]["samplers"] == ["top_k", "temperature"]
    # left out of the chain, top_k does nothing: temperature 2 over the whole vocabulary (fixed seed)
    assert completion(http, samplers=["temperature"], **hot)["content"] != greedy
    # a name may repeat; temperature 0 is greedy whatever the order
    assert completion(http, samplers=["min_p", "min_p", "temperature"], n_predict=12, **GREEDY)["content"] == greedy
    bad = http.post("/completion", json={"prompt": PROMPT, "samplers": ["top_k", "bogus"]})
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
    bad = http.post("/completion", json={"prompt": PROMPT, "samplers": "kq"})
    assert bad.status_code == 400 and "'q'" in bad.json()["error"]["message"]


def test_min_keep_and_t_max_predict_ms(http: httpx.Client) -> None:
    r = completion(http, n_predict=4, min_keep=3, top_p=0.0, seed=1, temperature=1.0)
    assert r["generation_settings"]["min_keep"] == 3 and r["tokens_predicted"] == 4
    lines = "1. One\n2. Two\n3. Three\n4."
    free = http.post("/completion", json={"prompt": lines, "n_predict": 40, **GREEDY}).json()
    assert free["content"].count("\n") >= 2  # the model goes on listing
    # 1 ms of generation passes before the second line ends: generation stops at that newline
    cut = http.post("/completion", json={"prompt": lines, "n_predict": 40, "t_max_predict_ms": 1, **GREEDY}).json()
    assert cut["stop_type"] == "limit" and cut["tokens_predicted"] < free["tokens_predicted"]
    assert "\n" in cut["content"] and free["content"].startswith(cut["content"])
    assert cut["content"].rstrip(" \t").endswith("\n")


def test_llama_server_default_body_is_accepted(server: ServerProcess, http: httpx.Client) -> None:
    body = {**LLAMA_SERVER_DEFAULTS, "n_predict": 2}
    r = http.post("/completion", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    assert r.json()["generation_settings"]["samplers"] == LLAMA_SERVER_DEFAULTS["samplers"]
    r = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 200, r.text
    # GET /props's own params, sent back as they are
    params = http.get("/props").json()["default_generation_settings"]["params"]
    r = http.post("/completion", json={"prompt": PROMPT, **params, "n_predict": 2})
    assert r.status_code == 200, r.text


def test_apply_template_is_what_chat_renders(server: ServerProcess, http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "What is the capital of France?" in prompt
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
    raw = http.post("/completion", json={"prompt": prompt, "n_predict": 24, **GREEDY}).json()
    assert raw["content"] == chat.choices[0].message.content
    assert raw["tokens_evaluated"] == chat.usage.prompt_tokens
    assert http.post("/apply-template", json={"messages": []}).status_code == 400


def test_health_alias_and_post_props(server: ServerProcess, http: httpx.Client, spawn) -> None:
    assert http.get("/v1/health").json() == http.get("/health").json() == {"status": "ok", "stage": "ready"}
    r = http.post("/props", json={})
    assert r.status_code == 501 and "--props" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "not_supported_error"
    assert http.get("/props").json()["endpoint_props"] is False
    node = spawn("--props", "--parallel", "1", "--ctx-size", "512")
    node.wait_ready()
    with httpx.Client(base_url=node.base, timeout=60) as other:
        assert other.post("/props", json={}).json() == {"success": True}
        assert other.get("/props").json()["endpoint_props"] is True


@pytest.mark.parametrize(
    "path", ["/infill", "/rerank", "/reranking", "/v1/rerank", "/lora-adapters", "/v1/responses", "/v1/messages"]
)
def test_not_implemented_endpoints(http: httpx.Client, path: str) -> None:
    r = http.post(path, json={})
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["type"] == "not_supported_error" and err["code"] == 501 and path in err["message"]


def test_slot_state_over_http(server: ServerProcess, http: httpx.Client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    first = http.post("/completion", json={"prompt": prompt, "n_predict": 0, "id_slot": 0}).json()
    assert first["id_slot"] == 0
    r = http.get("/slots/0/state")
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    blob = r.content
    n_past = http.get("/slots/0/state/meta").json()["n_past"]
    assert int(r.headers["x-n-past"]) == n_past == first["tokens_evaluated"]
    with Wire(server.port) as w:
        status, _meta, payload = w.call(Op.STATE_GET, key="0")
    assert status == Status.OK and payload == blob  # the same bytes as Hydra STATE_GET
    http.post("/slots/1?action=erase")
    put = http.put("/slots/1/state", content=blob)
    assert put.status_code == 200, put.text
    p = put.json()
    assert p["restored"] is True and p["id_slot"] == 1 and p["bytes"] == len(blob) and p["n_past"] == n_past
    assert p["model_hash_match"] is True
    assert http.get("/slots/1/state/meta").json()["n_past"] == n_past
    again = http.post("/completion", json={"prompt": prompt, "n_predict": 4, "id_slot": 1, **GREEDY}).json()
    assert again["timings"]["cache_n"] == n_past - 1  # all but the last prompt token came from the blob
    # garbage, a damaged blob: 400, the slot unchanged
    before = http.get("/slots/1/state/meta").json()["n_past"]
    bad = http.put("/slots/1/state", content=b"garbage")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    damaged = bytearray(blob)
    damaged[-1] ^= 0xFF
    bad = http.put("/slots/1/state", content=bytes(damaged))
    assert bad.status_code == 400 and "checksum" in bad.json()["error"]["message"]
    assert http.get("/slots/1/state/meta").json()["n_past"] == before
    assert http.get("/slots/9/state").status_code == 404
    assert http.put("/slots/x/state", content=blob).status_code == 400
    # a slot that is processing: 409, as STATE_GET / STATE_PUT answer BUSY
    with streaming(server.base, {"prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "id_slot": 2}):
        assert http.get("/slots/2/state").status_code == 409
        busy = http.put("/slots/2/state", content=blob)
        assert busy.status_code == 409 and busy.json()["error"]["type"] == "conflict_error"
