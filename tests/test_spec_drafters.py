"""The model-free drafters (hydra_trio/engine/speculative/): llama-server's ngram-simple, ngram-map-k,
ngram-map-k4v, ngram-mod and ngram-cache draw llama-server's drafts for the same history; the lookup-cache
files are llama.cpp's format; the suffix drafter; the combiner; the ``--spec-*`` settings.

Expected drafts are worked out by hand from ``common/ngram-map.cpp``, ``common/ngram-mod.cpp``,
``common/ngram-cache.cpp`` and ``common/speculative.cpp`` of the llama.cpp that llama-cpp-python 0.3.36
vendors; each test says how.  Pure and deterministic: token lists, no model (one test tokenizes with the
packaged model's vocabulary).
"""

from __future__ import annotations

import math
import re
import struct
import tarfile

import pytest

from hydra_trio.engine.speculative.base import Drafter, SlotDraft
from hydra_trio.engine.speculative.combine import Speculative, make_speculative
from hydra_trio.engine.speculative.ngram_cache import (
    NgramCache,
    NgramCacheDrafter,
    ngram_cache_load,
    ngram_cache_save,
    ngram_cache_update,
    std_unordered_order,
)
from hydra_trio.engine.speculative.ngram_map import NgramMapK4vDrafter, NgramMapKDrafter, NgramSimpleDrafter
from hydra_trio.engine.speculative.ngram_mod import NGRAM_MOD_SIZE, NgramModDrafter
from hydra_trio.engine.speculative.settings import (
    SPEC_OPTIONS,
    SpecSettings,
    apply_option,
    parse_spec_type,
    types_from_names,
)
from hydra_trio.engine.speculative.suffix import SuffixCorpus, SuffixDrafter

from .llama_arg_cpp import VERSION, sdist, server_flags


def draft(d: Drafter, tokens: list[int], id_last: int, slot: int = 0, n_max: int = 1000) -> list[int]:
    sd = SlotDraft(slot, n_max, len(tokens) + 1, id_last, list(tokens))
    d.draft([sd])
    return sd.result


# --------------------------------------------------------------------------- ngram-simple


def test_ngram_simple_drafts_what_followed_the_latest_earlier_match() -> None:
    # common_ngram_simple_draft with size_n=2, size_m=3: the pattern is the last token and id_last; the search
    # goes from cur_len-n-1 down to position 1 (position 0 never matches); the draft is the m tokens after the
    # match, fewer when the history ends first, none when fewer than n follow; none when cur_len <= n+m+1
    d = NgramSimpleDrafter(1, size_n=2, size_m=3)
    assert draft(d, [9, 1, 2, 3, 4, 5, 1], 2) == [3, 4, 5]  # [1, 2] at 1
    assert draft(d, [1, 2, 3, 4, 5, 6, 1], 2) == []  # only at position 0
    assert draft(d, [7, 1, 2, 8, 1, 2, 9, 5, 5, 1], 2) == [9, 5, 5]  # at 4, not at 1
    assert draft(d, [5, 6, 7, 8, 9, 1, 2, 1], 2) == []  # at 5: one token follows, fewer than n
    assert draft(d, [1, 2, 3, 4, 5, 1], 2) == []  # 6 tokens: not more than n+m+1


# --------------------------------------------------------------------------- ngram-map-k / -k4v


def test_ngram_map_k_drafts_as_long_as_the_key_was_last_accepted() -> None:
    # common_ngram_map_draft, key_only, n=2, m=3: a new key drafts m tokens after its match; accept(k) makes
    # that key draft min(m, k) tokens from then on (common_ngram_map_accept), 0 for good after accept(0)
    d = NgramMapKDrafter(1, size_n=2, size_m=3, min_hits=1)
    spec = Speculative([d])
    h = [9, 1, 2, 3, 4, 5, 6, 7, 1]
    assert draft(spec, h, 2) == [3, 4, 5]  # the key [1, 2] matches at 1 (scan from cur_len-n-m-1 down)
    spec.accept(0, 2)
    h += [2, 9, 1]
    assert draft(spec, h, 2) == [3, 4]  # found through the hash map; 2 tokens were accepted last time
    spec.accept(0, 0)
    h += [2, 8, 1]
    assert draft(spec, h, 2) == []
    assert d.maps[0].keys[0].key_num == 3 and d.maps[0].keys[0].values[0].n_accepted == 0


