"""The cells of the slots' KV cache: what moves, copies or frees them besides decoding.

A prompt prefix copied from another slot (:func:`share_prefix`), a context shift
(:func:`shift_context`) and ``--cache-reuse`` (:func:`reuse_chunks`) work on the
cells of one llama.cpp memory that all slots use; with a unified KV cache
(``-kvu``) the slots share one stream of cells, so what one slot does to a
shared cell it does to every slot that holds it (:func:`shared_cells`).
Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import llama_cpp

from ...observability.events import EventBus
from ..llama.model import LoadedModel
from .prompt_cache import Entry, PromptCache
from .prompt_cache import common_prefix as _common_prefix
from .slots import Slot

log = logging.getLogger("hydra_trio.engine")

SHARE_MIN_TOKENS = 128
"""The shortest prompt prefix that is copied from another slot rather than evaluated.

With one KV stream per slot, llama.cpp copies a sequence between streams
whole (every layer's K and V of the slot: 2 x n_ctx_slot x n_embd_kv values,
about 47 MiB for SmolLM2-135M at 2,048 tokens), which costs about as much as
evaluating some tens of prompt tokens on 2 cores; below this length
evaluating is cheaper.
"""


def share_prefix(slots: list[Slot], slot: Slot, m: LoadedModel) -> bool:
    """Copy the longest prefix of ``slot``'s prompt that another of ``slots`` holds (in ``m``'s KV
    cache); True: wait a step instead.

    Called before ``slot`` feeds its first prompt token.  Waits while a
    slot that is feeding its prompt now will hold a prefix at least
    :data:`SHARE_MIN_TOKENS` longer than any held now (that slot is fed in
    this same step, so the wait ends); otherwise copies the best prefix
    held now if it is that much longer than the slot's own cache, and
    from then on feeds the rest.  The last prompt token is always
    evaluated here (its logits are needed).

    Not used for a model whose memory cannot be cut back (recurrent, hybrid,
    SWA: :func:`~hydra_trio.engine.batching.checkpoints.needs_checkpoints`; the
    scheduler never sets ``may_share`` for one): ``llama_memory_seq_cp`` of
    recurrent memory ignores the range and gives the slot the donor's whole
    state, after all of the donor's tokens rather than after the shared
    prefix (``llama_memory_recurrent::seq_cp``), and cutting it back fails;
    with a unified KV cache the old code kept that wrong state.  Such a slot
    evaluates the prefix itself.
    """
    assert slot.handle is not None
    prompt = slot.cache_tokens + slot.pending_prompt
    limit = len(prompt) - 1
    have = slot.n_past
    donor, best_now, best_later = None, have, have
    for other in slots:
        if other is slot or (not other.cache_tokens and not other.pending_prompt):
            continue
        n = min(_common_prefix(other.cache_tokens, prompt), limit)
        if n > best_now:
            donor, best_now = other, n
        if other.handle is not None and other.pending_prompt and not other.may_share and n == other.n_past < limit:
            later = min(n + _common_prefix(other.pending_prompt, prompt[n:]), limit)
            best_later = max(best_later, later)
    if best_later >= best_now + SHARE_MIN_TOKENS:
        return True
    slot.may_share = False
    best_now = slot.media.snap(best_now)  # a media chunk (equal by id: its placeholder) is copied whole or not at all
    if donor is None or best_now < have + SHARE_MIN_TOKENS:
        return False
    at = slot.media.pos(best_now)  # the position after the prefix (M-RoPE media advance fewer than their cells)
    if m.n_stream == 1 and m.n_parallel > 1:
        # unified KV: the copy tags the donor's cells with the slot's sequence too (no bytes move), and
        # adds to the slot's own cells, so those go first; the prefix is all of both
        llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
        llama_cpp.llama_memory_seq_cp(m.memory, donor.id, slot.id, 0, at)
        ok = True
    else:
        # non-unified KV: the copy is the donor's whole stream (done at the next
        # llama_decode, before its batch), then everything past the prefix goes
        llama_cpp.llama_memory_seq_cp(m.memory, donor.id, slot.id, -1, -1)
        ok = llama_cpp.llama_memory_seq_rm(m.memory, slot.id, at, -1)
    if not ok:
        llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)  # this memory cannot cut a sequence
        slot.cache_tokens = []
        slot.pending_prompt = prompt
        slot.cache_n = 0
        return False
    slot.cache_tokens = prompt[:best_now]
    slot.pending_prompt = prompt[best_now:]
    slot.cache_n = best_now
    log.debug("slot %d: %d prompt tokens copied from slot %d", slot.id, best_now - have, donor.id)
    return False


def shared_cells(m: LoadedModel, slots: list[Slot], slot: Slot) -> int:
    """How many of ``slot``'s first cells other slots may share: in a unified KV cache (``-kvu``) a prefix
    copied between slots (:func:`share_prefix`) is one set of cells tagged with both sequences, and a
    cell has one position for all of them, so moving those cells for one slot (a context shift, a
    ``--cache-reuse`` shift) would move them for the others too.  Counted as the longest prefix
    ``slot`` has in common with another slot's cached tokens (copied or not: the cells do not say);
    0 without a unified cache."""
    if m.n_stream != 1 or m.n_parallel == 1 or not slot.cache_tokens:
        return 0
    return max((_common_prefix(o.cache_tokens, slot.cache_tokens) for o in slots if o is not slot), default=0)


def shift_context(m: LoadedModel, slot: Slot, n_keep_default: int, shared: int = 0) -> bool:
    """llama-server's context shift on the full ``slot``: drop tokens after the first ``n_keep``
    and move the rest down; False (nothing done) when ``m``'s memory cannot shift positions.

    ``n_keep`` is the job's (None: ``n_keep_default``; -1: the whole prompt), plus
    the BOS token when the model adds one, at most ``n_ctx_slot - 4``;
    ``n_discard`` is the job's, 0 meaning half of the tokens after ``n_keep``
    (``server-context.cpp``, ``pre_decode``).  The first ``shared`` cells may be other slots' too
    (:func:`shared_cells`): those are kept or discarded, never moved, so ``n_discard`` grows to
    reach past them (False when that leaves nothing to move).
    """
    assert slot.handle is not None
    if not llama_cpp.llama_memory_can_shift(m.memory):
        return False
    job = slot.handle.job
    n_keep = n_keep_default if job.n_keep is None else job.n_keep
    if n_keep < 0:
        n_keep = slot.n_prompt
    if m.add_bos:
        n_keep += 1
    n_keep = min(slot.n_ctx - 4, n_keep)
    n_past = slot.n_past
    n_left = n_past - n_keep
    n_discard = min(max(job.n_discard or n_left // 2, 0), max(0, n_left - 1))
    if shared > n_keep + n_discard:
        n_discard = shared - n_keep
        if n_discard > n_left - 1:
            return False
    if n_discard <= 0:
        return False
    llama_cpp.llama_memory_seq_rm(m.memory, slot.id, n_keep, n_keep + n_discard)
    llama_cpp.llama_memory_seq_add(m.memory, slot.id, n_keep + n_discard, n_past, -n_discard)
    del slot.cache_tokens[n_keep : n_keep + n_discard]
    slot.n_shifts += 1
    log.info("slot %d: context shift, n_keep %d, n_left %d, n_discard %d", slot.id, n_keep, n_left, n_discard)
    return True


def reuse_chunks(m: LoadedModel, slot: Slot, prompt: list[int], n_past: int, n_reuse: int) -> int:
    """llama-server's ``--cache-reuse``: move chunks of ``slot``'s cached tokens that ``prompt``
    holds further on into place by a KV shift; returns the prompt tokens now cached.

    ``n_past`` is the common prefix of the cache and the prompt.  From there,
    each cached run of at least ``n_reuse`` tokens equal to the prompt's next
    tokens is shifted down to the prompt's position (``llama_memory_seq_rm`` of
    the cells in between, ``llama_memory_seq_add`` of the run); cached tokens
    that match nothing are skipped (``server-context.cpp``, ``n_cache_reuse``).
    The caller removes what lies past the returned count.  Needs a memory that
    can shift (``llama_memory_can_shift``).  Leaves ``slot.cache_tokens`` equal
    to ``prompt[:returned]`` when it moved anything.
    """
    cache = slot.cache_tokens
    head_c = head_p = n_past
    n_c, n_p = len(cache), len(prompt)
    start = n_past
    while head_c < n_c and head_p < n_p:
        try:  # the next cached token that could start a chunk (a C scan, not a Python loop)
            head_c = cache.index(prompt[head_p], head_c)
        except ValueError:
            break
        if cache[head_c : head_c + n_reuse] != prompt[head_p : head_p + n_reuse]:
            head_c += 1
            continue
        n_match = _common_prefix(cache[head_c:], prompt[head_p:])
        if n_match < n_reuse:
            head_c += 1
            continue
        llama_cpp.llama_memory_seq_rm(m.memory, slot.id, head_p, head_c)
        llama_cpp.llama_memory_seq_add(m.memory, slot.id, head_c, head_c + n_match, head_p - head_c)
        log.debug(
            "slot %d: reusing %d cached tokens, shifted [%d, %d) -> [%d, %d)",
            slot.id,
            n_match,
            head_c,
            head_c + n_match,
            head_p,
            head_p + n_match,
        )
        n_past += n_match
        head_c += n_match
        head_p += n_match
    if n_past > start:
        slot.cache_tokens = list(prompt[:n_past])
    return n_past


def free_idle_cells(
    m: LoadedModel,
    keep: Slot | None = None,
    keep_entry: Entry | None = None,
    *,
    slots: list[Slot],
    prompt_cache: PromptCache,
    events: EventBus,
) -> bool:
    """Free the cells of the least recently used idle slot of ``slots`` other than ``keep`` that holds any
    (its state goes to the host-RAM ``prompt_cache`` first, when that is on, without evicting
    ``keep_entry``, an entry being restored now, so a returning conversation is restored rather than
    evaluated again); True when one was freed.  Only a unified KV cache (``-kvu``) shares its cells
    between slots; without it this frees nothing and returns False.

    llama-server frees idle slots of a unified cache for the same reason (``try_clear_idle_slots``
    when a batch finds no room, and every idle slot when a task starts); here they keep their cells
    until the room is needed."""
    if m.n_stream != 1 or m.n_parallel == 1:
        return False
    idle = [s for s in slots if s is not keep and not s.is_processing and s.cache_tokens]
    if not idle:
        return False
    slot = min(idle, key=lambda s: s.last_used)
    prompt_cache.save(m, slot, keep=keep_entry)
    tokens = slot.cache_tokens
    n = len(tokens)
    kept = any(e.tokens[:n] == tokens for e in prompt_cache.entries)
    llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
    slot.cache_tokens = []
    log.warning(
        "the KV cache is full: slot %d's %d idle tokens freed (%s)",
        slot.id,
        n,
        "kept in the prompt cache" if kept else "not kept",
    )
    events.publish("slot.purged", slot=slot.id, n_tokens=n)
    return True


def retry_without_room(m: LoadedModel, n_tokens: int, make_room: Callable[[LoadedModel], bool]) -> int | None:
    """The KV cache had no room for a batch of ``n_tokens`` (slots that share a unified cache filled it):
    the most tokens the retry's batch may take, as llama-server's ``update_slots`` retries — the whole
    batch again (0) after ``make_room`` freed an idle slot's cells (:func:`free_idle_cells`), else half
    of it.  None when a batch of one token found no room: every processing request fails with
    llama-server's "Context size has been exceeded." (the caller drops their cells)."""
    if make_room(m):
        return 0
    if n_tokens > 1:
        log.warning("no room in the KV cache for a batch of %d tokens; retrying with %d", n_tokens, n_tokens // 2)
        return n_tokens // 2
    log.error(
        "no room in the KV cache for one token: the processing slots hold all %d cells; their requests fail", m.n_ctx
    )
    return None
