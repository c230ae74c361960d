"""Several drafters as one: llama.cpp's ``common_speculative`` with hydra-trio's ``suffix`` type added.

After ``common_speculative_draft`` / ``_accept`` / ``_get_state`` in ``common/speculative.cpp`` of the llama.cpp
that llama-cpp-python 0.3.36 vendors: the drafters are asked in a fixed order (:data:`~.settings.PRIORITY`,
whatever the order on the command line); for each slot the first non-empty draft wins, cut to the slot's
``n_max``; the accept goes to the winner (``is_other=False``) and to every other drafter (``is_other=True``).

``suffix`` is asked first and does not end the chain: the other drafters are asked only for the slots where
its draft is shorter than they could draft, and the longer draft wins (a tie: suffix's).  Its draft is
already cut where its estimated acceptance gets too low, so the longer confident draft wins: long
suffix drafts where text repeats, the model-based drafter's few tokens elsewhere.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .base import Drafter, SlotDraft
from .ngram_cache import NgramCacheDrafter
from .ngram_map import NgramMapK4vDrafter, NgramMapKDrafter, NgramSimpleDrafter
from .ngram_mod import NgramModDrafter
from .settings import PRIORITY, SpecSettings

if TYPE_CHECKING:
    from .budget import DraftBudget
from .suffix import SuffixDrafter

MODEL_TYPES = ("draft-mtp", "draft-simple")
"""The types that run a model to draft: the draft budget cuts their drafts before they draft (each token
costs a decode); the model-free types draft whole and are cut afterwards."""


class Speculative(Drafter):
    """The drafters of one node (``common_speculative``), behind the :class:`Drafter` contract.

    The combiner keeps each drafter's :class:`~.base.DrafterStats` (drafts generated and accepted, tokens
    generated and accepted), as ``common_speculative_draft``/``_accept`` do; the drafters do not count.

    Args:
        drafters: at least one, all for the same number of slots; reordered by :data:`PRIORITY` (names not
            in it come last, in the order given).

    Raises:
        ValueError: no drafter, or drafters for different slot counts.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise ValueError("no drafter")
        if len({d.n_seq for d in drafters}) != 1:
            raise ValueError("drafters for different numbers of slots")
        rank = {name: i for i, name in enumerate(PRIORITY)}
        self.drafters = sorted(drafters, key=lambda d: rank.get(d.name, len(PRIORITY)))
        super().__init__(drafters[0].n_seq, max(max(0, d.n_max) for d in drafters))
        self.name = ",".join(d.name for d in self.drafters)  # type: ignore[misc]  # this instance's parts name it
        self.impl_last: list[Drafter | None] = [None] * self.n_seq
        """The drafter whose draft each slot is verifying."""
        self.budget: DraftBudget | None = None
        """How long a draft is worth verifying (None: every draft whole; set by :mod:`.build`)."""

    def begin(self, id_slot: int, prompt: Sequence[int]) -> None:
        for d in self.drafters:
            d.begin(id_slot, prompt)

    def process(self, batch: Any) -> bool:
        """Every drafter's :meth:`~.base.Drafter.process` until one returns False (llama.cpp's ``&&``)."""
        return all(d.process(batch) for d in self.drafters)

    def process_media(self, id_slot: int, embd: Any, pos: Any) -> None:
        for d in self.drafters:
            d.process_media(id_slot, embd, pos)

    def draft(self, drafts: list[SlotDraft]) -> None:
        """Fill each slot draft's ``result`` with the winning draft (see the module docstring)."""
        won: dict[int, tuple[Drafter, list[int]]] = {}
        chain = self.drafters
        if chain[0].name == "suffix":
            suffix, chain = chain[0], chain[1:]
            mine = [_copy(r) for r in drafts]
            suffix.draft(mine)
            for sd, got in zip(drafts, mine, strict=True):
                res = _cut(got.result, sd.n_max)
                if res:
                    won[id(sd)] = (suffix, res)
            reach = max((max(0, d.n_max) for d in chain), default=0)
            pending = [r for r in drafts if len(won.get(id(r), (None, []))[1]) < _cap(reach, r.n_max)]
        else:
            pending = list(drafts)
        for d in chain:
            if not pending:
                break
            asked = [_copy(r) for r in pending]
            if self.budget is not None and d.name in MODEL_TYPES:  # its drafting costs: cut before it drafts
                for r in asked:
                    r.n_max = self.budget.cap(r.id_slot, r.n_max, r.pos0, d.name)
                asked = [r for r in asked if r.n_max > 0]
                if not asked:
                    continue
            d.draft(asked)
            by_slot = {r.id_slot: r for r in asked}
            still = []
            for sd in pending:
                asked_sd = by_slot.get(sd.id_slot)
                if asked_sd is None:
                    still.append(sd)
                    continue
                res = _cut(asked_sd.result, asked_sd.n_max)
                if not res:
                    still.append(sd)
                elif len(res) > len(won.get(id(sd), (None, []))[1]):
                    won[id(sd)] = (d, res)
            pending = still
        for sd in drafts:
            winner, res = won.get(id(sd), (None, []))
            if winner is not None and self.budget is not None and winner.name not in MODEL_TYPES:
                res = res[: self.budget.cap(sd.id_slot, len(res), sd.pos0, winner.name)]  # drafted whole, cut here
                if not res:
                    winner = None
            sd.result[:] = res
            self.impl_last[sd.id_slot] = winner
            if winner is not None:
                winner.stats.n_gen_drafts += 1
                winner.stats.n_gen_tokens += len(res)

    def accept(self, id_slot: int, n_accepted: int, is_other: bool = False) -> None:
        """The target accepted ``n_accepted`` tokens of the slot's last draft (``is_other`` is ignored)."""
        impl = self.impl_last[id_slot]
        if impl is None:
            return
        if n_accepted > 0:
            impl.stats.n_acc_drafts += 1
            impl.stats.n_acc_tokens += n_accepted
        impl.accept(id_slot, n_accepted, False)
        for d in self.drafters:
            if d is not impl:
                d.accept(id_slot, n_accepted, True)

    def end(self, id_slot: int, tokens: Sequence[int]) -> None:
        for d in self.drafters:
            d.end(id_slot, tokens)
        self.impl_last[id_slot] = None

    def seq_rm(self, id_slot: int, p0: int, p1: int = -1) -> None:
        for d in self.drafters:
            d.seq_rm(id_slot, p0, p1)

    def seq_add(self, id_slot: int, p0: int, p1: int, delta: int) -> None:
        for d in self.drafters:
            d.seq_add(id_slot, p0, p1, delta)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        for d in self.drafters:
            d.seq_cp(src, dst, p0, p1)

    def close(self) -> None:
        for d in self.drafters:
            d.close()

    @property
    def follows_the_target(self) -> bool:
        """A drafter reads the target's context or keeps a model in step with it (``draft-mtp``,
        ``draft-simple``): it follows only the model it was built for (SOLO's, not COMBINED's)."""
        return any(d.name in MODEL_TYPES for d in self.drafters)

    def last_drafter(self, id_slot: int) -> str:
        """The type whose draft the slot is verifying ("" when none)."""
        impl = self.impl_last[id_slot]
        return impl.name if impl is not None else ""

    def get_state(self, id_slot: int) -> bytes | None:
        """Every drafter's state for the slot, tagged by type name: records of ``u8 name length, name,
        u32 (little-endian) length, state``; None when no drafter keeps any."""
        out = bytearray()
        for d in self.drafters:
            data = d.get_state(id_slot)
            if data is not None:
                name = d.name.encode()
                out += struct.pack("<B", len(name)) + name + struct.pack("<I", len(data)) + data
        return bytes(out) if out else None

    def set_state(self, id_slot: int, data: bytes) -> None:
        """Give each drafter its part of :meth:`get_state`'s bytes (parts of types this node does not run are
        skipped).  Raises ValueError: malformed bytes (nothing applied)."""
        parts: dict[str, bytes] = {}
        i = 0
        while i < len(data):
            n = data[i]
            if i + 1 + n + 4 > len(data):
                raise ValueError("speculative state: truncated record")
            name = data[i + 1 : i + 1 + n].decode("utf-8", "replace")
            (size,) = struct.unpack_from("<I", data, i + 1 + n)
            start = i + 1 + n + 4
            if start + size > len(data):
                raise ValueError("speculative state: truncated record")
            parts[name] = data[start : start + size]
            i = start + size
        for d in self.drafters:
            if d.name in parts:
                d.set_state(id_slot, parts[d.name])


