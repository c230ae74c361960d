"""Tool calls through the official ``openai`` client, on the real SmolLM2.

SmolLM2's own template knows no tools: the generic format (a JSON reply, tools described in a
system message).  A Hermes/Qwen-style template given with ``--chat-template-file`` exercises the
native path (tools rendered by the template, ``<tool_call>`` blocks, the lazy grammar of ``auto``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="sk-no-key-required", timeout=120, max_retries=0)


def _args(call: object) -> dict:
    args = json.loads(call.function.arguments)  # type: ignore[attr-defined]
    assert isinstance(args, dict)
    return args


def _streamed(client: openai.OpenAI, **kw: object) -> tuple[str, list[dict], str | None]:
    """Content, calls reassembled from the deltas (name first, then argument fragments; each call's
    ``fragments`` lists them), finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", stream=True, **kw):  # type: ignore[call-overload]
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or ():
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": "", "fragments": []}
            else:
                assert tc.function.name is None and tc.function.arguments
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["fragments"].append(tc.function.arguments)
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_gives_a_valid_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=64, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    args = _args(call)
    if call.function.name == "get_weather":
        assert isinstance(args["city"], str) and args.get("unit", "celsius") in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "add" and isinstance(args["a"], int) and isinstance(args["b"], int)


def test_named_function_is_called(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=64,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    args = _args(call)
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    assert r.choices[0].finish_reason == "tool_calls"


def test_streamed_calls_reassemble_to_the_whole_reply(client: openai.OpenAI) -> None:
    kw = dict(messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=64, temperature=0)
    whole = client.chat.completions.create(model="m", **kw)  # type: ignore[call-overload]
    content, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)


def test_arguments_stream_in_fragments_as_generated(client: openai.OpenAI) -> None:
    """The arguments come in several fragments, as the model writes them (OpenAI's and llama-server's
    streaming), and their concatenation is the non-streamed reply's ``arguments``."""
    kw = dict(
        messages=[{"role": "user", "content": "What is the weather in San Francisco, in fahrenheit?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    whole = client.chat.completions.create(model="m", **kw).choices[0].message.tool_calls  # type: ignore[call-overload]
    content, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and content == "" and len(calls) == len(whole) == 1
    (call,) = calls
    assert (call["name"], call["arguments"]) == (whole[0].function.name, whole[0].function.arguments)
    assert len(call["fragments"]) > 2, call["fragments"]  # not one piece
    assert _args(whole[0])["city"] and len(call["arguments"]) > len(max(call["fragments"], key=len))


def test_hydra_decode_reports_the_tool_calls(client: openai.OpenAI, server: ServerProcess) -> None:
    """A non-streamed DECODE with ``tools``: its meta has ``tool_calls`` as the HTTP reply's ``message.tool_calls``
    (the same calls for the same body); without tools the key is absent."""
    body = {"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": "required", "temperature": 0}
    http = (
        client.chat.completions.create(model="m", max_tokens=64, extra_body={"cache_prompt": False}, **body)
        .choices[0]
        .message.tool_calls
    )  # type: ignore[call-overload]
    body["cache_prompt"] = False
    with Wire(server.port) as w:
        status, meta, frames = w.call(
            Op.DECODE, key="1", payload=json.dumps({**body, "n_predict": 64, "stream": False}).encode()
        )
        assert status == Status.OK, meta
        assert len(frames) == 9 * meta["tokens_generated"] and meta["stop_reason"] == "eos"
        assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in meta["tool_calls"]] == [
            ("function", c.function.name, c.function.arguments) for c in http
        ]
        assert all(c["id"].startswith("call_") for c in meta["tool_calls"])
        status, meta, _ = w.call(
            Op.DECODE, key="1", payload=json.dumps({"messages": ASK, "n_predict": 2, "stream": False}).encode()
        )
        assert status == Status.OK and "tool_calls" not in meta
        status, meta, _ = w.call(
            Op.DECODE, key="1", payload=json.dumps({**body, "tool_choice": "sometimes", "stream": False}).encode()
        )
        assert status == Status.BAD_REQUEST and meta["error"].startswith("tool_choice"), meta


def test_a_tool_result_turn_renders_and_answers(client: openai.OpenAI) -> None:
    turn = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees"},
    ]
    r = client.chat.completions.create(model="m", messages=turn, tools=[WEATHER], max_tokens=48, temperature=0)
    m = r.choices[0].message
    # auto in the generic format: the grammar allows a call or a {"response": ...} reply, nothing else
    assert m.tool_calls or (m.content and r.choices[0].finish_reason in ("stop", "length"))
    content, calls, _ = _streamed(client, messages=turn, tools=[WEATHER], max_tokens=48, temperature=0)
    assert content == (m.content or "")  # a {"response": ...} reply streams its text
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in m.tool_calls or ()
    ]
    assert (
        r.usage.prompt_tokens
        > client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0
        ).usage.prompt_tokens
    )
    # without tools in the request the history still renders (content: null, role tool)
    r = client.chat.completions.create(model="m", messages=turn, max_tokens=16, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_tool_choice_none_is_plain_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0
    )
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=16, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_legacy_functions_are_mapped(server: ServerProcess) -> None:
    body = {
        "messages": ASK,
        "functions": [WEATHER["function"]],
        "function_call": {"name": "get_weather"},
        "max_tokens": 48,
        "temperature": 0,
    }
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"]["name"] == "get_weather"
    assert isinstance(json.loads(choice["message"]["function_call"]["arguments"])["city"], str)


