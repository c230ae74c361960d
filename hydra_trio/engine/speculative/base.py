"""The drafter contract: what the scheduler asks of a speculative decoding implementation.

Shaped after llama.cpp's ``common_speculative_impl`` (``common/speculative.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors): one implementation serves every slot (a llama.cpp sequence id each)
and is told when a slot starts a prompt (:meth:`Drafter.begin`), sees every batch the target model
decodes (:meth:`Drafter.process`: drafters with a model of their own keep it in step, MTP reads the
target's hidden states), proposes drafts for the slots that ask (:meth:`Drafter.draft`), and hears how
many drafted tokens the target accepted (:meth:`Drafter.accept`).  Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs


@attrs.define
class SlotDraft:
    """One slot asking for a draft (llama.cpp's ``common_speculative_draft_params``).

    Attributes:
        id_slot: the slot (its llama.cpp sequence id).
        n_max: the most tokens to propose (the slot's ``--spec-draft-n-max`` and room left).
        pos0: the position of ``id_last`` (the slot's next position: its n_past, less what media chunks hold
            beyond the positions they advance; ``id_last`` is not decoded yet); the drafted tokens take
            ``pos0 + 1``, ``pos0 + 2``, ... (llama.cpp's ``pos0``, llama-server's ``prompt.tokens.pos_next()``).
        id_last: the token the target sampled last (drafting continues after it).
        tokens: the slot's text tokens so far (media cells left out, as llama-server's ``get_text_tokens``):
            prompt and generated, ending just before ``id_last``.  Between two
            :meth:`Drafter.begin` calls of a slot they only grow at the end or get shorter (a context shift):
            the n-gram and suffix drafters keep a copy and compare only the length and the last tokens.
        result: the draft, filled by :meth:`Drafter.draft` (empty: no proposal).
    """

    id_slot: int
    n_max: int
    pos0: int
    id_last: int
    tokens: Sequence[int]
    result: list[int] = attrs.field(factory=list)


@attrs.define
class DrafterStats:
    """Counters of one implementation (llama.cpp's ``n_gen_drafts``, ``n_acc_drafts``, ``n_gen_tokens``,
    ``n_acc_tokens``), for ``/metrics``, ``/slots`` and the logs; kept by the combiner
    (:class:`~.combine.Speculative`), as ``common_speculative_draft``/``_accept`` do, not by the drafters."""

    n_gen_drafts: int = 0
    n_acc_drafts: int = 0
    n_gen_tokens: int = 0
    n_acc_tokens: int = 0


class Drafter:
    """One speculative decoding type (``--spec-type NAME``) for ``n_seq`` slots."""

    name: ClassVar[str] = ""
    """llama-server's name of the type (``ngram-simple``, ``draft-mtp``, ``suffix``, ...)."""

    def __init__(self, n_seq: int, n_max: int) -> None:
        self.n_seq, self.n_max = n_seq, n_max
        self.stats = DrafterStats()

    def begin(self, id_slot: int, prompt: Sequence[int]) -> None:
        """A slot starts a request whose prompt is ``prompt`` (its cached prefix included; text tokens only)."""

    def process(self, batch: Any) -> bool:
        """The target has just decoded ``batch`` (a ``llama_cpp.llama_batch`` of tokens; each entry's first
        sequence id is its slot, a slot's entries in position order); called after that ``llama_decode`` and
        before the target context decodes anything else (``draft-mtp`` reads the target's hidden states of
        this batch).  Every batch the target decodes goes through here: prompt chunks, single tokens,
        verification batches.  False when this drafter cannot follow it (the scheduler then stops drafting
        with it)."""
        return True

    def process_media(self, id_slot: int, embd: Any, pos: Any) -> None:
        """The target has just decoded a piece of a media chunk into the slot: ``embd`` float32 ``[n, n_embd]``
        (the projector's rows), ``pos`` int32 ``[n_pos, n]`` (4 rows with M-RoPE, else 1), as llama-server's
        ``process_mtmd_chunk`` hands them to its drafters.  A drafter that does not take them leaves a gap
        in the slot's sequence, which its next :meth:`process` closes (``drafting.sync_seq``: the sequence
        restarts); the slot drafts on either way."""

    def draft(self, drafts: list[SlotDraft]) -> None:
        """Fill ``result`` of each slot's draft (at most ``n_max`` tokens each; may leave it empty)."""
        raise NotImplementedError

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        """The target accepted ``n_accepted`` tokens of the slot's last draft (``is_other``: the draft
        was another implementation's)."""

    def end(self, id_slot: int, tokens: Sequence[int]) -> None:
        """The slot's request finished with ``tokens`` (prompt and output): drafters that learn from
        finished requests (a global n-gram cache, the suffix tree) take them in."""

    def seq_rm(self, id_slot: int, p0: int, p1: int = -1) -> None:
        """The target removed positions ``[p0, p1)`` of the slot's sequence (``p1`` -1: to the end; ``p0`` -1:
        from the start): a drafter with a context of its own removes them too, as llama-server's
        ``common_memory::seq_rm`` does for its draft context (rejected drafts, a cut prompt, a cleared slot)."""

    def seq_add(self, id_slot: int, p0: int, p1: int, delta: int) -> None:
        """The target moved positions ``[p0, p1)`` of the slot by ``delta`` (context shift, cache reuse):
        mirrored as ``common_memory::seq_add`` does."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """The target copied positions ``[p0, p1)`` of slot ``src`` to slot ``dst`` (prefix sharing):
        mirrored as ``common_memory::seq_cp`` does."""

    def close(self) -> None:
        """Free what this drafter holds of llama.cpp (engine thread); it is not used afterwards."""

    def get_state(self, id_slot: int) -> bytes | None:
        """The slot's drafter state to move with its KV blob (None: nothing to move)."""
        return None

    def set_state(self, id_slot: int, data: bytes) -> None:
        """Restore what :meth:`get_state` gave, on the slot a KV blob was restored into."""
