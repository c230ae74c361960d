"""Structured output and chat bodies whose cost is bounded before the work.

No wall-clock assertions: the refusals are checked by status, message and the
node's memory (RSS), the linear tokenizer by token-for-token equality with
one llama.cpp call.  Timings are in ``bench/costs.py``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import pytest

from hydra_trio.engine.batching.sampling import GrammarError, check_grammar
from hydra_trio.openai.json_schema import (
    MAX_REPETITION,
    MAX_SCHEMA_DEPTH,
    SchemaError,
    integer_range_gbnf,
    schema_to_gbnf,
)
from hydra_trio.openai.schemas import MAX_CONTENT_PARTS, MAX_MESSAGES
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess

MSGS = [{"role": "user", "content": "Give a number."}]


def _rss(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, **body})


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    return r.json()["error"]["message"]


# --------------------------------------------------------------------------- §2 schemas: limits

OVER_LIMITS = [
    ({"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000}, "minItems", "MAX_REPETITION"),
    ({"type": "array", "maxItems": 10**12, "items": {}}, "maxItems", "MAX_REPETITION"),
    ({"type": "string", "maxLength": 1_000_000_000}, "maxLength", "MAX_REPETITION"),
    ({"type": "string", "minLength": 5000}, "minLength", "MAX_REPETITION"),
    ({"type": "string", "pattern": "^a{1000000}$"}, "pattern", "MAX_REPETITION"),
    ({"type": "string", "pattern": "^(ab){2,}x{0,99999}$"}, "pattern", "MAX_REPETITION"),
    ({"type": "string", "pattern": "^" + "a" * 100_000 + "$"}, "pattern", "MAX_PATTERN_CHARS"),
    ({"type": "string", "pattern": "^" + "(" * 200 + "a" + ")" * 200 + "$"}, "pattern", "MAX_SCHEMA_DEPTH"),
]


def _deep(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def _wide(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


@pytest.mark.parametrize(
    "schema,keyword,limit",
    OVER_LIMITS
    + [
        (_deep(100), "nests deeper", "MAX_SCHEMA_DEPTH"),
        (_wide(50_000), "subschemas", "MAX_SCHEMA_NODES"),
        ({"enum": ["x" * 1000] * 1000}, "exceed", "MAX_GRAMMAR_BYTES"),
    ],
    ids=lambda v: str(v)[:30] if isinstance(v, str) else None,
)
def test_schema_over_a_limit_is_a_400_naming_it(
    server: ServerProcess, http: httpx.Client, schema: dict, keyword: str, limit: str
) -> None:
    rss = _rss(server)
    for field, body in (
        ("json_schema", {"json_schema": schema}),
        (
            "response_format",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        ),
    ):
        msg = _error(_chat(http, **body))
        assert msg.startswith(field) and keyword in msg and limit in msg, msg
    # nothing of the size asked for was built: the node grew by less than 64 MiB
    assert _rss(server) - rss < 64 * 2**20
    assert http.get("/health").status_code == 200


UNENFORCEABLE = [
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "number", "minimum": 0}, "minimum"),
    ({"type": "number", "exclusiveMaximum": 1}, "exclusiveMaximum"),
    ({"type": "string", "format": "email"}, "format"),
    ({"type": "string", "pattern": "abc"}, "anchored"),
    ({"type": "string", "pattern": "^(?=a)a$"}, "lookaround"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "beside pattern"),
    ({"type": "array", "items": {}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, "minProperties"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"not": {"type": "null"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"minimum": 3}, "minimum"),
    ({"anyOf": [{"type": "string"}], "maxLength": 3}, "maxLength"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
    ({"type": "integer", "minimum": 2**70}, "64-bit"),
]


@pytest.mark.parametrize("schema,word", UNENFORCEABLE, ids=[w for _, w in UNENFORCEABLE])
def test_schema_keyword_that_cannot_be_enforced_is_a_400_naming_it(http: httpx.Client, schema: dict, word: str) -> None:
    msg = _error(_chat(http, json_schema=schema))
    assert msg.startswith("json_schema") and word in msg, msg


def test_schema_limits_hold_offline() -> None:
    """The converter's checks happen before output grows: the messages name the limit constant."""
    with pytest.raises(SchemaError, match="MAX_REPETITION"):
        schema_to_gbnf({"type": "array", "items": {"type": "integer"}, "minItems": MAX_REPETITION + 1})
    with pytest.raises(SchemaError, match="MAX_SCHEMA_DEPTH"):
        schema_to_gbnf(_deep(MAX_SCHEMA_DEPTH + 2))
    schema_to_gbnf({"type": "array", "items": {"type": "integer"}, "minItems": MAX_REPETITION})
    # a recursive $ref is one rule, not an unrolled tree
    g = schema_to_gbnf(
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    )
    assert len(g) < 1000


