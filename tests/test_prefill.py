"""A chat's final message continued (llama-server's ``--prefill-assistant``, ``continue_final_message``,
``add_generation_prompt``), and the end-of-generation token counted and listed as llama-server does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hydra_trio.models.presets import resolve_model

from .conftest import ServerProcess
from .test_thinking import TEMPLATE

USER = {"role": "user", "content": "What is the capital of France?"}
PREFILL = "The capital of France is"
CONTINUED = [USER, {"role": "assistant", "content": PREFILL}]
EOS = 2  # SmolLM2's <|im_end|>, its end-of-generation token


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("prefill")
    srv = ServerProcess(d / "server.log", "-np", "1", "-c", "1024")
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def http(node: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.base, timeout=300) as client:
        yield client


def prompt_of(http: httpx.Client, **body: object) -> str:
    r = http.post("/apply-template", json=body)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def streamed(http: httpx.Client, body: dict) -> list[str]:
    """The content pieces of a streamed chat reply."""
    pieces = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if piece := choice["delta"].get("content"):
                        pieces.append(piece)
    return pieces


def test_a_final_assistant_message_is_continued(http: httpx.Client) -> None:
    """llama-server's default: the prompt ends with the message's text, no end of turn, no new turn."""
    assert prompt_of(http, messages=CONTINUED).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France is"
    )
    # text parts are joined by a blank line (common_chat_msg::render_content)
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    assert prompt_of(http, messages=[USER, {"role": "assistant", "content": parts}]).endswith("assistant\nWh\n\nill")
    # the explicit form gives the same prompt; add_generation_prompt false alone closes the last turn
    explicit = prompt_of(http, messages=CONTINUED, continue_final_message=True, add_generation_prompt=False)
    assert explicit == prompt_of(http, messages=CONTINUED)
    assert prompt_of(http, messages=[USER], add_generation_prompt=False).endswith("France?<|im_end|>\n")


def test_the_refusals_are_llama_servers(http: httpx.Client) -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases = [
        ({"messages": CONTINUED, "continue_final_message": True}, "Cannot set both add_generation_prompt and"),
        (
            {"messages": [*CONTINUED, {"role": "assistant", "content": "x"}]},
            "Cannot have 2 or more assistant messages at the end of the list.",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": "a", "tool_calls": [call]}]},
            "Cannot continue an assistant message that contains tool calls.",
        ),
    ]
    for body, message in cases:
        for path in ("/apply-template", "/v1/chat/completions"):
            r = http.post(path, json={**body, "max_tokens": 4})
            assert r.status_code == 400, (path, r.text)
            assert (
                r.json()["error"]["message"].startswith(message)
                and r.json()["error"]["type"] == "invalid_request_error"
            )
    assert http.get("/health").status_code == 200


def test_the_continued_text_starts_the_reply(http: httpx.Client) -> None:
    """The whole message starts with the continued text; streamed, the heuristic's first delta carries it too,
    the explicit ``continue_final_message``'s stream does not (llama-server's ``is_continuation``)."""
    body = {"messages": CONTINUED, "max_tokens": 6, "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert whole.startswith(PREFILL) and len(whole) > len(PREFILL)
    pieces = streamed(http, body)
    assert pieces[0].startswith(PREFILL) and "".join(pieces) == whole
    explicit = streamed(http, {**body, "continue_final_message": True, "add_generation_prompt": False})
    assert PREFILL + "".join(explicit) == whole


def test_without_prefill_a_final_assistant_message_is_a_closed_turn(spawn) -> None:
    node = spawn("-np", "1", "-c", "1024", "--no-prefill-assistant")
    node.wait_ready()
    r = httpx.post(node.base + "/apply-template", json={"messages": CONTINUED}, timeout=120)
    assert r.json()["prompt"].endswith("assistant\nThe capital of France is<|im_end|>\n<|im_start|>assistant\n")


def test_the_end_of_generation_token_is_counted_and_listed(http: httpx.Client) -> None:
    """llama-server counts the end-of-generation token that ends a reply (``predicted_n``,
    ``usage.completion_tokens``), lists it in a whole reply's tokens and log-probabilities and in a native
    stream, and in no OpenAI stream chunk.  A bias makes it the first token, on any CPU."""
    bias = [[EOS, 100.0]]
    native = {"prompt": "Hello", "n_predict": 8, "logit_bias": bias, "return_tokens": True, "n_probs": 1}
    r = http.post("/completion", json=native).json()
    assert (r["content"], r["tokens"], r["tokens_predicted"], r["stop_type"]) == ("", [EOS], 1, "eos")
    assert r["timings"]["predicted_n"] == 1 and r["completion_probabilities"][0]["id"] == EOS
    with http.stream("POST", "/completion", json={**native, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert chunks[0]["tokens"] == [EOS] and chunks[0]["content"] == "" and chunks[-1]["tokens_predicted"] == 1

    chat = {"messages": [USER], "max_tokens": 8, "logit_bias": {str(EOS): 100}, "logprobs": True}
    r = http.post("/v1/chat/completions", json=chat).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert r["usage"]["completion_tokens"] == 1 == len(entries) and entries[0]["id"] == EOS
    assert entries[0]["token"] == "" and entries[0]["bytes"] == []
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        lines = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert not any(c["choices"] and c["choices"][0]["logprobs"] for c in lines)


@pytest.mark.slow
def test_llama_server_renders_and_answers_the_same(http: httpx.Client, tmp_path: Path) -> None:
    """llama-server built from the vendored llama.cpp, same model: the same prompts, refusals and counts."""
    from .test_media_requests import llama_server

    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bodies = [
        {"messages": CONTINUED},
        {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False},
        {"messages": CONTINUED, "continue_final_message": "content", "add_generation_prompt": False},
        {"messages": [USER], "continue_final_message": "content", "add_generation_prompt": False},
        {"messages": [USER], "add_generation_prompt": False},
        {"messages": [USER], "add_generation_prompt": "no"},
        {
            "messages": [
                USER,
                {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        },
        {"messages": CONTINUED, "continue_final_message": True},
        {"messages": [*CONTINUED, {"role": "assistant", "content": "x"}]},
        {"messages": [USER, {"role": "assistant", "content": "a", "tool_calls": [call]}]},
    ]
    model, _ = resolve_model("smollm2-135m")
    with llama_server(tmp_path, "-m", str(model)) as ls:
        for body in bodies:
            theirs, ours = ls.post("/apply-template", json=body), http.post("/apply-template", json=body)
            assert theirs.status_code == ours.status_code, (body, theirs.text, ours.text)
            assert theirs.json().get("prompt") == ours.json().get("prompt"), body
            if theirs.status_code != 200:
                assert theirs.json()["error"]["message"] == ours.json()["error"]["message"]
        chat = {"messages": [USER], "max_tokens": 8, "logit_bias": {str(EOS): 100}, "logprobs": True}
        t, o = (c.post("/v1/chat/completions", json=chat).json() for c in (ls, http))
        assert t["usage"]["completion_tokens"] == o["usage"]["completion_tokens"] == 1
        assert [e["id"] for e in t["choices"][0]["logprobs"]["content"]] == [
            e["id"] for e in o["choices"][0]["logprobs"]["content"]
        ]


@pytest.mark.slow
def test_llama_server_continues_a_thinking_template_the_same(tmp_path: Path) -> None:
    """A template that writes ``<think>\\n`` before a reasoning and ``\\n</think>\\n\\n`` after it: the continued
    reasoning, and the continued content after a reasoning, render as llama-server renders them."""
    from .test_media_requests import llama_server

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    bodies = [
        {"messages": [USER, {"role": "assistant", "content": "", "reasoning_content": "Paris is"}]},
        {"messages": [USER, {"role": "assistant", "content": "It is", "reasoning_content": "Paris."}]},
        {"messages": CONTINUED},
        {"messages": CONTINUED, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": CONTINUED, "continue_final_message": "reasoning_content", "add_generation_prompt": False},
    ]
    model, _ = resolve_model("smollm2-135m")
    ours = ServerProcess(
        tmp_path / "node.log", "-np", "1", "-c", "1024", "--chat-template-file", str(tmp_path / "t.jinja")
    )
    with (
        ours.serving(),
        llama_server(tmp_path, "-m", str(model), "--chat-template-file", str(tmp_path / "t.jinja")) as ls,
    ):
        for body in bodies:
            theirs = ls.post("/apply-template", json=body).json()["prompt"]
            assert httpx.post(ours.base + "/apply-template", json=body, timeout=120).json()["prompt"] == theirs, body
        body = {**bodies[0], "max_tokens": 6, "temperature": 0}
        reply = httpx.post(ours.base + "/v1/chat/completions", json=body, timeout=300).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"].startswith("Paris is") and message["content"] == ""