def test_ngram_map_k4v_drafts_when_one_value_dominates_and_copies_the_match() -> None:
    # key_only=false, n=2, m=2, min_hits=1: the m-grams after each earlier [1, 2] up to the match are counted
    # (slots of up to 4 values); a draft needs max >= 2 * (sum of the others); the draft is the m tokens after
    # the match position, not the most frequent value
    d = NgramMapK4vDrafter(1, size_n=2, size_m=2, min_hits=1)
    assert draft(d, [0, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 8, 1], 2) == [5, 6]  # [3,4] twice, [5,6] once
    d = NgramMapK4vDrafter(1, size_n=2, size_m=2, min_hits=1)
    assert draft(d, [0, 1, 2, 3, 4, 1, 2, 5, 6, 8, 1], 2) == []  # once each: 1 < 2 * 1


# --------------------------------------------------------------------------- ngram-mod


def test_ngram_mod_follows_the_shared_table_from_the_prompt() -> None:
    # begin adds prompt[i:i+n] -> prompt[i+n] for i < len-n; drafting adds newer n-grams only in chunks of 32,
    # so [4, 5] -> 1 is not in the table yet and the draft stops after 3 tokens (>= n_min=2); the table is
    # shared by all slots
    d = NgramModDrafter(2, n_match=2, n_max=4, n_min=2)
    d.begin(0, [1, 2, 3, 4, 5])
    assert draft(d, [1, 2, 3, 4, 5, 1], 2) == [3, 4, 5]
    assert draft(d, [1, 2, 3, 4, 5, 1], 2, slot=1) == [3, 4, 5]
    d = NgramModDrafter(1, n_match=2, n_max=4, n_min=4)
    d.begin(0, [1, 2, 3, 4, 5])
    assert draft(d, [1, 2, 3, 4, 5, 1], 2) == []  # stopped before n_min


def test_ngram_mod_entries_collide_as_llama_cpps() -> None:
    # with n_match=1 the entry of [t] is t mod 4 Mi (common_ngram_mod::idx): [5] and [5 + 4 Mi] share one entry,
    # and the later add overwrites it
    d = NgramModDrafter(1, n_match=1, n_max=2, n_min=1)
    d.begin(0, [5, 7, 5 + NGRAM_MOD_SIZE, 8, 9])
    assert draft(d, [3], 5) == [8, 9]  # not 7


def test_ngram_mod_clears_its_table_after_five_poorly_accepted_drafts() -> None:
    # accept: n_accepted / n_draft_last < 0.25 five times in a row resets the table (and that slot's i_last)
    d = NgramModDrafter(1, n_match=2, n_max=4, n_min=2)
    d.begin(0, [1, 2, 3, 4, 5])
    spec = Speculative([d])
    for _ in range(4):
        assert draft(spec, [1, 2, 3, 4, 5, 1], 2) == [3, 4, 5]
        spec.accept(0, 0)
    d.accept(0, 0, is_other=True)  # another drafter's draft: ignored
    assert draft(spec, [1, 2, 3, 4, 5, 1], 2) == [3, 4, 5]
    spec.accept(0, 1)  # 1/3 >= 0.25: the streak starts over
    for _ in range(5):
        assert draft(spec, [1, 2, 3, 4, 5, 1], 2) == [3, 4, 5]
        spec.accept(0, 0)
    assert d.mod.used == 0 and draft(spec, [1, 2, 3, 4, 5, 1], 2) == []


# --------------------------------------------------------------------------- ngram-cache


