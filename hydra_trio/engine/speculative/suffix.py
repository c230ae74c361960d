"""``--spec-type suffix``: SuffixDecoding (Oliaro et al., NeurIPS 2025) over the node's own traffic.

hydra-trio's own drafter, beyond llama-server's types.  Two sources of earlier text:

* the slot's request so far (prompt and output): :class:`~.history.History` with a hash of every
  ``min_match``-gram, searched back from the end with numpy;
* :class:`SuffixCorpus`, the prompts and outputs of finished requests (fed by :meth:`SuffixDrafter.end`),
  bounded by a budget in tokens, least-recently-used whole sequences evicted first; an agent's next turn
  that extends an earlier sequence extends it in place.

A draft follows SuffixDecoding's suffix-tree walk, done over occurrence lists instead of tree nodes: the
occurrences of the longest suffix of the context (up to ``max_depth`` tokens) found in either source are
the node, the tokens that follow them its children with their counts.  The draft takes the most frequent
child at each step, its estimated probability the product of the count ratios along the path, times
``a**d`` where ``a`` is the slot's observed acceptance per drafted token (a geometric model fitted to the
accept feedback); it stops where that falls under ``min_token_prob``, where the occurrences run out, or at
``max_spec_factor * match_length + max_spec_offset`` tokens (SuffixDecoding's MAX_SPEC), so it drafts long
where text repeats and not at all where it does not.

Cost per step and slot: the matched occurrences (at most :data:`MAX_CANDIDATES`) are carried from step to
step and advanced by the tokens the slot took, O(candidates × new tokens); only when they run out is the
match searched again: one hash lookup in the corpus and a vectorized scan of the slot's hashes, plus
O(log max_depth) slice compares per candidate to measure its match.  The draft walk is
O(candidates × draft length).  :meth:`SuffixDrafter.begin` hashes the prompt (numpy, O(prompt));
:meth:`SuffixDrafter.end` indexes what the corpus did not hold yet, O(new tokens).
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from collections.abc import Sequence

import attrs
import numpy as np

from .base import Drafter, SlotDraft
from .history import History

MAX_CANDIDATES = 16
"""Occurrences kept per match (the most recent ones with the longest match)."""
_HASH_MULT = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


def gram_hashes(tokens: Sequence[int], k: int, lo: int, hi: int) -> list[int]:
    """The 64-bit hash of ``tokens[e-k:e]`` for each end position ``e`` in ``[lo, hi)`` (numpy)."""
    if hi <= lo:
        return []
    arr = np.asarray(tokens[lo - k : hi], dtype=np.uint64)
    h = np.zeros(hi - lo, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(k):
            h = h * np.uint64(_HASH_MULT) + arr[i : i + hi - lo]
    return h.tolist()


def gram_hash(gram: Sequence[int]) -> int:
    """:func:`gram_hashes` of one gram."""
    h = 0
    for t in gram:
        h = (h * _HASH_MULT + t) & _M64
    return h


class SuffixCorpus:
    """Earlier prompts and outputs, at most ``budget`` tokens, for :class:`SuffixDrafter`.

    An index maps the hash of each ``k``-gram to the places it ends at (``sequence id << 32 | end``, an int,
    or a list of them, oldest first); only places with a following token are indexed.  An evicted
    sequence leaves its index entries behind: lookups skip and prune them, and the index is rebuilt from the
    live sequences once dead entries outnumber live ones (amortized O(1) per token).

    Attributes:
        sequences: id -> tokens, least recently used first.
        n_tokens: tokens held.
    """

    def __init__(self, k: int, budget: int) -> None:
        self.k, self.budget = k, budget
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()
        self.n_tokens = 0
        self.n_dead = 0
        self.index: dict[int, int | list[int]] = {}
        self._next_id = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Take in a finished request's tokens; evict least-recently-used sequences beyond the budget.
        A sequence that starts with a held one (the next turn of a conversation) extends it in place; one
        that a held sequence starts with only marks that one used."""
        toks = list(tokens[-self.budget :]) if self.budget > 0 else []
        if len(toks) <= self.k:
            return
        for sid in list(itertools.islice(reversed(self.sequences), 8)):
            old = self.sequences[sid]
            if len(old) <= len(toks) and toks[: len(old)] == old:
                n0 = len(old)
                old.extend(toks[n0:])
                self._index(sid, old, n0)
                self.n_tokens += len(old) - n0
                self.sequences.move_to_end(sid)
                break
            if len(old) > len(toks) and old[: len(toks)] == toks:
                self.sequences.move_to_end(sid)
                return
        else:
            sid, self._next_id = self._next_id, self._next_id + 1
            self.sequences[sid] = toks
            self._index(sid, toks, self.k)
            self.n_tokens += len(toks)
        while self.n_tokens > self.budget and len(self.sequences) > 1:
            _, gone = self.sequences.popitem(last=False)
            self.n_tokens -= len(gone)
            self.n_dead += len(gone)
        if self.n_dead > self.n_tokens:
            self._rebuild()

    def lookup(self, gram: list[int], limit: int) -> list[tuple[list[int], int]]:
        """Up to ``limit`` places ``(tokens, end)`` where ``gram`` (``k`` tokens) ends, a following token
        there, most recent first; marks their sequences used."""
        entry = self.index.get(gram_hash(gram))
        if entry is None:
            return []
        codes = [entry] if isinstance(entry, int) else entry
        out: list[tuple[list[int], int]] = []
        dead = False
        k, seqs = self.k, self.sequences
        for code in reversed(codes):
            toks = seqs.get(code >> _POS_BITS)
            if toks is None:
                dead = True
                continue
            e = code & _POS_MASK
            if len(out) < limit and toks[e - k : e] == gram:
                out.append((toks, e))
                seqs.move_to_end(code >> _POS_BITS)
        if dead:
            self._prune(gram_hash(gram), codes)
        return out

    def _index(self, sid: int, toks: list[int], start: int) -> None:
        index, base = self.index, sid << _POS_BITS
        lo = max(self.k, start)
        for e, h in enumerate(gram_hashes(toks, self.k, lo, len(toks)), start=lo):
            entry = index.get(h)
            if entry is None:
                index[h] = base | e
            elif isinstance(entry, int):
                index[h] = [entry, base | e]
            else:
                entry.append(base | e)

    def _prune(self, h: int, codes: list[int]) -> None:
        live = [c for c in codes if (c >> _POS_BITS) in self.sequences]
        if not live:
            del self.index[h]
        else:
            self.index[h] = live[0] if len(live) == 1 else live

    def _rebuild(self) -> None:
        self.index, self.n_dead = {}, 0
        for sid in sorted(self.sequences):  # ids grow with age of first insertion: oldest entries first
            self._index(sid, self.sequences[sid], self.k)


