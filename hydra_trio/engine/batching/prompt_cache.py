"""The host-RAM prompt cache: slots' KV states kept in host memory, keyed by their tokens (engine thread only).

llama-server's ``server_prompt_cache`` (``tools/server/server-task.cpp``,
``server-context.cpp``: ``--cache-ram``, ``--cache-idle-slots``) is the floor;
the rules here:

* **Save.**  When a request takes a slot whose cached tokens share a prefix
  with the new prompt that is at least :data:`MIN_TOKENS` shorter than what
  the slot holds, the slot's whole state (``llama_state_seq_get_data`` of its
  sequence: llama.cpp's own bytes, without the Hydra blob header) is kept,
  keyed by the slot's tokens, before the slot is cut back.  llama-server saves
  only when the slot keeps less than half of what it holds (``f_keep < 0.5``),
  so two users with one long system prompt lose each other's turns there.
  With ``--cache-idle-slots`` (on by default, as llama-server) every idle slot
  is kept too, when the engine goes idle (llama-server does it when it starts
  the next task, before that task runs).  A state already held by an entry
  (a prefix of that entry's tokens) is not kept twice; entries whose tokens
  are a prefix of the new one are dropped (``contained``).
* **Restore.**  Before a prompt is evaluated, the entry sharing the longest
  prefix with it is restored into the chosen slot (``llama_state_seq_set_data``)
  when that prefix is at least :data:`MIN_TOKENS` longer than what the slot
  keeps and than what another slot would give by a copy
  (:func:`~hydra_trio.engine.batching.scheduler.share_prefix`); then only the rest is
  evaluated.  The entry stays in the cache (llama-server moves it out, so a
  turn that diverges early loses the rest of it).  Models that keep context
  checkpoints instead (recurrent, hybrid, SWA: :mod:`.checkpoints`) do not use
  the cache (the scheduler skips it): their memory cannot be cut back to a
  shared prefix and an entry does not carry the slot's checkpoints; a memory
  that cannot shift gets only entries a prompt holds whole.
* **Budget.**  The bytes of the entries' states stay within ``--cache-ram``
  MiB (-1: no limit, 0: off); the least recently used entries (saved or
  restored longest ago) go first; a state larger than the whole budget is not
  kept.
* **Failure.**  A restore that llama.cpp refuses (a short or damaged entry)
  drops the entry and empties the slot; the prompt is then evaluated, the
  request never fails for it.
* **Forgetting.**  Every entry is dropped when the served model or its KV
  layout changes: a new context (CONFIGURE ``n_ctx`` / ``n_parallel`` /
  model), SWAP_QUANT, a switch between SOLO and COMBINED.

Events (``prompt_cache.saved``, ``.restored``, ``.evicted``,
``.restore_failed``) go to the engine's bus; the counters are read by
``/metrics`` and ``/slots`` from other threads (plain ints).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import llama_cpp

from ...observability.events import EventBus

if TYPE_CHECKING:
    from ..llama.model import LoadedModel
    from .slots import Slot

log = logging.getLogger("hydra_trio.engine")

MIB = 1 << 20
MIN_TOKENS = 32
"""Tokens a restore must gain over what the slots offer, and a slot must be about to lose to be kept.

Restoring is a copy of the entry's KV bytes (about 23 kB a token for
SmolLM2-135M in f16: a 2,000-token entry is some 10 ms on 2 cores), which
costs about as much as evaluating a few tens of tokens there.
"""


@attrs.define(eq=False)
class Entry:
    """One kept state: the tokens of the slot it came from and llama.cpp's bytes of that sequence."""

    tokens: list[int]
    data: bytearray
    t_used: float = 0.0

    @property
    def size(self) -> int:
        return len(self.data)


