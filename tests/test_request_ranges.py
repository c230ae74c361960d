"""Out-of-range request values as llama-server treats them, on the real model over real HTTP.

The expected values are llama-server's, read from the llama.cpp that llama-cpp-python 0.3.36 vendors:
``tools/server/server-schema.cpp`` reads each number of a completion request through ``field_num<T>::eval``,
which converts the JSON value to the field's C type (its JSON library takes a float for an integer field,
truncated, and a boolean as 1 or 0; a string is an error) and then either clamps it into the field's soft
limits (``set_limits``), refuses it outside the hard ones (``set_hard_limits``, a 400), or takes any value
(no limits); ``common/sampling.cpp`` (``common_sampler_init``) then refuses penalties that are not finite.
What the node does beyond that to stay up (a float read at most as ``FLT_MAX``, ``n_probs`` at most
``N_PROBS_MAX``, a pick a grammar refuses) is said at each test.  Generated words are never asserted:
settings, statuses, counts and the shapes a grammar allows hold on every CPU.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from hydra_trio.openai.field_limits import N_PROBS_MAX

from .conftest import ServerProcess

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
FLT_MAX = 3.4028234663852886e38


def _settings(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    """``generation_settings`` of a one-token ``/completion`` with ``fields`` (200 required)."""
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 1, **fields})
    assert r.status_code == 200, (fields, r.text)
    return r.json()["generation_settings"]


def _refusal(r: httpx.Response) -> str:
    """The message of an OpenAI-style 400 body."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400, err
    return err["message"]


# --------------------------------------------------------------------------- soft limits: clamped
SOFT = [  # (field, value sent, value llama-server runs with)
    ("temperature", -1.5, 0.0),  # set_limits(0, inf)
    ("top_k", -5, 0),  # set_limits(0, INT32_MAX)
    ("top_k", 2**40, 2**31 - 1),
    ("top_p", 1.5, 1.0),  # set_limits(0, 1)
    ("top_p", -0.2, 0.0),
    ("min_p", 7, 1.0),
    ("xtc_probability", 2.5, 1.0),
    ("xtc_threshold", -1, 0.0),
    ("mirostat", 7, 2),  # set_limits(0, 2)
    ("mirostat", -3, 0),
    ("adaptive_target", 5.0, 1.0),  # set_limits(-FLT_MAX, 1)
    # the value is converted to the field's type first: a float truncated toward zero, a boolean 1 or 0
    ("top_k", 3.9, 3),
    ("mirostat", True, 1),
    ("temperature", True, 1.0),
    # seed is an unsigned 32-bit integer: modulo 2**32 (no limits)
    ("seed", 2**32 + 5, 5),
    ("seed", -2, 2**32 - 2),
    ("seed", 7.9, 7),
]


@pytest.mark.parametrize(("field", "sent", "runs"), SOFT, ids=[f"{f}={v!r}" for f, v, _ in SOFT])
def test_soft_limits_clamp_silently(http: httpx.Client, field: str, sent: Any, runs: Any) -> None:
    got = _settings(http, **{field: sent})[field]
    assert got == runs and type(got) is type(runs), (field, sent, got)


def test_a_chat_request_runs_with_the_clamped_values(http: httpx.Client) -> None:
    """The OpenAI endpoints read the same fields the same way: the slot's ``params`` (``/slots``) show what
    a chat request ran with."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 1,
        "id_slot": 3,
        "temperature": 9,
        "top_p": 3,
        "top_k": -1,
        "mirostat": 5,
        "xtc_threshold": 1.5,
        "min_p": -1,
        "seed": -2,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    params = next(s for s in http.get("/slots").json() if s["id"] == 3)["params"]
    assert {k: params[k] for k in ("temperature", "top_p", "top_k", "mirostat", "xtc_threshold", "min_p", "seed")} == {
        "temperature": 9.0,
        "top_p": 1.0,
        "top_k": 0,
        "mirostat": 2,
        "xtc_threshold": 1.0,
        "min_p": 0.0,
        "seed": 2**32 - 2,
    }


# --------------------------------------------------------------------------- no limits: any value of the type
ANY = [  # fields llama-server reads without limits (field_num with neither set_limits nor set_hard_limits)
    ("typical_p", 7.0),
    ("typical_p", -3.0),
    ("top_n_sigma", 500.0),
    ("dynatemp_range", 5.0),
    ("dynatemp_exponent", -2.0),
    ("dry_multiplier", -1.0),
    ("dry_multiplier", 1000.0),
    ("dry_base", 500.0),
    ("mirostat_tau", 500.0),
    ("mirostat_eta", -1.0),
    ("repeat_penalty", 50.0),
    ("presence_penalty", -5.0),
    ("frequency_penalty", 5.0),
    ("temperature", 1000.0),
]


@pytest.mark.parametrize(("field", "sent"), ANY, ids=[f"{f}={v!r}" for f, v in ANY])
def test_fields_without_limits_take_any_value(http: httpx.Client, field: str, sent: Any) -> None:
    assert _settings(http, **{field: sent})[field] == sent


def test_floats_beyond_a_32_bit_float_run_as_the_largest_one(http: httpx.Client) -> None:
    """llama-server holds these as C floats, where ``1e300`` (and the JSON number ``1e999``) is infinity: an
    infinite temperature divides every logit to 0 or NaN.  The node reads them as ``FLT_MAX`` (the same
    uniform choice, without NaN); a temperature's soft maximum is infinity in llama-server."""
    assert _settings(http, temperature=1e300, top_n_sigma=-1e300)["temperature"] == FLT_MAX
    r = http.post("/completion", content=b'{"prompt": "Hi", "n_predict": 1, "temperature": 1e999, "dry_base": 1e999}')
    assert r.status_code == 200, r.text
    assert r.json()["generation_settings"]["temperature"] == r.json()["generation_settings"]["dry_base"] == FLT_MAX


