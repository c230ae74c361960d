"""A slot's token history as the n-gram drafters read it: a private copy plus a hash of the n-gram that
starts at each position, kept up to date step by step.

llama.cpp's n-gram lookups (``common/ngram-map.cpp``) scan the whole history in C++ at every step; here
the scans run over the hashes with numpy (a vectorized compare, then a check of the tokens), so a step
costs O(new tokens) Python work plus a C-speed pass over the positions it searches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LCG_FACTOR = 2654435761
"""The multiplier of ``common_ngram_map_hash`` (``common/ngram-map.cpp``): a 32-bit LCG over the tokens."""

TAIL_CHECK = 8
"""Tokens at the end of the copy compared with the slot's history at each sync: a history that changed
elsewhere without getting shorter (a context shift always makes it shorter) is caught by :meth:`History.sync`
with ``full=True``, which :meth:`Drafter.begin` implementations call."""

_M32 = 0xFFFFFFFF


def lcg_hash(tokens: Sequence[int], start: int, size: int) -> int:
    """``common_ngram_map_hash``: ``h = h * 2654435761 + token`` over ``tokens[start:start+size]``, mod 2**32."""
    h = 0
    for i in range(start, start + size):
        h = (h * LCG_FACTOR + tokens[i]) & _M32
    return h


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (chunked compares: C speed)."""
    n = min(len(a), len(b))
    lo, step = 0, 1024
    while lo < n:
        hi = min(n, lo + step)
        if list(a[lo:hi]) != list(b[lo:hi]):
            while a[lo] == b[lo]:
                lo += 1
            return lo
        lo = hi
    return n


class History:
    """A copy of one slot's tokens and ``h[j]``, the :func:`lcg_hash` of ``tokens[j:j+n]`` for every ``j``
    with ``j + n <= len(tokens)``.

    Attributes:
        n: the n-gram size hashed.
        tokens: the copy (a list, appended to).
        h: uint32 array; ``h[:len(tokens) - n + 1]`` is valid.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.h = np.zeros(1024, dtype=np.uint32)
        self._n_h = 0

    def sync(self, tokens: Sequence[int], full: bool = False) -> bool:
        """Bring the copy to ``tokens``; True when only tokens were appended.  ``full``: compare the whole
        history (O(len) at C speed), else its length and its last :data:`TAIL_CHECK` tokens."""
        mine, size = self.tokens, len(self.tokens)
        lo = 0 if full else max(0, size - TAIL_CHECK)
        if len(tokens) < size or list(tokens[lo:size]) != mine[lo:size]:
            self.truncate(common_prefix(tokens, mine))
            appended = False
        else:
            appended = True
        if len(tokens) > len(mine):
            mine.extend(tokens[len(mine) :])
            self._hash_new()
        return appended

    def truncate(self, size: int) -> None:
        """Forget the tokens from ``size`` on."""
        del self.tokens[size:]
        self._n_h = min(self._n_h, max(0, size - self.n + 1))

    def _hash_new(self) -> None:
        n, toks = self.n, self.tokens
        end = len(toks) - n + 1
        start = self._n_h
        if end <= start:
            return
        if end > len(self.h):
            grown = np.zeros(max(end, 2 * len(self.h)), dtype=np.uint32)
            grown[:start] = self.h[:start]
            self.h = grown
        if end - start <= 16:
            for j in range(start, end):
                self.h[j] = lcg_hash(toks, j, n)
        else:
            arr = np.asarray(toks[start : end + n - 1], dtype=np.uint64)
            h = np.zeros(end - start, dtype=np.uint64)
            for i in range(n):
                h = (h * np.uint64(LCG_FACTOR) + arr[i : i + end - start]) & np.uint64(_M32)
            self.h[start:end] = h
        self._n_h = end

    def last_match(self, pattern: list[int], lo: int, hi: int) -> int:
        """The largest ``j`` in ``[lo, hi]`` with ``tokens[j:j+n] == pattern`` (``len(pattern) == n``), or -1.
        Searches back from ``hi`` in growing windows: O(distance to the match)."""
        n, h, toks = self.n, self.h, self.tokens
        key = lcg_hash(pattern, 0, n)
        width = 64
        while hi >= lo:
            wlo = max(lo, hi - width + 1)
            for c in np.flatnonzero(h[wlo : hi + 1] == key)[::-1].tolist():
                if toks[wlo + c : wlo + c + n] == pattern:
                    return wlo + c
            hi, width = wlo - 1, width * 4
        return -1

    def recent(self, pattern: list[int], lo: int, hi: int, limit: int) -> list[int]:
        """Up to ``limit`` positions ``j`` in ``[lo, hi]`` with ``tokens[j:j+n] == pattern``, latest first."""
        n, h, toks = self.n, self.h, self.tokens
        key = lcg_hash(pattern, 0, n)
        out: list[int] = []
        width = 256
        while hi >= lo and len(out) < limit:
            wlo = max(lo, hi - width + 1)
            for c in np.flatnonzero(h[wlo : hi + 1] == key)[::-1].tolist():
                if toks[wlo + c : wlo + c + n] == pattern:
                    out.append(wlo + c)
                    if len(out) == limit:
                        break
            hi, width = wlo - 1, width * 4
        return out

    def matches(self, pattern: list[int], lo: int, hi: int) -> list[int]:
        """Every ``j`` in ``[lo, hi]`` with ``tokens[j:j+n] == pattern``, ascending."""
        if hi < lo:
            return []
        n, toks = self.n, self.tokens
        key = lcg_hash(pattern, 0, n)
        return [
            lo + c for c in np.flatnonzero(self.h[lo : hi + 1] == key).tolist() if toks[lo + c : lo + c + n] == pattern
        ]
