"""The model-based drafters on real models, without the scheduler: ``draft-simple`` (SmolLM2 Q4_1 drafted for by
its Q8_0 requantization) and ``draft-mtp`` (the generated ``tiny-mtp``: the cluster's ``qwen35moe`` architecture
with one MTP layer).

Each test drives a minimal reference verification loop, as llama-server's ``update_slots`` runs one
(``tools/server/server-context.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors): draft, decode
``[id_last, draft...]`` in the target with logits for every entry, let the drafter see that batch, keep the
drafted tokens that equal the target's greedy choice plus the target's next token, remove the rest from the
target's memory (``llama_memory_seq_rm``; the hybrid ``tiny-mtp`` keeps ``n_rs_seq`` recurrent-state copies for
it, as llama-server sets for MTP), tell the drafter how many were accepted.  With greedy sampling the
tokens must be the target's own greedy continuation (llama.cpp's speculative test asserts the same).
Expected values are same-path results on this machine, never hard-coded words.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import llama_cpp
import numpy as np
import pytest

from hydra_trio.engine.llama.model import LoadedModel, init_backend
from hydra_trio.engine.settings import LlamaOptions
from hydra_trio.engine.speculative import reasons
from hydra_trio.engine.speculative.base import Drafter, SlotDraft
from hydra_trio.engine.speculative.draft_model import DraftSimple, load_draft_model, vocab_problem
from hydra_trio.engine.speculative.drafting import DraftParams, seq_state, set_seq_state
from hydra_trio.engine.speculative.mtp import DraftMtp, create_mtp_context, target_context_params, target_model_params
from hydra_trio.models.presets import resolve_model

N_MAX = 3
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "Hydra clusters serve agents: plans, tools and files, again and again.",
)


class Target:
    """A target context driven by hand: one ``llama_batch`` of tokens, greedy picks from its logits."""

    def __init__(self, model: Any, ctx: Any) -> None:
        self.model, self.ctx = model, ctx
        self.mem = llama_cpp.llama_get_memory(ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * 512)()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, 512, True, True)
        return list(buf[:n])

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode ``(token, pos, seq, logits)`` entries in one batch."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        assert llama_cpp.llama_decode(self.ctx, b) == 0

    def greedy(self, idx: int) -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)


def plain_greedy(t: Target, prompt: list[int], seq: int, n: int) -> list[int]:
    """The target's greedy continuation without speculation: one token per decode."""
    llama_cpp.llama_memory_seq_rm(t.mem, seq, -1, -1)
    t.decode([(tok, p, seq, p == len(prompt) - 1) for p, tok in enumerate(prompt)])
    out = [t.greedy(-1)]
    while len(out) < n:
        t.decode([(out[-1], len(prompt) + len(out) - 1, seq, True)])
        out.append(t.greedy(-1))
    llama_cpp.llama_memory_seq_rm(t.mem, seq, -1, -1)
    return out


class Run:
    """A slot's speculative generation: its tokens so far and what was drafted."""

    def __init__(self, seq: int, prompt: list[int]) -> None:
        self.seq, self.prompt = seq, prompt
        self.out: list[int] = []  # generated; out[-1] is id_last, not yet in the target's memory
        self.drafts: list[list[int]] = []
        self.n_drafted = self.n_accepted = 0

    @property
    def n_past(self) -> int:
        return len(self.prompt) + len(self.out) - 1


def prefill(t: Target, d: Drafter, runs: list[Run]) -> None:
    """Every run's prompt in one batch, the drafter sees it, each run's first token."""
    entries, last = [], {}
    for r in runs:
        for p, tok in enumerate(r.prompt):
            entries.append((tok, p, r.seq, p == len(r.prompt) - 1))
        last[r.seq] = len(entries) - 1
    t.decode(entries)
    assert d.process(t.batch)
    for r in runs:
        r.out = [t.greedy(last[r.seq])]


