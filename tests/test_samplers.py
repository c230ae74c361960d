"""llama-server's samplers beyond top-k/top-p/min-p (typical, top-n-sigma, XTC, DRY, Mirostat, dynamic
temperature) and node-wide sampling defaults, against a real server and the real SmolLM2."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from hydra_trio import EngineConfig, SamplingParams, ServerConfig, serve
from hydra_trio.models.presets import resolve_model
from hydra_trio.protocol.hydra import Op, Status, unpack_decode_frames
from hydra_trio.testing.hydra_wire import Wire

from .conftest import CAPITAL_QUESTION, ServerProcess

FRANCE = "The capital of France is"
COUNTING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"

# llama-server's request defaults for these samplers (common/common.h of the llama.cpp we run)
LLAMA_SERVER_DEFAULTS = {
    "typical_p": 1.0,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "min_keep": 0,
}
SAMPLER_FIELDS = set(LLAMA_SERVER_DEFAULTS)


def _complete(base: str, prompt: str = FRANCE, **fields: object) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _text(base: str, prompt: str = FRANCE, **fields: object) -> str:
    return _complete(base, prompt, **fields)["choices"][0]["text"]


# --------------------------------------------------------------------------- accepted, neutral
def test_llama_server_defaults_are_accepted_and_change_nothing_under_greedy(server: ServerProcess) -> None:
    plain = _text(server.base, max_tokens=12, temperature=0)
    assert plain.startswith(" Paris")
    assert _text(server.base, max_tokens=12, temperature=0, **LLAMA_SERVER_DEFAULTS) == plain
    # -1 (the context) is llama-server's older default for dry_penalty_last_n; a dry_base below 1 means the default
    assert (
        _text(
            server.base,
            max_tokens=12,
            temperature=0,
            **{**LLAMA_SERVER_DEFAULTS, "dry_penalty_last_n": -1, "dry_base": 0.5},
        )
        == plain
    )
    # the chat endpoint too
    chat = {"messages": CAPITAL_QUESTION, "max_tokens": 16, "temperature": 0}
    a = httpx.post(server.base + "/v1/chat/completions", json=chat, timeout=120)
    b = httpx.post(server.base + "/v1/chat/completions", json={**chat, **LLAMA_SERVER_DEFAULTS}, timeout=120)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    assert "Paris" in b.json()["choices"][0]["message"]["content"]


def test_seeded_sampling_with_neutral_samplers_is_unchanged(server: ServerProcess) -> None:
    """temperature > 0: the neutral values leave the chain as it was (same seed, same text)."""
    base = {"max_tokens": 16, "temperature": 1.0, "seed": 1234}
    plain = _text(server.base, **base)
    assert _text(server.base, **base, **LLAMA_SERVER_DEFAULTS) == plain


# --------------------------------------------------------------------------- refused
BAD = [  # llama-server's hard limits and types (the soft-limited and unlimited ones: test_request_ranges.py)
    ("dry_allowed_length", -1),
    ("dry_penalty_last_n", -2),
    ("dry_penalty_last_n", 2**31),
    ("dry_sequence_breakers", []),
    ("dry_sequence_breakers", "\n"),
    ("dry_sequence_breakers", [1]),
    ("dry_sequence_breakers", ["x" * 41]),
    ("dry_sequence_breakers", ["a"] * 17),
    ("min_keep", -1),
    ("typical_p", "0.9"),
    ("mirostat", [1]),
]


def test_out_of_range_values_are_400_naming_the_field(server: ServerProcess) -> None:
    for field, value in BAD:
        for path, body in (
            ("/v1/completions", {"prompt": "Hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ):
            r = httpx.post(server.base + path, json={**body, "max_tokens": 1, field: value}, timeout=60)
            assert r.status_code == 400, (path, field, value, r.text)
            message = r.json()["error"]["message"]
            assert message.startswith(field), (field, value, message)


# --------------------------------------------------------------------------- acting
def test_mirostat_runs_and_is_reproducible_with_a_seed(server: ServerProcess) -> None:
    for version in (1, 2):
        fields = {
            "max_tokens": 16,
            "temperature": 0.8,
            "seed": 42,
            "mirostat": version,
            "mirostat_tau": 3.0,
            "mirostat_eta": 0.2,
            "ignore_eos": True,
        }
        r = _complete(server.base, **fields)
        assert r["usage"]["completion_tokens"] == 16
        assert r["choices"][0]["text"]
        assert _text(server.base, **fields) == r["choices"][0]["text"]
        plain = {k: v for k, v in fields.items() if not k.startswith("mirostat")}
        assert _text(server.base, **plain) != r["choices"][0]["text"]  # the same seed without Mirostat
    # mirostat at temperature 0 is greedy
    assert _text(server.base, max_tokens=8, temperature=0, mirostat=2) == _text(
        server.base, max_tokens=8, temperature=0
    )


def test_xtc_removes_the_likeliest_tokens(server: ServerProcess) -> None:
    """XTC with probability 1 drops every token above the threshold but the least likely of them: under
    greedy the answer can no longer start with the argmax " Paris"."""
    plain = _complete(server.base, max_tokens=1, temperature=0, logprobs=5)
    assert plain["choices"][0]["text"] == " Paris"
    xtc = _complete(server.base, max_tokens=8, temperature=0, xtc_probability=1.0, xtc_threshold=0.01, seed=7)
    assert xtc["usage"]["completion_tokens"] > 0
    assert not xtc["choices"][0]["text"].startswith(" Paris"), xtc["choices"][0]["text"]
    # a threshold above 0.5 switches XTC off (llama.cpp's rule)
    assert _text(server.base, max_tokens=1, temperature=0, xtc_probability=1.0, xtc_threshold=0.6) == " Paris"


def test_dry_breaks_a_repetition_that_greedy_continues(server: ServerProcess) -> None:
    plain = _text(server.base, COUNTING, max_tokens=12, temperature=0)
    assert plain.startswith(" 1, 2, 3"), plain  # greedy continues the loop
    dry = _text(
        server.base,
        COUNTING,
        max_tokens=12,
        temperature=0,
        dry_multiplier=4.0,
        dry_base=2.0,
        dry_allowed_length=2,
        dry_penalty_last_n=-1,
    )
    assert dry != plain and not dry.startswith(" 1, 2, 3"), dry
    # the prompt's own repetition counts (llama-server feeds the prompt to the chain): DRY acts from the first token
    assert _text(server.base, COUNTING, max_tokens=1, temperature=0, dry_multiplier=4.0, dry_base=2.0) != " 1"


def test_typical_top_n_sigma_dynatemp_run(server: ServerProcess) -> None:
    for fields in (
        {"typical_p": 0.5},
        {"top_n_sigma": 1.0},
        {"dynatemp_range": 0.5, "dynatemp_exponent": 2.0},
        {"typical_p": 0.9, "top_n_sigma": 2.0, "xtc_probability": 0.5, "dry_multiplier": 0.8, "min_keep": 2},
    ):
        r = _complete(server.base, max_tokens=8, temperature=0.9, seed=3, ignore_eos=True, **fields)
        assert r["usage"]["completion_tokens"] == 8, fields
        assert (
            _text(server.base, max_tokens=8, temperature=0.9, seed=3, ignore_eos=True, **fields)
            == r["choices"][0]["text"]
        ), fields
    # top-n-sigma 0 (a tiny window) keeps only the top token: greedy's answer
    assert _text(server.base, max_tokens=1, temperature=1.5, top_n_sigma=0.001, seed=5) == " Paris"


# --------------------------------------------------------------------------- /props, Hydra
def test_props_show_every_sampler_field(server: ServerProcess) -> None:
    params = httpx.get(server.base + "/props", timeout=30).json()["default_generation_settings"]["params"]
    for field, value in LLAMA_SERVER_DEFAULTS.items():
        assert params[field] == value, field
    assert params["n_predict"] == params["max_tokens"] == -1
    assert params["samplers"] == [
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    ]
    # exactly the fields SamplingParams has, under the same names
    assert {f: params[f] for f in SamplingParams().to_json()} == SamplingParams().to_json()


def test_hydra_configure_decode_prefill_take_the_samplers(server: ServerProcess) -> None:
    change = {
        "dry_multiplier": 0.5,
        "dry_sequence_breakers": ["\n", "."],
        "mirostat": 2,
        "mirostat_tau": 4.0,
        "typical_p": 0.95,
        "xtc_threshold": 0.2,
        "top_n_sigma": 1.5,
        "dynatemp_range": 0.1,
        "min_keep": 1,
    }
    with Wire(server.port) as w:
        try:
            status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps(change).encode())
            assert status == Status.OK and meta["tier"] == 1, meta
            assert meta["params_applied"] == change and meta["unrecognized_keys"] == []
            info = w.call(Op.INFO)[1]["sampling_defaults"]
            assert {k: info[k] for k in change} == change
            params = httpx.get(server.base + "/props", timeout=30).json()["default_generation_settings"]["params"]
            assert {k: params[k] for k in change} == change
            for bad, name in (
                ({"mirostat": 5}, "mirostat"),
                ({"dry_sequence_breakers": "x"}, "dry_sequence_breakers"),
                ({"typical_p": 1e39}, "typical_p"),
                ({"dry_base": 0.5}, "dry_base"),
            ):
                status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps(bad).encode())
                assert status == Status.BAD_REQUEST and name in meta["error"], meta
            assert w.call(Op.INFO)[1]["sampling_defaults"]["mirostat"] == 2  # a refused change changes nothing
        finally:
            reset = {k: LLAMA_SERVER_DEFAULTS[k] for k in change}
            assert w.call(Op.CONFIGURE, payload=json.dumps(reset).encode())[0] == Status.OK
        # DECODE and PREFILL take the fields in their OpenAI body
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"messages": msgs, "n_predict": 4, "temperature": 0, **LLAMA_SERVER_DEFAULTS}
        status, meta, payload = w.call(Op.DECODE, key="1", payload=json.dumps(body).encode())
        assert status == Status.OK, meta
        assert len(unpack_decode_frames(payload)) == 4
        # a body's hard-limited field out of range (a soft-limited one is clamped, as llama-server)
        status, meta, _ = w.call(Op.DECODE, key="1", payload=json.dumps({**body, "min_keep": -1}).encode())
        assert status == Status.BAD_REQUEST and "min_keep" in meta["error"], meta
        status, meta, _ = w.call(
            Op.PREFILL, key="1", payload=json.dumps({"messages": msgs, **LLAMA_SERVER_DEFAULTS}).encode()
        )
        assert status == Status.OK, meta
        status, meta, _ = w.call(
            Op.PREFILL, key="1", payload=json.dumps({"messages": msgs, "dry_allowed_length": -1}).encode()
        )
        assert status == Status.BAD_REQUEST and "dry_allowed_length" in meta["error"], meta


# --------------------------------------------------------------------------- node-wide defaults
async def test_engine_config_sets_the_node_defaults() -> None:
    path, _alias = resolve_model("smollm2-135m")
    engine = EngineConfig(
        model_path=path,
        model_alias="defaults",
        n_parallel=1,
        n_ctx=512,
        sampling=SamplingParams(temperature=0.0, top_k=7),
        n_predict=5,
    )
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, ServerConfig(port=0, engine=engine))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
            with trio.fail_after(120):
                await server.engine.wait_ready()
            params = (await client.get("/props")).json()["default_generation_settings"]["params"]
            assert params["temperature"] == 0.0 and params["top_k"] == 7
            assert params["n_predict"] == params["max_tokens"] == 5
            assert params["top_p"] == 0.95 and params["mirostat"] == 0  # the rest: llama-server's defaults
            # no max_tokens: the node's n_predict; no temperature: the node's greedy
            r = (await client.post("/v1/completions", json={"prompt": "Once upon a time"})).json()
            assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
            greedy = (
                await client.post(
                    "/v1/completions", json={"prompt": "Once upon a time", "temperature": 0, "max_tokens": 5}
                )
            ).json()
            assert r["choices"][0]["text"] == greedy["choices"][0]["text"]
            r = (
                await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}]},
                )
            ).json()
            assert r["usage"]["completion_tokens"] == 5
            # a request's own budget wins
            r = (await client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2})).json()
            assert r["usage"]["completion_tokens"] == 2
        nursery.cancel_scope.cancel()


def test_engine_config_checks_its_values() -> None:
    path, _alias = resolve_model("smollm2-135m")
    with pytest.raises(ValueError, match=r"^n_predict"):
        EngineConfig(model_path=path, model_alias="x", n_predict=-2)
    with pytest.raises(ValueError, match=r"^dry_sequence_breakers"):
        SamplingParams(dry_sequence_breakers=["x" * 41])
    assert SamplingParams(dry_sequence_breakers=[]).dry_sequence_breakers == ()  # --dry-sequence-breaker none
