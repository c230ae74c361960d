"""Context checkpoints: copies of the part of a slot's memory that cannot be cut back (engine thread only).

A recurrent model's state (Mamba, RWKV, LFM2's short convolutions, the
recurrent layers of a hybrid) holds no per-token history: a new prompt that
shares only part of a slot's cached tokens cannot keep that part with a
partial ``llama_memory_seq_rm`` (it returns false, ``src/llama-memory-recurrent.cpp``).
The sliding-window layers of an SWA model without ``--swa-full`` have dropped
the cells before their window in the same way.  Without checkpoints the slot
evaluates its whole prompt again.

Borrowed from llama-server (``tools/server/server-context.cpp``: ``create_checkpoint``,
the placement in ``update_slots``, the restore when a slot starts a prompt;
``--ctx-checkpoints`` / ``--checkpoint-min-step`` in ``common/arg.cpp``):

* **What**: ``llama_state_seq_get_data_ext(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)``
  of the slot's sequence, the recurrent or SWA part only (a hybrid's attention
  KV cache can be cut back and is not copied), with the memory's
  ``pos_min``/``pos_max`` for the slot and the number of tokens it covers.
* **Where**: while a prompt is fed, its last chunks are cut so that one ends
  ``min(n_batch, 4 + n_ubatch)`` and one ``4`` tokens before the prompt's end
  (here both are the engine's tokens per step, so ``n_batch`` and ``4``),
  and a checkpoint is taken before each
  chunk that ends within ``n_ubatch`` of the prompt's end (the state after
  the tokens fed so far; before the ``llama_decode``).  At most
  ``n_ctx_checkpoints`` per slot: when the list is full, checkpoints of earlier
  requests closer than ``checkpoint_min_step`` tokens to the previous one go
  first, then the oldest.  llama-server also places one at the start of each
  user message of a chat; this node does not know where messages start in a
  prompt, so it places only the ones near the end.
* **Restore** (with ``--ctx-checkpoints 0`` too, which then finds none): when a
  prompt shares ``n`` tokens with the slot's cache but the
  memory's ``pos_min`` shows it cannot be cut back to ``n`` (``pos_min >=
  n - n_swa``, one less when no token would be left to evaluate), the latest
  checkpoint with ``pos_max <= n`` (and ``pos_min`` below that threshold) is
  loaded with ``llama_state_seq_set_data_ext`` and the prompt is evaluated from
  its token count; with none, from 0.  Checkpoints past the kept prefix are
  dropped.  A checkpoint is used only on the context it was taken from and
  only when the prompt's first tokens are the ones it covers (so a cache
  cleared and refilled by other paths never restores a stale state); a load
  that fails falls back to evaluating the whole prompt.

Applies to models whose memory cannot be truncated: ``llama_model_is_recurrent``,
``llama_model_is_hybrid``, or a sliding window (``llama_model_n_swa > 0``) without
``--swa-full``.  A model whose KV cache can be cut back never takes one.
"""

from __future__ import annotations

import ctypes
import logging
from array import array
from typing import TYPE_CHECKING

import llama_cpp

if TYPE_CHECKING:
    from ..llama.model import LoadedModel
    from .slots import Slot

log = logging.getLogger("hydra_trio.engine")

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
END_OFFSET = 4
"""A chunk ends this many tokens before the prompt's end (and ``END_OFFSET + n_ubatch``), llama-server's
``checkpoint_offsets``: a restore then re-evaluates a few tokens, never zero (the last token's logits are
needed)."""


def needs_checkpoints(m: LoadedModel) -> bool:
    """True when ``m``'s memory cannot be cut back to any prefix: recurrent, hybrid, or SWA without ``--swa-full``."""
    model = m.model
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return True
    return llama_cpp.llama_model_n_swa(model) > 0 and not m.options.swa_full


class Checkpoint:
    """The state of one slot's uncuttable memory after its first ``n_tokens`` tokens (``tokens``)."""

    __slots__ = ("ctx", "data", "job", "n_tokens", "pos_max", "pos_min", "tokens")

    def __init__(
        self, n_tokens: int, pos_min: int, pos_max: int, tokens: array, data: ctypes.Array, ctx: int | None, job: int
    ) -> None:
        self.n_tokens = n_tokens
        self.pos_min = pos_min
        self.pos_max = pos_max
        self.tokens = tokens  # array("i"): the prompt prefix it covers
        self.data = data  # llama_state_seq_get_data_ext(PARTIAL_ONLY) bytes
        self.ctx = ctx  # the llama_context it came from (address)
        self.job = job  # the job that took it (a count per slot)

    @property
    def size(self) -> int:
        return len(self.data)