def speculate(t: Target, d: Drafter, runs: list[Run], n: int, mirror: bool = True) -> None:
    """Verification steps for all runs together until each has at least ``n`` tokens (the last step may
    accept more).  ``mirror``: tell the drafter of the target's rollback (:meth:`Drafter.seq_rm`), as the
    scheduler does; without it the drafter finds out from the next batch's positions."""
    while any(len(r.out) < n for r in runs):
        live = [r for r in runs if len(r.out) < n]
        drafts = [SlotDraft(r.seq, N_MAX, r.n_past, r.out[-1], r.prompt + r.out[:-1]) for r in live]
        d.draft(drafts)
        entries, first = [], {}
        for r, q in zip(live, drafts, strict=False):
            assert len(q.result) <= N_MAX
            r.drafts.append(list(q.result))
            first[r.seq] = len(entries)
            entries += [(tok, r.n_past + i, r.seq, True) for i, tok in enumerate([r.out[-1], *q.result])]
        t.decode(entries)
        assert d.process(t.batch)
        for r, q in zip(live, drafts, strict=False):
            pos0, k = r.n_past, 0
            new = [t.greedy(first[r.seq])]
            while k < len(q.result) and q.result[k] == new[-1]:
                k += 1
                new.append(t.greedy(first[r.seq] + k))
            d.accept(r.seq, k, False)
            assert llama_cpp.llama_memory_seq_rm(t.mem, r.seq, pos0 + k + 1, -1)
            if mirror:
                d.seq_rm(r.seq, pos0 + k + 1, -1)
            r.out += new
            r.n_drafted += len(q.result)
            r.n_accepted += k


# -- draft-mtp on tiny-mtp --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_model() -> Iterator[Any]:
    """``tiny-mtp`` loaded as the target of ``draft-mtp`` is (``load_mtp``)."""
    init_backend()
    path, _ = resolve_model("tiny-mtp")
    mparams = llama_cpp.llama_model_default_params()
    target_model_params(mparams)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model
    yield model
    llama_cpp.llama_model_free(model)


def mtp_target(model: Any, n_seq: int = 2) -> Target:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 1024, 512, 512, n_seq
    cparams.n_threads = cparams.n_threads_batch = 2
    target_context_params(cparams, DraftParams(n_max=N_MAX))
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    assert ctx
    return Target(model, ctx)


@pytest.fixture
def mtp_pair(mtp_model: Any) -> Iterator[tuple[Target, DraftMtp]]:
    t = mtp_target(mtp_model)
    d = DraftMtp(t.ctx, create_mtp_context(mtp_model, t.ctx), 2, DraftParams(n_max=N_MAX))
    yield t, d
    d.close()
    t.close()
    llama_cpp.llama_free(t.ctx)


def test_tiny_mtp_is_the_clusters_architecture_with_one_mtp_layer(mtp_model: Any) -> None:
    """``-m tiny-mtp`` names a generated ``qwen35moe`` GGUF (hybrid: recurrent gated delta-net layers) whose
    last block is an MTP layer; llama.cpp reads ``nextn_predict_layers`` from it."""
    path, alias = resolve_model("tiny-mtp")
    assert alias == "tiny-mtp"
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "qwen35moe"
    assert reader.fields["qwen35moe.nextn_predict_layers"].contents() == 1
    n_block = reader.fields["qwen35moe.block_count"].contents()
    assert any(t.name == f"blk.{n_block - 1}.nextn.eh_proj.weight" for t in reader.tensors)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"  # SmolLM2's tokenizer, copied
    assert llama_cpp.llama_model_n_layer_nextn(mtp_model) == 1
    assert llama_cpp.llama_model_is_hybrid(mtp_model)