def test_ngram_cache_drafts_from_the_context_cache() -> None:
    # the context cache counts the 1..4-grams of tokens + id_last = [1,2,3,1,2,3]; each draft token comes from
    # the longest n-gram found whose counts pass the lax thresholds ([1,2,3] -> 1, [1,2,3,1] -> 2, ...), up to 8
    d = NgramCacheDrafter(1)
    assert draft(d, [1, 2, 3, 1, 2], 3) == [1, 2, 3, 1, 2, 3, 1, 2]


def test_ngram_cache_ties_resolve_in_libstdcxx_iteration_order() -> None:
    # [5, 6] was followed by 1, then by 14: counts 1 and 1, 50% passes the 2-gram lax threshold; llama.cpp keeps
    # the first maximum of its std::unordered_map scan: a new key goes first in its bucket or first in the list
    # (13 buckets), so with two keys the one counted last comes first
    assert std_unordered_order([1, 14]) == [14, 1] and std_unordered_order([14, 1]) == [1, 14]
    assert std_unordered_order([1, 2, 14]) == [2, 14, 1]  # 14 shares 1's bucket: it goes in front of 1 only
    assert draft(NgramCacheDrafter(1), [5, 6, 1, 5, 6, 14, 9, 5], 6) == [14, 9, 5, 6, 14, 9, 5, 6]


def _record(key: tuple[int, int, int, int], counts: list[tuple[int, int]]) -> bytes:
    """One record of common_ngram_cache_save: the 4 tokens of the n-gram (int32, -1 padded), ntokens (int32),
    then (token, count) int32 pairs, little-endian (x86-64), no header."""
    return struct.pack("<4ii", *key, len(counts)) + b"".join(struct.pack("<ii", t, c) for t, c in counts)


def test_ngram_cache_reads_llama_cpps_lookup_cache_files(tmp_path) -> None:
    static = tmp_path / "static.bin"
    static.write_bytes(_record((7, 8, -1, -1), [(9, 3), (10, 1)]) + _record((5, 6, -1, -1), [(1, 1)]))
    # tokens [7] + id_last 8: nothing in the context or dynamic cache; the static 2-gram [7, 8] has 9 at 3 of 4
    # (>= 2 samples, >= 50%); [8, 9] is not in it: the draft ends
    assert draft(NgramCacheDrafter(1, lookup_cache_static=str(static)), [7], 8) == [9]
    # the static counts weigh the context's candidates: 1 (static count 1: score 1*100) beats 14 (score 1)
    assert draft(NgramCacheDrafter(1, lookup_cache_static=str(static)), [5, 6, 1, 5, 6, 14, 9, 5], 6)[0] == 1
    dynamic = tmp_path / "dynamic.bin"
    dynamic.write_bytes(_record((7, 8, -1, -1), [(11, 3)]) + _record((8, 11, -1, -1), [(12, 2)]))
    # the dynamic cache (strict: 3 samples at >= 66% for a 2-gram) comes before the static one; [8, 11] has only
    # 2 samples: the static cache has nothing for it either
    got = draft(NgramCacheDrafter(1, str(static), str(dynamic)), [7], 8)
    assert got == [11]


def test_ngram_cache_file_round_trip_and_format(tmp_path) -> None:
    cache = NgramCache()
    ngram_cache_update(cache, 1, 4, [1, 2], 2)
    ngram_cache_save(cache, tmp_path / "one.bin")
    assert (tmp_path / "one.bin").read_bytes() == _record((1, -1, -1, -1), [(2, 1)])
    cache = NgramCache()
    ngram_cache_update(cache, 1, 4, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], 16)
    ngram_cache_save(cache, tmp_path / "pi.bin")
    back = ngram_cache_load(tmp_path / "pi.bin")
    assert back.parts == cache.parts and len(back) == len(cache) > 40
    assert [list(p) for p in back.parts.values()] == [list(p) for p in cache.parts.values()]  # token order kept
    (tmp_path / "cut.bin").write_bytes(_record((1, -1, -1, -1), [(2, 1), (3, 1)])[:-4])
    with pytest.raises(ValueError, match=r"truncated|ntokens"):
        ngram_cache_load(tmp_path / "cut.bin")
    (tmp_path / "zero.bin").write_bytes(_record((1, -1, -1, -1), []))
    with pytest.raises(ValueError, match="ntokens=0"):
        ngram_cache_load(tmp_path / "zero.bin")
    with pytest.raises(OSError):
        NgramCacheDrafter(1, lookup_cache_static=str(tmp_path / "missing.bin"))


