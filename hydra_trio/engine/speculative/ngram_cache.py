"""llama.cpp's n-gram lookup cache (``--spec-type ngram-cache``, ``-lcs``/``-lcd``) and its file format.

After ``common/ngram-cache.{h,cpp}`` and ``common_speculative_impl_ngram_cache`` in
``common/speculative.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors: a cache maps an n-gram
of 1 to 4 tokens (padded to 4 with ``LLAMA_TOKEN_NULL``, -1) to the counts of the tokens that followed
it.  Drafting looks up the context cache (this request), then the dynamic cache (``-lcd``, earlier
generations), then the static cache (``-lcs``, a corpus), one token at a time.

A cache is a dict ``{(t0, t1, t2, t3): {token: count}}``; each inner dict keeps its tokens in the order
they were first counted.  Where two tokens tie for the most counts, llama.cpp takes the first in the
iteration order of its ``std::unordered_map<int32_t, int32_t>`` (libstdc++), which depends on that
insertion order: :func:`std_unordered_order` replays it, so ties resolve as llama-server's do.

File format (``common_ngram_cache_save``/``_load``): records of little-endian int32s, back to back, no
header: the 4 tokens of the n-gram, ``ntokens`` (> 0), then ``ntokens`` pairs ``(token, count)``
(count > 0).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from typing import Any

import numpy as np

from .base import Drafter, SlotDraft

LLAMA_NGRAM_MIN = 1
LLAMA_NGRAM_MAX = 4
LLAMA_NGRAM_STATIC = 2
LLAMA_TOKEN_NULL = -1
NGRAM_CACHE_N_DRAFT = 8
"""Tokens the ngram-cache type drafts at most (llama-server's ``create_state_ngram_cache`` fixes it)."""

Ngram = tuple[int, ...]
"""An n-gram key: always ``LLAMA_NGRAM_MAX`` tokens, a shorter n-gram padded with ``LLAMA_TOKEN_NULL``."""
NgramCacheMap = dict[Ngram, dict[int, int]]

# If sample size or percentage are below these thresholds the draft is aborted early (index: n-gram size - 1).
DRAFT_MIN_SAMPLE_SIZE_LAX = (2, 2, 1, 1)
DRAFT_MIN_PERCENT_LAX = (66, 50, 50, 50)
DRAFT_MIN_SAMPLE_SIZE_STRICT = (4, 3, 2, 2)
DRAFT_MIN_PERCENT_STRICT = (75, 66, 66, 66)

_BUCKET_GROWTH = (
    (13, 13),
    (28, 29),
    (58, 59),
    (126, 127),
    (256, 257),
    (540, 541),
    (1108, 1109),
    (2356, 2357),
    (5086, 5087),
    (10272, 10273),
    (20752, 20753),
    (42042, 42043),
    (85228, 85229),
    (172932, 172933),
    (351060, 351061),
    (712696, 712697),
    (1447152, 1447153),
    (2938678, 2938679),
    (5967346, 5967347),
    (12117361, 12117361),
    (24607243, 24607243),
    (49969847, 49969847),
)
"""libstdc++'s bucket counts of an ``unordered_map`` filled by single inserts: ``(n, buckets)``: up to ``n``
elements it has ``buckets`` buckets (its ``_Prime_rehash_policy``: the first insert makes 13, each rehash
the prime at or after twice the count)."""


def std_unordered_order(keys: Iterable[int]) -> list[int]:
    """The iteration order of a libstdc++ ``std::unordered_map<int32_t, V>`` after inserting ``keys`` (distinct,
    in this order) one by one: each new node goes first in its bucket, or first in the whole list when its
    bucket is empty; a rehash relinks the list front to back the same way.  O(len(keys))."""
    head = None  # the list's head: no key (the keys are ints)
    nxt: dict[int | None, int | None] = {head: None}
    buckets: dict[int, int | None] = {}
    n_bkt, grow = 1, 0
    for count, key in enumerate(keys):
        if count + 1 > n_bkt:  # rehash before linking the new node
            while _BUCKET_GROWTH[grow][0] < count + 1:
                grow += 1
            n_bkt = _BUCKET_GROWTH[grow][1]
            node, nxt[head], bbegin, buckets = nxt[head], None, 0, {}
            while node is not None:
                after, bkt = nxt[node], node % n_bkt
                if bkt not in buckets:
                    nxt[node], nxt[head], buckets[bkt] = nxt[head], node, head
                    if nxt[node] is not None:
                        buckets[bbegin] = node
                    bbegin = bkt
                else:
                    nxt[node], nxt[buckets[bkt]] = nxt[buckets[bkt]], node
                node = after
        bkt = (key & 0xFFFFFFFFFFFFFFFF) % n_bkt
        if bkt in buckets:
            nxt[key], nxt[buckets[bkt]] = nxt[buckets[bkt]], key
        else:
            nxt[key], nxt[head] = nxt[head], key
            first = nxt[key]
            if first is not None:
                buckets[first % n_bkt] = key
            buckets[bkt] = head
    out: list[int] = []
    node = nxt[head]
    while node is not None:
        out.append(node)
        node = nxt[node]
    return out


class NgramCache:
    """A lookup cache (``common_ngram_cache``): ``parts[ngram] = {token: count}``, tokens in the order first
    counted, plus what drafting reads of each part, kept as counts change: the total, the highest count, the
    tokens that have it, and the part's libstdc++ iteration order (made when a tie needs it, until a new
    token joins the part)."""

    def __init__(self, parts: NgramCacheMap | None = None) -> None:
        self.parts: NgramCacheMap = parts if parts is not None else {}
        self._meta: dict[Ngram, list[Any]] = {}  # ngram -> [total, max count, tokens with it, order | None]

    def __len__(self) -> int:
        return len(self.parts)

    def get(self, key: Ngram) -> dict[int, int] | None:
        return self.parts.get(key)

    def meta(self, key: Ngram) -> list[Any]:
        m = self._meta.get(key)
        if m is None:
            part = self.parts[key]
            top = max(part.values())
            m = self._meta[key] = [sum(part.values()), top, [t for t, c in part.items() if c == top], None]
        return m

    def count(self, key: Ngram, token: int, n: int = 1) -> None:
        """Add ``n`` to the count of ``token`` after ``key``."""
        part = self.parts.get(key)
        if part is None:
            self.parts[key] = {token: n}
            self._meta.pop(key, None)
            return
        c = part.get(token, 0) + n
        m = self._meta.get(key)
        if m is not None:
            if token not in part:
                m[3] = None
            m[0] += n
            if c > m[1]:
                m[1], m[2] = c, [token]
            elif c == m[1]:
                m[2].append(token)
        part[token] = c

    def first_in_order(self, key: Ngram, tied: set[int]) -> int:
        """The first of ``tied`` in the part's libstdc++ iteration order (:func:`std_unordered_order`)."""
        if len(tied) == 1:
            return next(iter(tied))
        m = self.meta(key)
        if m[3] is None:
            m[3] = std_unordered_order(self.parts[key])
        return next(t for t in m[3] if t in tied)


def ngram_of(tokens: Sequence[int], start: int, size: int) -> Ngram:
    """The cache key of ``tokens[start:start+size]`` (``common_ngram``: padded with -1 to 4 tokens)."""
    pad = (LLAMA_TOKEN_NULL,) * (LLAMA_NGRAM_MAX - size)
    return tuple(tokens[start : start + size]) + pad


def ngram_cache_update(cache: NgramCache, ngram_min: int, ngram_max: int, inp: Sequence[int], nnew: int) -> None:
    """Count in ``cache`` the token after each n-gram (sizes ``ngram_min..ngram_max``) of the last ``nnew``
    tokens of ``inp`` (``common_ngram_cache_update``; ``inp`` may only have grown since the last call)."""
    n = len(inp)
    for size in range(ngram_min, ngram_max + 1):
        pad = (LLAMA_TOKEN_NULL,) * (LLAMA_NGRAM_MAX - size)
        for i in range(max(n - nnew, size), n):
            cache.count(tuple(inp[i - size : i]) + pad, inp[i])


def _try_draft_static(nc_static: NgramCache, ngram_static: Ngram) -> int:
    if nc_static.get(ngram_static) is None:
        return LLAMA_TOKEN_NULL
    total, max_count, tops, _ = nc_static.meta(ngram_static)
    if total < DRAFT_MIN_SAMPLE_SIZE_LAX[LLAMA_NGRAM_STATIC - 1]:
        return LLAMA_TOKEN_NULL
    if 100 * max_count < DRAFT_MIN_PERCENT_LAX[LLAMA_NGRAM_STATIC - 1] * total:
        return LLAMA_TOKEN_NULL
    return nc_static.first_in_order(ngram_static, set(tops))


def _best_weighted(cache: NgramCache, key: Ngram, part_static: Mapping[int, int]) -> int:
    """The token of the part with the highest ``count * (100 * static count, or 1 if not in the static
    part)``, the first in iteration order among equals (as llama.cpp's strict ``>`` scan)."""
    part = cache.parts[key]
    _, top, tops, _ = cache.meta(key)
    if not part_static:
        return cache.first_in_order(key, set(tops))
    small, big = (part, part_static) if len(part) <= len(part_static) else (part_static, part)
    scores = {t: 100 * part[t] * part_static[t] for t in small if t in big}
    if not scores:
        return cache.first_in_order(key, set(tops))
    s_best = max(scores.values())
    tied = {t for t, sc in scores.items() if sc == s_best}
    plain = {t for t in tops if t not in part_static}  # the best tokens without a static count score `top`
    if plain and top >= s_best:
        tied = plain if top > s_best else tied | plain
    return cache.first_in_order(key, tied)


def _try_draft(
    nc_primary: NgramCache,
    ngrams_primary: list[Ngram],
    part_static: Mapping[int, int],
    min_sample_size: tuple[int, ...],
    min_percent: tuple[int, ...],
) -> int:
    for i in range(len(ngrams_primary) - 1, -1, -1):
        key = ngrams_primary[i]
        part = nc_primary.get(key)
        if part is None:
            continue
        total = nc_primary.meta(key)[0]
        if total < min_sample_size[i]:
            continue
        token = _best_weighted(nc_primary, key, part_static)
        if 100 * part[token] < min_percent[i] * total:
            continue
        return token
    return LLAMA_TOKEN_NULL


def ngram_cache_draft(
    inp: Sequence[int],
    draft: list[int],
    n_draft: int,
    ngram_min: int,
    ngram_max: int,
    nc_context: NgramCache,
    nc_dynamic: NgramCache,
    nc_static: NgramCache,
) -> None:
    """Append up to ``n_draft`` tokens to ``draft`` (which holds the last sampled token, as in
    ``common_ngram_cache_draft``): each from the context cache (lax thresholds), else the dynamic cache
    (strict), else the static cache; the context and dynamic candidates are weighed by the static counts."""
    assert len(draft) == 1
    n = len(inp)
    if n < LLAMA_NGRAM_STATIC:
        return

    def token_at(i: int) -> int:
        # before the first token (an input shorter than 4 tokens): llama.cpp reads out of bounds there;
        # -2 is no token and no padding, so such an n-gram finds nothing
        return inp[i] if 0 <= i < n else draft[1 + i - n] if i >= n else -2

    while len(draft) - 1 < n_draft:
        start = n - LLAMA_NGRAM_STATIC + len(draft) - 1
        ngram_static = tuple(token_at(j) for j in range(start, start + LLAMA_NGRAM_STATIC)) + (LLAMA_TOKEN_NULL,) * (
            LLAMA_NGRAM_MAX - LLAMA_NGRAM_STATIC
        )
        part_static = nc_static.get(ngram_static) or {}
        ngrams_cd = []
        for size in range(ngram_min, ngram_max + 1):
            start = n - size + len(draft) - 1
            ngrams_cd.append(
                tuple(token_at(j) for j in range(start, start + size)) + (LLAMA_TOKEN_NULL,) * (LLAMA_NGRAM_MAX - size)
            )
        token = _try_draft(nc_context, ngrams_cd, part_static, DRAFT_MIN_SAMPLE_SIZE_LAX, DRAFT_MIN_PERCENT_LAX)
        if token == LLAMA_TOKEN_NULL:
            token = _try_draft(
                nc_dynamic, ngrams_cd, part_static, DRAFT_MIN_SAMPLE_SIZE_STRICT, DRAFT_MIN_PERCENT_STRICT
            )
        if token == LLAMA_TOKEN_NULL:
            token = _try_draft_static(nc_static, ngram_static)
        if token == LLAMA_TOKEN_NULL:
            break
        draft.append(token)


def ngram_cache_merge(target: NgramCache, add: NgramCache) -> None:
    """Add the counts of ``add`` to ``target`` (``common_ngram_cache_merge``)."""
    for key, part in add.parts.items():
        if key not in target.parts:
            target.parts[key] = dict(part)
            continue
        for token, count in part.items():
            target.count(key, token, count)


def ngram_cache_save(cache: NgramCache, path: str | PathLike[str]) -> None:
    """Write ``cache`` in llama.cpp's lookup-cache format (``common_ngram_cache_save``), tokens of each
    n-gram in the order they were counted (the order a llama.cpp load then iterates them in).

    Raises:
        OSError: the file cannot be written.
        ValueError: an empty count list or a count ≤ 0 (llama.cpp asserts the same).
    """
    out = bytearray()
    for key, part in cache.parts.items():
        if not part or min(part.values()) <= 0:
            raise ValueError(f"n-gram {key}: empty or non-positive counts")
        out += struct.pack(f"<5i{2 * len(part)}i", *key, len(part), *(x for kv in part.items() for x in kv))
    with open(path, "wb") as f:
        f.write(out)


def ngram_cache_load(path: str | PathLike[str]) -> NgramCache:
    """Read a lookup cache that llama.cpp's ``common_ngram_cache_save`` (``llama-lookup-create``,
    ``llama-lookup``) or :func:`ngram_cache_save` wrote.

    Raises:
        OSError: the file cannot be read.
        ValueError: a truncated record, ``ntokens`` ≤ 0 or a count ≤ 0 (where llama.cpp aborts).
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) % 4:
        raise ValueError(f"{path}: {len(data)} bytes is not a whole number of int32 values")
    values = np.frombuffer(data, dtype="<i4").tolist()
    cache: NgramCacheMap = {}
    i, end = 0, len(values)
    while i < end:
        if i + 5 > end:
            raise ValueError(f"{path}: record at byte {4 * i} is truncated")
        key, ntokens = tuple(values[i : i + 4]), values[i + 4]
        if ntokens <= 0 or i + 5 + 2 * ntokens > end:
            raise ValueError(f"{path}: record at byte {4 * i} has ntokens={ntokens} (file of {len(data)} bytes)")
        pairs = values[i + 5 : i + 5 + 2 * ntokens]
        counts = pairs[1::2]
        if min(counts) <= 0:
            raise ValueError(f"{path}: record at byte {4 * i} has a count ≤ 0")
        part = dict(zip(pairs[0::2], counts, strict=True))
        cache.setdefault(key, part)  # emplace: an n-gram seen twice keeps the first
        i += 5 + 2 * ntokens
    return NgramCache(cache)


class NgramCacheDrafter(Drafter):
    """``--spec-type ngram-cache``: llama-server's ``common_speculative_impl_ngram_cache``.

    Per slot a context cache, plus copies of the static (``-lcs``) and dynamic (``-lcd``) caches loaded at
    start.  As llama-server: :meth:`begin` does nothing and the context cache lives as long as the slot;
    each draft counts the n-grams of the tokens beyond those already counted (the part of the history
    that is new since the last draft, followed by ``id_last``) and drafts up to 8 tokens; neither file is
    written back.

    Raises:
        OSError, ValueError: from :func:`ngram_cache_load` (llama-server aborts at start).
    """

    name = "ngram-cache"

    def __init__(self, n_seq: int, lookup_cache_static: str = "", lookup_cache_dynamic: str = "") -> None:
        super().__init__(n_seq, NGRAM_CACHE_N_DRAFT)
        static = ngram_cache_load(lookup_cache_static) if lookup_cache_static else NgramCache()
        dynamic = ngram_cache_load(lookup_cache_dynamic) if lookup_cache_dynamic else NgramCache()
        self.n_draft = NGRAM_CACHE_N_DRAFT
        self.cache_size = [0] * n_seq
        self.context = [NgramCache() for _ in range(n_seq)]
        # the static and dynamic caches are never written: the slots share one copy each
        self.static, self.dynamic = static, dynamic

    def draft(self, drafts: list[SlotDraft]) -> None:
        for sd in drafts:
            self._draft_one(sd)

    def _draft_one(self, sd: SlotDraft) -> None:
        slot, prompt = sd.id_slot, sd.tokens
        if self.cache_size[slot] < len(prompt) + 1:
            tokens_new = list(prompt[self.cache_size[slot] :])
            tokens_new.append(sd.id_last)
            ngram_cache_update(self.context[slot], LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, tokens_new, len(tokens_new))
            self.cache_size[slot] = len(prompt) + 1
        tail = list(prompt[-(LLAMA_NGRAM_MAX - 1) :])
        tail.append(sd.id_last)  # the draft reads the last LLAMA_NGRAM_MAX tokens of the input only
        draft = [sd.id_last]
        ngram_cache_draft(
            tail, draft, self.n_draft, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, self.context[slot], self.dynamic, self.static
        )
        sd.result[:] = draft[1:]