def test_draft_mtp_verify_loop_gives_the_greedy_output_on_two_slots(mtp_pair: tuple[Target, DraftMtp]) -> None:
    """Two slots speculate in shared batches; each gets exactly the target's greedy tokens, and the MTP head's
    drafts were partly accepted, partly rejected (both paths ran, rollback included)."""
    t, d = mtp_pair
    prompts = [t.tokenize(p) for p in PROMPTS]
    want = [plain_greedy(t, p, seq, 60) for seq, p in enumerate(prompts)]
    runs = [Run(seq, p) for seq, p in enumerate(prompts)]
    prefill(t, d, runs)
    speculate(t, d, runs, 60)
    for r, w in zip(runs, want, strict=False):
        assert r.out[:60] == w
        assert 0 < r.n_accepted < r.n_drafted, (r.n_accepted, r.n_drafted)
        assert all(len(x) == N_MAX for x in r.drafts)  # p_min 0: always n_max (the target had room)


def test_draft_mtp_state_moves_with_the_slot(mtp_model: Any, mtp_pair: tuple[Target, DraftMtp]) -> None:
    """A slot's target KV and MTP state, saved mid-generation and restored on another slot of fresh contexts,
    continue with the same drafts and the same tokens as the run that never moved; restoring the target
    alone (a blob without the drafter's state) still gives the same tokens: only the drafts may suffer."""
    t, d = mtp_pair
    prompt = t.tokenize(PROMPTS[0])
    whole = Run(0, prompt)
    prefill(t, d, [whole])
    speculate(t, d, [whole], 50)

    llama_cpp.llama_memory_seq_rm(t.mem, 0, -1, -1)
    part = Run(0, prompt)
    prefill(t, d, [part])
    speculate(t, d, [part], 20)
    n_steps = len(part.drafts)
    kv, spec = seq_state(t.ctx, 0), d.get_state(0)
    assert spec is not None and len(spec) > 4 * d.n_embd

    for with_drafter_state in (True, False):
        t2 = mtp_target(mtp_model)
        d2 = DraftMtp(t2.ctx, create_mtp_context(mtp_model, t2.ctx), 2, DraftParams(n_max=N_MAX))
        try:
            set_seq_state(t2.ctx, 1, kv)
            if with_drafter_state:
                d2.set_state(1, spec)
                assert d2.pending_pos[1] == d.pending_pos[0] == part.n_past - 1
                assert np.array_equal(d2.pending_h[1], d.pending_h[0])
                assert llama_cpp.llama_memory_seq_pos_max(d2.mem, 1) == part.n_past - 1
            moved = Run(1, prompt)
            moved.out, moved.drafts = list(part.out), list(part.drafts)
            speculate(t2, d2, [moved], 50, mirror=False)
            assert moved.out == whole.out
            if with_drafter_state:
                assert moved.drafts[n_steps:] == whole.drafts[n_steps : len(moved.drafts)]
        finally:
            d2.close()
            t2.close()
            llama_cpp.llama_free(t2.ctx)


def test_draft_mtp_refuses_a_state_of_another_shape(mtp_pair: tuple[Target, DraftMtp]) -> None:
    """Bytes that are not a ``draft-mtp`` state of this model are refused, and the slot's MTP state is empty."""
    t, d = mtp_pair
    run = Run(0, t.tokenize(PROMPTS[0]))
    prefill(t, d, [run])
    good = d.get_state(0)
    assert good is not None
    with pytest.raises(ValueError, match="draft-mtp state"):
        d.set_state(0, good[:-3])
    assert llama_cpp.llama_memory_seq_pos_max(d.mem, 0) == -1
    with pytest.raises(ValueError, match="draft-mtp state"):
        d.set_state(0, b"\x00" * len(good))


# -- draft-simple: SmolLM2 Q4_1 with its Q8_0 as the draft ------------------------------------------


