"""Slot state, the requests that run on slots, and the events they emit.

A slot is one llama.cpp KV sequence (``seq_id == slot id``) plus the tokens it
holds (``cache_tokens``), in llama-server's vocabulary: ``n_past`` is the
number of tokens in the slot's KV cache (prompt + generated).
"""

from __future__ import annotations

import codecs
import math
from typing import Any

import attrs
import trio

from .settings import SamplingParams

# ---------------------------------------------------------------------------
# What a request asks for


@attrs.frozen
class CompletionJob:
    """One completion for the engine.

    Attributes:
        prompt_tokens: the full prompt, in tokens (at least one).
        n_predict: most tokens to generate; -1 = until end of generation or the
            slot's context is full; 0 = process the prompt only.
        stop: strings that end generation (not included in the output).
        id_slot: the slot to run on, or -1 for "pick one" (longest common
            prefix with a slot's cached tokens, as llama-server does).
        cache_prompt: reuse the slot's cached prefix (llama-server's
            ``cache_prompt``).
        ignore_eos: keep generating past end-of-generation tokens.
        logprobs: compute each sampled token's log-probability (natural log,
            over the model's raw logits) into ``TextDelta.logprobs``.
        n_probs: also the ``n_probs`` most likely tokens at each step
            (``TextDelta.top_logprobs``), 0..20.
        logit_bias: ``(token id, bias)`` pairs added to the logits.
        grammar: GBNF text the output must match (llama.cpp's grammar sampler).
        fail_if_busy: when ``id_slot`` is processing another request at the
            moment this job's turn comes, fail with code ``busy`` instead of
            waiting (the Hydra slot ops' BUSY).
        snapshot: save the slot's KV state blob when the job finishes, on the
            engine thread before anything else can use the slot
            (``Finished.state``: PREFILL's reply).
        continue_slot: ``prompt_tokens`` is empty and generation continues
            from the tokens already in slot ``id_slot``'s KV cache (a DECODE
            after a PREFILL or STATE_PUT, without messages).
        request_id: the request's id for the log (an HTTP reply's ``id``, a
            Hydra trace id); empty when the caller gave none.
    """

    prompt_tokens: tuple[int, ...]
    n_predict: int = -1
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    id_slot: int = -1
    cache_prompt: bool = True
    ignore_eos: bool = False
    logprobs: bool = False
    n_probs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    fail_if_busy: bool = False
    snapshot: bool = False
    continue_slot: bool = False
    request_id: str = ""


# ---------------------------------------------------------------------------
# What the engine sends back


@attrs.frozen
class SlotAssigned:
    """The request started on slot ``id_slot``; ``cache_n`` prompt tokens were reused."""

    id_slot: int
    n_prompt: int
    cache_n: int


@attrs.frozen
class TextDelta:
    """New generated text (never a split UTF-8 character) and the tokens behind it.

    ``logprobs`` (when the job asked) has one entry per token, and
    ``top_logprobs`` one tuple of ``(token, logprob)`` pairs per token.
    """

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@attrs.frozen
class Finished:
    """The request ended.  ``finish_reason`` is OpenAI's: ``stop`` or ``length``.

    ``stop_reason`` says which stop it was (the Hydra DECODE reply's names):
    ``eos`` (an end-of-generation token), ``stop`` (a stop string),
    ``length`` (the token budget, or a prompt-only request) or
    ``n_tokens_limit`` (the slot's context is full).  ``n_past`` is the
    slot's KV cache size at the end, in tokens.

    Timings are llama-server's: ``prompt_n`` tokens evaluated for the prompt
    (after the cache), ``cache_n`` prompt tokens reused, ``predicted_n``
    tokens generated, both durations in milliseconds.
    """

    finish_reason: str
    id_slot: int
    n_prompt: int
    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    stop_reason: str = "length"
    n_past: int = 0
    state: tuple[int, bytearray] | None = attrs.field(default=None, eq=False, repr=False)

    def timings(self) -> dict[str, Any]:
        def per_token(ms: float, n: int) -> float:
            return ms / n if n else 0.0

        def per_second(ms: float, n: int) -> float:
            return 1e3 * n / ms if ms > 0 else 0.0

        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": per_token(self.prompt_ms, self.prompt_n),
            "prompt_per_second": per_second(self.prompt_ms, self.prompt_n),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": per_token(self.predicted_ms, self.predicted_n),
            "predicted_per_second": per_second(self.predicted_ms, self.predicted_n),
        }


@attrs.frozen
class Failed:
    """The request ended without a result.

    ``code``: ``invalid_request`` (the client's fault), ``busy`` (its slot was
    processing), ``cancelled`` (:meth:`Engine.cancel`, queued or running) or
    ``server_error``.
    """

    message: str
    code: str = "server_error"


Event = SlotAssigned | TextDelta | Finished | Failed


class RequestHandle:
    """The trio side of a request: a channel of events, and cancellation.

    The engine thread calls :meth:`emit`; it never blocks (the channel is
    unbounded and the hand-over goes through ``TrioToken.run_sync_soon``).
    """

    def __init__(self, job: CompletionJob, trio_token: trio.lowlevel.TrioToken) -> None:
        self.job = job
        self._token = trio_token
        self._send, self.events = trio.open_memory_channel[Event](math.inf)
        self.cancelled = False
        self.deferred = False

    def emit(self, event: Event) -> None:
        try:
            self._token.run_sync_soon(self._deliver, event)
        except trio.RunFinishedError:
            pass

    def _deliver(self, event: Event) -> None:
        try:
            self._send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if isinstance(event, (Finished, Failed)):
            self._send.close()


# ---------------------------------------------------------------------------
# Slot state (engine thread writes, others read snapshots)


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
        self._firsts = frozenset(s[0] for s in self.stops)
        self._longest = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        self.held += text
        held = self.held
        if not self.stops:
            self.held = ""
            return held, False
        first = min((i for s in self.stops if (i := held.find(s)) >= 0), default=-1)
        if first >= 0:
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


class Slot:
    """One KV sequence and the request running on it (if any)."""

    def __init__(self, id_slot: int, n_ctx: int) -> None:
        self.id = id_slot
        self.n_ctx = n_ctx
        self.cache_tokens: list[int] = []
        self.last_used = 0.0
        self.reset_request()

    def reset_request(self) -> None:
        self.handle: RequestHandle | None = None
        self.pending_prompt: list[int] = []
        self.n_prompt = 0
        self.cache_n = 0
        self.n_decoded = 0
        self.last_token: int | None = None
        self.sampler: Any = None
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stopper = StopStringMatcher(())
        self.t_start = 0.0
        self.t_first = 0.0
        self.pending_tokens: list[int] = []
        self.pending_logprobs: list[float] = []
        self.pending_top: list[tuple[tuple[int, float], ...]] = []

    @property
    def n_past(self) -> int:
        return len(self.cache_tokens)

    @property
    def is_processing(self) -> bool:
        return self.handle is not None

    @property
    def generating(self) -> bool:
        return self.handle is not None and not self.pending_prompt and self.last_token is not None

    def info(self) -> dict[str, Any]:
        """A llama-server-like ``/slots`` entry."""
        h = self.handle
        return {
            "id": self.id,
            "id_task": id(h) if h is not None else -1,
            "n_ctx": self.n_ctx,
            "n_past": self.n_past,
            "is_processing": h is not None,
            "n_decoded": self.n_decoded if h is not None else 0,
            "next_token": {"n_remain": (h.job.n_predict - self.n_decoded) if h and h.job.n_predict >= 0 else -1},
        }