def test_raw_grammar_repetitions_are_bounded(http: httpx.Client) -> None:
    for grammar, word in (
        ('root ::= "a"{100000000}', "MAX_GRAMMAR_REPETITION"),
        ('root ::= "a"{0,5000}', "MAX_GRAMMAR_REPETITION"),  # llama.cpp would drop the 5000
        ('root ::= "' + "x" * 2000 + '"{1999}', "MAX_GRAMMAR_EXPANSION"),
    ):
        msg = _error(_chat(http, grammar=grammar))
        assert msg.startswith("grammar") and word in msg, msg


# --------------------------------------------------------------------------- §2 schemas: what is enforced


def _gbnf_regex(g: str) -> re.Pattern:
    """The integer-range GBNF subset (literals, classes, groups, |, {m,n}) as a Python regex."""
    out, i = [], 0
    while i < len(g):
        if g[i] == '"':
            j = g.index('"', i + 1)
            out.append(re.escape(g[i + 1 : j]))
            i = j + 1
        elif g[i] == " ":
            i += 1
        else:
            out.append(g[i])
            i += 1
    return re.compile("".join(out))


def test_integer_ranges_accept_exactly_the_range() -> None:
    rng = random.Random(22)
    pairs = [(10, 12), (0, 0), (-5, 5), (-12, -10), (99, 101), (7, None), (None, 7), (-7, None), (None, -7)]
    pairs += [(a, rng.randint(a, 2500)) for a in (rng.randint(-2500, 2500) for _ in range(60))]
    for lo, hi in pairs:
        r = _gbnf_regex(integer_range_gbnf(lo, hi))
        for n in range(-3000, 3000):
            assert bool(r.fullmatch(str(n))) == ((lo is None or n >= lo) and (hi is None or n <= hi)), (lo, hi, n)
        for bad in ("-0", "00", "01", ""):
            assert not r.fullmatch(bad), (lo, hi, bad)
    big = _gbnf_regex(integer_range_gbnf(-(2**63), 2**63 - 1))
    assert big.fullmatch(str(-(2**63))) and big.fullmatch(str(2**63 - 1)) and not big.fullmatch(str(2**63))


@pytest.mark.parametrize(
    "schema,lo,hi",
    [
        ({"type": "integer", "minimum": 10, "maximum": 12}, 10, 12),
        ({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 2}, -2, 1),
        ({"type": "integer", "minimum": 1000, "maximum": 1003.5}, 1000, 1003),
    ],
)
def test_integer_range_schema_generates_integers_in_range(http: httpx.Client, schema: dict, lo: int, hi: int) -> None:
    prompts = ["Give a number.", "Write 1000000000000000.", "Write -99.", "Count to ten."]
    for p in prompts:
        r = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": p}],
                "max_tokens": 12,
                "temperature": 0,
                "json_schema": schema,
            },
        )
        assert r.status_code == 200, r.text
        value = json.loads(r.json()["choices"][0]["message"]["content"])
        assert isinstance(value, int) and lo <= value <= hi, (p, value)