@pytest.fixture(scope="module")
def smol_pair() -> Iterator[tuple[Target, DraftSimple, LoadedModel]]:
    target = LoadedModel(resolve_model("smollm2-135m")[0], n_ctx=2048, n_parallel=2, n_batch=512, n_threads=2)
    draft = load_draft_model(resolve_model("smollm2-135m-q8")[0], target)
    d = DraftSimple(target.model, draft, 2, DraftParams(n_max=N_MAX))
    t = Target(target.model, target.ctx)
    yield t, d, target
    d.close()
    t.close()
    target.close()


def test_draft_simple_q8_drafts_mostly_the_targets_greedy_tokens(
    smol_pair: tuple[Target, DraftSimple, LoadedModel],
) -> None:
    """The Q8_0 draft of SmolLM2 proposes tokens the Q4_1 target would choose itself: at least half of the
    drafted tokens are accepted (measured: all of them on the prompts here, on an AVX2 machine)."""
    t, d, _ = smol_pair
    runs = [Run(seq, t.tokenize(p)) for seq, p in enumerate(PROMPTS)]
    prefill(t, d, runs)
    speculate(t, d, runs, 40)
    for r in runs:
        assert r.n_drafted >= 20
        assert r.n_accepted >= r.n_drafted / 2, (r.n_accepted, r.n_drafted)
        llama_cpp.llama_memory_seq_rm(t.mem, r.seq, -1, -1)
        d.seq_rm(r.seq, -1, -1)


def test_draft_simple_state_moves_to_another_slot(smol_pair: tuple[Target, DraftSimple, LoadedModel]) -> None:
    """The draft context's sequence moves with the slot's KV: restored on another slot, the next draft is
    the one the original slot makes."""
    t, d, _ = smol_pair
    run = Run(0, t.tokenize(PROMPTS[1]))
    prefill(t, d, [run])
    speculate(t, d, [run], 10)
    sd = SlotDraft(0, N_MAX, run.n_past, run.out[-1], run.prompt + run.out[:-1])
    d.draft([sd])
    assert sd.result
    kv, dstate = seq_state(t.ctx, 0), d.get_state(0)
    assert dstate
    set_seq_state(t.ctx, 1, kv)
    d.set_state(1, dstate)
    moved = SlotDraft(1, N_MAX, run.n_past, run.out[-1], sd.tokens)
    d.draft([moved])
    assert moved.result == sd.result
    assert llama_cpp.llama_memory_seq_pos_max(d.mem, 1) == run.n_past - 1  # the drafted positions are gone
    for seq in (0, 1):
        llama_cpp.llama_memory_seq_rm(t.mem, seq, -1, -1)
        d.seq_rm(seq, -1, -1)


def test_draft_simple_p_min_and_n_min_cut_drafts(smol_pair: tuple[Target, DraftSimple, LoadedModel]) -> None:
    """``--spec-draft-p-min`` 1.0 stops at the first token (no top-10 probability reaches 1), so nothing is
    drafted; ``--spec-draft-n-min`` above ``n_max`` drops every draft."""
    t, d, _ = smol_pair
    run = Run(0, t.tokenize(PROMPTS[0]))
    prefill(t, d, [run])
    for params in (DraftParams(n_max=N_MAX, p_min=1.0), DraftParams(n_max=N_MAX, n_min=N_MAX + 1)):
        d.params = params
        sd = SlotDraft(0, N_MAX, run.n_past, run.out[-1], run.prompt)
        d.draft([sd])
        assert sd.result == []
    d.params = DraftParams(n_max=N_MAX)
    sd = SlotDraft(0, 2, run.n_past, run.out[-1], run.prompt)  # the slot's own cap (room left)
    d.draft([sd])
    assert len(sd.result) == 2
    llama_cpp.llama_memory_seq_rm(t.mem, 0, -1, -1)
    d.seq_rm(0, -1, -1)


