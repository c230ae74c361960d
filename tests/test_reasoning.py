"""The sans-I/O thinking parser (hydra_trio.openai.reasoning): exact splits, and for any chunking of a
text the concatenated deltas equal the whole-text parse (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.openai.reasoning import (
    MARKERS,
    ReasoningParser,
    check_format,
    opened_in_prompt,
    parse,
    resolve_format,
    template_thinks,
)

THINK = ("<think>", "</think>")


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
        ("  <think>a</think>b", "a", "b"),
        ("<think>cut inside the thi", "cut inside the thi", ""),
        ("<think>\n\n</think>\n\nonly content", "", "only content"),
        ("no thinking at all", "", "no thinking at all"),
        ("  leading space kept", "", "  leading space kept"),
        ("text then <think>late</think>", "", "text then <think>late</think>"),
        ("<think>a <think> b</think>c", "a <think> b", "c"),
        ("<seed:think>s</seed:think>x", "s", "x"),
        ("[THINK]m[/THINK]y", "m", "y"),
        ("<|START_THINKING|>c<|END_THINKING|>z", "c", "z"),
        ("<mm:think>q</mm:think>w", "q", "w"),
        ("<think>a</seed:think>b", "a</seed:think>b", ""),  # the end marker of its own pair only
        ("", "", ""),
        ("<thin", "", "<thin"),  # a marker prefix that never completes is content
    ],
)
def test_deepseek_splits(text: str, reasoning: str, content: str) -> None:
    got = parse(text, "deepseek")
    assert (got.reasoning, got.content) == (reasoning, content)


def test_legacy_keeps_tags_and_fills_reasoning() -> None:
    got = parse("<think> r </think> c", "deepseek-legacy")
    assert (got.reasoning, got.content) == ("r", "<think> r </think> c")
    got = parse("r</think>c", "deepseek-legacy", prompt_open=THINK)
    assert (got.reasoning, got.content) == ("r", "<think>r</think>c")


def test_none_leaves_everything_in_content() -> None:
    got = parse("<think>r</think>c", "none")
    assert (got.reasoning, got.content) == ("", "<think>r</think>c")
    assert parse("r</think>c", "none", prompt_open=THINK).content == "r</think>c"


def test_opened_in_prompt() -> None:
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n") == THINK
    assert opened_in_prompt("<|im_start|>assistant\n[THINK]") == ("[THINK]", "[/THINK]")
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert opened_in_prompt("<|im_start|>assistant\n") is None
    got = parse("\nstep one\n</think>\n\nanswer", prompt_open=THINK)
    assert (got.reasoning, got.content) == ("step one", "answer")
    got = parse("never closed", prompt_open=THINK)
    assert (got.reasoning, got.content) == ("never closed", "")


def test_formats_and_auto() -> None:
    assert check_format("deepseek-legacy") == "deepseek-legacy"
    with pytest.raises(ValueError, match="reasoning_format"):
        check_format("deepseek2")
    with pytest.raises(ValueError):
        ReasoningParser("auto")
    assert template_thinks("{{ '<think>' }}") and not template_thinks("{{ messages }}")
    assert resolve_format("auto", "{{ messages }}", "<|im_start|>assistant\n") == "none"
    assert resolve_format("auto", "{{ '</think>' }}", "x") == "deepseek"
    assert resolve_format("auto", "{{ x }}", "assistant\n<think>\n") == "deepseek"
    assert resolve_format("none", "{{ '</think>' }}", "x") == "none"


def test_thinking_flag_per_piece() -> None:
    p = ReasoningParser("deepseek")
    flags = [p.feed(t).thinking for t in ["<think>", "a", " b", "</think>", "\n\n", "c"]]
    assert flags == [True, True, True, True, False, False]
    p = ReasoningParser("deepseek-legacy", prompt_open=THINK)
    assert [p.feed(t).thinking for t in ["a", "</think>", "c"]] == [True, True, False]


# ----------------------------------------------------------------------------- any chunking

_atoms = st.sampled_from(
    [m for pair in MARKERS for m in pair]
    + ["<", "</", "<th", "</thi", "[", "[/", "<|", "<seed:", " ", "\n", "  \n", "\t"]
    + ["a", "b c", "xyz", "é", "日本", "think", ">"]
)
_texts = st.lists(_atoms, max_size=14).map("".join) | st.text(max_size=40)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    out, last = [], 0
    for c in points:
        out.append(text[last:c])
        last = c
    out.append(text[last:])
    return out


@settings(max_examples=600, deadline=None)
@given(
    text=_texts,
    cuts=st.lists(st.integers(0, 1000), max_size=12),
    fmt=st.sampled_from(["none", "deepseek", "deepseek-legacy"]),
    open_=st.sampled_from([None, *MARKERS]),
)
def test_any_chunking_equals_whole_parse(text: str, cuts: list[int], fmt: str, open_: tuple[str, str] | None) -> None:
    whole = parse(text, fmt, prompt_open=open_)
    p = ReasoningParser(fmt, prompt_open=open_)
    deltas = [p.feed(piece) for piece in _chunks(text, cuts)] + [p.finish()]
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert "".join(d.content for d in deltas) == whole.content
    if fmt == "none":
        assert whole.content == text and whole.reasoning == ""
    if fmt == "deepseek-legacy":
        assert whole.content == (open_[0] if open_ else "") + text
    if fmt == "deepseek":  # content is free of the opening block's markers; reasoning is trimmed
        assert whole.reasoning == whole.reasoning.strip(" \t\r\n")  # the ASCII whitespace llama.cpp trims
        assert len(whole.reasoning) + len(whole.content) <= len(text)


@settings(max_examples=300, deadline=None)
@given(
    reasoning=st.text(st.characters(blacklist_characters="<>[]|"), max_size=20),
    content=st.text(max_size=20),
    pair=st.sampled_from(MARKERS),
    cuts=st.lists(st.integers(0, 100), max_size=8),
)
def test_round_trip(reasoning: str, content: str, pair: tuple[str, str], cuts: list[int]) -> None:
    text = f"{pair[0]}{reasoning}{pair[1]}{content}"
    p = ReasoningParser("deepseek")
    deltas = [p.feed(piece) for piece in _chunks(text, cuts)] + [p.finish()]
    assert "".join(d.reasoning for d in deltas) == reasoning.strip(" \t\r\n")
    assert "".join(d.content for d in deltas) == content.lstrip(" \t\r\n")