class Checkpoints:
    """Every slot's checkpoints, for one scheduler.

    Args:
        n_parallel: slots.
        n_max: checkpoints kept per slot (``--ctx-checkpoints``; 0: none, the old
            behaviour: a diverging prompt is evaluated whole).
        min_step: the least spacing in tokens between checkpoints of different
            requests once a slot's list is full (``--checkpoint-min-step``).
    """

    def __init__(self, n_parallel: int, n_max: int = 32, min_step: int = 8192) -> None:
        self.n_max = n_max
        self.min_step = min_step
        self.lists: list[list[Checkpoint]] = [[] for _ in range(n_parallel)]
        self.created = 0
        self.restored = 0
        self._job = 0
        self._jobs: dict[int, int] = {}

    @staticmethod
    def needed(m: LoadedModel) -> bool:
        """``m``'s memory cannot be cut back (:func:`needs_checkpoints`), whether or not checkpoints are on."""
        return needs_checkpoints(m)

    def active(self, m: LoadedModel) -> bool:
        """Checkpoints are taken and restored for ``m`` (``n_max > 0`` and :func:`needs_checkpoints`)."""
        return self.n_max > 0 and needs_checkpoints(m)

    def clear(self, id_slot: int | None = None) -> None:
        """Drop one slot's checkpoints (None: every slot's)."""
        for i, lst in enumerate(self.lists):
            if id_slot is None or i == id_slot:
                lst.clear()

    def start(self, m: LoadedModel, slot: Slot, prompt: list[int], n_past: int, need_logits: bool) -> int:
        """A request starts on ``slot`` with ``prompt``; ``n_past`` of its tokens are in the slot's cache.

        Returns how many of them the slot keeps: ``n_past`` when the memory can
        be cut back there, else a restored checkpoint's token count, else 0.
        ``need_logits``: the last prompt token must be evaluated (a generating
        request).  The caller then removes the slot's memory past the returned
        count (``llama_memory_seq_rm``) and evaluates the rest.
        """
        self._job += 1
        self._jobs[slot.id] = self._job
        lst = self.lists[slot.id]
        n_past = slot.media.snap(n_past)
        pos_next = slot.media.pos(n_past)  # positions from here on: media may hold more cells than positions
        has_new = n_past < len(prompt) or not need_logits
        # the largest pos_min that lets the memory serve the first n_past tokens (llama-server's pos_min_thold)
        thold = max(0, pos_next - llama_cpp.llama_model_n_swa(m.model) - (0 if has_new else 1))
        if n_past > 0:
            pos_min = llama_cpp.llama_memory_seq_pos_min(m.memory, slot.id)
            if pos_min >= thold:
                ckpt = self._find(m, lst, prompt, pos_next, thold)
                if ckpt is not None and self._load(m, slot, ckpt):
                    pos_next = min(pos_next, max(ckpt.pos_min + 1, ckpt.pos_max))
                    n_past = min(slot.media.n_at(pos_next), ckpt.n_tokens)
                    self.restored += 1
                    log.info(
                        "slot %d: restored context checkpoint of %d tokens (%.3f MiB); %d prompt tokens kept",
                        slot.id,
                        ckpt.n_tokens,
                        ckpt.size / 2**20,
                        n_past,
                    )
                else:
                    log.info(
                        "slot %d: no context checkpoint at or before token %d; the prompt is evaluated whole "
                        "(this model's memory cannot be cut back)",
                        slot.id,
                        n_past,
                    )
                    pos_next = n_past = 0
        lst[:] = [c for c in lst if c.pos_max <= pos_next]
        return n_past

    def _find(
        self, m: LoadedModel, lst: list[Checkpoint], prompt: list[int], pos_next: int, thold: int
    ) -> Checkpoint | None:
        ctx = ctypes.cast(m.ctx, ctypes.c_void_p).value
        for ckpt in reversed(lst):
            if ckpt.ctx != ctx or ckpt.pos_max > pos_next or not (ckpt.pos_min < thold or ckpt.pos_min == 0):
                continue
            if ckpt.n_tokens <= len(prompt) and array("i", prompt[: ckpt.n_tokens]) == ckpt.tokens:
                return ckpt
        return None

    @staticmethod
    def _load(m: LoadedModel, slot: Slot, ckpt: Checkpoint) -> bool:
        read = llama_cpp.llama_state_seq_set_data_ext(m.ctx, ckpt.data, len(ckpt.data), slot.id, PARTIAL)
        if read != len(ckpt.data):
            log.warning(
                "slot %d: a context checkpoint of %d tokens did not load (%d of %d bytes); the prompt is "
                "evaluated whole",
                slot.id,
                ckpt.n_tokens,
                read,
                len(ckpt.data),
            )
            llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
            return False
        return True

    def chunk(self, m: LoadedModel, slot: Slot, budget: int) -> list[int]:
        """The prompt tokens ``slot`` feeds this step (at most ``budget``), after taking a checkpoint where
        one is due (:meth:`chunk_len`, :meth:`before_chunk`; ``n_ubatch`` is ``m.n_batch``, the engine's
        tokens per step)."""
        if not self.active(m):
            return slot.pending_prompt[:budget]
        chunk = slot.pending_prompt[: self.chunk_len(slot, budget, m.n_batch)]
        self.before_chunk(m, slot, len(chunk), m.n_batch)
        return chunk

    def chunk_len(self, slot: Slot, n: int, n_ubatch: int) -> int:
        """``n`` (the prompt tokens ``slot`` may feed this step), cut so that a chunk ends ``END_OFFSET +
        n_ubatch`` and ``END_OFFSET`` tokens before the prompt's end (llama-server's ``checkpoint_offsets``)."""
        left = len(slot.pending_prompt)
        for offset in (END_OFFSET + n_ubatch, END_OFFSET):
            k = left - min(n_ubatch, offset)
            if 0 < k < n:
                n = k
        return n

    def before_chunk(self, m: LoadedModel, slot: Slot, n_chunk: int, n_ubatch: int) -> None:
        """``slot`` is about to feed ``n_chunk`` prompt tokens: take a checkpoint of its state now (the
        tokens fed so far) when the chunk ends within ``n_ubatch`` tokens of the prompt's end and the
        memory holds anything (llama-server's ``do_checkpoint`` rule, without user-message starts)."""
        n_start = slot.n_past
        if slot.n_prompt >= n_start + n_chunk + n_ubatch:  # not near the prompt's end
            return
        pos_min = llama_cpp.llama_memory_seq_pos_min(m.memory, slot.id)
        if pos_min < 0:
            return
        pos_max = llama_cpp.llama_memory_seq_pos_max(m.memory, slot.id)
        self._create(m, slot, n_start, pos_min, pos_max)

    def _create(self, m: LoadedModel, slot: Slot, n_tokens: int, pos_min: int, pos_max: int) -> None:
        """llama-server's ``create_checkpoint``: make room, then append the slot's state."""
        lst = self.lists[slot.id]
        job = self._jobs.get(slot.id, 0)
        i, last = 0, -1  # while full: drop earlier requests' ones too close to the one before
        while len(lst) + 1 >= self.n_max and i < len(lst):
            c = lst[i]
            if c.job != job and last >= 0 and c.n_tokens <= last + self.min_step:
                del lst[i]
                continue
            last = c.n_tokens
            i += 1
        while len(lst) >= self.n_max:
            lst.pop(0)
        lst[:] = [c for c in lst if c.n_tokens != n_tokens]
        size = llama_cpp.llama_state_seq_get_size_ext(m.ctx, slot.id, PARTIAL)
        data = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data_ext(m.ctx, data, size, slot.id, PARTIAL)
        if written != size:
            log.warning("slot %d: a context checkpoint could not be taken (%d of %d bytes)", slot.id, written, size)
            return
        lst.append(
            Checkpoint(
                n_tokens,
                pos_min,
                pos_max,
                array("i", slot.cache_tokens[:n_tokens]),
                data,
                ctypes.cast(m.ctx, ctypes.c_void_p).value,
                job,
            )
        )
        self.created += 1
        log.debug(
            "slot %d: context checkpoint %d of %d (pos_min %d, pos_max %d, %d tokens, %.3f MiB)",
            slot.id,
            len(lst),
            self.n_max,
            pos_min,
            pos_max,
            n_tokens,
            size / 2**20,
        )