# --------------------------------------------------------------------------- hard limits: a 400 naming field and range
HARD = [  # (field, value): set_hard_limits(lo, hi) in tools/server/server-schema.cpp
    ("n_predict", -2, "-1 and 2147483647"),
    ("max_tokens", 2**31, "-1 and 2147483647"),
    ("n_keep", -2, "-1 and 2147483647"),
    ("n_discard", -1, "0 and 2147483647"),
    ("n_cache_reuse", -1, "0 and 2147483647"),
    ("t_max_predict_ms", -2, "-1 and 9223372036854775807"),
    ("dry_allowed_length", -1, "0 and 2147483647"),
    ("min_keep", -1, "0 and 2147483647"),
    ("adaptive_decay", 0.995, "0 and 0.99"),
    ("adaptive_decay", -0.5, "0 and 0.99"),
    # the penalty windows: -1 is the slot's context (earlier llama-server versions' meaning), below is refused
    ("repeat_last_n", -2, "-1 and 2147483647"),
    ("dry_penalty_last_n", -2, "-1 and 2147483647"),
    # a float for an integer field is truncated first, then checked
    ("n_keep", -2.5, "-1 and 2147483647"),
]


@pytest.mark.parametrize(("field", "sent", "between"), HARD, ids=[f"{f}={v!r}" for f, v, _ in HARD])
@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_hard_limits_refuse_naming_the_field_and_range(
    http: httpx.Client, path: str, field: str, sent: Any, between: str
) -> None:
    base: dict[str, Any] = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    budget = {} if field in ("n_predict", "max_tokens") else {"n_predict": 1}  # n_predict is read first
    message = _refusal(http.post(path, json={**base, **budget, field: sent}))
    assert message.startswith(f"{field}: must be between {between}, got "), message


def test_hard_limits_accept_their_edges(http: httpx.Client) -> None:
    """The edges themselves run (llama-server's limits are inclusive; ``adaptive_decay`` compared as a 32-bit
    float, where 0.9900000001 is 0.99)."""
    got = _settings(
        http,
        n_keep=-1,
        n_discard=0,
        repeat_last_n=2**31 - 1,
        dry_penalty_last_n=0,
        min_keep=0,
        adaptive_decay=0.9900000001,
        t_max_predict_ms=2**63 - 1,
    )
    assert got["repeat_last_n"] == 2**31 - 1 and got["n_keep"] == -1


PENALTIES = [  # common_sampler_init (common/sampling.cpp) refuses these: not finite as a float, or <= 0
    ("repeat_penalty", 0),
    ("repeat_penalty", -1.0),
    ("repeat_penalty", 1e-39),
    ("frequency_penalty", 1e39),
    ("presence_penalty", -1e39),
]


@pytest.mark.parametrize(("field", "sent"), PENALTIES, ids=[f"{f}={v!r}" for f, v in PENALTIES])
def test_penalties_llama_cpp_refuses_are_400(http: httpx.Client, field: str, sent: Any) -> None:
    message = _refusal(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, field: sent}))
    assert message.startswith(f"{field}: must be"), message


