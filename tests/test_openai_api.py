"""The OpenAI API as its users expect it, through the official ``openai`` client, on the real model.

Every field the API accepts either acts (logprobs, logit_bias, response_format,
grammar, echo, nullable defaults) or is refused with a 400 naming it.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import ServerProcess

PARIS = 7042  # SmolLM2's token " Paris"
BANANA = 21285  # " banana"
FRANCE = "The capital of France is"


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="sk-no-key-required", timeout=120, max_retries=0)


def _bad(client: openai.OpenAI, field: str, **kwargs: object) -> None:
    """The request is a 400 whose message starts with ``field``."""
    with pytest.raises(openai.BadRequestError) as info:
        if "messages" in kwargs:
            client.chat.completions.create(model="m", **kwargs)  # type: ignore[call-overload]
        else:
            client.completions.create(model="m", **kwargs)  # type: ignore[call-overload]
    message = info.value.body["message"]  # type: ignore[index]
    assert message.startswith(field), message


# --------------------------------------------------------------------------- logprobs
def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        # greedy: the sampled token is the most likely one
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    text = b"".join(bytes(e.bytes) for e in content).decode()
    assert text == r.choices[0].message.content


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    entries, usage, text = [], None, ""
    for chunk in client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                entries += choice.logprobs.content
    assert usage is not None and len(entries) == usage.completion_tokens > 0
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=FRANCE, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 6
    assert lp.tokens[0] == " Paris"
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 2 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=False))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # the streamed pieces add up to the same lists
    tokens: list[str] = []
    for chunk in client.completions.create(
        model="m", prompt=FRANCE, max_tokens=6, temperature=0, logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == lp.tokens


def test_logprobs_bounds(client: openai.OpenAI) -> None:
    """``top_logprobs`` without ``logprobs: true`` is llama-server's 400; the counts themselves have no limits
    there (tests/test_request_ranges.py)."""
    msgs = [{"role": "user", "content": "Hi"}]
    _bad(client, "top_logprobs", messages=msgs, top_logprobs=2)
    _bad(client, "logprobs", prompt="Hi", logprobs="2")


# --------------------------------------------------------------------------- logit_bias
def test_logit_bias_acts(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="m", prompt=FRANCE, max_tokens=6, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.tokens[0] == " Paris"
    banned = client.completions.create(
        model="m", prompt=FRANCE, max_tokens=6, temperature=0, logit_bias={str(PARIS): -100}
    )
    assert "Paris" not in banned.choices[0].text
    forced = client.completions.create(
        model="m", prompt=FRANCE, max_tokens=4, temperature=0, logit_bias={str(BANANA): 100}
    )
    assert forced.choices[0].text == " banana" * 4


# a key that is not an integer is a text (llama-server's form: every token of its tokenization), not an error
@pytest.mark.parametrize("bias", [{"1": "x"}, [1, 2], {"": 1}, {"99999": 1}, {"1": 101}, {"-1": 1}, {"1": None}, "x"])
def test_logit_bias_malformed(client: openai.OpenAI, bias: object) -> None:
    _bad(client, "logit_bias", prompt=FRANCE, max_tokens=1, logit_bias=bias)


# --------------------------------------------------------------------------- grammars
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)


def test_response_format_json_object_and_llama_server_fields(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"  # the grammar ended, not the budget
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model="m",
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"grammar": 'root ::= " yes" | " no"'},
    )
    assert r.choices[0].text in (" yes", " no")
    r = client.completions.create(
        model="m", prompt="A number:", max_tokens=12, temperature=0, extra_body={"json_schema": {"type": "integer"}}
    )
    assert isinstance(json.loads(r.choices[0].text), int)


def test_bad_grammars_are_400(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "x"}]
    _bad(client, "grammar", messages=msgs, extra_body={"grammar": "root ::= ("})
    _bad(client, "grammar", messages=msgs, extra_body={"grammar": "root ::= undefined-rule"})
    _bad(client, "grammar", messages=msgs, extra_body={"grammar": "root ::= " + "(" * 500 + '"a"' + ")" * 500})
    _bad(client, "response_format", messages=msgs, response_format={"type": "xml"})
    _bad(client, "grammar", messages=msgs, extra_body={"grammar": 'root ::= "a"', "json_schema": {}})
    _bad(client, "ignore_eos", messages=msgs, response_format={"type": "json_object"}, extra_body={"ignore_eos": True})


# --------------------------------------------------------------------------- fields acted on or refused
def test_unsupported_fields_are_400_naming_them(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    # tools are supported (test_openai_tools.py); what cannot be honoured is refused by name
    _bad(client, "tool_choice", messages=msgs, tool_choice="required")  # no tools to call
    _bad(client, "functions", messages=msgs, tools=[tool], functions=[tool["function"]])
    _bad(client, "n", messages=msgs, n=2)
    _bad(client, "best_of", prompt="Hi", best_of=2)
    _bad(client, "suffix", prompt="def f(", suffix="return 1")
    _bad(client, "store", messages=msgs, store=True)
    _bad(client, "samplers", prompt="Hi", extra_body={"samplers": ["temperature", "no_such_sampler"]})
    _bad(client, "post_sampling_probs", prompt="Hi", extra_body={"post_sampling_probs": True})
    _bad(client, "n_indent", prompt="Hi", extra_body={"n_indent": 4})
    _bad(client, "echo", prompt="Hi", echo=True, logprobs=1)


def test_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=FRANCE, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text == FRANCE + " Paris.\n"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="m", prompt=FRANCE, max_tokens=3, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_nullable_fields_mean_their_default(server: ServerProcess) -> None:
    nulls = {
        k: None
        for k in (
            "n",
            "stream",
            "stream_options",
            "stop",
            "temperature",
            "top_p",
            "max_tokens",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "logprobs",
            "seed",
            "user",
            "response_format",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "store",
            "metadata",
            "service_tier",
            "max_completion_tokens",
            "top_logprobs",
            "id_slot",
            "cache_prompt",
            "ignore_eos",
            "n_predict",
            "top_k",
            "min_p",
            "repeat_penalty",
            "repeat_last_n",
            "grammar",
            "json_schema",
            "n_probs",
            "typical_p",
            "mirostat",
            "mirostat_tau",
            "mirostat_eta",
            "top_n_sigma",
            "xtc_probability",
            "xtc_threshold",
            "dry_multiplier",
            "dry_base",
            "dry_allowed_length",
            "dry_penalty_last_n",
            "dry_sequence_breakers",
            "dynatemp_range",
            "dynatemp_exponent",
            "min_keep",
        )
    }
    chat = {"messages": [{"role": "user", "content": "Hi"}], **nulls, "max_tokens": 3, "temperature": 0}
    r = httpx.post(server.base + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    comp = {
        "prompt": FRANCE,
        **{
            k: v
            for k, v in nulls.items()
            if k not in ("tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "top_logprobs")
        },
        "echo": None,
        "best_of": None,
        "suffix": None,
        "max_tokens": 1,
        "temperature": 0,
    }
    r = httpx.post(server.base + "/v1/completions", json=comp, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " Paris"
    # a null prompt starts a new document
    r = httpx.post(server.base + "/v1/completions", json={"prompt": None, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- UTF-8
EMOJI = "Emoji list: 😀 🐱 🐶 🦊 😀"


def test_a_reply_cut_inside_a_character_drops_the_partial_bytes(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=EMOJI, max_tokens=1, temperature=0, logprobs=0)
    raw = bytes(b for b in r.choices[0].logprobs.tokens[0].encode())  # what the token rendered to
    assert "\ufffd" in raw.decode(), "the first token must be a partial character for this test to mean anything"
    assert r.choices[0].text == ""
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="m", prompt=EMOJI, max_tokens=1, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == ""
    # with room for the whole character, it arrives whole
    r = client.completions.create(model="m", prompt=EMOJI, max_tokens=4, temperature=0)
    assert "\ufffd" not in r.choices[0].text and r.choices[0].text
