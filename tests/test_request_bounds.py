"""Requests whose size would drive recursion, time or memory: each gets a correct result or a 400 naming the limit.

Grammars are checked with llama.cpp's own grammar engine (a vocabulary-only load of the default model:
a text is accepted when each of its characters is allowed in turn and then the end of generation).
No wall-clock assertions: the node answers, names the limit, keeps serving, and its peak memory stays
within a bound where the input would otherwise be multiplied.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.strategies import SizedCase, deep_grammars, deep_json_bodies, long_request_lists, wide_and_deep_schemas
from hydra_trio.engine.batching.gbnf_depth import depths, stack_depth
from hydra_trio.engine.batching.sampling import MAX_GRAMMAR_BYTES, MAX_GRAMMAR_STACK_DEPTH, GrammarError, check_grammar
from hydra_trio.openai.json_schema import MAX_SCHEMA_NODES, schema_to_gbnf
from hydra_trio.openai.tools import parse_tool_spec, tool_grammar
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire
from hydra_trio.validation import strict

from .conftest import ServerProcess

MSGS = [{"role": "user", "content": "Give a record."}]


def _optional(n: int, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}, "required": list(required)}


def _deep(n: int, inner: str = "1") -> str:
    return "[" * n + inner + "]" * n


def _chain(n: int) -> str:
    """A grammar whose n rules each reference the next before one more item: llama.cpp stacks n entries."""
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(n)) + f'r{n} ::= "a"\n'


def _raw_chat(http: httpx.Client, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    return r.json()["error"]["message"]


def _peak_rss(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# --------------------------------------------------------------------------- llama.cpp's grammar engine, offline


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    import llama_cpp

    from hydra_trio.models.presets import resolve_model

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(resolve_model("smollm2-135m")[0]).encode(), params)
    assert model
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def _accepts(vocab: Any, gbnf: str, text: str) -> bool:
    """llama.cpp's grammar engine takes ``text`` (one character a token) and then the end of generation."""
    import llama_cpp

    smpl = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    assert smpl, "llama.cpp could not parse the grammar"

    def allowed(token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(id=token, logit=0.0, p=0.0))
        arr = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
        return data[0].logit != -math.inf

    try:
        buf = (llama_cpp.llama_token * 8)()
        for ch in text:
            raw = ch.encode()
            assert llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, 8, False, False) == 1, ch
            if not allowed(buf[0]):
                return False
            llama_cpp.llama_sampler_accept(smpl, buf[0])
        return allowed(llama_cpp.llama_vocab_eos(vocab))
    finally:
        llama_cpp.llama_sampler_free(smpl)


def test_a_thousand_optional_properties_make_llama_cpps_rule_set(vocab: Any) -> None:
    """llama.cpp's converter (``common/json-schema-to-grammar.cpp``, ``_build_object_rule``): optional properties in
    the schema's order, any of them may be the first, each followed by a ``-rest`` rule for those after it.  Built
    without recursion, linear in the properties (it was a RecursionError, an HTTP 500)."""
    g = schema_to_gbnf(_optional(1000))
    assert len(g) < MAX_GRAMMAR_BYTES and g.count("-rest ::=") == 999
    check_grammar(vocab, g)
    for text, ok in (
        ("{}", True),
        ('{"p0": "a"}', True),
        ('{"p0": "a", "p999": "b"}', True),
        ('{"p500": "x", "p501": "y"}', True),
        ('{"p999": "b", "p0": "a"}', False),
        ('{"p0": "a", "p0": "a"}', False),
        ('{"q": "a"}', False),
    ):
        assert _accepts(vocab, g, text) == ok, text
    g = schema_to_gbnf(_optional(1000, ("p500",)))
    assert _accepts(vocab, g, '{"p500": "x"}') and _accepts(vocab, g, '{"p500": "x", "p999": "z"}')
    assert not _accepts(vocab, g, "{}") and not _accepts(vocab, g, '{"p0": "a"}')


def test_additional_properties_after_optional_ones(vocab: Any) -> None:
    """llama.cpp's rule set: after the optional properties, any number of other keys (``"," kv`` each)."""
    g = schema_to_gbnf(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
        }
    )
    for text in ("{}", '{"a": 1}', '{"a": 1, "b": 2}', '{"a": 1, "x": 2}', '{"x": 2, "y": 3}', '{"b": 2, "x": 3}'):
        assert _accepts(vocab, g, text), text
    assert not _accepts(vocab, g, '{"a": 1 "x": 2}') and not _accepts(vocab, g, '{"x": "s"}')


