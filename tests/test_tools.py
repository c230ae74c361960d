"""Tool calling, sans-I/O (hydra_trio.openai.tools): request checks, formats, grammars, and the reply
parser, with hypothesis: any chunking of the same reply gives the same content and calls."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.openai import tools as T
from hydra_trio.openai.schemas import ChatCompletionRequest, structure_body
from hydra_trio.validation.strict import MessageError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _chat(**kw: object) -> ChatCompletionRequest:
    return structure_body({"messages": [{"role": "user", "content": "hi"}], **kw}, ChatCompletionRequest)


def _err(field: str, **kw: object) -> None:
    with pytest.raises(MessageError) as info:
        _chat(**kw)
    assert str(info.value).startswith(field), str(info.value)


# --------------------------------------------------------------------------- request
def test_tool_spec_from_a_request() -> None:
    spec = _chat(tools=[WEATHER, ADD]).tool_spec
    assert spec is not None and spec.choice == "auto" and [t.name for t in spec.tools] == ["get_weather", "add"]
    assert not spec.parallel  # llama-server's default
    assert _chat(tools=[WEATHER], tool_choice="none").tool_spec.active is False
    named = _chat(
        tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=True
    ).tool_spec
    assert named.choice == "function" and [t.name for t in named.offered] == ["add"] and named.parallel
    legacy = _chat(functions=[WEATHER["function"]], function_call={"name": "get_weather"}).tool_spec
    assert legacy.legacy and legacy.choice == "function" and legacy.tools[0].name == "get_weather"
    assert _chat(tools=None, tool_choice="none").tool_spec is None


def test_bad_tools_name_the_field() -> None:
    _err("tools", tools="get_weather")
    _err("tools", tools={"a": 1})
    _err("tools[0].function.name", tools=[{"type": "function", "function": {"description": "x"}}])
    _err("tools[0].function.name", tools=[{"type": "function", "function": {"name": "a b"}}])
    _err("tools[1].function", tools=[WEATHER, {"type": "function"}])
    _err("tools[0].type", tools=[{"type": "retrieval"}])
    _err("tools[0].function.parameters", tools=[{"type": "function", "function": {"name": "f", "parameters": []}}])
    _err(
        "tools[0].function.parameters",
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                },
            }
        ],
    )
    _err("tools", tools=[WEATHER, WEATHER])
    _err("tool_choice", tools=[WEATHER], tool_choice="sometimes")
    _err("tool_choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    _err("tool_choice", tool_choice="required")
    _err("parallel_tool_calls", tools=[WEATHER], parallel_tool_calls="yes")
    _err("functions", tools=[WEATHER], functions=[WEATHER["function"]])
    _err("function_call", functions=[WEATHER["function"]], function_call="required")
    _err("tools", tools=[WEATHER], response_format={"type": "json_object"})


def test_tool_messages_are_checked() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    ok = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = structure_body({"messages": ok}, ChatCompletionRequest)
    assert body.messages[1].tool_calls[0]["id"] == "call_1" and body.messages[2].tool_call_id == "call_1"
    for bad, field in (
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "messages[0].tool_calls"),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
        ([{"role": "assistant", "tool_calls": "x"}], "messages[0].tool_calls"),
    ):
        with pytest.raises(MessageError) as info:
            structure_body({"messages": bad}, ChatCompletionRequest)
        assert str(info.value).startswith(field), str(info.value)


# --------------------------------------------------------------------------- formats and rendering
def test_format_detection() -> None:
    assert T.detect_format("... <tool_call> ...") == "hermes"
    assert T.detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert T.detect_format('"<|start_header_id|>ipython<|end_header_id|>\\n\\n"') == "llama3"
    assert T.detect_format("{{ messages }}") == "generic"
    assert T.template_supports_tools("jinja", "{% if tools %}") and not T.template_supports_tools("builtin", "chatml")


def test_generic_rendering_polyfills_tools_and_results() -> None:
    body = structure_body(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "w?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        },
        ChatCompletionRequest,
    )
    out = T.render_messages(body.messages, body.tool_spec, "generic", native=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call any of")
    assert T.GENERIC_INSTRUCTION in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]
    }
    assert out[3]["role"] == "user"
    assert json.loads(out[3]["content"]) == {
        "tool_response": {"tool": "get_weather", "content": "sunny", "tool_call_id": "call_1"}
    }
    native = T.render_messages(body.messages, body.tool_spec, "hermes", native=True)
    assert native[2]["content"] == "" and native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    mistral = T.render_messages(body.messages, body.tool_spec, "mistral", native=True)
    cid = mistral[2]["tool_calls"][0]["id"]
    assert len(cid) == 9 and cid.isalnum() and mistral[3]["tool_call_id"] == cid


def test_grammars_per_format_and_choice() -> None:
    spec = _chat(tools=[WEATHER, ADD], tool_choice="required").tool_spec
    for fmt in T.FORMATS:
        g = T.tool_grammar(spec, fmt)
        assert g is not None and not g.lazy and "root ::=" in g.gbnf and '"\\"get_weather\\""' in g.gbnf
    auto = _chat(tools=[WEATHER]).tool_spec
    assert T.tool_grammar(auto, "hermes").lazy and T.tool_grammar(auto, "hermes").triggers == ("<tool_call>",)
    assert T.tool_grammar(auto, "mistral").triggers == (r"\[TOOL_CALLS\]",)
    assert T.tool_grammar(auto, "llama3").lazy
    g = T.tool_grammar(auto, "generic")
    assert not g.lazy and "response" in g.gbnf  # a call or a response object, as llama-server's generic format
    named = _chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}).tool_spec
    assert "get_weather" not in T.tool_grammar(named, "hermes").gbnf
    assert T.tool_grammar(_chat(tools=[WEATHER], tool_choice="none").tool_spec, "hermes") is None


# --------------------------------------------------------------------------- parsing
def _calls(fmt: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = T.parse_reply(fmt, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PARIS = {"city": "Paris"}


@pytest.mark.parametrize(
    "fmt, text, want",
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            (None, [("get_weather", PARIS)]),
        ),
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
            ("Let me look.", [("get_weather", PARIS), ("add", {"a": 1, "b": 2})]),
        ),
        ("hermes", "<tool_call>not json</tool_call> ok", ("<tool_call>not json</tool_call> ok", [])),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}', (None, [("f", {})])),  # cut before the closing tag
        ("hermes", "a < b <tool_", ("a < b <tool_", [])),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]',
            (None, [("get_weather", PARIS)]),
        ),
        ("mistral", "[TOOL_CALLS] nope", ("[TOOL_CALLS] nope", [])),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [("get_weather", PARIS)])),
        (
            "llama3",
            '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
            (None, [("get_weather", PARIS)]),
        ),
        ("llama3", "Sets look like {1, 2}.", ("Sets look like {1, 2}.", [])),
        ("llama3", '{"name": "x"', ('{"name": "x"', [])),
        (
            "generic",
            '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
            (None, [("get_weather", PARIS)]),
        ),
        (
            "generic",
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
            (None, [("get_weather", PARIS), ("add", {"a": 1, "b": 2})]),
        ),
        ("generic", '{"response": "Hello!"}', ("Hello!", [])),
        (
            "generic",
            '{ "response" : "a \\"q\\" \\u00e9 \\ud83d\\ude00" }  after',
            ('a "q" \u00e9 \U0001f600  after', []),
        ),
        ("generic", '{"response": "cut sho', ("cut sho", [])),
        ("generic", '{"response": "lone \\ud83d"}', ("lone ?", [])),
        ("generic", "Plain words.", ("Plain words.", [])),
        ("generic", '{"other": 1}', ('{"other": 1}', [])),
        ("generic", "   ", (None, [])),
    ],
)
def test_parse_reply(fmt: str, text: str, want: tuple) -> None:
    assert _calls(fmt, text) == want


def test_arguments_given_as_a_string_are_parsed() -> None:
    assert _calls("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == (
        None,
        [("f", {"a": 1})],
    )


def test_stream_shapes() -> None:
    p = T.ToolCallParser("hermes", ids=itertools.repeat("call_x"))
    events = p.feed('Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') + p.finish()
    assert [T.stream_delta(e) for e in events] == [
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":1}'}}]},
    ]
    assert T.finish_reason("stop", p.calls) == "tool_calls" and T.finish_reason("length", p.calls) == "length"
    assert T.message(*p.result()) == {
        "role": "assistant",
        "content": "Hi",
        "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
    }
    assert T.new_call_id().startswith("call_") and len(T.new_call_id()) == 29


def test_arguments_stream_as_the_model_writes_them() -> None:
    """The head (name) as soon as ``"arguments": {`` has come, then minified fragments; each fragment ends
    where what was sent can be closed into valid JSON (a key waits for its value, a number for its end)."""
    p = T.ToolCallParser("hermes", ids=itertools.repeat("call_x"))
    steps = [
        '<tool_call>\n{"name": "get_weather", "argu',
        'ments": {"ci',
        'ty": "Pa',
        'ris", "n": 1',
        '2, "f": tr',
        "ue}}\n</tool_call>",
    ]
    got = [[T.stream_delta(e) for e in p.feed(x)] for x in steps] + [[T.stream_delta(e) for e in p.finish()]]
    args = [
        [d["tool_calls"][0]["function"]["arguments"] for d in step if "id" not in d["tool_calls"][0]] for step in got
    ]
    assert got[0] == [] and got[1][0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert args == [[], ["{"], ['"city":"Pa'], ['ris"'], [',"n":12'], [',"f":true}'], []]
    assert json.loads(p.calls[0].arguments) == {"city": "Paris", "n": 12, "f": True}


@pytest.mark.parametrize(
    "fmt, text, args",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "x y', '{"a":"x y"}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": tr', '{"a":[1,{}]}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1.5, "b"', '{"a":1.5}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\u00', '{"a":""}'),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "c',
            '{"b":"c"}',
        ),
        ("generic", '{"tool_calls": [{"name": "f", "arguments": {"q": "line\none"', '{"q":"line\\none"}'),
        ("llama3", '{"name": "f", "parameters": {"a": 1} oops', '{"a":1}'),
    ],
)
def test_a_reply_cut_or_broken_inside_the_arguments_gets_them_closed(fmt: str, text: str, args: str) -> None:
    _, calls = T.parse_reply(fmt, text)
    assert calls[-1].arguments == args and isinstance(json.loads(args), dict)


# --------------------------------------------------------------------------- any chunking, the same reply
_PIECES = {
    "hermes": [
        "Sure. ",
        "<tool_call>\n",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "\n</tool_call>",
        "\n",
        "<tool_call>",
        '{"name": "add", "arguments": {"a": 1}}',
        "</tool_call>",
        " done",
        "<tool",
        "<",
        "x > y ",
        "{",
        "}",
        "  ",
        "\n",
        '{"name": "f", "arguments": {"s": "a b',
        " c\\u00e9 ",
        '\\n"',
        ', "n": [1, 2.5e3, true, null, {"k": ',
        '"v"}]',
        "}}",
        '{"arguments": {}, "name": "g"}',
    ],
    "mistral": [
        "[TOOL_CALLS]",
        '[{"name": "f", "arguments": {"a": [1, 2]}, "id": "abcdefghi"}]',
        "text ",
        "[",
        "]",
        "[TOOL_",
        " ",
        "{}",
        '[{"name": "g", "arguments": {"x": "y',
        '"}, "id": "abcdefghi"}',
        ", ",
        '{"name": "h", "arguments": {}}',
        '{"foo": 1}',
    ],
    "llama3": [
        '{"name": "f", "parameters": {"a": 1}}',
        "; ",
        "text ",
        "{",
        '"name"',
        ":",
        "}",
        '{"type": "function", ',
        '"name": "g", "arguments": {}}',
        " ",
        "\n",
        '{"name": "h", "parameters": {"q": "x',
        '", "r": 1',
        "0}}",
    ],
    "generic": [
        '{"tool_call": {"name": "f", "arguments": {"a": 1}}}',
        '{"response": "hi"}',
        '{"tool_calls": [{"name": "f", "arguments": {}}]}',
        "text",
        " ",
        "{",
        "}",
        '"',
        '{"response": "',
        '\\"',
        "\\u00e9",
        "\\ud83d\\ude00",
        "\\ud83d",
        "\\n",
        "x",
        '"}',
        "\\",
        "u",
        '{"tool_calls": [{"name": "f", "arguments": {"b": "c',
        '"}}, ',
        '{"name": "g", "arguments": {}}',
        '], "content": "note"}',
        "]}",
        '{"tool_call": {"name": "h", "arguments": {"z": [',
        "1]}}}",
    ],
}


def _replay(fmt: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[int, str, str]]]:
    """Feed ``text`` cut at ``cuts``; the streamed content and the calls reassembled from the events."""
    p = T.ToolCallParser(fmt, ids=(f"call_{i}" for i in itertools.count()))
    events: list[T.Event] = []
    last = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[last:c])
        last = c
    events += p.finish()
    content = "".join(e.text for e in events if isinstance(e, T.ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, T.CallStart):
            assert e.index == len(calls)  # indexes count up from 0, the name comes first
            calls[e.index] = [e.id, e.name, ""]
        elif isinstance(e, T.CallArguments):
            calls[e.index][2] += e.text
    whole = p.result()
    assert (whole[0] or "") == content
    assert [(c.id, c.name, c.arguments) for c in whole[1]] == [tuple(v) for v in calls.values()]
    return content, [(i, n, a) for i, (_, n, a) in calls.items()]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(T.FORMATS))
def test_any_chunking_gives_the_same_reply(data: st.DataObject, fmt: str) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(_PIECES[fmt]), max_size=8)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    one = _replay(fmt, text, [])
    assert _replay(fmt, text, cuts) == one
    assert _replay(fmt, text, list(range(len(text)))) == one  # a character at a time
    content, calls = T.parse_reply(fmt, text)
    assert (content or "") == one[0] and [(c.name, c.arguments) for c in calls] == [(n, a) for _, n, a in one[1]]
    for _, _, args in one[1]:
        assert isinstance(json.loads(args), dict)