# --------------------------------------------------------------------------- suffix


def test_suffix_drafts_the_continuation_of_the_longest_match_up_to_the_match_length() -> None:
    d = SuffixDrafter(1)
    # [1, 2, 3, 4] (tokens + id_last) matched at the start, 4 tokens: at most 1.0 * 4 tokens drafted
    assert draft(d, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], 4) == [5, 6, 7, 8]
    assert draft(SuffixDrafter(1), [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 20) == []  # no repeat: no draft
    seq = list(range(100, 140))
    # a 40-token repeat, 39 matched plus id_last: the prior acceptance 0.9 per token allows 0.9**d >= 0.1: 21
    assert draft(SuffixDrafter(1), seq + [7] + seq[:-1], seq[-1]) == [7] + seq[:20]
    assert draft(SuffixDrafter(1, max_spec_factor=0.25), seq + [7] + seq[:-1], seq[-1]) == [7] + seq[:9]


def test_suffix_weighs_what_followed_each_occurrence() -> None:
    # [1, 2, 3] (3 tokens matched: at most 3 drafted) was followed by 8 once and 9 once: the most recent (9) at
    # 1/2 * 0.9 = 0.45, then its continuation at 1/2 * 0.9**2 = 0.405, 1/2 * 0.9**3 = 0.3645
    h = [1, 2, 3, 8, 5, 1, 2, 3, 9, 6, 1, 2]
    assert draft(SuffixDrafter(1), h, 3) == [9, 6, 1]
    assert draft(SuffixDrafter(1, min_token_prob=0.4), h, 3) == [9, 6]
    assert draft(SuffixDrafter(1, min_token_prob=0.5), h, 3) == []
    # followed by 8 twice and 9 once: 2/3 * 0.9 = 0.6 for 8, then 0.9**2 * 2/3 = 0.54 for 5 after [.., 8]
    h = [1, 2, 3, 8, 5, 1, 2, 3, 9, 6, 1, 2, 3, 8, 5, 7, 1, 2]
    assert draft(SuffixDrafter(1, min_token_prob=0.5), h, 3) == [8, 5]


def test_suffix_draft_length_follows_the_observed_acceptance() -> None:
    seq = list(range(100, 200))
    h = seq + [7] + seq[:-1]
    d = SuffixDrafter(1)
    spec = Speculative([d])
    assert len(draft(spec, h, seq[-1])) == 21  # prior 0.9
    for _ in range(5):  # rejected: a = 9 / (10 + 1 + .95 + .95**2 + .95**3 + .95**4) = 0.62: 0.62**d >= 0.1 for d <= 4
        spec.accept(0, 0)
        assert draft(spec, h, seq[-1])
    assert math.isclose(d.acceptance(0), 9 / (10 + sum(0.95**i for i in range(5))))
    assert len(draft(spec, h, seq[-1])) == 4
    for _ in range(20):  # fully accepted drafts: longer ones
        n = len(draft(spec, h, seq[-1]))
        spec.accept(0, n)
    assert len(draft(spec, h, seq[-1])) == 64  # n_max
    assert d.stats.n_gen_drafts == 1 + 5 + 1 + 20 + 1 and d.stats.n_acc_drafts == 20


def test_suffix_learns_from_finished_requests_and_keeps_state_per_slot() -> None:
    d = SuffixDrafter(2)
    text = [50 + i for i in range(30)]
    assert draft(d, [1, 2] + text[:10], text[10], slot=1) == []  # slot 1 has not seen the text
    d.begin(0, [9] + text)
    d.end(0, [9] + text + [3, 4])
    assert draft(d, [1, 2] + text[:10], text[10], slot=1) == text[11:22]  # from the corpus: 11 matched tokens
    data = d.get_state(1)
    d.accept(1, 0, False)
    assert d.acceptance(1) < 0.9
    other = SuffixDrafter(2)
    other.set_state(0, d.get_state(1))
    assert other.acceptance(0) == d.acceptance(1)
    other.set_state(0, data)
    assert other.acceptance(0) == 0.9
    with pytest.raises(ValueError):
        other.set_state(0, b"\x00" * 3)


def test_suffix_corpus_stays_within_its_budget_evicting_the_least_recently_used() -> None:
    corpus = SuffixCorpus(k=3, budget=100)
    a, b, c = [list(range(s, s + 40)) for s in (1000, 2000, 3000)]
    corpus.add(a)
    corpus.add(b)
    assert corpus.n_tokens == 80
    assert corpus.lookup(a[:3], 4) == [(a, 3)]  # a used: b is now the least recently used
    corpus.add(c)
    assert corpus.n_tokens == 80 and corpus.lookup(b[:3], 4) == [] and corpus.lookup(a[:3], 4) == [(a, 3)]
    corpus.add(c + [7, 8])  # the next turn of c: extends it in place
    assert corpus.n_tokens == 82 and len(corpus.sequences) == 2 and corpus.lookup(c[-2:] + [7], 4)[0][1] == 41
    corpus.add(list(range(5000, 5150)))  # longer than the budget: its last 100 tokens, alone
    assert corpus.n_tokens == 100 and corpus.lookup(a[:3], 4) == [] and corpus.lookup([5050, 5051, 5052], 4)
    for i in range(40):  # dead index entries are dropped along the way: the index stays proportional
        corpus.add(list(range(10000 * (i + 1), 10000 * (i + 1) + 60)))
    assert corpus.n_tokens <= 100 and len(corpus.index) <= 2 * 100


# --------------------------------------------------------------------------- the combiner


class Fixed(Drafter):
    """A drafter of the contract that proposes a fixed draft and records what it hears."""

    def __init__(self, name: str, result: list[int], n_max: int = 8) -> None:
        super().__init__(2, n_max)
        self.name, self.result, self.asked, self.heard = name, result, 0, []  # type: ignore[misc]

    def draft(self, requests: list[SlotDraft]) -> None:
        self.asked += 1
        for sd in requests:
            sd.result[:] = self.result

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        self.heard.append((id_slot, n_accepted, is_other))


def test_the_combiner_asks_in_llama_servers_order_and_the_first_draft_wins() -> None:
    mtp, mod, simple = Fixed("draft-mtp", [1, 2, 3]), Fixed("ngram-mod", []), Fixed("ngram-simple", [7, 8])
    spec = Speculative([mtp, mod, simple])
    assert spec.name == "ngram-simple,ngram-mod,draft-mtp" and spec.n_max == 8
    assert draft(spec, [0], 0, n_max=1) == [7]  # cut to the slot's n_max
    assert mod.asked == mtp.asked == 0
    spec.accept(0, 1)
    assert simple.heard == [(0, 1, False)] and mod.heard == mtp.heard == [(0, 1, True)]
    simple.result = []
    assert draft(spec, [0], 0) == [1, 2, 3] and mtp.asked == 1
    assert (mtp.stats.n_gen_drafts, mtp.stats.n_gen_tokens, simple.stats.n_gen_drafts) == (1, 3, 1)
    spec.accept(0, 0)
    assert mtp.stats.n_acc_drafts == 0 and mtp.heard[-1] == (0, 0, False)


def test_the_combiner_takes_the_longer_of_suffix_and_the_others() -> None:
    suffix, mtp = Fixed("suffix", [5, 6]), Fixed("draft-mtp", [1, 2, 3], n_max=4)
    spec = Speculative([mtp, suffix])
    assert draft(spec, [0], 0) == [1, 2, 3]  # suffix's 2 < mtp's 3
    suffix.result = [5, 6, 7]
    assert draft(spec, [0], 0) == [5, 6, 7] and mtp.asked == 2  # a tie: suffix's
    suffix.result = [5, 6, 7, 8]
    assert draft(spec, [0], 0) == [5, 6, 7, 8] and mtp.asked == 2  # as long as mtp can draft: not asked
    spec.accept(0, 4)
    assert suffix.heard[-1] == (0, 4, False) and mtp.heard[-1] == (0, 4, True)


def test_the_combiners_state_holds_each_drafters_part() -> None:
    suffix = SuffixDrafter(2)
    spec = Speculative([NgramModDrafter(2), suffix])
    suffix.accept(0, 0, False)  # no draft yet: nothing to learn
    suffix.slots[0].n_fail = 2.0
    data = spec.get_state(0)
    assert data is not None and data[:7] == b"\x06suffix"
    other = SuffixDrafter(2)
    Speculative([other, NgramModDrafter(2)]).set_state(1, data)
    assert other.slots[1].n_fail == 2.0
    with pytest.raises(ValueError):
        spec.set_state(1, data[:-1])
    assert Speculative([NgramModDrafter(2)]).get_state(0) is None  # llama.cpp's n-gram types keep none


def test_make_speculative_builds_the_enabled_types() -> None:
    s = apply_option(apply_option(SpecSettings(), "--spec-type", "suffix,ngram-mod"), "--spec-type", "ngram-simple")
    spec = make_speculative(s, 3)
    assert spec is not None and spec.name == "suffix,ngram-simple,ngram-mod" and spec.n_seq == 3
    assert make_speculative(SpecSettings(), 3) is None
    assert make_speculative(apply_option(SpecSettings(), "--spec-type", "none"), 3) is None
    with pytest.raises(ValueError, match="draft-mtp needs a draft model"):
        make_speculative(apply_option(SpecSettings(), "--spec-type", "draft-mtp"), 1)
    spec = make_speculative(
        apply_option(SpecSettings(), "--spec-type", "draft-mtp"),
        1,
        {"draft-mtp": lambda st, n: Fixed("draft-mtp", [1], st.draft_n_max)},
    )
    assert spec is not None and spec.n_max == 3


# --------------------------------------------------------------------------- settings


def test_spec_type_values_as_llama_server_parses_them() -> None:
    assert parse_spec_type("ngram-mod,suffix") == ("ngram-mod", "suffix")
    assert parse_spec_type("ngram-mod,none,bogus") == ("none",)  # names after none are not checked
    for bad, name in (
        ("bogus,none", "bogus"),
        ("ngram-mod,", ""),
        ("Ngram-Mod", "Ngram-Mod"),
        (" ngram-mod", " ngram-mod"),
    ):
        with pytest.raises(ValueError, match=f"^unknown speculative type: {re.escape(name)}$"):
            parse_spec_type(bad)
    assert types_from_names([]) == ()
    s = apply_option(apply_option(SpecSettings(), "--spec-type", "ngram-mod"), "--spec-type", "none")
    assert s.types == ("none", "ngram-mod", "none") and s.enabled == ("ngram-mod",)  # none disables nothing
    assert s.n_max() == 64


def test_spec_options_apply_with_llama_servers_checks() -> None:
    s = apply_option(SpecSettings(), "--spec-default")
    assert (s.enabled, s.ngram_mod_n_match, s.ngram_mod_n_min, s.ngram_mod_n_max) == (("ngram-mod",), 24, 48, 64)
    s = apply_option(s, "--spec-ngram-map-k4v-min-hits", "65537")  # a uint16 in llama-server
    assert s.ngram_map_k4v_min_hits == 1
    assert apply_option(s, "--draft-p-min", "0.5x").draft_p_min == 0.5  # std::stof reads a prefix
    assert apply_option(s, "-ngld", "all").draft_n_gpu_layers == -2
    assert apply_option(s, "--no-spec-draft-backend-sampling").draft_backend_sampling is False
    assert apply_option(s, "-lcs", "a.bin").lookup_cache_static == "a.bin"
    for name, value, message in (
        ("--spec-ngram-mod-n-max", "1025", "ngram n-max must be between 0 and 1024"),
        ("--spec-ngram-simple-size-m", "0", "ngram size M must be between 1 and 1024"),
        ("--spec-ngram-map-k-min-hits", "0", "ngram min hits must be at least 1"),
        ("--spec-draft-n-max", "-1", "invalid value"),
        ("--spec-draft-n-max", "x", "stoi"),
        ("-ctkd", "q9", "Unsupported cache type: q9"),
        ("--spec-synth-len", "-1", "invalid"),
        ("--spec-synth-rates", "0.5,x", "invalid value"),
        ("--draft-max", "3", "the argument has been removed. use --spec-draft-n-max or --spec-ngram-mod-n-max"),
        ("--spec-ngram-size-n", "3", "the argument has been removed"),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            apply_option(s, name, value)


def _vendored(path: str) -> str:
    with tarfile.open(sdist()) as tar:
        member = tar.extractfile(f"llama_cpp_python-{VERSION}/vendor/llama.cpp/{path}")
        assert member is not None
        return member.read().decode()


def test_defaults_and_flag_spellings_are_llama_servers() -> None:
    common_h = _vendored("common/common.h")
    for struct_name, prefixes in (
        ("common_params_speculative_draft", ("draft_",)),
        ("common_params_speculative_ngram_mod", ("ngram_mod_",)),
        ("common_params_speculative_ngram_map", ("ngram_simple_", "ngram_map_k_", "ngram_map_k4v_")),
    ):
        body = re.search(rf"struct {struct_name} \{{(.*?)\n\}};", common_h, re.S).group(1)
        fields = dict(re.findall(r"^\s*\w+\s+(\w+)\s*=\s*([-\d.]+)f?;", body, re.M))
        assert len(fields) >= 3
        for name, value in fields.items():
            for prefix in prefixes:
                assert getattr(SpecSettings(), prefix + name) == float(value), (prefix + name, value)
    assert SpecSettings().types == ("none",) and SpecSettings().draft_backend_sampling is True
    llama = server_flags()
    ours = {n: o for o in SPEC_OPTIONS if not o.own for n in o.names + o.neg}
    prefixes = ("--spec-", "--draft", "--no-spec-", "--lookup-cache-", "-lcs", "-lcd")
    prefixed = {n for n in llama if n.startswith(prefixes)}
    assert prefixed <= set(ours) <= set(llama) and len(ours) > 80  # every such option, each spelling llama-server's
    assert all(ours[n].env is None or ours[n].env in llama[n] for n in ours)
    assert all((ours[n].env is not None) == bool(llama[n]) for n in ours)
    assert all(
        not n.startswith("--spec") or n.startswith(("--spec-suffix-", "--spec-budget-"))
        for o in SPEC_OPTIONS
        if o.own
        for n in o.names
    ) and not {n for o in SPEC_OPTIONS if o.own for n in o.names} & set(llama)


def test_suffix_takes_more_tokens_per_step_than_llama_servers_types_on_an_agent_session() -> None:
    # a replayed agent session (bench/spec_drafters.py) tokenized with the packaged model's vocabulary; the
    # recorded answers stand for the target (a drafted token is accepted when it is the recorded one)
    from bench.spec_drafters import replay, session, tokenizer

    tok = tokenizer(False)
    turns = [(tok(p), tok(a)) for p, a in session(12)]
    per_step = {}
    for name in ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache", "suffix"):
        spec = make_speculative(apply_option(SpecSettings(), "--spec-type", name), 1)
        assert spec is not None
        per_step[name] = replay(spec, turns)["tps"]
    best = max(v for k, v in per_step.items() if k != "suffix")
    assert best > 1.0 and per_step["suffix"] > 1.5 * best, per_step
