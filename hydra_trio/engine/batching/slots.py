"""Slot state (the engine thread only; other threads read :mod:`~hydra_trio.engine.snapshot`) and stop strings.

A slot is one llama.cpp KV sequence (``seq_id == slot id``) plus the tokens it
holds (``cache_tokens``), in llama-server's vocabulary: ``n_past`` is the
number of tokens in the slot's KV cache (prompt + generated).  The requests
that run on slots are in :mod:`hydra_trio.engine.requests`.
"""

from __future__ import annotations

import codecs
import enum
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

import attrs

from ..llama.media import NO_MEDIA, MediaLayout

if TYPE_CHECKING:
    from ..requests import CompletionJob, JobHandle
    from .thinking_budget import ThinkingBudget

# ---------------------------------------------------------------------------
# Slot state (engine thread only; others read the engine's published snapshot)


class TextTokens(Sequence[int]):
    """``prefix`` (the text tokens of ``tokens[:split]``) followed by ``tokens[split:]``, read through without a
    copy of the tail (a slot with media: its prompt's text, then what it generated since)."""

    def __init__(self, prefix: list[int], tokens: list[int], split: int) -> None:
        self.prefix, self.tokens, self.split = prefix, tokens, split

    def __len__(self) -> int:
        return len(self.prefix) + len(self.tokens) - self.split

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        n_pre = len(self.prefix)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            head = self.prefix[start:stop] if start < n_pre else []
            tail = self.tokens[self.split + max(start - n_pre, 0) : self.split + stop - n_pre] if stop > n_pre else []
            return head + tail
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.prefix[i] if i < n_pre else self.tokens[self.split + i - n_pre]


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back a possible partial match.

    ``push(text)`` returns ``(safe_text, stopped)``: ``safe_text`` can be sent
    now; when ``stopped`` the text after the stop string is dropped.
    ``flush()`` returns the held-back text at the end of generation.  At most
    ``len(longest stop) - 1`` characters are held back; the work per push is
    bounded by the stop strings' count and length (at most 16 × 512
    characters: :mod:`hydra_trio.engine.settings`).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched = ""  # the stop string that ended generation (llama-server's ``stopping_word``)
        self._firsts = frozenset(s[0] for s in self.stops)
        self._longest = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        self.held += text
        held = self.held
        if not self.stops:
            self.held = ""
            return held, False
        found = [(i, n, s) for n, s in enumerate(self.stops) if (i := held.find(s)) >= 0]
        if found:
            first, _, self.matched = min(found)
            self.held = ""
            return held[:first], True
        # hold back the longest tail of the text that is the start of a stop string
        cut = len(held)
        for i in range(max(0, len(held) - self._longest + 1), len(held)):
            if held[i] in self._firsts:
                tail = held[i:]
                if any(s.startswith(tail) for s in self.stops):
                    cut = i
                    break
        self.held = held[cut:]
        return held[:cut], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class SlotState(enum.Enum):
    """Where a slot is in its request (llama-server's ``slot_state`` in ``tools/server/server-context.cpp``).

    ``IDLE`` -> ``STARTED`` (a request is assigned, its cached prefix being found) -> ``PROCESSING_PROMPT``
    (prompt tokens left to feed) -> ``DONE_PROMPT`` (the prompt is in the KV cache, no token sampled yet)
    -> ``GENERATING`` (a sampled token waits to be fed) -> ``IDLE`` when the request ends.  A prefill-only
    request ends at ``DONE_PROMPT``.
    """

    IDLE = "idle"
    STARTED = "started"
    PROCESSING_PROMPT = "processing_prompt"
    DONE_PROMPT = "done_prompt"
    GENERATING = "generating"


_TASK_IDS = itertools.count()
"""Task ids (``id_task``: llama-server's name in ``/slots``), one per job started on any slot of the process, from 0
up (engine thread)."""