def test_a_property_named_like_a_rule_keeps_the_grammars_root(vocab: Any) -> None:
    """``root`` is a reserved rule name (llama.cpp's ``is_reserved_name``): a property called so gets ``root-``."""
    g = schema_to_gbnf({"type": "object", "properties": {"root": {"type": "integer"}, "space": {"type": "string"}}})
    assert _accepts(vocab, g, '{"root": 1}') and _accepts(vocab, g, '{"root": 1, "space": "s"}')
    assert not _accepts(vocab, g, "1")


def test_tool_grammars_come_from_the_bounded_converter(vocab: Any) -> None:
    """Tools' ``parameters`` go through the same converter as ``json_schema``: a thousand optional properties make a
    grammar for each format, each tool's ``$ref`` resolves inside its own parameters, and a keyword or a limit is
    named with the tool's field."""
    big = {"type": "function", "function": {"name": "big", "parameters": _optional(1000)}}
    own_refs = [
        {
            "type": "function",
            "function": {
                "name": f"t{i}",
                "parameters": {
                    "$defs": {"v": {"type": kind}},
                    "type": "object",
                    "properties": {"v": {"$ref": "#/$defs/v"}},
                    "required": ["v"],
                },
            },
        }
        for i, kind in enumerate(("integer", "string"))
    ]
    spec = parse_tool_spec({"tools": [big], "tool_choice": "required"})
    assert spec is not None
    for fmt in ("generic", "hermes", "mistral", "llama3"):
        g = tool_grammar(spec, fmt)
        assert g is not None
        check_grammar(vocab, g.gbnf)
    gbnf = tool_grammar(spec, "llama3").gbnf  # type: ignore[union-attr]
    assert _accepts(vocab, gbnf, '{"name": "big", "parameters": {"p3": "x", "p999": "y"}}')
    spec = parse_tool_spec({"tools": own_refs, "tool_choice": "required"})
    gbnf = tool_grammar(spec, "llama3").gbnf  # type: ignore[arg-type, union-attr]
    assert _accepts(vocab, gbnf, '{"name": "t0", "parameters": {"v": 1}}')
    assert _accepts(vocab, gbnf, '{"name": "t1", "parameters": {"v": "s"}}')
    assert not _accepts(vocab, gbnf, '{"name": "t0", "parameters": {"v": "s"}}')
    with pytest.raises(
        strict.MessageError, match=r"tools\[1\]\.function\.parameters/properties/n: the keyword minimum"
    ):
        parse_tool_spec(
            {
                "tools": [
                    big,
                    {
                        "type": "function",
                        "function": {
                            "name": "n",
                            "parameters": {"type": "object", "properties": {"n": {"type": "number", "minimum": 1}}},
                        },
                    },
                ]
            }
        )
    with pytest.raises(strict.MessageError, match="MAX_SCHEMA_NODES"):
        parse_tool_spec(
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_SCHEMA_NODES // 3 + 1)]}
        )


