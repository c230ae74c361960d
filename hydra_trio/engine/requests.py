"""Jobs for the engine: what a completion asks for, the events the engine sends back, and the trio side of a
running job.

A completion is a :class:`CompletionJob` (a job) submitted with ``Engine.submit``; the
engine thread answers with events on a :class:`JobHandle`:
:class:`SlotAssigned`, then :class:`TextDelta` s, then exactly one of
:class:`Finished` or :class:`Failed`.  Front ends read them through
:class:`JobRun`, which turns a ``Failed`` into its typed error and cancels
the job on every way out.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ..errors import HydraTrioError, Stopping
from ..protocol.media import MediaPrompt
from .batching.thinking_budget import BudgetSpec
from .kv.blobbuf import BlobBuffer
from .settings import SamplingParams

if TYPE_CHECKING:
    from .llama.media import MediaChunk

# ---------------------------------------------------------------------------
# What a job asks for


@attrs.frozen
class CompletionJob:
    """One completion for the engine.

    Attributes:
        prompt_tokens: the full prompt, in tokens (at least one).
        n_predict: most tokens to generate; -1 = until end of generation or the
            slot's context is full.  0 is llama-server's: its limit is checked after a token is
            sampled, so one token is sampled from the prompt's logits and returned, and the job
            ends (``length``) without decoding it: the slot holds the prompt only (as with 1).
        prompt_only: evaluate the prompt into the slot and generate nothing, not even the logits
            of its last token (Hydra PREFILL); ``n_predict`` is not read.
        stop: strings that end generation (not included in the output).
        id_slot: the slot to run on, or -1 for "pick one" (longest common
            prefix with a slot's cached tokens, as llama-server does); see
            ``Engine.submit`` for other values.
        cache_prompt: reuse the slot's cached prefix (llama-server's
            ``cache_prompt``).
        ignore_eos: keep generating past end-of-generation tokens.
        logprobs: compute each sampled token's log-probability (natural log,
            over the model's raw logits) into ``TextDelta.logprobs``.
        n_probs: also the ``n_probs`` most likely tokens at each step
            (``TextDelta.top_logprobs``), 0 .. ``hydra_trio.openai.field_limits.N_PROBS_MAX``.
        logit_bias: ``(token id, bias)`` pairs added to the logits.
        grammar: GBNF text the output must match (llama.cpp's grammar sampler).
        grammar_lazy: the grammar applies only from the first match of one of
            ``grammar_triggers`` on (ECMAScript regexes over the generated text;
            llama.cpp's ``llama_sampler_init_grammar_lazy_patterns``): tool calls in ``auto``.
        fail_if_busy: when ``id_slot`` is processing another job at the
            moment this job's turn comes, fail with :class:`~hydra_trio.errors.Busy`
            instead of waiting (the Hydra slot ops' BUSY).
        save_state: save the slot's KV state blob when the job finishes, on the
            engine thread before anything else can use the slot
            (``Finished.state``: PREFILL's reply).
        continue_slot: ``prompt_tokens`` is empty and generation continues
            from the tokens already in slot ``id_slot``'s KV cache (a DECODE
            after a PREFILL or STATE_PUT, without messages).
        request_id: the request's id for the log (an HTTP reply's ``id``, a
            Hydra trace id); empty when the caller gave none.
        n_keep: prompt tokens a context shift keeps (-1: all of the prompt);
            None: the node's ``EngineConfig.n_keep`` (llama-server's ``n_keep``).
        n_discard: tokens a context shift discards after ``n_keep``; 0: half
            of them (llama-server's ``n_discard``).
        n_cache_reuse: the shortest cached chunk moved into place by a KV shift
            (0: off); None: the node's ``EngineConfig.n_cache_reuse``
            (llama-server's ``n_cache_reuse``).
        samplers: the sampler chain's order under llama-server's canonical names
            (``penalties``, ``dry``, ``top_n_sigma``, ``top_k``, ``typ_p``, ``top_p``,
            ``min_p``, ``xtc``, ``temperature``, ``infill``, ``adaptive_p``; a name may repeat);
            None: the default order (:data:`~hydra_trio.engine.settings.SAMPLER_ORDER`).
        adaptive_target, adaptive_decay: the ``adaptive_p`` sampler's settings (llama-server's
            request fields of those names; used only when ``samplers`` names it).
        t_max_predict_ms: stop (``length``) once generation has run this many milliseconds,
            measured from the first generated token, at a token whose text holds a newline
            (llama-server's ``t_max_predict_ms``); 0: no limit.
        reasoning_budget: the thinking budget (:class:`~hydra_trio.engine.batching.thinking_budget.BudgetSpec`:
            after that many tokens inside the thinking block its end marker is forced); None: none.
        special: generated special tokens are written into the text as their text (llama-server's
            ``-sp/--special``); otherwise they add no text.
        reasoning_format: the format a chat reply's text is split with (``/slots``' ``params``); None: the
            node's.  The engine never reads it: how a reply is shaped stays with the front end.
        media_chunks: the prompt's images and audio clips, tokenized (:meth:`ModelView.tokenize_with_media
            <hydra_trio.engine.view.ModelView.tokenize_with_media>` gives ``prompt_tokens`` and these): each fills
            its ``n_tokens`` entries of ``prompt_tokens`` (its placeholder) from its ``start``.
        stream, timings_per_token: the request's fields of those names (the reply is streamed; each
            event carries timings), shown in the slot's ``params`` by ``/slots``; the engine never reads them.
        media: a prompt with media as the request gave it (:class:`~hydra_trio.protocol.media.MediaPrompt`: the
            text with one media marker per item, and the items); the engine evaluates ``media_chunks``, which
            :meth:`ModelView.tokenize_with_media <hydra_trio.engine.view.ModelView.tokenize_with_media>` makes
            of it.  None: a text prompt.
    """

    prompt_tokens: tuple[int, ...]
    n_predict: int = -1
    prompt_only: bool = False
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    id_slot: int = -1
    cache_prompt: bool = True
    ignore_eos: bool = False
    logprobs: bool = False
    n_probs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    grammar_lazy: bool = False
    grammar_triggers: tuple[str, ...] = ()
    fail_if_busy: bool = False
    save_state: bool = False
    continue_slot: bool = False
    request_id: str = ""
    n_keep: int | None = None
    n_discard: int = 0
    n_cache_reuse: int | None = None
    samplers: tuple[str, ...] | None = None
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    t_max_predict_ms: int = 0
    reasoning_budget: BudgetSpec | None = None
    special: bool = False
    reasoning_format: str | None = None
    stream: bool = False
    timings_per_token: bool = False
    media_chunks: tuple[MediaChunk, ...] = ()
    media: MediaPrompt | None = None


# ---------------------------------------------------------------------------
# What the engine sends back


@attrs.frozen
class SlotAssigned:
    """The job started on slot ``id_slot``; ``cache_n`` prompt tokens were reused."""

    id_slot: int
    n_prompt: int
    cache_n: int


@attrs.frozen
class TextDelta:
    """New generated text (never a split UTF-8 character) and the tokens behind it.

    ``logprobs`` (when the job asked) has one entry per token, and
    ``top_logprobs`` one tuple of ``(token, logprob)`` pairs per token.

    ``eog``: the delta of the end-of-generation token that ended the job (no text, the last delta).  llama-server
    counts it as a generated token and lists it in a native ``/completion`` stream and in a whole reply's
    ``tokens`` and log-probabilities, not in an OpenAI stream's chunks (``tools/server/server-context.cpp``);
    Hydra DECODE sends no frame for it.
    """

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    eog: bool = False


@attrs.frozen
class Finished:
    """The job ended.  ``finish_reason`` is OpenAI's: ``stop`` or ``length``.

    ``stop_reason`` says which stop it was (the Hydra DECODE reply's names):
    ``eos`` (an end-of-generation token), ``stop`` (a stop string),
    ``length`` (the token budget, or a prompt-only job) or
    ``n_tokens_limit`` (the slot's context is full); ``stopping_word`` is the stop
    string that matched (``stop``), else empty.  ``n_past`` is the
    slot's KV cache size at the end, in tokens.  ``truncated``: a context
    shift discarded tokens of this job (llama-server's ``truncated``).

    Timings are llama-server's: ``prompt_n`` tokens evaluated for the prompt
    (after the cache), ``cache_n`` prompt tokens reused, ``predicted_n``
    tokens generated, both durations in milliseconds; with speculative decoding ``draft_n`` tokens drafted
    and ``draft_n_accepted`` of them accepted (None: nothing was drafted; llama-server's timings carry them
    only then).
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
    truncated: bool = False
    stopping_word: str = ""
    state: tuple[int, BlobBuffer] | None = attrs.field(default=None, eq=False, repr=False)
    draft_n: int | None = None
    draft_n_accepted: int | None = None

    def timings(self) -> dict[str, Any]:
        def per_token(ms: float, n: int) -> float:
            return ms / n if n else 0.0

        def per_second(ms: float, n: int) -> float:
            return 1e3 * n / ms if ms > 0 else 0.0

        draft = {} if self.draft_n is None else {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted}
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
            **draft,
        }


@attrs.frozen
class Failed:
    """The job ended without a result; ``error`` says why, as a typed error.

    :class:`~hydra_trio.errors.InvalidRequest` (the client's fault),
    :class:`~hydra_trio.errors.Busy` (its slot was processing and the job
    asked not to wait), :class:`~hydra_trio.errors.Cancelled` (:meth:`Engine.cancel`,
    or the node is stopping) or :class:`~hydra_trio.errors.EngineFailure`.
    """

    error: HydraTrioError

    @property
    def message(self) -> str:
        return str(self.error)


Event = SlotAssigned | TextDelta | Finished | Failed


class JobHandle:
    """The trio side of a job: a channel of events, and cancellation.

    The engine thread calls :meth:`emit`; it never blocks (the channel is
    unbounded and the hand-over goes through ``TrioToken.run_sync_soon``,
    or through ``hand_off``'s batch of the current step: :class:`StepHandOff`).
    """

    def __init__(
        self,
        job: CompletionJob,
        trio_token: trio.lowlevel.TrioToken,
        hand_off: StepHandOff | None = None,
        live: LiveJobs | None = None,
    ) -> None:
        """``live``: the engine's jobs in flight, which this one joins (raises Stopping once the node stopped)."""
        if live is not None:
            live.add(self)
        self.job = job
        self._token = trio_token
        self._hand_off = hand_off
        self._send, self.events = trio.open_memory_channel[Event](math.inf)
        self.cancelled = False
        self.deferred = False
        self.ended = False
        """True once the job's last event (Finished or Failed) was handed to trio."""

    def emit(self, event: Event) -> None:
        if self._hand_off is not None:
            self._hand_off.emit(self, event)
            return
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
            self.ended = True
            self._send.close()

    def end(self, error: HydraTrioError) -> bool:
        """Trio side: end the job now with ``error`` (a :class:`Failed` after the events already handed
        over), whatever the engine sends later (dropped); False when it had already ended."""
        if self.ended:
            return False
        self._deliver(Failed(error))
        return True


class LiveJobs:
    """Trio side: an engine's jobs in flight, and the node's stop that ends them.

    Attributes:
        stopped_why: None until :meth:`end_all`; from then on a new job is refused with it (:meth:`add`).
        embeddings: embeddings requests working now (``hydra_trio.openai.embeddings.embed_request`` counts them):
            they count in ``Engine.requests_processing``, and slot 0, whose sequence their inputs decode on,
            is processing meanwhile (:meth:`busy`), as llama-server runs an embeddings request in a slot.
    """

    def __init__(self) -> None:
        self._handles: weakref.WeakSet[JobHandle] = weakref.WeakSet()
        self.stopped_why: str | None = None
        self.embeddings = 0

    def add(self, handle: JobHandle) -> None:
        """Track a job being submitted; raise :class:`~hydra_trio.errors.Stopping` once the node stopped
        (:meth:`end_all`): a job prepared meanwhile never reaches the engine."""
        if self.stopped_why is not None:
            raise Stopping(self.stopped_why)
        self._handles.add(handle)

    def busy(self, id_slot: int) -> dict[str, Any]:
        """What slot ``id_slot``'s ``/slots`` entry shows besides its snapshot: ``{"is_processing": true}`` for
        slot 0 while :attr:`embeddings` work, else nothing."""
        return {"is_processing": True} if self.embeddings and id_slot == 0 else {}

    def end_all(self, why: str, cancel: Callable[[JobHandle], None]) -> int:
        """At the end of the node's shutdown grace: end each job not ended with
        :class:`~hydra_trio.errors.Stopping` (``why``) at once, as its reader sees it after the events already
        handed over (:meth:`JobHandle.end`), without waiting for the engine thread, and ``cancel`` it
        there (``Engine.cancel``: its slot frees at the next step); from now on :meth:`add` refuses new ones.
        So a stream ends with an error event, a whole reply is a 503, a streamed DECODE pads its rest with
        the error flag.  Returns the number ended."""
        self.stopped_why = why
        n = 0
        for handle in list(self._handles):
            n += handle.end(Stopping(why))
            cancel(handle)
        return n


def _deliver_all(held: list[tuple[JobHandle, Event]]) -> None:
    """Trio side of :class:`StepHandOff`: each event to its job, in the order emitted."""
    for handle, event in held:
        handle._deliver(event)


class StepHandOff:
    """Hands the events of one engine step to trio in one go (engine thread only).

    Outside :meth:`collect`, :meth:`emit` hands each event over at once
    (``TrioToken.run_sync_soon``).  Inside, events are held in the order they
    were emitted and handed over together when the outermost block ends: one
    wake-up of the trio loop per batching step, instead of one per generated
    token of each job (llama-server's ``update_slots`` likewise sends a
    step's results to its HTTP threads after the step).  The engine runs each
    :meth:`Scheduler.step <hydra_trio.engine.batching.scheduler.Scheduler.step>` inside
    :meth:`collect`; what it emits elsewhere (a call that fails jobs, the
    shutdown) goes at once, after anything held.
    """

    def __init__(self) -> None:
        self._held: list[tuple[JobHandle, Event]] | None = None

    @contextlib.contextmanager
    def collect(self) -> Iterator[None]:
        """Hold emitted events until the block ends, then hand them over (also when it raises)."""
        if self._held is not None:  # nested: the outer block hands over
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._hand(held)

    def emit(self, handle: JobHandle, event: Event) -> None:
        """``event`` for ``handle``: held while a :meth:`collect` block runs, else handed over now."""
        if self._held is not None:
            self._held.append((handle, event))
        else:
            self._hand([(handle, event)])

    @staticmethod
    def _hand(held: list[tuple[JobHandle, Event]]) -> None:
        try:  # every job of an engine has the same trio loop: the first one's token reaches it
            held[0][0]._token.run_sync_soon(_deliver_all, held)
        except trio.RunFinishedError:
            pass  # trio is gone: nobody reads the events


class Submitter(Protocol):
    """What :class:`JobRun` needs of the engine (``Engine.submit`` / ``Engine.cancel``)."""

    def submit(self, job: CompletionJob) -> JobHandle: ...

    def cancel(self, handle: JobHandle) -> None: ...


class JobRun:
    """Run one job on the engine from trio and read its events as typed results.

    ::

        async with JobRun(engine, job) as run:
            assigned = await run.started()      # optional: wait for the slot
            async for delta in run:             # TextDelta, until the end
                ...
            finished = run.finished             # the Finished event

    Entering submits the job; leaving cancels it (a no-op when it ended), so a
    handler that stops early, fails or is cancelled always frees the slot.

    Raises (from :meth:`started` or the iteration): the job's typed error
    (:class:`~hydra_trio.errors.InvalidRequest`, :class:`~hydra_trio.errors.Busy`,
    :class:`~hydra_trio.errors.Cancelled`, :class:`~hydra_trio.errors.EngineFailure`);
    entering raises what ``Engine.submit`` raises.
    """

    def __init__(self, engine: Submitter, job: CompletionJob) -> None:
        self.engine = engine
        self.job = job
        self.handle: JobHandle | None = None
        self.assigned: SlotAssigned | None = None
        self.finished: Finished | None = None
        self._failed: Failed | None = None  # met by ready(), raised by the next read

    def submit(self) -> JobRun:
        """Submit the job (what entering does; for a reader that outlives this scope, e.g. a stream)."""
        self.handle = self.engine.submit(self.job)
        return self

    def close(self) -> None:
        """Cancel the job unless it ended (what leaving does; idempotent)."""
        if self.handle is not None and not self.handle.ended:
            self.engine.cancel(self.handle)

    async def __aenter__(self) -> JobRun:
        return self.submit()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def _next(self) -> Event | None:
        assert self.handle is not None, "use JobRun in 'async with'"
        if self._failed is not None:  # met by ready(): raised now, after the deltas before it were used
            failed, self._failed = self._failed, None
            return self._take(failed)
        try:
            ev = await self.handle.events.receive()
        except trio.EndOfChannel:
            return None
        return self._take(ev)

    def ready(self) -> Iterator[TextDelta]:
        """The deltas that have arrived and not been read, without waiting (none once the job ended).

        For a reader that writes what a step produced in one go (an SSE stream falling behind
        sends one write, not one per delta).  A failure it meets is raised by the next read of
        the iteration, so the deltas before it can be used first.
        """
        assert self.handle is not None, "use JobRun in 'async with'"
        while self.finished is None and self._failed is None:
            try:
                ev = self.handle.events.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            if isinstance(ev, Failed):
                self._failed = ev
                return
            ev = self._take(ev)
            if isinstance(ev, TextDelta):
                yield ev

    def _take(self, ev: Event) -> Event:
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, SlotAssigned):
            self.assigned = ev
        elif isinstance(ev, Finished):
            self.finished = ev
        return ev

    async def started(self) -> SlotAssigned:
        """Wait until the job holds its slot."""
        while self.assigned is None:
            if await self._next() is None:
                raise HydraTrioError("the request ended without starting")
        return self.assigned

    def __aiter__(self) -> AsyncIterator[TextDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[TextDelta]:
        while self.finished is None:
            ev = await self._next()
            if ev is None:
                raise HydraTrioError("the request ended without a result")
            if isinstance(ev, TextDelta):
                yield ev

    async def result(self) -> Finished:
        """Read to the end, dropping the text; the Finished event."""
        async for _ in self:
            pass
        assert self.finished is not None
        return self.finished
