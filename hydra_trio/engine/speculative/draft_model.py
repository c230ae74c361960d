"""``draft-simple``: a smaller model of the same vocabulary drafts greedily in a context of its own.

As llama.cpp's ``common_speculative_impl_draft_simple`` (``common/speculative.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors), loaded as llama-server loads ``--model-draft`` / ``-md``
(``common_speculative_init_from_params``): the draft context holds as many tokens and sequences as the
target's, with the draft's own KV cache types (``-ctkd`` / ``-ctvd``, f16 by default), placement
(``-ngld``, ``-devd``, ``-otd``) and threads (``-td`` / ``-tbd``, by default the target's).  This
llama.cpp has no separate draft context size: the draft's ``n_ctx`` is the target's.

- :meth:`DraftSimple.process` decodes every batch the target decodes in the draft context too (only the
  last entry asks for logits), so the draft's KV cache follows the target's;
- :meth:`DraftSimple.process_media` decodes the embeddings of each media chunk the target decodes, at their
  positions (rows of zeros when the draft's input width is not the projector's), as llama-server hands them to
  its drafters;
- :meth:`DraftSimple.draft` decodes ``id_last`` at ``pos0`` and then each drafted token, taking the most
  probable of the top 10 while its probability is at least ``p_min``, up to ``n_max`` tokens; drafts
  shorter than ``n_min`` are dropped; the drafted positions are removed from the draft context again
  (llama-server removes them before the verification batch, which :meth:`process` then feeds in).

The slot's draft KV moves with the slot (:meth:`DraftSimple.get_state`, as llama-server's prompt cache
keeps ``ctx_dft``'s sequence beside the target's).  Engine thread only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from ..llama.model import LoadedModel
from ..settings import LlamaOptions
from .base import Drafter, SlotDraft
from .drafting import DraftBatch, DraftParams, n_pos_per_embd, pick_greedy, seq_state, set_seq_state, sync_seq

log = logging.getLogger("hydra_trio.engine")

VOCAB_MAX_SIZE_DIFFERENCE = 128
"""Vocabularies of draft and target may differ in size by this many tokens (``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``)."""
VOCAB_CHECK_START_TOKEN_ID = 5
"""Token texts are compared from this id on (``SPEC_VOCAB_CHECK_START_TOKEN_ID``)."""


def vocab_problem(model_tgt: Any, model_dft: Any) -> str | None:
    """Why ``model_dft`` cannot draft for ``model_tgt`` (None: it can), by llama.cpp's
    ``common_speculative_are_compatible``: the same vocabulary type, the same BOS and EOS use and ids,
    sizes within :data:`VOCAB_MAX_SIZE_DIFFERENCE`, the same token texts from
    :data:`VOCAB_CHECK_START_TOKEN_ID` on."""
    v_tgt, v_dft = llama_cpp.llama_model_get_vocab(model_tgt), llama_cpp.llama_model_get_vocab(model_dft)
    t_tgt, t_dft = llama_cpp.llama_vocab_type(v_tgt), llama_cpp.llama_vocab_type(v_dft)
    if t_tgt != t_dft:
        return f"the draft model's vocabulary type ({t_dft}) differs from the target's ({t_tgt})"
    for what, add, tok in (
        ("bos", llama_cpp.llama_vocab_get_add_bos, llama_cpp.llama_vocab_bos),
        ("eos", llama_cpp.llama_vocab_get_add_eos, llama_cpp.llama_vocab_eos),
    ):
        if add(v_tgt) != add(v_dft) or (add(v_tgt) and tok(v_tgt) != tok(v_dft)):
            return (
                f"the draft model's {what} token (add {bool(add(v_dft))}, id {tok(v_dft)}) differs from the "
                f"target's (add {bool(add(v_tgt))}, id {tok(v_tgt)})"
            )
    n_tgt, n_dft = llama_cpp.llama_vocab_n_tokens(v_tgt), llama_cpp.llama_vocab_n_tokens(v_dft)
    if abs(n_tgt - n_dft) > VOCAB_MAX_SIZE_DIFFERENCE:
        return (
            f"the draft model's vocabulary ({n_dft} tokens) differs from the target's ({n_tgt}) by more "
            f"than {VOCAB_MAX_SIZE_DIFFERENCE} tokens"
        )
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(n_tgt, n_dft)):
        if llama_cpp.llama_vocab_get_text(v_tgt, i) != llama_cpp.llama_vocab_get_text(v_dft, i):
            return f"token {i} differs between the draft model and the target"
    return None


def load_draft_model(
    path: Path, target: LoadedModel, options: LlamaOptions | None = None, n_threads: int | None = None
) -> LoadedModel:
    """Load ``--model-draft`` for ``target``: a context of the target's ``n_ctx``, slots and batch size;
    ``options`` carries the draft's flags (``-ctkd``/``-ctvd`` as ``cache_type_k``/``cache_type_v``,
    ``-ngld``, ``-devd``, ``-otd`` as the placement fields, ``-tbd`` as ``n_threads_batch``), ``n_threads``
    is ``-td`` (None: the target's).

    Raises ModelLoadError as :class:`~hydra_trio.engine.llama.model.LoadedModel` does.
    """
    return LoadedModel(
        path,
        n_ctx=target.n_ctx,
        n_parallel=target.n_parallel,
        n_batch=target.n_batch,
        n_threads=n_threads or llama_cpp.llama_n_threads(target.ctx),
        options=options,
    )


class DraftSimple(Drafter):
    """``draft-simple`` for the ``n_seq`` slots of ``model_tgt``'s context, with ``draft`` (from
    :func:`load_draft_model`; owned and closed by this drafter).

    Raises:
        ValueError: the vocabularies are not compatible (:func:`vocab_problem`'s reason), the draft context
            has another number of sequences, or the draft model's memory is recurrent or hybrid (its
            drafted tokens could not be removed again without checkpoints, which this drafter does not keep).
    """

    name = "draft-simple"

    def __init__(self, model_tgt: Any, draft: LoadedModel, n_seq: int, params: DraftParams = DraftParams()) -> None:
        super().__init__(n_seq, params.n_max)
        problem = vocab_problem(model_tgt, draft.model)
        if problem is not None:
            raise ValueError(f"draft-simple: {problem}")
        if llama_cpp.llama_n_seq_max(draft.ctx) != n_seq:
            raise ValueError(
                f"draft-simple: the draft context has {llama_cpp.llama_n_seq_max(draft.ctx)} sequences, not {n_seq}"
            )
        if llama_cpp.llama_model_is_recurrent(draft.model) or llama_cpp.llama_model_is_hybrid(draft.model):
            raise ValueError("draft-simple: a draft model with recurrent memory is not served")
        self.params = params
        self.draft_model = draft
        self.ctx = draft.ctx
        self.mem = llama_cpp.llama_get_memory(draft.ctx)
        self.n_vocab = draft.n_vocab
        self.batch = DraftBatch(draft.ctx)
        self.n_batch = draft.n_batch
        self.n_pos = n_pos_per_embd(draft.model)
        self.n_embd_inp = llama_cpp.llama_model_n_embd_inp(draft.model)
        self.after_media = [False] * n_seq
        """Per slot: its last entries were media on an M-RoPE draft (the next text may jump forward)."""
        self._zeros_warned = False

    def process(self, batch: Any) -> bool:
        n = batch.n_tokens
        if n <= 0 or not batch.token:
            return True
        self.batch.clear()
        seen: set[int] = set()
        for k in range(n):
            seq, pos = batch.seq_id[k][0], batch.pos[k]
            if seq not in seen:
                seen.add(seq)
                sync_seq(self.mem, seq, pos, self.after_media[seq])
                self.after_media[seq] = False
            self.batch.add(batch.token[k], pos, seq, k == n - 1)
        return self.batch.decode() == 0

    def process_media(self, id_slot: int, embd: Any, pos: Any) -> None:
        """As llama.cpp's ``draft-simple``: the draft decodes the target's media rows at their positions when
        its input width is theirs, else rows of zeros (its positions stay those of the target; a warning
        once); a draft whose position layout (M-RoPE or not) differs from the target's takes nothing (its
        sequence restarts at the next text, :func:`sync_seq`)."""
        if pos.shape[0] != self.n_pos:
            return
        rows = embd
        if embd.shape[1] != self.n_embd_inp:
            if not self._zeros_warned:
                log.warning(
                    "draft-simple: media embeddings of width %d do not fit the draft's input width %d; the draft "
                    "reads rows of zeros for them and drafts after media will be poor",
                    embd.shape[1],
                    self.n_embd_inp,
                )
                self._zeros_warned = True
            rows = np.zeros((embd.shape[0], self.n_embd_inp), np.float32)
        if not self.after_media[id_slot]:  # else a piece of the same chunk, or the next one: M-RoPE positions repeat
            sync_seq(self.mem, id_slot, int(pos[0].min()))
        try:
            for start in range(0, len(rows), self.n_batch):
                self.batch.clear()
                for i in range(start, min(start + self.n_batch, len(rows))):
                    self.batch.add_embd(rows[i], pos[:, i], id_slot)
                if self.batch.decode() != 0:
                    raise RuntimeError("the draft context did not decode the media rows")
        except RuntimeError as exc:  # the slot's draft sequence restarts at its next text
            log.warning("draft-simple: slot %d: %s", id_slot, exc)
            llama_cpp.llama_memory_seq_rm(self.mem, id_slot, -1, -1)
            self.after_media[id_slot] = False
            return
        self.after_media[id_slot] = self.n_pos > 1

    def draft(self, drafts: list[SlotDraft]) -> None:
        active: dict[int, tuple[SlotDraft, int]] = {}
        self.batch.clear()
        for r in drafts:
            r.result.clear()
            if min(r.n_max, self.params.n_max) <= 0:
                continue
            sync_seq(self.mem, r.id_slot, r.pos0, self.after_media[r.id_slot])
            active[r.id_slot] = (r, self.batch.add(r.id_last, r.pos0, r.id_slot, True))
        try:
            while active and self.batch.decode() == 0:
                picks = []
                for seq, (r, idx) in active.items():
                    token, p = pick_greedy(self.ctx, idx, self.n_vocab)
                    if p < self.params.p_min:
                        continue
                    r.result.append(token)
                    if len(r.result) < min(r.n_max, self.params.n_max):
                        picks.append((seq, r, token))
                self.batch.clear()
                active = {seq: (r, self.batch.add(token, r.pos0 + len(r.result), seq, True)) for seq, r, token in picks}
        finally:
            for r in drafts:  # the draft context as before: process() feeds the verification batch in
                llama_cpp.llama_memory_seq_rm(self.mem, r.id_slot, r.pos0, -1)
                if len(r.result) < self.params.n_min:
                    r.result.clear()

    def seq_rm(self, id_slot: int, p0: int, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, id_slot, p0, p1)

    def seq_add(self, id_slot: int, p0: int, p1: int, delta: int) -> None:
        llama_cpp.llama_memory_seq_add(self.mem, id_slot, p0, p1, delta)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def get_state(self, id_slot: int) -> bytes | None:
        """The slot's sequence in the draft context (``llama_state_seq_get_data``)."""
        return seq_state(self.ctx, id_slot)

    def set_state(self, id_slot: int, data: bytes) -> None:
        """Restore :meth:`get_state`'s bytes; raises ValueError when the draft context refuses them."""
        set_seq_state(self.ctx, id_slot, data)

    def close(self) -> None:
        self.batch.close()
        self.draft_model.close()