def test_grammar_stack_depth_is_bounded(vocab: Any) -> None:
    """A chain of references each followed by more of its alternative makes llama.cpp stack one entry per link, its
    time and memory growing with the square of the chain: counted from the text, refused past the limit."""
    assert stack_depth(_chain(5000)) == 5000
    assert stack_depth("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(5000)) + 'r5000 ::= "a"') == 0
    assert stack_depth('root ::= "a" root? | "b"') == 0  # recursion needs generated text: it counts nothing
    deep_schema: dict = {"type": "string"}
    for _ in range(64):
        deep_schema = {"type": "array", "items": deep_schema}
    assert stack_depth(schema_to_gbnf(deep_schema)) < MAX_GRAMMAR_STACK_DEPTH  # the converter's deepest fits
    check_grammar(vocab, _chain(MAX_GRAMMAR_STACK_DEPTH))
    with pytest.raises(GrammarError, match="MAX_GRAMMAR_STACK_DEPTH"):
        check_grammar(vocab, _chain(10_000))
    # any chain of references: llama.cpp's left-recursion check recurses once per link (18,000 overflowed 2 MiB)
    links = "root ::= a0\n" + "".join(f"a{i} ::= a{i + 1}\n" for i in range(12_000)) + 'a12000 ::= "b"\n'
    assert depths(links) == (0, 12_001)
    with pytest.raises(GrammarError, match="MAX_GRAMMAR_REF_CHAIN"):
        check_grammar(vocab, links)


def test_json_depth_is_counted_without_recursion() -> None:
    assert strict.json_depth('{"a": [1, {"b": "[[[[\\"{"}], "c": []}') == 3
    strict.loads(_deep(strict.MAX_JSON_DEPTH))
    for text in (_deep(strict.MAX_JSON_DEPTH + 1), _deep(100_000), '{"a": ' + _deep(strict.MAX_JSON_DEPTH) + "}"):
        with pytest.raises(strict.TooDeep, match="MAX_JSON_DEPTH"):
            strict.loads(text)
    value = json.loads(_deep(200, '"x", "y"'))
    assert strict.dumps_within(value, None, indent=2) == json.dumps(value, indent=2)
    with pytest.raises(strict.TooLong):
        strict.dumps_within(value, 10_000, indent=2)  # its text is 40,000 characters: each line repeats the indent


# --------------------------------------------------------------------------- the live node


def test_a_thousand_optional_properties_are_answered(server: ServerProcess, http: httpx.Client) -> None:
    """llama-server answers such a schema; so does the node, over HTTP (both fields) and Hydra DECODE."""
    names = [f"p{i}" for i in range(1000)]
    for body in (
        {"json_schema": _optional(1000)},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _optional(1000)}}},
        {"json_schema": _optional(1000, ("p999",))},
    ):
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 12, "temperature": 0, **body})
        assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        assert choice["message"]["content"].startswith("{"), choice
        if choice["finish_reason"] == "stop":
            obj = json.loads(choice["message"]["content"])
            keys = list(obj)
            assert all(k in names for k in keys) and keys == sorted(keys, key=names.index)
    with Wire(server.port) as w:
        payload = json.dumps({"messages": MSGS, "n_predict": 4, "json_schema": _optional(1000)}).encode()
        status, meta, _ = w.call(Op.DECODE, key="1", payload=payload)
        assert status == Status.OK, meta


def test_an_allof_ref_chain_is_a_400_naming_the_depth_limit(http: httpx.Client) -> None:
    """Each ``allOf``-``$ref`` link counts towards the schema's depth (it restarted from 0 and recursed into a 500)."""
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}]} for i in range(3000)}
    defs["d3000"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    msg = _error(
        http.post(
            "/v1/chat/completions",
            json={"messages": MSGS, "max_tokens": 1, "json_schema": {"$defs": defs, "$ref": "#/$defs/d0"}},
        )
    )
    assert msg.startswith("json_schema") and "MAX_SCHEMA_DEPTH" in msg


@pytest.mark.parametrize("depth", [strict.MAX_JSON_DEPTH, strict.MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deep_json_in_any_field_is_a_400_naming_the_limit(
    server: ServerProcess, http: httpx.Client, depth: int
) -> None:
    """Every body the node reads (HTTP, Hydra) and a tool call's ``arguments`` text nest at most MAX_JSON_DEPTH deep
    (a body nesting 300 deep was served; 1,000 was 'nested too deeply' without a limit; arguments 100,000 deep were
    a RecursionError, an HTTP 500)."""
    over = depth > strict.MAX_JSON_DEPTH
    inner = _deep(depth - 1)  # the body's own object is one level
    bodies = {
        "/v1/chat/completions": '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "x": %s}',
        "/v1/completions": '{"prompt": "x", "max_tokens": 1, "x": %s}',
        "/completion": '{"prompt": "x", "n_predict": 1, "x": %s}',
        "/tokenize": '{"content": "x", "x": %s}',
        "/apply-template": '{"messages": [{"role": "user", "content": "x"}], "x": %s}',
    }
    for path, text in bodies.items():
        r = _raw_chat(http, (text % inner).encode(), path)
        if over:
            assert "MAX_JSON_DEPTH" in _error(r), path
        else:
            assert r.status_code == 200, (path, r.text[:300])
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _deep(depth)}}
    r = http.post(
        "/v1/chat/completions",
        json={
            "max_tokens": 1,
            "messages": [
                *MSGS,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
        },
    )
    if over:
        msg = _error(r)
        assert msg.startswith("messages[1].tool_calls[0].function.arguments") and "MAX_JSON_DEPTH" in msg, msg
    else:  # its pretty-printed text does not fit the context: refused as a prompt too long, not as too deep
        assert r.status_code == 200 or "context holds" in _error(r)
    with Wire(server.port) as w:
        for op in (Op.DECODE, Op.PREFILL):
            payload = ('{"messages": [{"role": "user", "content": "x"}], "n_predict": 1, "x": %s}' % inner).encode()
            status, meta, _ = w.call(op, key="1", payload=payload)
            assert (
                (status == Status.BAD_REQUEST and "MAX_JSON_DEPTH" in meta["error"]) if over else status == Status.OK
            ), (op, status, meta)
        assert w.call(Op.INFO)[0] == Status.OK
    assert http.get("/health").status_code == 200


def test_pretty_printed_tool_calls_stop_at_the_context(spawn: Any) -> None:
    """The tool-call polyfill pretty-prints arguments as llama-server does (indent 2): text that grows with depth.
    8,000 calls 250 deep (4 MB of body) would be a 1 GB prompt; the rendering stops once the prompt could not fit a
    slot, with the 400 of a prompt too long, and the node's peak memory stays far below the prompt it would have
    built (its peak grew by over 1 GiB)."""
    node = spawn("-np", "1", "-c", "2048")
    node.wait_ready()
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": _deep(250)}} for i in range(8000)
    ]
    # a user turn after the calls: a final assistant message is continued, and one with tool calls is refused
    # before it renders (llama-server's --prefill-assistant)
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    body = {"max_tokens": 1, "messages": [*MSGS, turn, {"role": "user", "content": "and?"}]}
    with httpx.Client(base_url=node.base, timeout=300) as c:
        assert c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).status_code == 200
        before = _peak_rss(node)
        msg = _error(c.post("/v1/chat/completions", json=body))
        assert "context holds" in msg, msg
        assert _peak_rss(node) - before < 256 * 2**20
        assert c.get("/health").status_code == 200


