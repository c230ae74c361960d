"""``draft-mtp``: drafts from the target model's own next-token-prediction (MTP, NextN) layer.

As llama.cpp's ``common_speculative_impl_draft_mtp`` (``common/speculative.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors), for models with one MTP block (``qwen35``, ``qwen35moe``: the
cluster's Qwen3.6-35B-A3B).  A second context on the *target's* model, of type
``LLAMA_CONTEXT_TYPE_MTP``, runs only that block; its KV cache holds the block's one attention layer for
every slot.  Its entry at position ``p`` pairs token ``x_p`` with ``h_{p-1}``, the target's final-norm hidden
state of the token before (``llama_get_embeddings_nextn`` of the target's batch), and its logits there
predict ``x_{p+1}``.  So:

- :meth:`DraftMtp.process` follows every batch the target decodes: each token goes into the MTP context
  with the target's hidden state of the token before it (the first token of a slot's run with the one kept
  from the slot's previous batch, ``pending_h``); the target's rows of this batch are kept
  (``verify_h``);
- :meth:`DraftMtp.draft` decodes ``(id_last, pending_h)`` at ``pos0``, takes the greedy token, and goes on
  with the drafted token paired with the MTP block's own hidden state, up to ``n_max`` tokens (or until a
  token's probability is below ``p_min``); the drafted positions are removed again from the MTP context,
  as llama-server removes them before the verification batch, which :meth:`process` then feeds in;
- :meth:`DraftMtp.process_media` takes nothing (media rows have no hidden state to pair, llama.cpp skips them
  too); on an M-RoPE model the slot's MTP sequence goes on after the media, whose positions jump;
- :meth:`DraftMtp.accept` keeps, as ``pending_h``, the target's row of the last accepted token.

Per-slot state moves with the slot (:meth:`DraftMtp.get_state`): the MTP context's sequence and
``pending_h``.  It cannot be rebuilt on arrival without decoding the prompt through the target again,
since every MTP cell needs the target's hidden state at its position.  A slot whose state did not come
along still drafts correctly, only worse: the MTP sequence restarts empty at the next batch.

The target needs ``load_mtp`` (:func:`target_model_params`: the MTP block's weights are skipped otherwise)
and, when its memory is recurrent or hybrid, ``n_rs_seq`` >= ``n_max`` (:func:`target_context_params`: the
recurrent state keeps that many per-token copies so that rejected drafts can be removed with
``llama_memory_seq_rm``; llama-server sets it the same way).  Engine thread only.
"""

from __future__ import annotations

import struct
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from ..settings import LlamaOptions
from .base import Drafter, SlotDraft
from .drafting import DraftBatch, DraftParams, n_pos_per_embd, pick_greedy, seq_state, set_seq_state, sync_seq

_STATE_MAGIC = b"HTMTP\x01"
_STATE_HEAD = struct.Struct("<6siiQ")  # magic, n_embd, pending_pos, length of the MTP context's sequence state


def target_model_params(mparams: Any) -> None:
    """Set what the target model needs for ``draft-mtp`` in its ``llama_model_params``: ``load_mtp``."""
    mparams.load_mtp = True


def target_context_params(cparams: Any, params: DraftParams) -> None:
    """Set what the target context needs for ``draft-mtp`` in its ``llama_context_params``: ``n_rs_seq`` =
    ``n_max`` (recurrent-state copies for rolling back rejected drafts; llama-server's
    ``need_n_rs_seq``)."""
    cparams.n_rs_seq = max(cparams.n_rs_seq, params.n_max)


def create_mtp_context(model: Any, ctx_tgt: Any, options: LlamaOptions | None = None) -> Any:
    """A ``LLAMA_CONTEXT_TYPE_MTP`` context on the target's ``model`` beside ``ctx_tgt``: as many tokens and
    sequences as the target context, its batch sizes and threads, one output per sequence; KV cache types,
    flash attention and RoPE from ``options`` (the draft's ``-ctkd``/``-ctvd`` over the target's flags).

    Raises:
        ValueError: the model has no MTP layer loaded (``nextn_predict_layers`` 0, or loaded without
            ``load_mtp``).
        RuntimeError: llama.cpp could not create the context.
    """
    from ..llama.model import apply_context_options

    if llama_cpp.llama_model_n_layer_nextn(model) < 1:
        raise ValueError("draft-mtp needs a model with MTP layers (GGUF key nextn_predict_layers)")
    cparams = llama_cpp.llama_context_default_params()
    if options is not None:
        apply_context_options(cparams, options)
        cparams.kv_unified = options.kv_unified
    cparams.embeddings = False
    cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    cparams.n_ctx = llama_cpp.llama_n_ctx(ctx_tgt)
    cparams.n_batch = llama_cpp.llama_n_batch(ctx_tgt)
    cparams.n_ubatch = llama_cpp.llama_n_ubatch(ctx_tgt)
    cparams.n_seq_max = llama_cpp.llama_n_seq_max(ctx_tgt)
    cparams.n_outputs_max = cparams.n_seq_max
    cparams.n_outputs_max_per_seq = 1
    cparams.n_rs_seq = 0
    cparams.n_threads = llama_cpp.llama_n_threads(ctx_tgt)
    cparams.n_threads_batch = llama_cpp.llama_n_threads_batch(ctx_tgt)
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create the MTP context")
    return ctx


