"""The thinking budget's state machine (:mod:`hydra_trio.engine.batching.thinking_budget`), sans-I/O: token pieces in,
forced tokens out, as llama-server's ``common/reasoning-budget.cpp`` behaves."""

from __future__ import annotations

import pytest

from hydra_trio.engine.batching.thinking_budget import (
    COUNTING,
    DONE,
    FORCING,
    IDLE,
    WAITING_UTF8,
    BudgetSpec,
    ThinkingBudget,
)

FORCED = (900, 901, 902)  # e.g. "</", "think", ">"


def _spec(budget: int, opened: bool = False, forced: tuple[int, ...] = FORCED) -> BudgetSpec:
    return BudgetSpec(budget, b"<think>", b"</think>", forced, opened=opened)


def _run(b: ThinkingBudget, pieces: list[bytes]) -> list[int | None]:
    """Feed pieces as sampled tokens (id 1) unless the budget forces one; the forced ids, in order."""
    forced = []
    for p in pieces:
        f = b.forced
        forced.append(f)
        b.accept(f if f is not None else 1, p if f is None else b"?")
    return forced


def test_counts_from_the_start_marker_then_forces_the_end() -> None:
    b = ThinkingBudget(_spec(3))
    assert b.state == IDLE
    _run(b, [b"\n", b"<think>"])
    assert b.state == COUNTING and b.remaining == 3
    _run(b, [b"a", b" b", b" c"])
    assert b.state == FORCING and b.forced == 900
    assert _run(b, [b"", b"", b"", b" free"]) == [900, 901, 902, None]
    assert b.state == DONE and b.n_forced == 3


def test_a_prompt_opened_block_counts_at_once_and_budget_zero_forces_at_once() -> None:
    b = ThinkingBudget(_spec(2, opened=True))
    assert b.state == COUNTING
    _run(b, [b"x", b"y"])
    assert b.forced == 900
    b0 = ThinkingBudget(_spec(0, opened=True))
    assert b0.state == FORCING and b0.forced == 900


def test_a_block_that_ends_by_itself_is_left_alone() -> None:
    b = ThinkingBudget(_spec(5, opened=True))
    assert _run(b, [b"ok.\n</", b"think", b">", b"a", b"b", b"c", b"d"]) == [None] * 7
    assert b.state == DONE  # the marker across tokens counted, and nothing was forced after it


def test_a_reply_that_does_not_think_is_never_forced() -> None:
    b = ThinkingBudget(_spec(1))
    assert _run(b, [b" <thi", b"nk?", b"a", b"b"]) == [None] * 4
    assert b.state == DONE


def test_a_cut_character_is_finished_before_forcing() -> None:
    euro = "€".encode()  # three bytes
    b = ThinkingBudget(_spec(1, opened=True))
    _run(b, [euro[:2]])
    assert b.state == WAITING_UTF8 and b.forced is None
    _run(b, [euro[2:]])
    assert b.state == FORCING and b.forced == 900


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        ThinkingBudget(_spec(-1))
    with pytest.raises(ValueError):
        ThinkingBudget(_spec(1, forced=()))


def test_giving_up_ends_the_forcing() -> None:
    b = ThinkingBudget(_spec(0, opened=True))
    assert b.forced == 900
    b.give_up()
    assert b.state == DONE and b.forced is None
    assert _run(b, [b"</think>", b"x"]) == [None, None]
