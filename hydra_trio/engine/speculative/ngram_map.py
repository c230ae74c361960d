"""llama.cpp's n-gram lookups in the slot's own history: ``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``.

After ``common/ngram-map.{h,cpp}`` and ``common_speculative_impl_ngram_simple`` /
``common_speculative_impl_ngram_map_k`` in ``common/speculative.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors, step for step (the same positions searched in the same order, the same
saturating counters, the same hash table of 2**18 entries with its collisions), so the drafts are
llama-server's for the same history.  The searches run over :class:`~.history.History`'s hashes.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from .base import Drafter, SlotDraft
from .history import History, lcg_hash

COMMON_NGRAM_MAX_VALUES = 4
"""m-gram values kept per key n-gram."""
COMMON_NGRAM_HASH_MAP_SIZE = 262144
"""Entries of the map from n-gram hash to n-gram position."""
COMMON_NGRAM_MAX_VALUE_COUNT = 16380
"""Where the key and value counters saturate."""


def ngram_simple_draft(
    size_ngram: int, size_mgram: int, tokens: Sequence[int], sampled: int, history: History | None = None
) -> list[int]:
    """``common_ngram_simple_draft``: find the latest earlier occurrence (at a position ≥ 1) of the last
    ``size_ngram`` tokens (``tokens[-size_ngram+1:] + [sampled]``) and propose the ``size_mgram`` tokens that
    followed it (fewer when the history ends first; none when fewer than ``size_ngram`` follow).

    ``history``: a :class:`History` of n-gram size ``size_ngram`` already synced to ``tokens`` (built here when
    None).  Returns the draft (``[]``: no match).
    """
    n, m, cur_len = size_ngram, size_mgram, len(tokens)
    if cur_len <= n + m + 1:
        return []
    if history is None:
        history = History(n)
        history.sync(tokens)
    pattern = list(tokens[cur_len - n + 1 :])
    pattern.append(sampled)
    match_pos = history.last_match(pattern, 1, cur_len - n - 1)
    if match_pos <= 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return list(tokens[match_pos + n : match_pos + n + copy_max])


@attrs.define
class NgramMapValue:
    """``common_ngram_map_value``: an m-gram seen after a key (``value_idx`` 0: an unused slot)."""

    value_idx: int = 0
    value_num: int = 0
    n_accepted: int = -1


@attrs.define
class NgramMapKey:
    """``common_ngram_map_key``: a key n-gram at ``key_idx``, its hits and up to 4 following m-grams."""

    key_idx: int
    stat_idx: int = 0
    key_num: int = 0
    values: list[NgramMapValue] = attrs.field(factory=list)


class NgramMap:
    """``common_ngram_map`` of one slot: keys of ``size_key`` tokens and their ``size_value``-token values.

    ``key_only`` (``ngram-map-k``): draft the m-gram after the key's match, as long as the last draft from
    that key was accepted.  Otherwise (``ngram-map-k4v``): count up to 4 different m-grams after each key
    and draft only when the most frequent one is seen at least twice as often as the others together (and
    the key ``min_hits`` times).
    """

    def __init__(self, size_key: int, size_value: int, key_only: bool, min_hits: int) -> None:
        self.size_key, self.size_value, self.key_only, self.min_hits = size_key, size_value, key_only, min_hits
        self.keys: list[NgramMapKey] = []
        self.size_last_begin = 0
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0
        self.idx_last_check = 0
        self.key_map = np.zeros(COMMON_NGRAM_HASH_MAP_SIZE, dtype=np.uint32)
        self.key_map_last_idx = 0
        self.history = History(size_key)
        self._key_of: dict[tuple[int, ...], int] | None = {}  # key tokens -> first offset in keys (None: stale)

    def begin(self, tokens: Sequence[int]) -> None:
        """``common_ngram_map_begin``: a new generation starts after ``tokens``; when the history got shorter
        than at the last draft, forget the keys, values and hashes from the cut on."""
        n, m = self.size_key, self.size_value
        self.history.sync(tokens, full=True)
        self._key_of = None
        size_begin = len(tokens)
        idx_begin_cleanup = self.size_last_begin
        if idx_begin_cleanup > size_begin:
            idx_begin_cleanup = size_begin - n - m if size_begin > n + m else 0
        if size_begin < self.idx_last_check:
            km = self.key_map
            km[(km != 0) & (km >= idx_begin_cleanup)] = 0
            self.key_map_last_idx = idx_begin_cleanup - 1 if idx_begin_cleanup > 0 else 0
        if size_begin < self.idx_last_check and self.keys:
            for i in range(len(self.keys) - 1, -1, -1):
                key = self.keys[i]
                if key.key_idx >= idx_begin_cleanup:
                    del self.keys[i]
                    continue
                if self.key_only:
                    continue
                vals = key.values
                for j in range(COMMON_NGRAM_MAX_VALUES - 1, -1, -1):
                    if vals[j].value_idx != 0 and vals[j].value_idx >= idx_begin_cleanup:
                        last = vals[-1]
                        vals[j:-1] = [attrs.evolve(v) for v in vals[j + 1 :]]
                        vals[-1] = NgramMapValue(0, 0, last.n_accepted)
                if vals[0].value_idx == 0:
                    del self.keys[i]
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    def draft(self, inp: Sequence[int], sampled: int) -> list[int]:
        """``common_ngram_map_draft``: the draft after ``inp`` + ``sampled`` (``[]``: none).  Where llama.cpp
        aborts (the history got shorter than at the last draft without :meth:`begin`), this begins anew."""
        self.last_draft_created = False
        self.last_draft_key_idx = self.last_draft_value_idx = 0
        n, m, cur_len = self.size_key, self.size_value, len(inp)
        if cur_len < 2 * n + m:
            return []
        if self.idx_last_check > cur_len or self.size_last_begin > cur_len:
            self.begin(inp)
        if not self.history.sync(inp):
            self._key_of = None
        self.idx_last_check = cur_len
        hist, toks = self.history, self.history.tokens
        key_tokens = list(inp[cur_len - n + 1 :])
        key_tokens.append(sampled)

        match_pos = 0
        idx_key = int(self.key_map[lcg_hash(key_tokens, 0, n) % COMMON_NGRAM_HASH_MAP_SIZE])
        if idx_key != 0 and idx_key < cur_len - n - m - 1 and toks[idx_key : idx_key + n] == key_tokens:
            match_pos = idx_key
        lo_old, hi_old = self.key_map_last_idx, self.size_last_begin - n - m - 1
        if match_pos == 0 and self.size_last_begin > n + m + 1:
            match_pos = max(0, hist.last_match(key_tokens, lo_old + 1, hi_old))
        lo_new, hi_new = max(self.size_last_begin, self.key_map_last_idx), cur_len - n - m - 1
        if match_pos == 0:
            match_pos = max(0, hist.last_match(key_tokens, lo_new + 1, hi_new))
        if self.size_last_begin > n + m + 1:
            self._fill_key_map(lo_old, hi_old)
        self._fill_key_map(lo_new, hi_new)
        self.key_map_last_idx = max(cur_len - n - m - 1, self.key_map_last_idx)
        if match_pos == 0:
            return []

        key_offset = self._find_key(key_tokens)
        if key_offset == len(self.keys):
            self.keys.append(
                NgramMapKey(match_pos, values=[NgramMapValue(0, 0, m) for _ in range(COMMON_NGRAM_MAX_VALUES)])
            )
            if self._key_of is not None:
                self._key_of.setdefault(tuple(key_tokens), key_offset)
        key = self.keys[key_offset]
        key.key_num = min(key.key_num + 1, COMMON_NGRAM_MAX_VALUE_COUNT)
        if self.key_only:
            self.last_draft_created, self.last_draft_key_idx, self.last_draft_value_idx = True, key_offset, 0
            return toks[match_pos + n : match_pos + n + max(0, min(m, key.values[0].n_accepted))]
        if key.key_num < self.min_hits:
            return []
        for i in hist.matches(key_tokens, key.stat_idx, match_pos):
            self._count_value(key, i + n)
        key.stat_idx = match_pos
        counts = [v.value_num for v in key.values]
        max_occur = max(counts)
        slot_max = counts.index(max_occur) if max_occur > 0 else 0
        sum_occur = sum(counts) - counts[slot_max]
        if sum_occur > 0 and max_occur < 2 * sum_occur:
            return []
        self.last_draft_created, self.last_draft_key_idx, self.last_draft_value_idx = True, key_offset, slot_max
        return toks[match_pos + n : match_pos + n + max(0, min(m, key.values[slot_max].n_accepted))]

    def accept(self, n_accepted: int) -> None:
        """``common_ngram_map_accept``: the last draft's value drafts at most ``n_accepted`` tokens from now on."""
        if self.last_draft_created:
            self.keys[self.last_draft_key_idx].values[self.last_draft_value_idx].n_accepted = n_accepted

    def _count_value(self, key: NgramMapKey, begin: int) -> None:
        toks, m = self.history.tokens, self.size_value
        for v in key.values:
            if v.value_idx == 0:
                v.value_idx, v.value_num, v.n_accepted = begin, 0, m
            elif toks[begin : begin + m] != toks[v.value_idx : v.value_idx + m]:
                continue
            v.value_num = min(v.value_num + 1, COMMON_NGRAM_MAX_VALUE_COUNT)
            return

    def _find_key(self, key_tokens: list[int]) -> int:
        """The first key whose tokens (read at its ``key_idx`` in the history now) are ``key_tokens``."""
        if self._key_of is None:
            toks, n = self.history.tokens, self.size_key
            found: dict[tuple[int, ...], int] = {}
            for i, k in enumerate(self.keys):
                if k.key_idx + n <= len(toks):
                    found.setdefault(tuple(toks[k.key_idx : k.key_idx + n]), i)
            self._key_of = found
        return self._key_of.get(tuple(key_tokens), len(self.keys))

    def _fill_key_map(self, lo: int, hi: int) -> None:
        """Record position ``j`` for its hash, ``j`` from ``hi`` down to ``lo + 1``, where the entry is empty."""
        if hi <= lo:
            return
        km = self.key_map
        idx = self.history.h[lo + 1 : hi + 1] % COMMON_NGRAM_HASH_MAP_SIZE
        if hi - lo <= 32:
            for j in range(hi, lo, -1):
                e = int(idx[j - lo - 1])
                if km[e] == 0:
                    km[e] = j
            return
        uniq, first = np.unique(idx[::-1], return_index=True)
        empty = km[uniq] == 0
        km[uniq[empty]] = hi - first[empty]