class DraftMtp(Drafter):
    """``draft-mtp`` for ``n_seq`` slots of ``ctx_tgt``, drafting through ``ctx_dft`` (from
    :func:`create_mtp_context`, owned and freed by this drafter).

    Raises:
        ValueError: the model has more than one MTP block (chained heads are not implemented), or the MTP
            context shares the target's memory (a Gemma 4 assistant: not implemented).
    """

    name = "draft-mtp"

    def __init__(self, ctx_tgt: Any, ctx_dft: Any, n_seq: int, params: DraftParams = DraftParams()) -> None:
        super().__init__(n_seq, params.n_max)
        model = llama_cpp.llama_get_model(ctx_dft)
        if llama_cpp.llama_model_n_layer_nextn(model) != 1:
            raise ValueError(
                f"draft-mtp: {llama_cpp.llama_model_n_layer_nextn(model)} MTP blocks; only models with one are served"
            )
        if llama_cpp_ext.llama_get_ctx_other(ctx_dft) == ctx_tgt:
            raise ValueError("draft-mtp: an MTP context that shares the target's memory is not served")
        self.params = params
        self.ctx_tgt, self.ctx_dft = ctx_tgt, ctx_dft
        self.mem = llama_cpp.llama_get_memory(ctx_dft)
        self.n_embd = llama_cpp.llama_model_n_embd_out(model)
        if self.n_embd != llama_cpp.llama_model_n_embd_out(llama_cpp.llama_get_model(ctx_tgt)):
            raise ValueError("draft-mtp: the MTP input width differs from the target's hidden state")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        llama_cpp_ext.llama_set_embeddings_nextn(ctx_tgt, True, False)  # every token's row, by batch index
        llama_cpp_ext.llama_set_embeddings_nextn(ctx_dft, True, True)  # the output rows only
        self.batch = DraftBatch(ctx_dft)
        zeros = np.zeros(self.n_embd, dtype=np.float32)
        self.pending_h = [zeros.copy() for _ in range(n_seq)]
        """Per slot: the target's hidden state of the slot's last decoded token (at ``pending_pos``)."""
        self.pending_pos = [-1] * n_seq
        self.verify_h: list[np.ndarray] = [np.zeros((0, self.n_embd), np.float32) for _ in range(n_seq)]
        """Per slot: the target's rows of the slot's entries in the last batch (row 0: the sampled token)."""
        self.verify_pos = [-1] * n_seq
        self.mrope = n_pos_per_embd(model) > 1
        self.after_media = [False] * n_seq
        """Per slot: media came after its last entries (skipped here, as llama.cpp's ``draft-mtp`` skips them)."""

    def _sync(self, seq: int, pos: int) -> None:
        """:func:`sync_seq` for entries from ``pos`` on: across skipped media an M-RoPE sequence goes on."""
        sync_seq(self.mem, seq, pos, self.after_media[seq] and self.mrope)

    def _h_before(self, seq: int, pos: int) -> np.ndarray:
        """The target's hidden state at ``pos - 1`` when it is the one kept, else zeros (a slot restarted).
        After skipped media, the one kept before it when the sequence still ends there (llama.cpp pairs the
        first token after media with the row it kept, the last one before it)."""
        kept = self.pending_pos[seq]
        if kept == pos - 1 or (
            self.after_media[seq] and kept >= 0 and kept == llama_cpp.llama_memory_seq_pos_max(self.mem, seq)
        ):
            return self.pending_h[seq]
        return np.zeros(self.n_embd, np.float32)

    def process_media(self, id_slot: int, embd: Any, pos: Any) -> None:
        """Nothing is decoded: the MTP block pairs tokens with the target's hidden states, which media rows
        have none of (llama.cpp's ``draft-mtp`` skips embeddings batches too).  With M-RoPE the slot's
        sequence goes on after the media (its positions jump there), else it restarts."""
        self.after_media[id_slot] = True

    def process(self, batch: Any) -> bool:
        n = batch.n_tokens
        if n <= 0 or not batch.token:
            return True  # embeddings input: nothing to pair (llama.cpp skips it too)
        ptr = llama_cpp_ext.llama_get_embeddings_nextn(self.ctx_tgt)
        if not ptr:
            return False
        h_tgt = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd))
        rows: dict[int, list[int]] = {}
        pos0: dict[int, int] = {}
        self.batch.clear()
        for k in range(n):
            seq, pos = batch.seq_id[k][0], batch.pos[k]
            mine = rows.setdefault(seq, [])
            if not mine:
                pos0[seq] = pos
                self._sync(seq, pos)
                h = self._h_before(seq, pos)
                self.after_media[seq] = False
            else:
                h = h_tgt[mine[-1]]
            mine.append(k)
            self.batch.add(batch.token[k], pos, seq, False, h)
        if self.batch.decode() != 0:
            return False
        for seq, idx in rows.items():
            self.verify_h[seq] = h_tgt[idx].copy()
            self.verify_pos[seq] = pos0[seq]
            self.pending_h[seq] = self.verify_h[seq][-1]
            self.pending_pos[seq] = pos0[seq] + len(idx) - 1
        return True

    def draft(self, drafts: list[SlotDraft]) -> None:
        active: dict[int, tuple[SlotDraft, int]] = {}  # slot -> (its draft, its entry in the batch)
        self.batch.clear()
        for r in drafts:
            r.result.clear()
            if min(r.n_max, self.params.n_max) <= 0:
                continue
            self._sync(r.id_slot, r.pos0)
            active[r.id_slot] = (
                r,
                self.batch.add(r.id_last, r.pos0, r.id_slot, True, self._h_before(r.id_slot, r.pos0)),
            )
        try:
            while active and self.batch.decode() == 0:
                step: dict[int, tuple[SlotDraft, int]] = {}
                picks = []
                for seq, (r, idx) in active.items():
                    token, p = pick_greedy(self.ctx_dft, idx, self.n_vocab)
                    if p < self.params.p_min:
                        continue
                    r.result.append(token)
                    if len(r.result) >= min(r.n_max, self.params.n_max):
                        continue
                    h = np.ctypeslib.as_array(
                        llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ctx_dft, idx), shape=(self.n_embd,)
                    ).copy()
                    picks.append((seq, r, token, h))
                self.batch.clear()
                for seq, r, token, h in picks:
                    step[seq] = (r, self.batch.add(token, r.pos0 + len(r.result), seq, True, h))
                active = step
        finally:
            for r in drafts:  # the MTP context as before: process() feeds the verification batch in
                llama_cpp.llama_memory_seq_rm(self.mem, r.id_slot, r.pos0, -1)
                if len(r.result) < self.params.n_min:
                    r.result.clear()

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        rows = self.verify_h[id_slot]
        if len(rows) == 0:
            return
        i = min(n_accepted, len(rows) - 1)
        self.pending_h[id_slot] = rows[i]
        self.pending_pos[id_slot] = self.verify_pos[id_slot] + i

    def seq_rm(self, id_slot: int, p0: int, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, id_slot, p0, p1)

    def seq_add(self, id_slot: int, p0: int, p1: int, delta: int) -> None:
        llama_cpp.llama_memory_seq_add(self.mem, id_slot, p0, p1, delta)
        if p0 <= self.pending_pos[id_slot] and (p1 < 0 or self.pending_pos[id_slot] < p1):
            self.pending_pos[id_slot] += delta

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        if self.pending_pos[src] >= 0 and (p1 < 0 or self.pending_pos[src] == p1 - 1):
            self.pending_h[dst] = self.pending_h[src].copy()
            self.pending_pos[dst] = self.pending_pos[src]

    def get_state(self, id_slot: int) -> bytes | None:
        """The slot's MTP state: ``pending_h`` and the MTP context's sequence (``llama_state_seq_get_data``),
        behind a header naming the hidden-state width."""
        kv = seq_state(self.ctx_dft, id_slot)
        head = _STATE_HEAD.pack(_STATE_MAGIC, self.n_embd, self.pending_pos[id_slot], len(kv))
        return head + self.pending_h[id_slot].astype(np.float32).tobytes() + kv

    def set_state(self, id_slot: int, data: bytes) -> None:
        """Restore :meth:`get_state`'s bytes on ``id_slot``.  Raises ValueError for bytes that are not such a
        state, or are of a model with another hidden-state width (the slot's MTP state is then empty)."""
        self.pending_pos[id_slot] = -1
        self.verify_h[id_slot] = np.zeros((0, self.n_embd), np.float32)
        if len(data) < _STATE_HEAD.size:
            raise ValueError("draft-mtp state: too short")
        magic, n_embd, pending_pos, n_kv = _STATE_HEAD.unpack_from(data)
        n_h = 4 * n_embd
        if magic != _STATE_MAGIC or n_embd != self.n_embd or len(data) != _STATE_HEAD.size + n_h + n_kv:
            set_seq_state(self.ctx_dft, id_slot, b"")
            raise ValueError(f"draft-mtp state: not a state of this model (n_embd {n_embd}, {len(data)} bytes)")
        set_seq_state(self.ctx_dft, id_slot, data[_STATE_HEAD.size + n_h :])
        self.pending_h[id_slot] = np.frombuffer(data, np.float32, n_embd, _STATE_HEAD.size).copy()
        self.pending_pos[id_slot] = pending_pos

    def close(self) -> None:
        self.batch.close()
        if self.ctx_dft:
            llama_cpp.llama_free(self.ctx_dft)
            self.ctx_dft = None
