"""Thinking on the real model, through the official ``openai`` client and the Hydra protocol.

SmolLM2 does not think by itself, so the node gets a thinking chat template:
chatml that writes an assistant turn's ``reasoning_content`` as
``<think>\\n...\\n</think>\\n\\n`` and, with ``enable_thinking`` (the default),
opens ``<think>\\n`` at the end of the prompt (as Qwen3's does; with
``enable_thinking`` false it writes an empty, closed block); a ``reasoning_effort``
variable is written as a system line (as gpt-oss's template writes ``Reasoning: low``).  A three-shot
conversation whose assistant turns carry ``reasoning_content`` makes greedy
SmolLM2 answer ``2 plus 2 is 4.\\n</think>\\n\\nThe answer is 4.``: the reply
starts inside the thinking the prompt opened and closes it itself.

Every generated word asserted here holds on any x86-64 build (the kernels' arithmetic differs between
instruction sets, and with it a tiny model's near ties): measured with greedy decoding on an AVX2-only and an
AVX-512 build, the smallest gap between the top two tokens' probabilities over the tokens each assertion reads
is at least 0.33 (the whole reply 0.41; after a budget of 1, 3 or 7 tokens, or 3 and a message, the free tokens
up to "The answer is" 0.33; with thinking off, up to "2 + 2 is 4" 0.40).  With one example turn instead of
three, the newline after ``</think>`` led the end of turn by only 0.14, and by 0.04 after a forced end: an
AVX2-only build ended such replies with empty content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess

TEMPLATE = r"""
{%- if reasoning_effort is defined -%}
{{- '<|im_start|>system\nReasoning effort: ' + reasoning_effort + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{{- '<|im_start|>' + m.role + '\n' -}}
{%- if m.role == 'assistant' and m.reasoning_content -%}
{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' -}}
{%- endif -%}
{{- m.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- else -%}
{{- '<think>\n' -}}
{%- endif -%}
{%- endif -%}
"""

SYSTEM = "You are a helpful assistant. You always think step by step inside <think> and </think> before you answer."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "The answer is 2.", "reasoning_content": "1 plus 1 is 2."},
    {"role": "user", "content": "What is 3 + 3?"},
    {"role": "assistant", "content": "The answer is 6.", "reasoning_content": "3 plus 3 is 6."},
    {"role": "user", "content": "What is 5 + 5?"},
    {"role": "assistant", "content": "The answer is 10.", "reasoning_content": "5 plus 5 is 10."},
    {"role": "user", "content": "What is 2 + 2?"},
]
RAW = "2 plus 2 is 4.\n</think>\n\nThe answer is 4."  # greedy SmolLM2's reply to MESSAGES
REASONING, CONTENT = "2 plus 2 is 4.", "The answer is 4."


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("thinking")
    (d / "thinking.jinja").write_text(TEMPLATE)
    srv = ServerProcess(d / "server.log", "--chat-template-file", str(d / "thinking.jinja"), "-np", "2")
    with srv.serving():
        yield srv


@pytest.fixture(scope="module")
def client(node: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.base + "/v1", api_key="none", timeout=120, max_retries=0)


def _chat(client: openai.OpenAI, **kw: object) -> object:
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model="m", temperature=0, **kw)  # type: ignore[call-overload]


def _stream(client: openai.OpenAI, **kw: object) -> tuple[str, str, list[object], object]:
    reasoning, content, chunks, usage = "", "", [], None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kw):  # type: ignore[attr-defined]
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            chunks.append(choice.delta)
    return reasoning, content, chunks, usage


def _reasoning(message: object) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")  # type: ignore[attr-defined]


def test_split_whole(client: openai.OpenAI) -> None:
    r = _chat(client)
    m = r.choices[0].message
    assert (_reasoning(m), m.content) == (REASONING, CONTENT)
    assert r.choices[0].finish_reason == "stop"
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens


def test_split_streamed(client: openai.OpenAI) -> None:
    reasoning, content, chunks, usage = _stream(client)
    assert (reasoning, content) == (REASONING, CONTENT)
    # reasoning arrives chunk by chunk, before any content
    n_reasoning = sum(1 for d in chunks if (d.model_extra or {}).get("reasoning_content"))
    assert n_reasoning > 3
    first_content = next(i for i, d in enumerate(chunks) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in chunks[first_content:])
    assert (
        usage.completion_tokens_details.reasoning_tokens
        == _chat(client).usage.completion_tokens_details.reasoning_tokens
    )


def test_deepseek_legacy_keeps_tags(client: openai.OpenAI) -> None:
    m = _chat(client, extra_body={"reasoning_format": "deepseek-legacy"}).choices[0].message
    assert m.content == "<think>\n" + RAW  # the open marker the prompt wrote, then the reply as generated
    assert _reasoning(m) == REASONING
    reasoning, content, _, _ = _stream(client, extra_body={"reasoning_format": "deepseek-legacy"})
    assert (reasoning, content) == (REASONING, "<think>\n" + RAW)


def test_none_leaves_all_in_content(client: openai.OpenAI) -> None:
    r = _chat(client, extra_body={"reasoning_format": "none"})
    assert r.choices[0].message.content == RAW and _reasoning(r.choices[0].message) is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content, _, _ = _stream(client, extra_body={"reasoning_format": "none"})
    assert (reasoning, content) == ("", RAW)


def test_cut_inside_thinking_is_all_reasoning(client: openai.OpenAI) -> None:
    r = _chat(client, max_tokens=4)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert m.content == "" and _reasoning(m) and REASONING.startswith(_reasoning(m))
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 4
    reasoning, content, _, _ = _stream(client, max_tokens=4)
    assert (reasoning, content) == (_reasoning(m), "")


def test_reasoning_content_reaches_the_template(client: openai.OpenAI) -> None:
    without = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in MESSAGES]
    a, b = _chat(client, max_tokens=1), _chat(client, messages=without, max_tokens=1)
    assert a.usage.prompt_tokens > b.usage.prompt_tokens  # the old turn's thinking was rendered


def test_thinking_off_by_kwargs_or_budget(client: openai.OpenAI, node: ServerProcess) -> None:
    # cache_prompt false: the same evaluation for both (a reused prefix may change greedy SmolLM2's words)
    off = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}, "cache_prompt": False})
    budget = _chat(client, extra_body={"thinking_budget_tokens": 0, "cache_prompt": False})
    assert off.choices[0].message.content == budget.choices[0].message.content
    for r in (off, budget):
        m = r.choices[0].message
        # the template closed the (empty) block in the prompt, so the reply is outside thinking (were a stray
        # end marker written, it would stay in content, as llama-server's parser leaves it)
        assert _reasoning(m) is None and m.content.startswith("2 + 2 is 4")
        assert r.usage.completion_tokens_details.reasoning_tokens == 0
    # the prompt holds the closed, empty block: more tokens than the open one
    assert off.usage.prompt_tokens == budget.usage.prompt_tokens > _chat(client, max_tokens=1).usage.prompt_tokens


def test_bad_fields(node: ServerProcess) -> None:
    for body, field in (
        ({"reasoning_format": "r1"}, "reasoning_format"),
        ({"thinking_budget_tokens": -2}, "thinking_budget_tokens"),
        ({"reasoning_budget_tokens": 2**31}, "reasoning_budget_tokens"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ):
        r = httpx.post(node.base + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text


def test_hydra_decode_reports_reasoning_tokens(node: ServerProcess, client: openai.OpenAI) -> None:
    http = _chat(client)
    with Wire(node.port) as w:
        body = {"messages": MESSAGES, "n_predict": 40, "temperature": 0, "stream": False}
        status, meta, _ = w.call(Op.DECODE, key="1", payload=json.dumps(body).encode())
        assert status == Status.OK, meta
        # the end-of-generation token that ended the reply counts in usage (llama-server's way) and has no frame
        ended = meta.get("stop_reason") == "eos"
        assert meta["tokens_generated"] == http.usage.completion_tokens - ended
        assert meta["reasoning_tokens"] == http.usage.completion_tokens_details.reasoning_tokens > 0
        status, meta, _ = w.call(Op.DECODE, key="1", payload=json.dumps({**body, "reasoning_format": "none"}).encode())
        assert status == Status.OK and meta["reasoning_tokens"] == 0
        status, meta, _ = w.call(Op.PREFILL, key="0", payload=json.dumps({**body, "reasoning_format": "r1"}).encode())
        assert status == Status.BAD_REQUEST and meta["error"].startswith("reasoning_format")
        status, meta, _ = w.call(
            Op.PREFILL,
            key="0",
            payload=json.dumps({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}).encode(),
        )
        assert status == Status.OK, meta


def test_node_flags(tmp_path: Path, spawn) -> None:  # type: ignore[no-untyped-def]
    """``--reasoning-format none`` leaves thinking in content; ``--reasoning-budget 0`` closes the thinking
    in the prompt (``enable_thinking`` false); ``--reasoning-budget 3 --reasoning-budget-message`` forces the
    message and the end marker after 3 thinking tokens; a request's fields override the node's."""
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    srv = spawn(
        "--chat-template-file",
        str(tmp_path / "t.jinja"),
        "-np",
        "1",
        "--reasoning-format",
        "none",
        "--reasoning-budget",
        "3",
        "--reasoning-budget-message",
        " Answer now.",
    )
    off = spawn("--chat-template-file", str(tmp_path / "t.jinja"), "-np", "2", "--reasoning-budget", "0")
    srv.wait_ready()
    off.wait_ready()
    c = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=120, max_retries=0)
    unrestricted = {"thinking_budget_tokens": 1000}
    m = _chat(c, extra_body=unrestricted).choices[0].message
    assert (m.content, _reasoning(m)) == (RAW, None)
    m = _chat(c, extra_body={"reasoning_format": "deepseek", **unrestricted}).choices[0].message
    assert (m.content, _reasoning(m)) == (CONTENT, REASONING)
    m = _chat(c, extra_body={"reasoning_format": "deepseek"}).choices[0].message  # the node's budget
    assert _reasoning(m) == "2 plus  Answer now." and m.content
    m = _chat(c, extra_body={"reasoning_format": "deepseek", "reasoning_budget_message": ""}).choices[0].message
    assert _reasoning(m) == "2 plus" and m.content
    c = openai.OpenAI(base_url=off.base + "/v1", api_key="none", timeout=120, max_retries=0)
    r = _chat(c)
    m = r.choices[0].message
    assert _reasoning(m) is None and m.content.startswith("2 + 2 is 4")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_required_tool_call_comes_after_the_thinking(client: openai.OpenAI) -> None:
    """A thinking reply with ``tool_choice: "required"``: the grammar leaves the thinking block free and
    forces the call after its end marker, so the call is a tool call, not reasoning."""
    tool = {
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
    r = _chat(client, tools=[tool], tool_choice="required", max_tokens=120)
    msg = r.choices[0].message
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content
    assert r.choices[0].finish_reason == "tool_calls", msg
    assert msg.tool_calls[0].function.name == "add"
    args = json.loads(msg.tool_calls[0].function.arguments)
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


def _tokens(node: ServerProcess, text: str) -> int:
    return len(httpx.post(node.base + "/tokenize", json={"content": text}, timeout=60).json()["tokens"])


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_a_budget_of_n_tokens_ends_the_thinking_and_the_model_answers(
    client: openai.OpenAI, node: ServerProcess, budget: int
) -> None:
    """``thinking_budget_tokens: N`` (llama-server's budget sampler): after N tokens inside the block the node
    forces ``</think>``; the reasoning holds at most N tokens (counted by ``/tokenize``), the content follows."""
    r = _chat(client, extra_body={"thinking_budget_tokens": budget})
    m = r.choices[0].message
    assert _reasoning(m) and REASONING.startswith(_reasoning(m)) and _reasoning(m) != REASONING
    assert _tokens(node, _reasoning(m)) <= budget
    # (greedy SmolLM2 may repeat the end marker itself after a forced one: that stays in content, as llama-server's)
    assert "The answer is" in m.content and r.choices[0].finish_reason == "stop"
    # the block's tokens: N counted, then the forced end marker's
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + _tokens(node, "</think>")
    reasoning, content, _, _ = _stream(client, extra_body={"reasoning_budget_tokens": budget})
    assert (reasoning, content) == (_reasoning(m), m.content)
    # a budget larger than the thinking changes nothing
    big = _chat(client, extra_body={"thinking_budget_tokens": 30}).choices[0].message
    assert (_reasoning(big), big.content) == (REASONING, CONTENT)


def test_the_budget_message_is_forced_before_the_end_marker(client: openai.OpenAI) -> None:
    r = _chat(client, extra_body={"thinking_budget_tokens": 3, "reasoning_budget_message": " Time to answer."})
    m = r.choices[0].message
    assert _reasoning(m).endswith("Time to answer.") and m.content


def test_reasoning_effort(client: openai.OpenAI) -> None:
    """OpenAI's ``reasoning_effort`` as llama-server maps it: ``none`` turns thinking off (``enable_thinking``
    false), another level reaches the template as ``reasoning_effort``; an unknown level is a 400."""
    plain = _chat(client, max_tokens=1)
    low = _chat(client, reasoning_effort="low", max_tokens=1)
    assert low.usage.prompt_tokens > plain.usage.prompt_tokens  # the template wrote "Reasoning effort: low"
    high = _chat(client, reasoning_effort="high")
    assert _reasoning(high.choices[0].message) and high.choices[0].message.content
    none = _chat(client, reasoning_effort="none", extra_body={"cache_prompt": False})
    off = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}, "cache_prompt": False})
    assert _reasoning(none.choices[0].message) is None
    assert none.choices[0].message.content == off.choices[0].message.content
    assert none.usage.prompt_tokens == off.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, reasoning_effort="extreme")
    assert "none, minimal, low, medium, high, xhigh, max" in err.value.response.json()["error"]["message"]


def test_a_grammar_that_refuses_the_end_marker_wins_over_the_budget(client: openai.OpenAI, node: ServerProcess) -> None:
    """The budget's forced ``</think>`` is checked against the request's grammar first (accepting a token the
    grammar refuses would abort llama.cpp): refused, the forcing ends and the reply follows the grammar."""
    r = _chat(client, max_tokens=8, extra_body={"thinking_budget_tokens": 2, "grammar": "root ::= [a-z ]+"})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert set(_reasoning(m)) <= set("abcdefghijklmnopqrstuvwxyz ") and m.content == ""
    assert httpx.get(node.base + "/health", timeout=10).status_code == 200


def test_drafts_compose_with_thinking_its_budget_and_a_required_tool_call(
    client: openai.OpenAI, tmp_path: Path, spawn
) -> None:  # type: ignore[no-untyped-def]
    """A node that drafts (``--spec-type suffix,ngram-simple``) gives the replies of one that does not: the
    split of thinking and content, a thinking budget forced inside a draft's reach, and a required tool
    call whose grammar rejects drafts outside it; and it did draft."""
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    spec = spawn("--chat-template-file", str(tmp_path / "t.jinja"), "-np", "1", "--spec-type", "suffix,ngram-simple")
    spec.wait_ready()
    drafting = openai.OpenAI(base_url=spec.base + "/v1", api_key="none", timeout=120, max_retries=0)
    tool = {
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
    whole = {"cache_prompt": False}
    for kw in (
        {"extra_body": whole},
        {"extra_body": {**whole, "thinking_budget_tokens": 3}},
        {"extra_body": whole, "tools": [tool], "tool_choice": "required", "max_tokens": 120},
    ):
        want, got = _chat(client, **kw), _chat(drafting, **kw)
        w, g = want.choices[0], got.choices[0]  # type: ignore[attr-defined]
        assert (g.message.content, _reasoning(g.message), g.finish_reason) == (
            w.message.content,
            _reasoning(w.message),
            w.finish_reason,
        ), kw
        assert [(t.function.name, t.function.arguments) for t in g.message.tool_calls or []] == [
            (t.function.name, t.function.arguments) for t in w.message.tool_calls or []
        ], kw
    metrics = httpx.get(spec.base + "/metrics", timeout=60).text
    accepted = [
        line for line in metrics.splitlines() if line.startswith("llamacpp:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and float(accepted[0].split()[-1]) > 0, accepted