class Slot:
    """One KV sequence and the job running on it (if any); :attr:`state` says where the job is.

    ``id_task`` and ``job`` are the running job's id (``/slots``' ``id_task``) and job, or the last one's once
    it ended (-1 and None before the slot's first), as llama-server's slot keeps its previous task for ``/slots``.
    """

    def __init__(self, id_slot: int, n_ctx: int) -> None:
        self.id = id_slot
        self.n_ctx = n_ctx
        self.cache_tokens: list[int] = []
        self.media: MediaLayout = NO_MEDIA
        """The media chunks of the prompt whose prefix ``cache_tokens`` is (set when a request starts): where
        they lie and the positions they advance (:class:`~hydra_trio.engine.llama.media.MediaLayout`)."""
        self._text_prefix: tuple[MediaLayout, list[int]] | None = None  # text_tokens' copy, for this layout
        self.last_used = 0.0
        self.id_task = -1
        self.job: CompletionJob | None = None
        self.reset_job()

    def start_job(self, job: CompletionJob) -> None:
        """A job starts on the slot: the job's state is reset (:meth:`reset_job`), a new ``id_task``, and
        ``job`` is the slot's :attr:`job` (kept without its prompt tokens: the slot holds them, and an ended
        job's need not stay in memory)."""
        self.reset_job()
        self.id_task = next(_TASK_IDS)
        self.job = attrs.evolve(job, prompt_tokens=())

    def reset_job(self) -> None:
        self.state = SlotState.IDLE
        self.handle: JobHandle | None = None
        self.pending_prompt: list[int] = []
        self.may_share = False  # no prompt token fed yet: a prefix may still come from another slot
        self.n_prompt = 0
        self.cache_n = 0
        self.n_decoded = 0
        self.n_shifts = 0  # context shifts during this request (llama-server's ``truncated``)
        self.has_new_line = False  # the text sent so far holds a newline (llama-server's ``has_new_line``)
        self.last_token: int | None = None
        self.sampler: Any = None
        self.budget: ThinkingBudget | None = None  # the request's thinking budget, once it samples
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stopper = StopStringMatcher(())
        self.t_start = 0.0
        self.t_first = 0.0
        self.pending_tokens: list[int] = []
        self.pending_logprobs: list[float] = []
        self.pending_top: list[tuple[tuple[int, float], ...]] = []
        self.speculative = False  # this request drafts (the node speculates, and on the model serving it)
        self.draft_n = 0  # tokens drafted for this request (llama-server's timings ``draft_n``)
        self.draft_n_accepted = 0  # of those, the ones the target agreed with (``draft_n_accepted``)
        self.spec_ahead = 0
        """While a verified draft's tokens are handed on: the accepted drafted tokens in the KV cache past the
        one being handed on (cut when the request ends there: ``Generation.drop_ahead``)."""

    def hold(self, tokens: list[int], media: MediaLayout = NO_MEDIA) -> None:
        """The slot's KV cache now holds ``tokens`` (each media cell its chunk's placeholder), with ``media``'s
        chunks where they lie: what a restored state blob put there."""
        self.cache_tokens[:] = tokens
        self.media = media

    @property
    def n_past(self) -> int:
        return len(self.cache_tokens)

    @property
    def pos_next(self) -> int:
        """The position of the next cell (``n_past`` less what media chunks hold beyond their positions: M-RoPE)."""
        return self.media.pos(self.n_past) if self.media else len(self.cache_tokens)

    def text_tokens(self) -> Sequence[int]:
        """:attr:`cache_tokens` without media cells, as llama-server hands a slot's tokens to its drafters
        (``server_tokens::get_text_tokens``): the list itself when the slot holds no media, else a
        :class:`TextTokens` view (its prompt's text part copied once per request)."""
        if not self.media:
            return self.cache_tokens
        end = self.media.chunks[-1].end
        if len(self.cache_tokens) < end:
            return [t for t in self.cache_tokens if t >= 0]
        if self._text_prefix is None or self._text_prefix[0] is not self.media:
            self._text_prefix = (self.media, [t for t in self.cache_tokens[:end] if t >= 0])
        return TextTokens(self._text_prefix[1], self.cache_tokens, end)

    @property
    def holds_media(self) -> bool:
        """The slot's KV cache holds an image's or audio clip's embeddings."""
        return self.media.held(self.n_past)

    @property
    def is_processing(self) -> bool:
        """A request runs on the slot (any state but ``IDLE``)."""
        return self.state is not SlotState.IDLE

    @property
    def generating(self) -> bool:
        """The prompt is fed and a sampled token waits to be fed (``GENERATING``)."""
        return self.state is SlotState.GENERATING