def test_bad_tools_are_400_naming_the_field(server: ServerProcess) -> None:
    def bad(field: str, **kw: object) -> None:
        r = httpx.post(server.base + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **kw}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(field), r.text

    bad("tools", tools="get_weather")
    bad("tools[0].function.name", tools=[{"type": "function", "function": {"parameters": {}}}])
    bad("tools[0].function.parameters", tools=[{"type": "function", "function": {"name": "f", "parameters": 7}}])
    bad(
        "tools[0].function.parameters",
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/none"}}},
                },
            }
        ],
    )
    bad("tool_choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    bad("tool_choice", tool_choice="required")
    bad("messages[1].tool_call_id", messages=ASK + [{"role": "tool", "content": "x"}])


# --------------------------------------------------------------------------- a template with tools (Hermes/Qwen)
HERMES = r"""{%- if tools %}{{- '<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    '</tool_call><|im_end|>\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}
{%- for tc in message.tool_calls %}{{- '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' }}
{{- tc.function.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content
    + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> openai.OpenAI:
    d = tmp_path_factory.mktemp("hermes")
    (d / "hermes.jinja").write_text(HERMES)
    with ServerProcess(d / "server.log", "--chat-template-file", str(d / "hermes.jinja"), "-np", "1").serving() as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0)


def test_hermes_template_required_and_streamed(hermes: openai.OpenAI) -> None:
    kw = dict(messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=64, temperature=0)
    r = hermes.chat.completions.create(model="m", **kw)  # type: ignore[call-overload]
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "add")
    _args(call)
    _content, calls, finish = _streamed(hermes, **kw)
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_hermes_auto_lazy_grammar_wakes_at_the_marker(hermes: openai.OpenAI) -> None:
    """Few-shot history makes the model open a <tool_call>; the lazy grammar then holds it to the schema:
    the only city it may name is Tokyo, although the user asks about London."""
    tokyo = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Tokyo"]}},
                "required": ["city"],
            },
        },
    }
    msgs: list[dict] = []
    for city in ("Paris", "Rome", "Berlin", "Madrid"):
        msgs += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{city}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                    }
                ],
            },
        ]
    msgs.append({"role": "user", "content": "What is the weather in London?"})
    r = hermes.chat.completions.create(model="m", messages=msgs, tools=[tokyo], max_tokens=48, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and _args(call) == {"city": "Tokyo"}
    # a tool-result turn in the template's own shape answers
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Rain"},
    ]
    r = hermes.chat.completions.create(
        model="m", messages=msgs, tools=[tokyo], tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content


# --------------------------------------------------------------------------- a Mistral template ([TOOL_CALLS])
# llama.cpp's models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja (the vendored copy in
# llama-cpp-python 0.3.36), verbatim: tools rendered as [AVAILABLE_TOOLS][...], calls as
# [TOOL_CALLS][{"name", "arguments", "id" (9 characters)}], results as [TOOL_RESULTS].
MISTRAL_NEMO = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, ServerProcess]]:
    d = tmp_path_factory.mktemp("mistral")
    (d / "mistral.jinja").write_text(MISTRAL_NEMO)
    with ServerProcess(d / "server.log", "--chat-template-file", str(d / "mistral.jinja"), "-np", "1").serving() as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0), srv


def test_mistral_template_renders_the_tools_and_its_calls_parse(mistral: tuple[openai.OpenAI, ServerProcess]) -> None:
    """The parser is chosen from the template (``[TOOL_CALLS]`` in it: the Mistral format); ``required`` and a
    named function make the grammar force ``[TOOL_CALLS][{...}]``, which becomes ``message.tool_calls``."""
    client, srv = mistral
    prompt = httpx.post(
        srv.base + "/apply-template", json={"messages": ASK, "tools": [WEATHER, ADD]}, timeout=60
    ).json()["prompt"]
    assert prompt.count("[AVAILABLE_TOOLS]") == 1 and '"name": "get_weather"' in prompt
    assert prompt.endswith("[INST]What is the weather in Paris?[/INST]")
    kw = dict(messages=ASK, tools=[WEATHER, ADD], max_tokens=64, temperature=0)
    r = client.chat.completions.create(model="m", tool_choice="required", **kw)  # type: ignore[call-overload]
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name in ("get_weather", "add") and call.id.startswith("call_")
    _args(call)
    named = (
        client.chat.completions.create(  # type: ignore[call-overload]
            model="m", tool_choice={"type": "function", "function": {"name": "add"}}, **kw
        )
        .choices[0]
        .message
    )
    (add,) = named.tool_calls
    args = _args(add)
    assert add.function.name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    content, calls, finish = _streamed(client, tool_choice={"type": "function", "function": {"name": "add"}}, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", add.function.arguments)]
    assert len(calls[0]["fragments"]) > 1


def test_mistral_tool_result_turn(mistral: tuple[openai.OpenAI, ServerProcess]) -> None:
    """A tool-result turn through the Mistral template: the call id becomes the 9 characters it demands."""
    client, srv = mistral
    turn = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123DEF456ghi789JKL0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123DEF456ghi789JKL0", "content": '{"temperature_c": 18}'},
    ]
    prompt = httpx.post(srv.base + "/apply-template", json={"messages": turn, "tools": [WEATHER]}, timeout=60).json()[
        "prompt"
    ]
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": ' in prompt and "[TOOL_RESULTS]" in prompt
    ids = re.findall(r'"id": "([^"]*)"\}\]', prompt) + re.findall(r'"call_id": "([^"]*)"', prompt)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == 9 and ids[0].isalnum()
    r = client.chat.completions.create(
        model="m",
        messages=turn,
        tools=[WEATHER],
        tool_choice="none",  # type: ignore
        max_tokens=16,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > len(prompt) // 8  # the whole turn was rendered and evaluated


def test_a_stop_string_inside_a_call_does_not_finish_with_tool_calls(client: openai.OpenAI) -> None:
    """A stop string that ends the reply inside a call's arguments leaves a healed, unfinished call: the
    reply finishes with ``stop`` (llama-server drops such a call), streamed or not; without the stop
    string the same request finishes with ``tool_calls``."""
    kw = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert "city" in json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    cut = client.chat.completions.create(**kw, stop=["city"])
    calls = cut.choices[0].message.tool_calls or []
    assert all("city" not in json.loads(c.function.arguments) for c in calls)  # cut before the key
    assert cut.choices[0].finish_reason == "stop"
    reasons = [
        c.choices[0].finish_reason
        for c in client.chat.completions.create(**kw, stop=["city"], stream=True)
        if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == ["stop"]
