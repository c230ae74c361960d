"""llama.cpp's ``ngram-mod``: one hash table from n-gram to next token, shared by all slots.

After ``common/ngram-mod.{h,cpp}`` and ``common_speculative_impl_ngram_mod`` in ``common/speculative.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors: the table has 4 Mi entries indexed by
``(Σ token·6364136223846793005^k) mod 2**64 mod 4 Mi``; a new n-gram overwrites its entry.  It is held
sparse here (a dict of the used entries) and the index is rolled over the window, O(1) per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .base import Drafter, SlotDraft

NGRAM_MOD_SIZE = 4 * 1024 * 1024
"""Entries of the table (``common_speculative_impl_ngram_mod``: ``mod(n_match, 4*1024*1024)``)."""
NGRAM_MOD_MULT = 6364136223846793005
EMPTY = -1
OCCUPANCY_RESET = 0.25
"""At :meth:`NgramModDrafter.begin`, a table fuller than this is cleared."""
CHUNK = 32
"""A draft adds the slot's new n-grams once more than this many tokens are pending."""

_MASK = NGRAM_MOD_SIZE - 1  # the size is a power of two: mod 2**64 then mod 4 Mi is mod 4 Mi


class NgramMod:
    """``common_ngram_mod``: ``n``-gram hasher into :data:`NGRAM_MOD_SIZE` entries (sparse)."""

    def __init__(self, n: int, size: int = NGRAM_MOD_SIZE) -> None:
        if size & (size - 1):
            raise ValueError(f"size {size} is not a power of two")
        self.n, self.size, self.mask = n, size, size - 1
        self.mult = NGRAM_MOD_MULT & self.mask
        self.lead = pow(self.mult, n - 1, size)  # weight of the oldest token in the window
        self.entries: dict[int, int] = {}

    def idx(self, tokens: Sequence[int], start: int = 0) -> int:
        """The entry of ``tokens[start:start+n]``."""
        res, mult, mask = 0, self.mult, self.mask
        for i in range(start, start + self.n):
            res = (res * mult + tokens[i]) & mask
        return res

    def roll(self, idx: int, drop: int, add: int) -> int:
        """The entry of the window moved one token on: ``drop`` leaves it, ``add`` joins it."""
        return ((idx - drop * self.lead) * self.mult + add) & self.mask

    def add_range(self, tokens: Sequence[int], lo: int, hi: int) -> None:
        """``add`` at each ``i`` in ``[lo, hi)``: the entry of ``tokens[i:i+n]`` becomes ``tokens[i+n]``."""
        if hi <= lo:
            return
        n, entries = self.n, self.entries
        idx = self.idx(tokens, lo)
        for i in range(lo, hi):
            entries[idx] = tokens[i + n]
            if i + 1 < hi:
                idx = self.roll(idx, tokens[i], tokens[i + n])

    def get(self, idx: int) -> int:
        return self.entries.get(idx, EMPTY)

    def reset(self) -> None:
        self.entries.clear()

    @property
    def used(self) -> int:
        return len(self.entries)


@attrs.define
class _SeqInfo:
    i_last: int = 0  # the last position of the history added to the table
    n_draft_last: int = 0  # length of the last draft
    n_low: int = 0  # consecutive accepts with an acceptance fraction < 0.25


class NgramModDrafter(Drafter):
    """``--spec-type ngram-mod`` (``--spec-ngram-mod-n-match``/``-n-min``/``-n-max``).

    :meth:`begin` adds the prompt's n-grams (and clears the table when more than a quarter is used); a draft
    adds the slot's newer n-grams in chunks of 32, then follows the table from the last ``n_match`` tokens,
    up to ``n_max`` tokens, none when it stops before ``n_min``; five drafts in a row of which less than a
    quarter was accepted clear the table.
    """

    name = "ngram-mod"

    def __init__(self, n_seq: int, n_match: int = 24, n_max: int = 64, n_min: int = 48) -> None:
        super().__init__(n_seq, n_max)
        self.n_match, self.n_min = n_match, n_min
        self.mod = NgramMod(n_match)
        self.sinfos = [_SeqInfo() for _ in range(n_seq)]

    def begin(self, id_slot: int, prompt: Sequence[int]) -> None:
        sinfo = self.sinfos[id_slot]
        sinfo.i_last = sinfo.n_draft_last = 0
        n = self.mod.n
        if len(prompt) < n:
            return
        self.mod.add_range(prompt, 0, len(prompt) - n)
        sinfo.i_last = len(prompt) - n
        if self.mod.used / self.mod.size > OCCUPANCY_RESET:
            self.mod.reset()

    def draft(self, drafts: list[SlotDraft]) -> None:
        for sd in drafts:
            sd.result[:] = self._draft_one(sd)

    def _draft_one(self, sd: SlotDraft) -> list[int]:
        sinfo, mod, prompt = self.sinfos[sd.id_slot], self.mod, sd.tokens
        sinfo.n_draft_last = 0
        cur_len, n = len(prompt), mod.n
        if cur_len < n:
            return []
        if sinfo.i_last + CHUNK < cur_len:
            mod.add_range(prompt, sinfo.i_last, cur_len - n)
            sinfo.i_last = cur_len - n
        window = list(prompt[cur_len - n + 1 :])
        window.append(sd.id_last)
        idx = mod.idx(window)
        out: list[int] = []
        for i in range(self.n_max):
            token = mod.get(idx)
            if token == EMPTY:
                if i < self.n_min:
                    return []
                break
            out.append(token)
            window.append(token)
            idx = mod.roll(idx, window[i], token)
        sinfo.n_draft_last = len(out)
        return out

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return
        sinfo = self.sinfos[id_slot]
        if sinfo.n_draft_last > 0:
            if n_accepted / sinfo.n_draft_last < 0.25:
                sinfo.n_low += 1
                if sinfo.n_low >= 5:
                    self.mod.reset()
                    sinfo.n_low = 0
                    sinfo.i_last = 0
            else:
                sinfo.n_low = 0
