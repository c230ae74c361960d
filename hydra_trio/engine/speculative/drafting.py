"""What the model-based drafters share: their parameters, a batch for their own context, greedy draft picks,
and a slot's sequence state in their context.

After ``common/speculative.cpp`` and ``common/common.cpp`` (``common_batch``) of the llama.cpp that
llama-cpp-python 0.3.36 vendors.  Engine thread only.
"""

from __future__ import annotations

import ctypes
from typing import Any

import attrs
import llama_cpp
import numpy as np

DRAFT_TOP_K = 10
"""llama.cpp's draft sampler: top-k 10, then the most probable token (``common_speculative_impl_draft_*``)."""


@attrs.frozen
class DraftParams:
    """The draft limits shared by ``draft-simple`` and ``draft-mtp`` (llama.cpp's
    ``common_params_speculative_draft``, defaults from ``common/common.h``).

    Attributes:
        n_max: the most tokens one draft proposes (``--spec-draft-n-max``, 3).
        n_min: a shorter draft is dropped (``--spec-draft-n-min``, 0).
        p_min: drafting stops at a token whose probability among the top :data:`DRAFT_TOP_K` is below this
            (``--spec-draft-p-min``, 0.0: never).
    """

    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0


class DraftBatch:
    """A ``llama_batch_ext`` for a drafter's own context (llama.cpp's ``common_batch``): entries carry a token
    and, for an MTP context, the hidden-state row that goes with it.

    Args:
        ctx: the context the batch is for (its ``n_batch`` bounds the entries).

    Raises:
        RuntimeError: llama.cpp refused to make the batch.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self._ptr = llama_cpp.llama_batch_ext_init(ctx)
        if not self._ptr:
            raise RuntimeError("llama_batch_ext_init failed")
        self._pos = (llama_cpp.llama_pos * 4)()
        self.size = 0

    def clear(self) -> None:
        llama_cpp.llama_batch_ext_clear(self._ptr)
        self.size = 0

    def add(self, token: int, pos: int, seq: int, output: bool, embd: np.ndarray | None = None) -> int:
        """Append ``token`` at position ``pos`` of sequence ``seq``; ``embd`` (float32, contiguous, one row of
        the context's input width) is copied into the batch.  Returns the entry's index.

        Raises RuntimeError when llama.cpp refuses the entry (batch full, bad sequence id or row width).
        """
        idx = llama_cpp.llama_batch_ext_add_token(self._ptr, seq, token)
        if idx < 0:
            raise RuntimeError(f"llama_batch_ext_add_token(seq {seq}, token {token}) failed ({idx})")
        self._pos[0] = pos
        llama_cpp.llama_batch_ext_set_pos(self._ptr, idx, self._pos)
        if embd is not None:
            view = llama_cpp.llama_embd(embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, embd.shape[-1])
            if not llama_cpp.llama_batch_ext_set_embd_token(self._ptr, idx, view):
                raise RuntimeError(f"llama_batch_ext_set_embd_token: a row of {embd.shape[-1]} floats was refused")
        if output:
            llama_cpp.llama_batch_ext_set_output_logits(self._ptr, idx, True)
        self.size += 1
        return idx

    def add_embd(self, embd: np.ndarray, pos: np.ndarray, seq: int) -> int:
        """Append an embeddings entry (no token; ``embd`` float32, one row of the context's input width) at
        ``pos`` (one position, or 4 with M-RoPE) of sequence ``seq``, no output (llama.cpp's
        ``common_batch::add_embd``).  Returns the entry's index.

        Raises RuntimeError when llama.cpp refuses it (batch full, bad sequence id or row width)."""
        row = np.ascontiguousarray(embd, dtype=np.float32)
        view = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[-1])
        idx = llama_cpp.llama_batch_ext_add_embd(self._ptr, seq, view)
        if idx < 0:
            raise RuntimeError(f"llama_batch_ext_add_embd(seq {seq}, a row of {row.shape[-1]} floats) failed ({idx})")
        for j, p in enumerate(pos[:4]):
            self._pos[j] = int(p)
        llama_cpp.llama_batch_ext_set_pos(self._ptr, idx, self._pos)
        self.size += 1
        return idx

    def decode(self) -> int:
        """``llama_process`` (decode) of the entries; llama_decode's return codes (0: done)."""
        return int(llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._ptr))

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_batch_ext_free(self._ptr)
            self._ptr = None


def n_pos_per_embd(model: Any) -> int:
    """Positions an embeddings entry of ``model`` carries: 4 with M-RoPE (``MROPE``, ``IMROPE``), else 1
    (llama.cpp's ``llama_hparams::n_pos_per_embd``)."""
    mrope = (llama_cpp.LLAMA_ROPE_TYPE_MROPE, llama_cpp.LLAMA_ROPE_TYPE_IMROPE)
    return 4 if llama_cpp.llama_model_rope_type(model) in mrope else 1


def pick_greedy(ctx: Any, idx: int, n_vocab: int) -> tuple[int, float]:
    """The draft token at output ``idx`` of ``ctx``'s last decode and its probability, as llama.cpp's draft
    sampler gives them: the :data:`DRAFT_TOP_K` highest logits, softmax over those, the most probable one."""
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
    top = np.argpartition(logits, -DRAFT_TOP_K)[-DRAFT_TOP_K:]
    vals = logits[top].astype(np.float64)
    best = int(vals.argmax())
    return int(top[best]), float(1.0 / np.exp(vals - vals[best]).sum())


def seq_state(ctx: Any, seq: int) -> bytes:
    """Sequence ``seq`` of ``ctx``'s memory as ``llama_state_seq_get_data`` writes it."""
    size = llama_cpp.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq)
    return bytes(buf[:written])


def set_seq_state(ctx: Any, seq: int, data: bytes) -> None:
    """Replace sequence ``seq`` of ``ctx``'s memory with ``data`` (from :func:`seq_state`).

    Raises ValueError when llama.cpp refuses it (the sequence is left empty then).
    """
    mem = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    if not data:
        return
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    if llama_cpp.llama_state_seq_set_data(ctx, buf, len(data), seq) != len(data):
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
        raise ValueError(f"the drafter's state for sequence {seq} does not fit its context")


def sync_seq(mem: Any, seq: int, pos: int, jump: bool = False) -> None:
    """Make sequence ``seq`` of a drafter's memory end just before ``pos``, ready for entries from ``pos`` on:
    cells at ``pos`` and later go (a rolled-back draft, a cut prompt); when cells before ``pos`` are missing
    (the drafter did not see some of the target's batches) the sequence is emptied, as llama.cpp accepts
    any first position in an empty sequence and only the next one in a non-empty one.  ``jump``: the
    target's positions jumped forward since the sequence's last cell (media the drafter took, or skipped, on
    an M-RoPE model, whose memory accepts any later position, as llama.cpp's batch check lets M-RoPE
    positions jump): the sequence stays."""
    llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)
    last = llama_cpp.llama_memory_seq_pos_max(mem, seq)
    if last >= 0 and last != pos - 1 and not (jump and last < pos):
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