class NgramSimpleDrafter(Drafter):
    """``--spec-type ngram-simple``: :func:`ngram_simple_draft` (``--spec-ngram-simple-size-n``/``-size-m``;
    llama-server ignores ``--spec-ngram-simple-min-hits``).  No state beyond a cached copy of the history."""

    name = "ngram-simple"

    def __init__(self, n_seq: int, size_n: int = 12, size_m: int = 48) -> None:
        super().__init__(n_seq, size_m)
        self.size_n, self.size_m = size_n, size_m
        self.histories = [History(size_n) for _ in range(n_seq)]

    def begin(self, id_slot: int, prompt: Sequence[int]) -> None:
        self.histories[id_slot].sync(prompt, full=True)

    def draft(self, drafts: list[SlotDraft]) -> None:
        for sd in drafts:
            hist = self.histories[sd.id_slot]
            hist.sync(sd.tokens)
            sd.result[:] = ngram_simple_draft(self.size_n, self.size_m, sd.tokens, sd.id_last, hist)


class NgramMapDrafter(Drafter):
    """``--spec-type ngram-map-k`` (``key_only``) and ``ngram-map-k4v``: one :class:`NgramMap` per slot
    (``--spec-ngram-map-k[4v]-size-n``/``-size-m``/``-min-hits``)."""

    key_only: bool = True

    def __init__(self, n_seq: int, size_n: int = 12, size_m: int = 48, min_hits: int = 1) -> None:
        super().__init__(n_seq, size_m)
        self.maps = [NgramMap(size_n, size_m, self.key_only, min_hits) for _ in range(n_seq)]

    def begin(self, id_slot: int, prompt: Sequence[int]) -> None:
        self.maps[id_slot].begin(prompt)

    def draft(self, drafts: list[SlotDraft]) -> None:
        for sd in drafts:
            sd.result[:] = self.maps[sd.id_slot].draft(sd.tokens, sd.id_last)

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        if not is_other:
            self.maps[id_slot].accept(n_accepted)


class NgramMapKDrafter(NgramMapDrafter):
    """``--spec-type ngram-map-k``: keys only."""

    name = "ngram-map-k"
    key_only = True


class NgramMapK4vDrafter(NgramMapDrafter):
    """``--spec-type ngram-map-k4v``: keys and up to 4 values each."""

    name = "ngram-map-k4v"
    key_only = False