@attrs.define
class _SlotState:
    """One slot's match and acceptance statistics."""

    history: History
    candidates: list[tuple[list[int] | None, int]] = attrs.field(factory=list)  # (tokens | None: the slot's, end)
    match_len: int = 0
    ctx_len: int = 0  # context length (tokens + id_last) the candidates were advanced to
    id_last: int = -1
    n_ok: float = 0.0  # drafted tokens accepted (decayed)
    n_fail: float = 0.0  # drafts cut short by a rejected token (decayed)
    last_draft: int = 0


def _acceptance(st: _SlotState) -> float:
    return (st.n_ok + ACCEPT_PRIOR * ACCEPT_PRIOR_WEIGHT) / (st.n_ok + st.n_fail + ACCEPT_PRIOR_WEIGHT)


ACCEPT_PRIOR = 0.9
"""Acceptance per drafted token assumed before any feedback, weighted as :data:`ACCEPT_PRIOR_WEIGHT` trials."""
ACCEPT_PRIOR_WEIGHT = 10.0
ACCEPT_DECAY = 0.95
"""Weight of older feedback, per accept."""


class SuffixDrafter(Drafter):
    """``--spec-type suffix`` (``--spec-suffix-*``); see the module docstring.

    Args:
        n_seq: slots.
        n_max: most tokens per draft.
        max_depth: longest context suffix matched (tokens).
        min_match: shortest match that drafts (tokens; the gram the sources are indexed by).
        max_spec_factor, max_spec_offset: a draft is at most ``factor * match_length + offset`` tokens.
        min_token_prob: a drafted token's estimated acceptance probability must reach this.
        cache_tokens: budget of the corpus of finished requests (0: none kept).
    """

    name = "suffix"

    def __init__(
        self,
        n_seq: int,
        n_max: int = 64,
        max_depth: int = 64,
        min_match: int = 3,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        cache_tokens: int = 262144,
    ) -> None:
        super().__init__(n_seq, n_max)
        self.max_depth, self.k = max(max_depth, min_match), min_match
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.min_token_prob = min_token_prob
        self.corpus = SuffixCorpus(min_match, cache_tokens)
        self.slots = [_SlotState(History(min_match)) for _ in range(n_seq)]

    # --- the contract ---------------------------------------------------------------------------------

    def begin(self, id_slot: int, prompt: Sequence[int]) -> None:
        st = self.slots[id_slot]
        st.history.sync(prompt, full=True)
        st.candidates, st.ctx_len = [], 0  # the acceptance statistics stay with the slot

    def draft(self, drafts: list[SlotDraft]) -> None:
        for sd in drafts:
            sd.result[:] = self._draft_one(sd)

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        st = self.slots[id_slot]
        if is_other or st.last_draft <= 0:
            return
        st.n_ok = ACCEPT_DECAY * st.n_ok + n_accepted
        st.n_fail = ACCEPT_DECAY * st.n_fail + (1.0 if n_accepted < st.last_draft else 0.0)
        st.last_draft = 0

    def end(self, id_slot: int, tokens: Sequence[int]) -> None:
        self.corpus.add(tokens)
        self.slots[id_slot].candidates = []

    def get_state(self, id_slot: int) -> bytes | None:
        """The slot's acceptance statistics (two float64): the match is found again from the tokens."""
        st = self.slots[id_slot]
        return struct.pack("<2d", st.n_ok, st.n_fail)

    def set_state(self, id_slot: int, data: bytes) -> None:
        """Restore :meth:`get_state`'s statistics.  Raises ValueError: not 16 bytes."""
        if len(data) != 16:
            raise ValueError(f"suffix drafter state: {len(data)} bytes, expected 16")
        st = self.slots[id_slot]
        st.n_ok, st.n_fail = struct.unpack("<2d", data)
        st.candidates, st.ctx_len = [], 0

    def acceptance(self, id_slot: int) -> float:
        """The slot's estimated acceptance probability per drafted token."""
        return _acceptance(self.slots[id_slot])

    # --- matching -------------------------------------------------------------------------------------

    def _draft_one(self, sd: SlotDraft) -> list[int]:
        st = self.slots[sd.id_slot]
        hist = st.history
        appended = hist.sync(sd.tokens)
        toks = hist.tokens
        ctx_len = len(toks) + 1
        keep = bool(st.candidates) and appended and 0 < st.ctx_len <= ctx_len
        if keep:  # the context grew from the one the candidates were advanced to
            keep = sd.id_last == st.id_last if st.ctx_len == ctx_len else toks[st.ctx_len - 1] == st.id_last
        if keep:
            self._advance(st, sd.id_last, ctx_len)
        else:
            st.candidates = []
        st.ctx_len, st.id_last = ctx_len, sd.id_last
        if not st.candidates and ctx_len >= self.k:
            self._anchor(st, sd.id_last)
        st.last_draft = 0
        if not st.candidates:
            return []
        n_max = min(sd.n_max, self.n_max, int(self.max_spec_factor * st.match_len + self.max_spec_offset))
        out = self._walk(st, sd.id_last, n_max)
        st.last_draft = len(out)
        return out

    def _advance(self, st: _SlotState, id_last: int, ctx_len: int) -> None:
        """Carry the candidates over the tokens the context gained since the last draft."""
        toks, n_tok = st.history.tokens, len(st.history.tokens)
        cands = st.candidates
        for p in range(st.ctx_len, ctx_len):
            x = toks[p] if p < n_tok else id_last
            nxt = []
            for src, e in cands:
                t: int | None
                if src is None:
                    t = toks[e] if e < n_tok else id_last
                else:
                    t = src[e] if e < len(src) else None
                if t == x:
                    nxt.append((src, e + 1))
            cands = nxt
            if not cands:
                break
        st.candidates = cands
        st.match_len = min(self.max_depth, st.match_len + (ctx_len - st.ctx_len))

    def _anchor(self, st: _SlotState, id_last: int) -> None:
        """Find the occurrences of the longest context suffix (at least ``min_match`` tokens) in the slot's
        history and the corpus."""
        k, depth = self.k, self.max_depth
        hist = st.history
        n_tok = len(hist.tokens)
        tail = hist.tokens[max(0, n_tok - depth + 1) :]
        tail.append(id_last)
        gram = tail[-k:]
        found: list[tuple[list[int] | None, int, int]] = []
        for j in hist.recent(gram, 0, n_tok - k, MAX_CANDIDATES):
            found.append((None, j + k, self._extend(hist.tokens, j + k, tail)))
        for src, e in self.corpus.lookup(gram, MAX_CANDIDATES):
            found.append((src, e, self._extend(src, e, tail)))
        if not found:
            st.candidates, st.match_len = [], 0
            return
        best = max(f[2] for f in found)
        st.candidates = [(src, e) for src, e, n in found if n == best]
        st.match_len = best

    def _extend(self, seq: list[int], e: int, tail: list[int]) -> int:
        """How many tokens before ``seq[e]`` equal the end of ``tail`` (at least ``min_match``, which the
        caller checked; at most ``max_depth``)."""
        cap = min(len(tail), e)
        n = self.k
        while n < cap and n < 8:
            if seq[e - n - 1] != tail[-n - 1]:
                return n
            n += 1
        if n >= cap or seq[e - cap : e] == tail[-cap:]:
            return cap
        lo, hi = n, cap  # seq matches lo tokens, not hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if seq[e - mid : e] == tail[-mid:]:
                lo = mid
            else:
                hi = mid
        return lo

    def _walk(self, st: _SlotState, id_last: int, n_max: int) -> list[int]:
        """Follow the most frequent continuation of the candidates while its estimated acceptance
        probability (count ratios along the path times ``a**d``) reaches ``min_token_prob``."""
        toks = st.history.tokens
        n_tok = len(toks)
        a = _acceptance(st)
        out: list[int] = []
        cands = st.candidates
        prob = 1.0
        while len(out) < n_max and cands:
            counts: dict[int, int] = {}
            nexts: list[tuple[int, tuple[list[int] | None, int]]] = []
            for src, e in cands:
                if src is None:
                    t = toks[e] if e < n_tok else id_last if e == n_tok else out[e - n_tok - 1]
                elif e < len(src):
                    t = src[e]
                else:
                    continue  # the sequence ends here: its share of the count leads nowhere
                counts[t] = counts.get(t, 0) + 1
                nexts.append((t, (src, e + 1)))
            if not counts:
                break
            best = max(counts, key=counts.__getitem__)  # ties: the most recent occurrence's token
            prob *= counts[best] / len(cands)
            if prob * a ** (len(out) + 1) < self.min_token_prob:
                break
            out.append(best)
            cands = [c for t, c in nexts if t == best]
        return out