def test_enforced_schema_keywords_generate_valid_json(http: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["id", "tags", "n"],
        "additionalProperties": False,
    }
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "A record as JSON."}],
            "max_tokens": 80,
            "temperature": 0,
            "json_schema": schema,
        },
    )
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert re.fullmatch(r"[a-z]{2}-[0-9]{3}", obj["id"])
    assert 1 <= len(obj["tags"]) <= 2 and all(len(t) <= 4 for t in obj["tags"])
    assert -5 <= obj["n"] <= 5


def test_generated_grammars_parse(server: ServerProcess) -> None:
    """Every kind of rule the converter writes is accepted by llama.cpp (checked over HTTP: max_tokens 0)."""
    schemas = [
        {"type": "string", "pattern": r"^[^abc]\.\d+(x|y)*\w?\s\D$"},
        {"type": "string", "format": "date-time"},
        {"type": "string", "format": "uuid4"},
        {"type": ["string", "null", "number", "boolean"]},
        {"prefixItems": [{"type": "null"}, {"const": {"k": [1, 2]}}]},
        {
            "allOf": [
                {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"anyOf": [{"properties": {"y": {}}}]},
            ]
        },
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}, "minItems": MAX_REPETITION},
    ]
    with httpx.Client(base_url=server.base, timeout=120) as c:
        for s in schemas:
            r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 0, "json_schema": s})
            assert r.status_code == 200, (s, r.text)


# --------------------------------------------------------------------------- §2 over Hydra


def test_hydra_decode_and_prefill_refuse_schemas_over_limits(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        for op, extra in ((Op.DECODE, {"n_predict": 4}), (Op.PREFILL, {})):
            for schema, word in (
                (OVER_LIMITS[0][0], "MAX_REPETITION"),
                ({"type": "number", "maximum": 3}, "maximum"),
                (_deep(100), "MAX_SCHEMA_DEPTH"),
            ):
                body = {"messages": MSGS, "json_schema": schema, **extra}
                status, meta, _ = w.call(op, key="1", payload=json.dumps(body).encode())
                assert status == Status.BAD_REQUEST and word in meta["error"], (op, meta)
            body = {"messages": MSGS, "grammar": 'root ::= "a"{100000000}', **extra}
            status, meta, _ = w.call(op, key="1", payload=json.dumps(body).encode())
            assert status == Status.BAD_REQUEST and "MAX_GRAMMAR_REPETITION" in meta["error"], (op, meta)
        assert w.call(Op.INFO)[0] == Status.OK  # the connection and the node go on


# --------------------------------------------------------------------------- §3 chat bodies


def _words(n: int) -> list[dict]:
    return [{"role": "user", "content": "hi"} for _ in range(n)]


@pytest.mark.parametrize(
    "messages,word",
    [
        (_words(MAX_MESSAGES + 1), "MAX_MESSAGES"),
        (_words(40_000), "MAX_MESSAGES"),
        (_words(5_000), "context holds"),
        (_words(MAX_MESSAGES), "context holds"),
        ([{"role": "user", "content": "word " * 2_000_000}], "context holds"),
        ([{"role": "user", "content": "<|im_end|>" * 100_000}], "context holds"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}], "MAX_CONTENT_PARTS"),
    ],
    ids=["over-max", "40k", "5k", "at-max", "huge-message", "special-texts", "parts"],
)
def test_chat_body_too_big_is_a_400_naming_the_limit(
    server: ServerProcess, http: httpx.Client, messages: list, word: str
) -> None:
    msg = _error(http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}))
    assert word in msg, msg
    assert http.get("/health").status_code == 200


def test_many_stop_strings_are_refused(http: httpx.Client) -> None:
    assert "stop" in _error(_chat(http, stop=["x"] * 100_000))
    assert "stop" in _error(_chat(http, stop=["x" * 100_000]))


