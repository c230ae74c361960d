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
class DraftRequest:
    """One slot asking for a draft (llama.cpp's ``common_speculative_draft_params``).

    Attributes:
        id_slot: the slot (its llama.cpp sequence id).
        n_max: the most tokens to propose (the slot's ``--spec-draft-n-max`` and room left).
        pos0: the position the first drafted token will take (the slot's n_past + 1: ``id_last`` sits at
            n_past, not yet decoded).
        id_last: the token the target sampled last (drafting continues after it).
        tokens: the slot's tokens so far: prompt and generated, ending just before ``id_last``.  Between two
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
        """A slot starts a request whose prompt is ``prompt`` (its cached prefix included)."""

    def process(self, batch: Any) -> bool:
        """The target is about to decode (or has decoded) ``batch``; False when this drafter cannot follow
        it (the scheduler then stops drafting with it)."""
        return True

    def draft(self, requests: list[DraftRequest]) -> None:
        """Fill ``result`` of each request (at most ``n_max`` tokens each; may leave it empty)."""
        raise NotImplementedError

    def accept(self, id_slot: int, n_accepted: int, is_other: bool) -> None:
        """The target accepted ``n_accepted`` tokens of the slot's last draft (``is_other``: the draft
        was another implementation's)."""

    def end(self, id_slot: int, tokens: Sequence[int]) -> None:
        """The slot's request finished with ``tokens`` (prompt and output): drafters that learn from
        finished requests (a global n-gram cache, the suffix tree) take them in."""

    def get_state(self, id_slot: int) -> bytes | None:
        """The slot's drafter state to move with its KV blob (None: nothing to move)."""
        return None

    def set_state(self, id_slot: int, data: bytes) -> None:
        """Restore what :meth:`get_state` gave, on the slot a KV blob was restored into."""