class PromptCache:
    """The entries, least recently used first, within ``limit_mib`` MiB (-1: no limit, 0: off).

    Args:
        limit_mib: ``--cache-ram``.
        idle_slots: ``--cache-idle-slots``: keep idle slots' states when the engine goes idle.
        events: where ``prompt_cache.*`` events go.

    Counters (read by ``/metrics``): ``hits`` (restores), ``misses`` (a prompt
    that the slots left at least :data:`MIN_TOKENS` short of, and that no
    entry helped; a failed restore counts too), ``saves``,
    ``restore_failures``, ``evicted`` (by reason: ``lru``, ``contained``, ``erased``, ``restore_failed``,
    ``reload``, ``mode_switch``); ``bytes`` and ``n_entries`` now.
    """

    def __init__(self, limit_mib: int = 8192, idle_slots: bool = True, events: EventBus | None = None) -> None:
        self.limit_mib = limit_mib
        self.limit_bytes = limit_mib * MIB if limit_mib > 0 else 0  # 0: no limit (when enabled)
        self.idle_slots = idle_slots and limit_mib != 0
        self.events = events if events is not None else EventBus()
        self.entries: list[Entry] = []
        self.bytes = 0
        self.n_entries = 0
        self.hits = self.misses = self.saves = self.restore_failures = 0
        self.evicted: collections.Counter[str] = collections.Counter()
        self.make_room: Callable[[LoadedModel, Slot, Entry], bool] | None = None
        """Frees another slot's cells when a restore finds no room in a unified KV cache (the scheduler's
        :meth:`~hydra_trio.engine.batching.scheduler.Scheduler.make_room`, which keeps the entry being restored)."""

    @property
    def enabled(self) -> bool:
        return self.limit_mib != 0

    def info(self) -> dict[str, int | bool]:
        """The cache now, for ``/slots``: ``enabled``, ``entries``, ``bytes``, ``limit_bytes`` (-1: none),
        ``hits``, ``misses``."""
        return {
            "enabled": self.enabled,
            "entries": self.n_entries,
            "bytes": self.bytes,
            "limit_bytes": self.limit_bytes if self.limit_mib > 0 else (-1 if self.enabled else 0),
            "hits": self.hits,
            "misses": self.misses,
        }

    # ------------------------------------------------------------ the rules
    def prepare(
        self,
        m: LoadedModel,
        slot: Slot,
        prompt: list[int],
        cache_n: int,
        slots: list[Slot],
        use_cache: bool,
        share_min: int,
        trace_id: str = "",
    ) -> int:
        """Before ``slot`` (idle) takes ``prompt`` and keeps its first ``cache_n`` cached tokens: keep the
        slot's state when it is about to lose at least :data:`MIN_TOKENS` of them, then restore the best
        entry when it gives at least that many more than the slots do (``use_cache``: the request's
        ``cache_prompt``; ``share_min``: the scheduler's ``SHARE_MIN_TOKENS``).  Returns the prompt tokens
        the slot now holds (its ``cache_tokens`` start with them); on a failed restore the slot is empty
        and 0 comes back."""
        if not self.enabled:
            return cache_n
        entry, lcp, offered = self._lookup(m, slot, prompt, cache_n, slots, share_min) if use_cache else (None, 0, 0)
        if entry is not None:  # the most recently used now: keeping the slot's state below never evicts it
            self.entries.remove(entry)
            self.entries.append(entry)
        if slot.n_past - cache_n >= MIN_TOKENS:
            self.save(m, slot, trace_id, keep=entry)
        if entry is None:
            return cache_n
        if not self._restore(m, slot, entry, trace_id):
            self.misses += 1
            return 0
        self.hits += 1
        self.events.publish(
            "prompt_cache.restored",
            trace_id,
            slot=slot.id,
            n_tokens=len(entry.tokens),
            n_used=lcp,
            bytes=entry.size,
            gain=lcp - offered,
        )
        log.info(
            "slot %d: restored %d of %d prompt tokens from the prompt cache (%d tokens, %.1f MiB)",
            slot.id,
            lcp,
            len(prompt),
            len(entry.tokens),
            entry.size / MIB,
        )
        return lcp

    def _lookup(
        self, m: LoadedModel, slot: Slot, prompt: list[int], cache_n: int, slots: list[Slot], share_min: int
    ) -> tuple[Entry | None, int, int]:
        """``(entry, prompt tokens it gives, what the slots give)`` for :meth:`prepare`; entry None (a miss
        counted when the slots left at least :data:`MIN_TOKENS` to evaluate) when none is worth a restore."""
        limit = len(prompt) - 1  # the last prompt token is always evaluated (its logits)
        offered = max(cache_n, _offered_by_others(slots, slot, prompt, cache_n, share_min))
        if limit - offered < MIN_TOKENS:
            return None, 0, offered  # the slots give (nearly) all of it: nothing to look up
        entry, lcp = self._best(prompt, whole_only=not llama_cpp.llama_memory_can_shift(m.memory))
        if entry is None or min(lcp, limit) < offered + MIN_TOKENS:
            self.misses += 1
            return None, 0, offered
        return entry, min(lcp, limit), offered

    def save_idle(self, m: LoadedModel, slots: list[Slot]) -> None:
        """With ``--cache-idle-slots``: keep every idle slot's state that no entry holds yet (the engine
        calls this when it goes idle)."""
        if self.idle_slots:
            for slot in slots:
                if not slot.is_processing and slot.cache_tokens:
                    self.save(m, slot)

    def save(self, m: LoadedModel, slot: Slot, trace_id: str = "", keep: Entry | None = None) -> bool:
        """Keep ``slot``'s state (idle, or before its new prompt cuts it back); True when an entry was added.

        Least recently used entries make room, never ``keep`` (about to be restored).  Not kept: an empty
        slot, a state an entry already holds, one that does not fit beside ``keep`` in the budget.
        """
        tokens = slot.cache_tokens
        n = len(tokens)
        if not self.enabled or not n or any(len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries):
            return False
        size = llama_cpp.llama_state_seq_get_size(m.ctx, slot.id)
        if self.limit_bytes and size + (keep.size if keep is not None else 0) > self.limit_bytes:
            log.info(
                "slot %d: its state (%.1f MiB) does not fit in the prompt cache (--cache-ram %d): not kept",
                slot.id,
                size / MIB,
                self.limit_mib,
            )
            return False
        for e in [e for e in self.entries if len(e.tokens) <= n and tokens[: len(e.tokens)] == e.tokens]:
            if e is not keep:
                self._drop(e, "contained")
        while self.limit_bytes and self.bytes + size > self.limit_bytes:
            self._drop(next(e for e in self.entries if e is not keep), "lru")
        data = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        written = llama_cpp.llama_state_seq_get_data(m.ctx, buf, size, slot.id)
        del buf
        if written == 0:
            log.warning("slot %d: llama.cpp gave no state to keep in the prompt cache", slot.id)
            return False
        del data[written:]
        entry = Entry(list(tokens), data, time.monotonic())
        self.entries.append(entry)
        self.saves += 1
        self._account()
        self.events.publish(
            "prompt_cache.saved",
            trace_id,
            slot=slot.id,
            n_tokens=n,
            bytes=entry.size,
            entries=self.n_entries,
            total_bytes=self.bytes,
        )
        log.debug("slot %d: kept %d tokens (%.1f MiB) in the prompt cache", slot.id, n, entry.size / MIB)
        return True

    def forget(self, tokens: list[int]) -> None:
        """Drop the entries of the conversation ``tokens`` (a slot being erased): those that start with
        ``tokens`` and those ``tokens`` start with, so an erased slot's prompt is evaluated afresh."""
        n = len(tokens)
        if n:
            for e in [e for e in self.entries if e.tokens[:n] == tokens[: len(e.tokens)]]:
                self._drop(e, "erased")

    def clear(self, reason: str) -> None:
        """Drop every entry (the model or its KV layout changed: ``reason`` names what)."""
        for e in list(self.entries):
            self._drop(e, reason)

    # ------------------------------------------------------------- helpers
    def _best(self, prompt: list[int], whole_only: bool) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (the shorter one among equals: a cheaper copy)."""
        best, best_n = None, 0
        for e in self.entries:
            if not e.tokens or e.tokens[0] != prompt[0]:
                continue
            n = common_prefix(e.tokens, prompt)
            if whole_only and n < len(e.tokens):
                continue
            if n > best_n or (n == best_n and best is not None and len(e.tokens) < len(best.tokens)):
                best, best_n = e, n
        return best, best_n

    def _restore(self, m: LoadedModel, slot: Slot, entry: Entry, trace_id: str) -> bool:
        """Put ``entry`` into ``slot``; False (the entry dropped, the slot empty) when llama.cpp refuses it."""
        size = entry.size
        ok = False
        while size:
            buf = (ctypes.c_uint8 * size).from_buffer(entry.data)
            read = llama_cpp.llama_state_seq_set_data(m.ctx, buf, size, slot.id)
            del buf
            ok = read == size and llama_cpp.llama_memory_seq_pos_max(m.memory, slot.id) == len(entry.tokens) - 1
            if ok or self.make_room is None or not self.make_room(m, slot, entry):
                break  # else another slot's cells were freed: try again
        if not ok:
            llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
            slot.cache_tokens.clear()
            self.restore_failures += 1
            log.warning(
                "slot %d: llama.cpp refused a prompt-cache entry (%d tokens, %d bytes); it is dropped and "
                "the prompt is evaluated",
                slot.id,
                len(entry.tokens),
                size,
            )
            self.events.publish(
                "prompt_cache.restore_failed", trace_id, slot=slot.id, n_tokens=len(entry.tokens), bytes=size
            )
            self._drop(entry, "restore_failed")
            return False
        slot.cache_tokens[:] = entry.tokens
        entry.t_used = time.monotonic()
        return True

    def _drop(self, entry: Entry, reason: str) -> None:
        self.entries.remove(entry)
        self.evicted[reason] += 1
        self._account()
        self.events.publish(
            "prompt_cache.evicted",
            reason=reason,
            n_tokens=len(entry.tokens),
            bytes=entry.size,
            entries=self.n_entries,
            total_bytes=self.bytes,
        )
        log.debug("prompt cache: dropped an entry of %d tokens (%s)", len(entry.tokens), reason)

    def _account(self) -> None:
        self.bytes = sum(e.size for e in self.entries)
        self.n_entries = len(self.entries)


def _offered_by_others(slots: list[Slot], slot: Slot, prompt: list[int], have: int, share_min: int) -> int:
    """The prompt prefix another slot would give ``slot`` by a copy (:func:`share_prefix`'s rule: at
    least ``share_min`` more than ``have``), counting prompts being evaluated now; 0 if none."""
    best = 0
    for other in slots:
        if other is slot:
            continue
        held = other.cache_tokens + other.pending_prompt if other.pending_prompt else other.cache_tokens
        if held and held[0] == prompt[0]:
            best = max(best, common_prefix(held, prompt))
    return best if best >= have + share_min else 0


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token sequences (slice comparisons run in C: a binary
    search, not a Python loop)."""
    n = min(len(a), len(b))
    a, b = list(a[:n]), list(b[:n])
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