def test_hydra_decode_refuses_a_chat_body_over_the_limits(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        for messages, word in ((_words(MAX_MESSAGES + 1), "MAX_MESSAGES"), (_words(5000), "context holds")):
            for op, extra in ((Op.DECODE, {"n_predict": 4}), (Op.PREFILL, {})):
                status, meta, _ = w.call(op, key="1", payload=json.dumps({"messages": messages, **extra}).encode())
                assert status == Status.BAD_REQUEST and word in meta["error"], (op, meta)


def test_linear_tokenizer_gives_llama_cpp_tokens() -> None:
    """Chunked tokenization equals one llama_tokenize call, special-token texts, BOS and all."""
    from hydra_trio.engine.llama.model import LoadedModel
    from hydra_trio.engine.llama.tokenize import PromptTooLong, tokenize_bytes
    from hydra_trio.models.presets import smollm2_path

    m = LoadedModel(smollm2_path(), n_ctx=256, n_parallel=1, n_batch=32, n_threads=1)
    try:
        rng = random.Random(3)
        parts = [
            "hi",
            " world",
            "<|im_start|>",
            "<|im_end|>",
            "\n",
            "  ",
            "é",
            "日本",
            "<jupyter_code>",
            "<|endoftext|>",
            " <|im_end|> ",
            "x" * 50,
            "<repo_name>",
            "\t",
        ]
        for _ in range(60):
            text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8000)))
            for ps in (True, False):
                for ad in (True, False):
                    assert m.tokenize(text, add_special=ad, parse_special=ps) == tokenize_bytes(
                        m.vocab, text.encode(), ad, ps
                    )
        prompt, _ = m.apply_chat_template(_words(3000))
        single = tokenize_bytes(m.vocab, prompt.encode(), False, True)
        assert m.chat_prompt_tokens(prompt)[-len(single) :] == single
        with pytest.raises(PromptTooLong, match="context holds 200"):
            m.chat_prompt_tokens(prompt, limit=200)
    finally:
        m.close()


def test_check_grammar_scan_offline() -> None:
    from hydra_trio.engine.batching import sampling

    assert sampling._scan('root ::= ("a"){3} [a-z]{2,5} x*')[1] == 3 + 5 * 5 + 2
    with pytest.raises(GrammarError, match="MAX_GRAMMAR_REPETITION"):
        check_grammar(None, 'root ::= "a"{2001}')


def test_tokenizing_stops_for_a_client_that_left() -> None:
    """Prompt preparation for a client that disconnected stops at the next chunk: under
    ``stop_when`` with the event set, tokenizing a long prompt raises Cancelled instead of finishing."""
    import threading

    from hydra_trio.engine.llama.model import LoadedModel
    from hydra_trio.engine.llama.tokenize import CHUNK_BYTES, stop_when
    from hydra_trio.errors import Cancelled
    from hydra_trio.models.presets import smollm2_path

    m = LoadedModel(smollm2_path(), n_ctx=256, n_parallel=1, n_batch=32, n_threads=1)
    try:
        prompt, _ = m.apply_chat_template(_words(3000))
        assert len(prompt.encode()) > 4 * CHUNK_BYTES  # several chunks
        event = threading.Event()
        with stop_when(event):
            tokens = m.chat_prompt_tokens(prompt)  # not set: the whole prompt
            event.set()
            with pytest.raises(Cancelled, match="went away while its prompt was tokenized"):
                m.chat_prompt_tokens(prompt)
        assert m.chat_prompt_tokens(prompt) == tokens  # outside the block nothing stops it
    finally:
        m.close()


def test_a_client_that_leaves_during_prompt_preparation_gets_no_work_done(server: ServerProcess) -> None:
    """A chat body near the message limit, sent and abandoned at once: the node stays up and serves."""
    import socket

    body = json.dumps({"messages": _words(9000), "max_tokens": 1}).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
    r = httpx.get(server.base + "/health", timeout=60)
    assert r.status_code == 200
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
