"""Small pure parts: stop strings, request schemas, first-byte rules, presets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine.batching.slots import StopStringMatcher
from hydra_trio.models.presets import PresetError, resolve_model
from hydra_trio.openai.replies import ResponseContext
from hydra_trio.openai.replies import sse as _sse
from hydra_trio.openai.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from hydra_trio.protocol.classify import Protocol, classify
from hydra_trio.validation.strict import MessageError


@given(st.lists(st.text(max_size=5), max_size=12), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_stop_matcher_equals_whole_text_search(pieces: list[str], stops: list[str]) -> None:
    m = StopStringMatcher(tuple(stops))
    out, stopped = "", False
    for p in pieces:
        text, stopped = m.push(p)
        out += text
        if stopped:
            break
    if not stopped:
        out += m.flush()
    whole = "".join(pieces)
    hits = [whole.find(s) for s in stops if s in whole]
    expected = whole[: min(hits)] if hits else whole
    assert out == expected
    assert stopped == bool(hits)


def test_stop_matcher_holds_back_partial_match() -> None:
    m = StopStringMatcher(("</s>",))
    assert m.push("hello </") == ("hello ", False)
    assert m.push("x") == ("</x", False)


def test_schema_errors_name_fields() -> None:
    with pytest.raises(MessageError, match=r"messages\[1\]"):
        parse_body(json.dumps({"messages": [{"role": "user", "content": "a"}, 5]}).encode(), ChatCompletionRequest)
    with pytest.raises(MessageError, match="stop"):
        parse_body(json.dumps({"prompt": "a", "stop": 3}).encode(), CompletionRequest)
    with pytest.raises(MessageError, match="max_tokens: must be between -1 and 2147483647, got -2"):
        parse_body(json.dumps({"prompt": "a", "max_tokens": -2}).encode(), CompletionRequest)
    # -1 is llama-server's "no limit" for n_predict and its aliases max_tokens / max_completion_tokens
    # (GET /props shows max_tokens: -1; a client sends it back)
    assert parse_body(json.dumps({"prompt": "a", "max_tokens": -1}).encode(), CompletionRequest).max_tokens == -1


def test_schema_accepts_openai_shapes() -> None:
    body = parse_body(
        json.dumps(
            {
                "model": "x",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
                ],
                "stop": "END",
                "stream_options": {"include_usage": True},
                "user": "ignored",
                "max_completion_tokens": 5,
            }
        ).encode(),
        ChatCompletionRequest,
    )
    assert body.messages[0].content == "hi there"
    assert body.stop == ("END",) and body.include_usage and body.n_predict_effective() == 5
    assert parse_body(b'{"prompt": [1, 2, 3]}', CompletionRequest).prompt == (1, 2, 3)


@pytest.mark.parametrize(
    ("first", "proto"),
    [
        (b"G", Protocol.HTTP),
        (b"P", Protocol.HTTP),
        (b"O", Protocol.HTTP),
        (b"Y", Protocol.HYDRA),
        (b"\x0e", Protocol.GGML_RPC),
        (b"\x16", Protocol.TLS),
        (b"\x00", Protocol.UNKNOWN),
        (b"", Protocol.UNKNOWN),
        (b"Z", Protocol.UNKNOWN),
        (b"g", Protocol.UNKNOWN),
    ],
)
def test_classify(first: bytes, proto: Protocol) -> None:
    assert classify(first) is proto


def test_presets() -> None:
    path, alias = resolve_model("smollm2-135m")
    assert alias == "smollm2-135m" and path.stat().st_size > 50_000_000
    path2, alias2 = resolve_model(str(path))
    assert path2 == path and alias2 == "SmolLM2-135M-Instruct.Q4_1"
    with pytest.raises(PresetError, match="neither a file nor a known alias"):
        resolve_model("no-such-model")


@given(
    st.booleans(),
    st.text(),
    st.one_of(st.text(), st.dictionaries(st.sampled_from(["content", "reasoning_content"]), st.text(), max_size=2)),
    st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {
                "content": st.lists(
                    st.fixed_dictionaries({"token": st.text(max_size=3), "logprob": st.floats(-50, 0)}), max_size=2
                ),
                "refusal": st.none(),
            }
        ),
    ),
)
@settings(deadline=None)
def test_stream_chunk_json_is_the_chunk_encoded(chat: bool, model: str, delta: object, logprobs: object) -> None:
    """The per-token SSE chunk built from a fixed head (ResponseContext.chunk_json) is byte for byte the
    chunk object encoded as the stream's other events are (compact, non-ASCII as is)."""
    ctx = ResponseContext(chat=chat, model=model, include_usage=False, id='chatcmpl-\u00e9"x')
    for _ in range(2):  # the head is built once and reused
        assert f"data: {ctx.chunk_json(delta, logprobs)}\n\n" == _sse(ctx.chunk(delta, None, logprobs))  # type: ignore[arg-type]
    json.loads(ctx.chunk_json(delta, logprobs))