def test_a_number_field_refuses_what_is_not_a_number(http: httpx.Client) -> None:
    """A string, a list, an object: llama-server's JSON library throws (``type must be number``), a 400."""
    for field, sent in (("top_k", "5"), ("temperature", [1]), ("seed", {"a": 1}), ("n_probs", "3")):
        message = _refusal(http.post("/completion", json={"prompt": PROMPT, "n_predict": 1, field: sent}))
        assert message.startswith(f"{field}: expected a number, got "), message


def test_a_float_budget_is_truncated(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3.9, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------------------- alternatives per token
def test_alternatives_per_token_have_no_limit_but_the_nodes(http: httpx.Client) -> None:
    """llama-server takes any ``n_probs`` (and ``top_logprobs`` / ``logprobs``, which become it) and returns
    "at maximum" that many alternatives (``tools/server/README.md``), at most the vocabulary.  The node
    returns at most ``N_PROBS_MAX`` per token: each costs work on the engine thread all slots share."""
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "n_probs": 10**12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [len(p["top_logprobs"]) for p in r.json()["completion_probabilities"]] == [N_PROBS_MAX, N_PROBS_MAX]
    chat = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": True}
    r = http.post("/v1/chat/completions", json={**chat, "top_logprobs": 21})
    assert r.status_code == 200, r.text
    assert [len(t["top_logprobs"]) for t in r.json()["choices"][0]["logprobs"]["content"]] == [21, 21]
    # a negative count asks for none: no log-probabilities at all (llama-server's "n_probs > 0")
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": -1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


# --------------------------------------------------------------------------- a grammar and logits gone to NaN
NAN_PRONE = [  # values llama-server takes that drive logits to infinity and the chain's arithmetic to NaN
    {"temperature": 1e-40, "top_k": 0, "top_p": 1, "min_p": 0},
    {"typical_p": -1.0},
    {"frequency_penalty": -3e38, "top_k": 0, "top_p": 1, "min_p": 0},
    {"dry_multiplier": -3e38, "dry_base": 3e38, "dry_allowed_length": 0, "top_k": 0, "top_p": 1, "min_p": 0},
]


@pytest.mark.parametrize("fields", NAN_PRONE, ids=[next(iter(f)) for f in NAN_PRONE])
def test_a_grammar_holds_when_the_settings_overflow_the_logits(
    server: ServerProcess, http: httpx.Client, fields: dict[str, Any]
) -> None:
    """llama.cpp's ``dist`` takes the last candidate when its sums are NaN; with a grammar that may be a token
    the grammar refused, and accepting it throws inside llama.cpp, which aborts the process.  The node
    checks a grammar's pick before accepting it: the reply follows the grammar and the node stays up."""
    r = http.post(
        "/completion", json={"prompt": PROMPT, "n_predict": 6, "grammar": 'root ::= "{" "}" | "[" "]"', **fields}
    )
    assert r.status_code == 200, r.text
    assert r.json()["content"] in ("{}", "[]"), r.json()["content"]
    assert server.proc.poll() is None and http.get("/health").status_code == 200


def test_the_same_settings_without_a_grammar_answer(http: httpx.Client) -> None:
    """Without a grammar nothing is checked: the reply is whatever llama.cpp's chain picks (as llama-server's),
    and the node answers."""
    for fields in NAN_PRONE:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **fields})
        assert r.status_code == 200, (fields, r.text)
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 4, fields


# --------------------------------------------------------------------------- CONFIGURE stays strict
def test_configure_refuses_rather_than_clamps(server: ServerProcess, http: httpx.Client) -> None:
    """CONFIGURE (hydra-trio's own protocol) sets the node's defaults: a value the engine cannot run is
    refused, never clamped; what a request may send unclamped (a temperature of 5) it accepts."""
    from hydra_trio.protocol.hydra import Op, Status
    from hydra_trio.testing.hydra_wire import Wire

    with Wire(server.port) as w:
        for params, name in (
            ({"temperature": -0.5}, "temperature"),
            ({"top_p": 1.5}, "top_p"),
            ({"mirostat": 3}, "mirostat"),
            ({"seed": -2}, "seed"),
        ):
            status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps(params).encode())
            assert status == Status.BAD_REQUEST and meta["error"].startswith(name + ":"), (params, meta)
        try:
            status, meta, _ = w.call(Op.CONFIGURE, payload=b'{"temperature": 5, "typical_p": 3}')
            assert status == Status.OK, meta
            params = http.get("/props").json()["default_generation_settings"]["params"]
            assert (params["temperature"], params["typical_p"]) == (5.0, 3.0)
        finally:
            status, _, _ = w.call(Op.CONFIGURE, payload=b'{"temperature": 0.8, "typical_p": 1.0}')
            assert status == Status.OK