def test_draft_simple_refuses_a_draft_with_another_bos(smol_pair: tuple[Target, DraftSimple, LoadedModel]) -> None:
    """The vocabularies must match as llama.cpp's ``common_speculative_are_compatible`` requires: a draft
    that adds BOS where the target does not is refused, naming why; the Q8_0 draft and ``tiny-mtp``'s copied
    tokenizer pass."""
    _, _, target = smol_pair
    q8 = resolve_model("smollm2-135m-q8")[0]
    odd = LoadedModel(
        q8,
        n_ctx=256,
        n_parallel=2,
        n_batch=64,
        n_threads=1,
        options=LlamaOptions(kv_overrides=(("tokenizer.ggml.add_bos_token", "bool", not target.add_bos),)),
    )
    try:
        assert "bos token" in (vocab_problem(target.model, odd.model) or "")
        with pytest.raises(ValueError, match="draft-simple: the draft model's bos token"):
            DraftSimple(target.model, odd, 2)
    finally:
        odd.close()
    mparams = llama_cpp.llama_model_default_params()
    mparams.vocab_only = True
    tiny = llama_cpp.llama_model_load_from_file(str(resolve_model("tiny-mtp")[0]).encode(), mparams)
    try:
        assert vocab_problem(target.model, tiny) is None
    finally:
        llama_cpp.llama_model_free(tiny)


# -- the types the bindings cannot serve ----------------------------------------------------------


def test_eagle3_dflash_dspark_refusals_name_the_missing_bindings() -> None:
    """The three types need llama.cpp's layer-input extraction, which the bindings lack (this fails, and the
    types can be built, once llama-cpp-python binds it); each refusal says so."""
    from llama_cpp import llama_cpp_ext

    for name in ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_model_target_layer_ids"):
        assert not hasattr(llama_cpp, name) and not hasattr(llama_cpp_ext, name)
    assert hasattr(llama_cpp_ext, "llama_get_embeddings_nextn_ith")  # what draft-mtp uses is bound
    assert set(reasons.UNSUPPORTED) == {"draft-eagle3", "draft-dflash", "draft-dspark"}
    for name, text in reasons.UNSUPPORTED.items():
        assert text.startswith(f"--spec-type {name} is not supported: ")
        assert "llama_set_embeddings_layer_inp" in text and "llama_model_target_layer_ids" in text


def test_draft_mtp_pairs_each_token_with_the_previous_hidden_state(
    mtp_model: Any, mtp_pair: tuple[Target, DraftMtp]
) -> None:
    """The MTP context's entry at position ``p`` is ``(x_p, h_{p-1})`` with the target's final-norm hidden
    state of the token before (zeros before the first), and a draft starts from ``(id_last, h_{n_past-1})``
    (``common_speculative_impl_draft_mtp``): the drafter's first draft logits equal those of a fresh MTP
    context fed exactly that by hand."""
    from llama_cpp import llama_cpp_ext

    from hydra_trio.engine.speculative.drafting import DraftBatch

    t, d = mtp_pair
    prompt = t.tokenize(PROMPTS[1])
    run = Run(0, prompt)
    prefill(t, d, [run])
    h = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(t.ctx), shape=(len(prompt), d.n_embd)).copy()
    d.params = DraftParams(n_max=1)
    sd = SlotDraft(0, 1, run.n_past, run.out[-1], prompt)
    d.draft([sd])
    got = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(d.ctx_dft, 0), shape=(t.n_vocab,)).copy()
    d.params = DraftParams(n_max=N_MAX)

    ref = create_mtp_context(mtp_model, t.ctx)
    llama_cpp_ext.llama_set_embeddings_nextn(ref, True, True)
    b = DraftBatch(ref)
    try:
        for p, tok in enumerate(prompt):
            b.add(tok, p, 0, False, h[p - 1] if p else np.zeros(d.n_embd, np.float32))
        assert b.decode() == 0
        b.clear()
        b.add(run.out[-1], run.n_past, 0, True, h[-1])
        assert b.decode() == 0
        want = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ref, 0), shape=(t.n_vocab,))
        assert sd.result == [int(want.argmax())]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    finally:
        b.close()
        llama_cpp.llama_free(ref)