def test_logit_bias_holds_at_most_the_vocabulary(vocab: Any, http: httpx.Client) -> None:
    """Every token once is the most (llama.cpp's logit-bias sampler walks every pair at each token); one more pair,
    or texts that tokenize to more, is a 400 naming n_vocab."""
    import llama_cpp

    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    every = [[t, 0] for t in range(n_vocab)]
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "logit_bias": every})
    assert r.status_code == 200, r.text[:300]
    for bias in (every + [[0, 1]], {f"w{i}": 1 for i in range(n_vocab + 1)}, [["hello world"] * 1 + [1]] * n_vocab):
        msg = _error(http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "logit_bias": bias}))
        assert msg.startswith("logit_bias") and "n_vocab" in msg, msg


def test_raw_grammars_that_stack_deep_are_refused(http: httpx.Client) -> None:
    """10,000 stacking references (200 KB) took llama.cpp 2.5 s and 630 MiB to set up; now a 400 naming the limit.
    A chain at the limit is served."""
    msg = _error(http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "grammar": _chain(10_000)}))
    assert msg.startswith("grammar") and "MAX_GRAMMAR_STACK_DEPTH" in msg, msg
    r = http.post(
        "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "grammar": _chain(MAX_GRAMMAR_STACK_DEPTH)}
    )
    assert r.status_code == 200 and re.fullmatch("a?x*", r.json()["choices"][0]["message"]["content"]), r.text[:300]


def test_response_fields_and_tools_are_bounded(http: httpx.Client) -> None:
    from hydra_trio.openai.schemas import MAX_RESPONSE_FIELDS

    r = http.post(
        "/completion", json={"prompt": "x", "n_predict": 1, "response_fields": ["content"] * MAX_RESPONSE_FIELDS}
    )
    assert r.status_code == 200 and list(r.json()) == ["content"], r.text[:300]
    for fields in (["content"] * (MAX_RESPONSE_FIELDS + 1), ["x" * (MAX_RESPONSE_FIELDS + 1)]):
        msg = _error(http.post("/completion", json={"prompt": "x", "n_predict": 1, "response_fields": fields}))
        assert "MAX_RESPONSE_FIELDS" in msg
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_SCHEMA_NODES // 3 + 1)]
    msg = _error(http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "tools": tools}))
    assert msg.startswith("tools") and "MAX_SCHEMA_NODES" in msg


@settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.one_of(wide_and_deep_schemas(), deep_json_bodies(), long_request_lists(), deep_grammars()))
def test_the_fuzzers_sized_requests(http: httpx.Client, case: SizedCase) -> None:
    """The fuzzer's strategies for the kind (``fuzz/strategies.py``): each request is answered or refused naming its
    limit, and the node serves on."""
    r = _raw_chat(http, case.body)
    text = r.json()["error"]["message"] if r.status_code == 400 else ""
    if case.limits:
        assert r.status_code == 400 and any(k in text for k in case.limits), (case.what, r.status_code, text[:300])
    else:
        assert r.status_code == 200 or "context holds" in text, (case.what, r.status_code, r.text[:300])
    assert http.get("/health").status_code == 200