def _copy(sd: SlotDraft) -> SlotDraft:
    return attrs.evolve(sd, result=[])


def _cut(result: list[int], n_max: int) -> list[int]:
    """llama.cpp truncates a draft to the slot's ``n_max`` when that is set (> 0)."""
    return result[:n_max] if n_max > 0 else list(result)


def _cap(reach: int, n_max: int) -> int:
    return min(reach, n_max) if n_max > 0 else reach


DrafterFactory = Callable[[SpecSettings, int], Drafter]
"""Builds one drafter for ``n_seq`` slots from the settings (the draft-model types: given by the engine)."""


BUILTIN_FACTORIES: dict[str, DrafterFactory] = {
    "ngram-simple": lambda s, n: NgramSimpleDrafter(n, s.ngram_simple_size_n, s.ngram_simple_size_m),
    "ngram-map-k": lambda s, n: NgramMapKDrafter(n, s.ngram_map_k_size_n, s.ngram_map_k_size_m, s.ngram_map_k_min_hits),
    "ngram-map-k4v": lambda s, n: NgramMapK4vDrafter(
        n, s.ngram_map_k4v_size_n, s.ngram_map_k4v_size_m, s.ngram_map_k4v_min_hits
    ),
    "ngram-mod": lambda s, n: NgramModDrafter(n, s.ngram_mod_n_match, s.ngram_mod_n_max, s.ngram_mod_n_min),
    "ngram-cache": lambda s, n: NgramCacheDrafter(n, s.lookup_cache_static, s.lookup_cache_dynamic),
    "suffix": lambda s, n: SuffixDrafter(
        n,
        s.suffix_n_max,
        s.suffix_max_depth,
        s.suffix_min_match,
        s.suffix_max_spec_factor,
        s.suffix_max_spec_offset,
        s.suffix_min_token_prob,
        s.suffix_cache_tokens,
    ),
}
"""The model-free types, built from the settings."""


def make_speculative(
    settings: SpecSettings, n_seq: int, factories: Mapping[str, DrafterFactory] | None = None
) -> Speculative | None:
    """The node's drafters for ``settings.enabled`` (None: no type enabled).

    The model-free types (``ngram-*``, ``suffix``) are built here; the others come from ``factories`` (type
    name -> factory).

    Raises:
        ValueError: an enabled type without a factory (``speculative type NAME needs a draft model or MTP
            layers``), or from a factory.
        OSError, ValueError: ``-lcs``/``-lcd`` cannot be read.
    """
    known = {**BUILTIN_FACTORIES, **(factories or {})}
    drafters = []
    for name in settings.enabled:
        if name not in known:
            raise ValueError(
                f"speculative type {name} needs a draft model or MTP layers, which this node does not provide"
            )
        drafters.append(known[name](settings, n_seq))
    return Speculative(drafters) if drafters else None
