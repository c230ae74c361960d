"""Request fields that are one setting under several names, or whose meanings overlap, resolve in
llama-server's order, on the real model over real HTTP and the Hydra wire.

The expected values are llama-server's, read from the llama.cpp that llama-cpp-python 0.3.36 vendors:
``tools/server/server-schema.cpp`` (each field reads its first name that is present and not null, then its
aliases in the order they were added, and no other), ``tools/server/server-common.cpp``
(``oaicompat_chat_params_parse``: what a chat body becomes) and ``tools/server/server-context.cpp`` (what a
slot does with the result).  Generated words are never asserted: counts, slots, finish reasons and
the shapes a grammar allows hold on every CPU.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from hydra_trio.openai.schemas import ChatCompletionRequest, parse_body
from hydra_trio.protocol.hydra import DECODE_FLAG_PAD, Op, Status, unpack_decode_frames
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Tell me about the history of Paris."}]
PROMPT = "The history of Paris began"
N_SLOTS = 4  # the shared server's slots (conftest.server)


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _n_generated(path: str, reply: dict[str, Any]) -> int:
    return reply["tokens_predicted"] if path == "/completion" else reply["usage"]["completion_tokens"]


def _body(path: str, **fields: Any) -> dict[str, Any]:
    """A greedy request for ``path`` that never ends at an end-of-generation token (``ignore_eos``), so the
    budget alone ends it."""
    base: dict[str, Any] = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    return {**base, "temperature": 0, "ignore_eos": True, **fields}


def _n_past(http: httpx.Client, id_slot: int) -> int:
    return http.get(f"/slots/{id_slot}/state/meta").json()["n_past"]


# --------------------------------------------------------------------------- the token budget


def test_core_prefill_body_evaluates_the_prompt_only(server: ServerProcess, http: httpx.Client) -> None:
    """Core prefills over HTTP with the client's chat body (its ``max_tokens``) plus ``n_predict: 0`` and
    ``id_slot``.  llama-server reads ``n_predict`` before its aliases, so the budget is 0: its limit is
    checked after a token is sampled, so it samples one token from the prompt's logits, returns it
    (``completion_tokens`` 1, ``finish_reason`` length) and ends without decoding it: the slot holds the
    prompt and nothing else.  Hydra PREFILL of the same body leaves the same ``n_past``."""
    body = {"messages": MESSAGES, "max_tokens": 10, "n_predict": 0, "id_slot": 1, "temperature": 0, "ignore_eos": True}
    reply = _post(http, "/v1/chat/completions", body)
    n_prompt = reply["usage"]["prompt_tokens"]
    assert reply["id_slot"] == 1
    assert reply["usage"]["completion_tokens"] == 1 and reply["choices"][0]["finish_reason"] == "length"
    assert _n_past(http, 1) == n_prompt
    assert http.get("/slots").json()[1]["n_past"] == n_prompt
    with Wire(server.port) as w:
        status, meta, blob = w.call(Op.PREFILL, key="2", payload=json.dumps(body).encode())
    assert status == Status.OK, meta
    assert meta["n_past"] == n_prompt and blob
    # the native endpoint: the same budget, its own counters
    native = _post(
        http, "/completion", {"prompt": PROMPT, "max_tokens": 10, "n_predict": 0, "id_slot": 3, "ignore_eos": True}
    )
    assert native["tokens_predicted"] == 1 and native["stop_type"] == "limit"
    assert native["tokens_cached"] == native["tokens_evaluated"] == _n_past(http, 3)
    assert native["generation_settings"]["n_predict"] == 0


BUDGETS = [
    # (fields, tokens llama-server generates): n_predict, then max_completion_tokens, then max_tokens
    ({"max_tokens": 7, "max_completion_tokens": 3}, 3),
    ({"max_completion_tokens": 5, "n_predict": 2}, 2),
    ({"max_tokens": 6, "n_predict": 4}, 4),
    ({"n_predict": None, "max_completion_tokens": None, "max_tokens": 4}, 4),  # null: not set
    ({"n_predict": 3, "max_tokens": -7}, 3),  # an alias that is not read is not checked either
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completion"])
@pytest.mark.parametrize(("fields", "expected"), BUDGETS, ids=[json.dumps(f) for f, _ in BUDGETS])
def test_budget_names_are_read_in_llama_servers_order(
    http: httpx.Client, path: str, fields: dict, expected: int
) -> None:
    reply = _post(http, path, _body(path, **fields))
    assert _n_generated(path, reply) == expected


def test_budget_minus_one_is_the_nodes_n_predict(spawn) -> None:
    """-1 under any name is llama-server's "the node's ``-n``" (``server-context.cpp``: a request's
    ``n_predict`` of -1 takes ``params_base.n_predict``), and it is read before the aliases."""
    srv = spawn("-np", "1", "-c", "512", "-n", "5")
    srv.wait_ready()
    with httpx.Client(base_url=srv.base, timeout=120) as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            assert _n_generated(path, _post(http, path, _body(path, n_predict=-1, max_tokens=9))) == 5, path
            assert _n_generated(path, _post(http, path, _body(path, max_completion_tokens=-1))) == 5, path
            assert _n_generated(path, _post(http, path, _body(path))) == 5, path


def test_hydra_decode_reads_the_budget_in_the_same_order(server: ServerProcess) -> None:
    """DECODE takes the chat body Core sends over HTTP: ``max_completion_tokens`` before ``max_tokens``."""
    body = {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3, "ignore_eos": True, "temperature": 0}
    with Wire(server.port) as w:
        status, meta, payload = w.call(Op.DECODE, key="0", payload=json.dumps({**body, "stream": False}).encode())
        assert status == Status.OK, meta
        assert meta["n_predict"] == 3 and meta["tokens_generated"] == 3 and len(payload) == 27
        status, meta, payload = w.call(Op.DECODE, key="0", payload=json.dumps({**body, "n_predict": 2}).encode())
        assert status == Status.OK, meta
        assert meta["n_predict"] == 2
        assert len([f for f in unpack_decode_frames(payload) if not f[2] & DECODE_FLAG_PAD]) == 2


# --------------------------------------------------------------------------- log-probabilities


def _chat_alternatives(reply: dict[str, Any]) -> list[int]:
    logprobs = reply["choices"][0].get("logprobs")
    return [] if logprobs is None else [len(t["top_logprobs"]) for t in logprobs["content"]]


def test_logprob_fields_in_llama_servers_order(http: httpx.Client) -> None:
    chat = {"messages": MESSAGES, "temperature": 0, "max_tokens": 2, "ignore_eos": True}
    # logprobs: true without top_logprobs is n_probs 20 (oaicompat_chat_params_parse: top_logprobs defaults to 20)
    assert _chat_alternatives(_post(http, "/v1/chat/completions", {**chat, "logprobs": True})) == [20, 20]
    # with logprobs: true the body's n_probs is not read: top_logprobs is
    assert _chat_alternatives(
        _post(http, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2, "n_probs": 5})
    ) == [2, 2]
    # without logprobs, n_probs > 0 asks for them (llama-server's own field)
    assert _chat_alternatives(_post(http, "/v1/chat/completions", {**chat, "n_probs": 3})) == [3, 3]
    assert _chat_alternatives(_post(http, "/v1/chat/completions", {**chat, "n_probs": 0})) == []
    # completions: n_probs, then its alias logprobs (server-schema.cpp)
    text = {"prompt": PROMPT, "temperature": 0, "max_tokens": 2, "ignore_eos": True}
    reply = _post(http, "/v1/completions", {**text, "n_probs": 1, "logprobs": 3})
    assert [len(t) for t in reply["choices"][0]["logprobs"]["top_logprobs"]] == [1, 1]
    reply = _post(http, "/v1/completions", {**text, "n_probs": 0, "logprobs": 3})
    assert reply["choices"][0]["logprobs"] is None  # n_probs 0 is read: no log-probabilities
    reply = _post(http, "/completion", {**text, "logprobs": 2})
    assert [len(t["top_logprobs"]) for t in reply["completion_probabilities"]] == [2, 2]
    reply = _post(http, "/completion", {**text, "n_probs": 1, "logprobs": 4})
    assert [len(t["top_logprobs"]) for t in reply["completion_probabilities"]] == [1, 1]


# --------------------------------------------------------------------------- slots


def test_id_slot_as_llama_server_reads_it(http: httpx.Client) -> None:
    """``id_slot`` past the last slot wraps around (``get_slot_by_id``: ``id_slot % n_slots``); one below -1
    names no slot and the request takes an idle one; ``slot_id`` is no alias (llama-server reads
    ``id_slot`` only) and is ignored as any unknown key."""
    for asked, got in ((N_SLOTS + 1, 1), (2 * N_SLOTS + 2, 2), (N_SLOTS - 1, N_SLOTS - 1)):
        for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            assert _post(http, path, _body(path, max_tokens=1, id_slot=asked))["id_slot"] == got, (path, asked)
    assert 0 <= _post(http, "/v1/completions", _body("/v1/completions", max_tokens=1, id_slot=-3))["id_slot"] < N_SLOTS
    reply = _post(http, "/v1/chat/completions", _body("/v1/chat/completions", max_tokens=1, id_slot=0, slot_id=2))
    assert reply["id_slot"] == 0


def test_n_cmpl_is_read_before_n(http: httpx.Client) -> None:
    """llama-server's ``n_cmpl`` with its alias ``n`` (OpenAI's): ``n`` is not read when ``n_cmpl`` is set;
    below 1 is llama-server's 400.  This node makes one completion per request: more is a 400 naming the
    field that asked."""
    assert _post(http, "/v1/chat/completions", _body("/v1/chat/completions", max_tokens=1, n_cmpl=1, n=3))
    for fields, name in (({"n_cmpl": 2, "n": 1}, "n_cmpl"), ({"n": 0}, "n"), ({"n_cmpl": 0, "n": 1}, "n_cmpl")):
        r = http.post("/v1/completions", json=_body("/v1/completions", max_tokens=1, **fields))
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(name + ":"), r.text


# --------------------------------------------------------------------------- constrained output

YES_NO = {"enum": ["yes", "no"]}
RED_BLUE = {"enum": ["red", "blue"]}
GRAMMAR_X = 'root ::= "x" "x"?'


def test_constraint_fields_in_llama_servers_order(http: httpx.Client) -> None:
    chat = {"messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    # chat: a response_format of type json_schema wins over json_schema (oaicompat_chat_params_parse)
    rf = {"type": "json_schema", "json_schema": {"schema": YES_NO}}
    reply = _post(http, "/v1/chat/completions", {**chat, "json_schema": RED_BLUE, "response_format": rf})
    assert json.loads(reply["choices"][0]["message"]["content"]) in ("yes", "no")
    # json_object with its own schema too; without one it keeps a non-empty json_schema
    rf_obj = {"type": "json_object", "schema": YES_NO}
    reply = _post(http, "/v1/chat/completions", {**chat, "json_schema": RED_BLUE, "response_format": rf_obj})
    assert json.loads(reply["choices"][0]["message"]["content"]) in ("yes", "no")
    reply = _post(
        http, "/v1/chat/completions", {**chat, "json_schema": RED_BLUE, "response_format": {"type": "json_object"}}
    )
    assert json.loads(reply["choices"][0]["message"]["content"]) in ("red", "blue")
    # a schema (here response_format's) wins over grammar
    reply = _post(http, "/v1/chat/completions", {**chat, "grammar": GRAMMAR_X, "response_format": rf})
    assert json.loads(reply["choices"][0]["message"]["content"]) in ("yes", "no")
    # no type (or ""): plain text; json_schema without its wrapper: any JSON object
    assert _post(http, "/v1/chat/completions", {**chat, "max_tokens": 1, "response_format": {}})
    reply = _post(http, "/v1/chat/completions", {**chat, "max_tokens": 3, "response_format": {"type": "json_schema"}})
    assert reply["choices"][0]["message"]["content"].lstrip().startswith("{")
    # completions (the json_schema field, server-schema.cpp): grammar wins over json_schema
    for path in ("/v1/completions", "/completion"):
        reply = _post(
            http,
            path,
            {"prompt": PROMPT, "temperature": 0, "max_tokens": 4, "grammar": GRAMMAR_X, "json_schema": YES_NO},
        )
        text = reply["choices"][0]["text"] if path == "/v1/completions" else reply["content"]
        assert text in ("x", "xx"), (path, text)


def test_empty_stop_strings_are_dropped(http: httpx.Client) -> None:
    """llama-server's ``stop`` keeps the non-empty strings of a list (an empty one would stop at once)."""
    reply = _post(http, "/completion", {"prompt": PROMPT, "n_predict": 3, "ignore_eos": True, "stop": ["", "zzqx", ""]})
    assert reply["generation_settings"]["stop"] == ["zzqx"] and reply["tokens_predicted"] == 3


def test_thinking_budget_names_in_llama_servers_order() -> None:
    """``oaicompat_chat_params_parse``: ``reasoning_budget_tokens``, else ``thinking_budget_tokens`` (the first
    that is not null; the other is not read), and -1 means the node's ``--reasoning-budget``."""

    def budget(**fields: Any) -> int | None:
        body = {"messages": MESSAGES, **fields}
        return parse_body(json.dumps(body).encode(), ChatCompletionRequest).thinking_budget

    assert budget(reasoning_budget_tokens=-1, thinking_budget_tokens=0) is None  # -1 is read: the node's
    assert budget(reasoning_budget_tokens=7, thinking_budget_tokens=0) == 7
    assert budget(reasoning_budget_tokens=None, thinking_budget_tokens=0) == 0
    assert budget() is None
