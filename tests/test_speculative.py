"""Speculative decoding in the scheduler, on real models in-process: drafts are verified in the same batch,
the accepted prefix kept and the rest removed from the KV cache, so the output is what the target alone
gives (llama.cpp's own speculative tests assert the same: identical greedy tokens, and identical tokens
for a seeded low temperature, since each position is sampled by the target's own chain).

Prompts are ones the tiny models continue with wide margins (the alphabet, counting), so that the few
ulps by which a batch of several positions differs from one position at a time cannot flip a token on
any x86-64 CPU; every comparison is this node's arithmetic against itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from hydra_trio.engine.engine import Engine
from hydra_trio.engine.requests import CompletionJob, Finished, JobRun
from hydra_trio.engine.settings import LlamaOptions, SamplingParams
from hydra_trio.engine.speculative.settings import SpecSettings
from hydra_trio.engine.tasks import RestoreSlot, SaveSlot

from .conftest import running_engine

ALPHABET = "a b c d e f g h i j k l m n o p q r s t u v w x y z\n" * 12 + "a b c d"  # copied on, p > 0.9 a token
ALPHABET_BODY = {
    "prompt": ALPHABET,
    "n_predict": 40,
    "temperature": 0,
    "ignore_eos": True,
    "cache_prompt": False,
    "return_tokens": True,
}
"""A ``/completion`` body over :data:`ALPHABET` that any drafter drafts well on: 40 greedy tokens and their ids."""
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.2, seed=4242)  # llama-server's own speculative test: 0.2, 16 tokens
MODEL_FREE = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")


@contextlib.asynccontextmanager
async def engine_with(*types: str, **config: Any) -> AsyncIterator[Engine]:
    spec = SpecSettings(types=("none", *types), **config.pop("spec", {})) if types else SpecSettings()
    async with running_engine(n_ctx=config.pop("n_ctx", 4096), speculative=spec, **config) as engine:
        yield engine


async def generate(engine: Engine, prompt: str | list[int], **job: Any) -> tuple[list[int], str, Finished]:
    """One completion on ``engine``: its tokens, text and Finished event."""
    tokens = engine.model.tokenize(prompt, add_special=True) if isinstance(prompt, str) else prompt
    # the whole prompt evaluated every time: a cached prompt evaluates only its last token, with other
    # kernels than a whole prompt, and that would be a difference of its own
    fields: dict[str, Any] = {
        "n_predict": 64,
        "ignore_eos": True,
        "id_slot": 0,
        "sampling": GREEDY,
        "cache_prompt": False,
        **job,
    }
    out, text = [], []
    async with JobRun(engine, CompletionJob(prompt_tokens=tuple(tokens), **fields)) as run:
        async for delta in run:
            out.extend(delta.tokens)
            text.append(delta.text)
        assert run.finished is not None
        return out, "".join(text), run.finished


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    """What the target alone gives for each case (one engine without speculation)."""
    out: dict[str, Any] = {}
    trio.run(_plain, out)
    return out


async def _plain(out: dict[str, Any]) -> None:
    async with engine_with() as engine:
        out["greedy"] = await generate(engine, ALPHABET)
        out["seeded"] = await generate(engine, ALPHABET, sampling=SEEDED, n_predict=16)
        out["stop"] = await generate(engine, ALPHABET, stop=("q r",), n_predict=200)
        out["budget"] = await generate(engine, ALPHABET, n_predict=37)
        out["probs"] = await generate(engine, ALPHABET, n_probs=3, n_predict=24)
        assert not engine.slots[0].speculative and out["greedy"][2].draft_n is None


@pytest.mark.parametrize("kind", MODEL_FREE)
async def test_each_model_free_type_gives_the_targets_own_tokens(kind: str, plain: dict[str, Any]) -> None:
    async with engine_with(kind) as engine:
        tokens, text, done = await generate(engine, ALPHABET)
        assert tokens == plain["greedy"][0] and text == plain["greedy"][1]
        # it did speculate, and the target agreed with drafts of this repeating text
        assert done.draft_n and done.draft_n_accepted, done
        assert 0 < done.draft_n_accepted <= done.draft_n
        timings = done.timings()
        assert (timings["draft_n"], timings["draft_n_accepted"]) == (done.draft_n, done.draft_n_accepted)
        # the slot holds what it would hold without drafts: prompt and generated tokens but the last
        assert done.n_past == plain["greedy"][2].n_past
        assert engine.snapshot.slot(0).speculative and engine.slots[0].n_past == done.n_past
        stats = engine.stats  # llama-server's spec_decode_num_* counters
        assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (done.draft_n, done.draft_n_accepted)
        assert stats.spec_drafts > 0 and stats.spec_accepted_per_pos[0] > 0


async def test_sampled_output_is_the_targets_and_limits_cut_inside_a_draft(plain: dict[str, Any]) -> None:
    """A seeded low temperature gives the same tokens (one draw per position, by the target's chain); a stop
    string and ``n_predict`` that end the request inside a verified draft leave the slot as generating
    without one would; log-probabilities come one per token, equal to the target's."""
    async with engine_with("suffix", "ngram-simple") as engine:
        for case, job in [
            ("seeded", {"sampling": SEEDED, "n_predict": 16}),
            ("stop", {"stop": ("q r",), "n_predict": 200}),
            ("budget", {"n_predict": 37}),
        ]:
            tokens, text, done = await generate(engine, ALPHABET, **job)
            want_tokens, want_text, want = plain[case]
            assert (tokens, text) == (want_tokens, want_text), case
            assert (done.finish_reason, done.stop_reason, done.predicted_n, done.n_past) == (
                want.finish_reason,
                want.stop_reason,
                want.predicted_n,
                want.n_past,
            ), case
            assert done.draft_n_accepted, case
        tokens, _, done = await generate(engine, ALPHABET, n_probs=3, n_predict=24)
        assert tokens == plain["probs"][0] and done.draft_n_accepted


async def test_a_grammar_composes_with_drafts() -> None:
    """A grammar that allows only the alphabet's letters: drafts the grammar refuses are rejected by
    sampling, the output follows the grammar and equals the target's alone."""
    grammar = 'root ::= ([a-z] " ")+'
    results = []
    for types in ((), ("suffix",)):
        async with engine_with(*types) as engine:
            results.append(
                await generate(engine, ALPHABET, grammar=grammar, n_predict=20)
            )  # to the "z" before a "\\n" it refuses
    (plain_tokens, plain_text, _), (tokens, text, done) = results
    assert tokens == plain_tokens and text == plain_text and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert done.draft_n


async def test_draft_mtp_on_the_tiny_mtp_model_and_its_state_moves_with_a_kv_blob() -> None:
    """``draft-mtp`` (the target's own MTP layer; the model is hybrid: rejected drafts leave its
    recurrent state through its per-token copies) gives the target's greedy tokens; a slot saved with its drafters'
    state (a version 4 blob) and restored on another node continues with the same tokens as the slot that
    stayed, and drafts from the moved MTP sequence at once."""
    from hydra_trio.models.presets import resolve_model

    resolve_model("tiny-mtp")  # made on first use
    prompt = list(range(300, 340))
    async with engine_with(model="tiny-mtp") as engine:
        want, _, _ = await generate(engine, prompt, n_predict=48)
    async with engine_with("draft-mtp", model="tiny-mtp") as a, engine_with("draft-mtp", model="tiny-mtp") as b:
        tokens, _, done = await generate(a, prompt, n_predict=24)
        assert tokens == want[:24] and done.draft_n_accepted, done
        n_past, blob = await a.run_task(SaveSlot(0))
        assert bytes(blob.view()[4:6]) == (4).to_bytes(2, "little")  # version 4: the drafters' part rides along
        data = bytes(blob.view())
        restored = await b.run_task(RestoreSlot(0, bytearray(data)))
        assert restored.n_past == n_past and restored.extra
        cont = {"continue_slot": True, "n_predict": 24}
        here, _, _ = await generate(a, [], **cont)
        there, _, moved = await generate(b, [], **cont)
        # a slot continued re-evaluates its last cached token, so the 24th token comes again (the Hydra
        # DECODE way of going on from a PREFILL): the target's own tokens from there
        assert here == there == want[23:47]
        assert moved.draft_n_accepted, moved


async def test_context_shift_and_a_unified_cache_compose_with_drafts() -> None:
    """A generation that runs past a small slot context with ``--context-shift`` (drafts are cut to leave
    room, so a shift never falls inside one), and two slots drafting at once in one unified KV cache:
    each gives the target's own tokens.

    After the shift the slot holds the second half of its context only, and there the tiny model's next
    token is no longer a wide-margin choice (it drifts into repeating one letter, and an AVX2-only build
    and an AVX-512 one drift differently, with drafts or without): the tokens up to the shift must be the
    target's own, and the shift must come at the same token and the generation go on to its end."""
    cases = {"shift": {"n_ctx": 1024, "context_shift": True}, "unified": {"llama": LlamaOptions(kv_unified=True)}}
    for name, config in cases.items():
        outs = []
        for types in ((), ("suffix", "ngram-simple")):
            async with engine_with(*types, **dict(config)) as engine:
                prompt = engine.model.tokenize(ALPHABET, add_special=True)
                if name == "shift":
                    tokens, _text, done = await generate(engine, prompt, n_predict=260)  # past the 512 of a slot
                    assert done.truncated and len(tokens) == 260  # it did shift, and went on
                    before = engine.slots[0].n_ctx - len(prompt)  # the tokens generated before the shift
                    outs.append((tokens[:before], done.n_past))
                else:
                    async with trio.open_nursery() as nursery:
                        got: dict[int, list[int]] = {}

                        async def one(i: int) -> None:
                            got[i] = (await generate(engine, prompt, id_slot=i, n_predict=40))[0]  # noqa: B023  (called and finished within this iteration)

                        for i in range(2):
                            nursery.start_soon(one, i)
                    outs.append([got[0], got[1]])
        assert outs[0] == outs[1], name


async def test_the_draft_budget_cuts_unpaying_drafts_and_is_the_same_on_every_run() -> None:
    """``--spec-budget-row-cost``: with a per-row cost, a slot whose drafts are rejected drafts less than
    with drafts verified whole (0, llama-server's way), and a draft's length depends on the tokens only, so
    two runs of one request verify the same drafts and give the same text."""
    from hydra_trio.engine.speculative.budget import DraftBudget

    budget = DraftBudget(0.35)
    assert budget.cap(0, 16) >= 1  # the prior's acceptance pays for a draft
    for _ in range(20):
        budget.observe_verify(0, 4, 0)  # every draft rejected at once
    held = [budget.cap(0, 16) for _ in range(8)]
    assert sorted(held) == [0] * 7 + [1]  # held to none, with a one-token probe every EXPLORE steps
    for _ in range(40):
        budget.observe_verify(0, 8, 8)  # every draft accepted whole
    assert budget.cap(0, 16) >= 8
    assert DraftBudget(0.01).cap(0, 64) > DraftBudget(1.0).cap(0, 64)  # cheaper rows, longer drafts
    grows = DraftBudget(0.5, 0.09)  # auto on a CPU: each row costs more the longer the slot's context
    for i in range(60):
        grows.observe_verify(0, 16, i % 8)  # drafts accepted up to 0, 1, ... 7 tokens, as many of each
    assert grows.cap(0, 64, n_past=0) > grows.cap(0, 64, n_past=8000) >= 1
    # flash attention off: a one-row step grows with the context faster than a row does, so a row's share,
    # and with it the cut, goes the other way
    from hydra_trio.engine.speculative.budget import CPU_NO_FA

    no_fa = DraftBudget(*CPU_NO_FA)
    for i in range(60):
        no_fa.observe_verify(0, 16, i % 16)  # drafts accepted up to 0, 1, ... 15 tokens
    assert no_fa.cap(0, 64, n_past=0) < no_fa.cap(0, 64, n_past=8000)

    # copied text: the first drafted token is accepted half the time, the ones after it nearly always; kept
    # apart by position, the budget learns to draft long where one acceptance for all would keep drafts short
    copy = DraftBudget(0.5, 0.09)
    caps = []
    for i in range(200):
        caps.append(copy.cap(0, 16, n_past=500))
        if caps[-1]:
            copy.observe_verify(0, caps[-1], 0 if i % 4 in (1, 2) else caps[-1])
    assert caps[0] <= 3 and min(caps[-20:]) == 16, caps
    assert copy.acceptance(0, depth=0) < 0.7 < 0.95 < copy.acceptance(0, depth=8)

    async with engine_with("ngram-simple") as engine:  # auto: this machine's CPU (a build with ggml-RPC only)
        auto = engine.scheduler.spec.budget
        assert auto is not None and (auto.row_cost, auto.per_ktoken, auto.step_per_ktoken) == (0.5, 0.09, 0.0)
    async with engine_with("ngram-simple", llama=LlamaOptions(flash_attn="off")) as engine:  # auto follows -fa
        auto = engine.scheduler.spec.budget
        assert auto is not None and (auto.row_cost, auto.per_ktoken, auto.step_per_ktoken) == CPU_NO_FA

    prose = "The history of the city begins with a small market by the river, where traders met"
    runs = []
    for row_cost in (1.0, 1.0, 0.0):
        async with engine_with("ngram-simple", "suffix", spec={"budget_row_cost": row_cost}) as engine:
            assert (engine.scheduler.spec.budget is None) == (row_cost == 0)
            runs.append(await generate(engine, prose, n_predict=96))
    (a, text_a, done_a), (b, text_b, done_b), (_whole, _, done_whole) = runs
    assert (a, text_a, done_a.draft_n, done_a.draft_n_accepted) == (b, text_b, done_b.draft_n, done_b.draft_n_accepted)
    assert done_whole.draft_n - done_whole.draft_n_accepted > done_a.draft_n - done_a.draft_n_accepted


async def test_prefix_sharing_and_the_prompt_cache_compose_with_drafts() -> None:
    """One sequence of requests on a node with and without drafts: a conversation evaluated on slot 0, the
    same prefix continued on slot 1 (shared from slot 0's cells), both slots taken by another prompt (their
    conversations go to the host-RAM prompt cache) and the conversation back on slot 0 (restored from the
    cache, with the drafters' view of the slot rebuilt from the restored tokens).  Each request gives the
    target's own tokens, and the speculating node reuses as much of each prompt as the other."""
    counting = " ".join(str(i) for i in range(1, 120))
    runs = []
    for types in ((), ("suffix", "ngram-simple")):
        async with engine_with(*types) as engine:
            first = await generate(engine, ALPHABET, n_predict=24, cache_prompt=True)
            convo = engine.model.tokenize(ALPHABET, add_special=True) + first[0]
            steps = [
                first,
                await generate(engine, convo, id_slot=1, n_predict=24, cache_prompt=True),
                await generate(engine, counting, n_predict=8, cache_prompt=True),
                await generate(engine, counting, id_slot=1, n_predict=8, cache_prompt=True),
                await generate(engine, convo, id_slot=0, n_predict=24, cache_prompt=True),
            ]
            runs.append(steps)
            if types:
                assert engine.prompt_cache.hits >= 1
    plain, spec = runs
    for i, ((want, _, w), (got, _, g)) in enumerate(zip(plain, spec, strict=False)):
        assert got == want, i
        assert g.cache_n == w.cache_n, i
    assert spec[1][2].cache_n > 0 and spec[4][2].cache_n >= len(spec[0][0])  # shared; restored
    assert all(step[2].draft_n_accepted for i, step in enumerate(spec) if i in (0, 1, 4))


async def test_context_checkpoints_compose_with_drafts() -> None:
    """On a hybrid model (tiny-mtp: its recurrent memory cannot be cut back), a prompt that diverges from
    the slot's cache resumes from the context checkpoint taken 4 tokens before the end of the first prompt
    (llama-server's placement), with drafts on: the same tokens, and as much of the prompt reused, as on
    a node that does not draft, where the drafts' rolled-back positions left no trace in the checkpoint."""
    from hydra_trio.models.presets import resolve_model

    resolve_model("tiny-mtp")  # made on first use
    first = list(range(300, 300 + 600))
    second = first + list(range(1000, 1040))  # the first prompt and more: it diverges after the reply
    runs = []
    for types in ((), ("draft-mtp", "ngram-simple")):
        async with engine_with(*types, model="tiny-mtp") as engine:
            runs.append(
                [
                    await generate(engine, first, n_predict=24, cache_prompt=True),
                    await generate(engine, second, n_predict=24, cache_prompt=True),
                ]
            )
    plain, spec = runs
    for (want, _, w), (got, _, g) in zip(plain, spec, strict=False):
        assert got == want
        assert (g.cache_n, g.prompt_n) == (w.cache_n, w.prompt_n)
    assert spec[1][2].cache_n == len(first) - 4  # resumed from the checkpoint
    assert spec[0][2].draft_n_accepted and spec[1][2].draft_n_accepted
