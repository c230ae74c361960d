"""What happens to each token a slot samples, and to a slot whose request ends.

llama-server keeps this per slot (``server_slot``'s token processing, ``send_final_response``, ``release``
in ``tools/server/server-context.cpp``); here one :class:`Generation` serves every slot of a
:class:`~hydra_trio.engine.batching.scheduler.Scheduler`, which builds and decodes the batches.  After a decode,
:meth:`Generation.sample` samples each slot's token with the slot's own sampler chain and hands it on
(:meth:`Generation.on_token`: end of generation, stop strings, ``n_predict``, the time limit, a full
context); a slot that speculates had its draft verified in the same batch, and
:meth:`Generation.verify` keeps the drafted tokens the target agrees with, as llama-server's
``common_sampler_sample_and_accept_n`` does (the distribution of the output is the target's: each
position is sampled by the target's chain, and a draft token counts only when it is the token sampled).
Engine thread only; events go out through ``JobHandle.emit``, which never blocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp

from ...errors import HydraTrioError
from ..kv.state import save_slot
from ..llama.model import LoadedModel
from ..requests import Failed, Finished, JobHandle, StepHandOff, TextDelta
from ..stats import EngineStats
from .kv_cells import shared_cells, shift_context
from .sampling import grammar_allows, sample_next, token_probs
from .slots import Slot, SlotState
from .thinking_budget import ThinkingBudget

if TYPE_CHECKING:  # the drafters load numpy: imported where a node speculates (speculative/build.py)
    from ..speculative.combine import Speculative

log = logging.getLogger("hydra_trio.engine")


class Batching(Protocol):
    """What :class:`Generation` reads of its scheduler (:class:`~hydra_trio.engine.batching.scheduler.Scheduler`)."""

    slots: list[Slot]
    stats: EngineStats
    events: Any
    hand_off: StepHandOff | None
    context_shift: bool
    n_keep: int
    model_hash: str
    spec: Speculative | None
    publish: Callable[[], None]

    @property
    def model(self) -> LoadedModel | None: ...


class Generation:
    """Token handling and the ends of requests, for every slot of ``sched``."""

    def __init__(self, sched: Batching) -> None:
        self.sched = sched

    # ---------------------------------------------------------------- sampling
    def sample(
        self,
        m: LoadedModel,
        to_sample: list[tuple[Slot, int]],
        to_verify: Sequence[tuple[Slot, list[int], list[int]]] = (),
    ) -> None:
        """After a decode: each slot of ``to_sample`` samples its token at its batch index, each slot of
        ``to_verify`` checks its draft (:meth:`verify`); the step's token events reach trio together, in
        one hand-over (``sched.hand_off``)."""
        hand_off = self.sched.hand_off
        with hand_off.collect() if hand_off is not None else contextlib.nullcontext():
            for slot, idx in to_sample:
                if slot.handle is not None:
                    token = self.sample_one(m, slot, idx)
                    self.on_token(slot, token)
            for slot, idxs, draft in to_verify:
                if slot.handle is not None:
                    self.verify(m, slot, idxs, draft)

    def sample_one(self, m: LoadedModel, slot: Slot, idx: int) -> int:
        """The slot's next token from the logits at batch index ``idx`` (:func:`sample_token`), with its
        log-probability and alternatives kept for the reply when the request asks for them."""
        assert slot.handle is not None
        token, job = sample_token(m, slot, idx), slot.handle.job
        if job.logprobs or job.n_probs:
            probs = token_probs(m.ctx, idx, m.n_vocab, token, job.n_probs)
            slot.pending_logprobs.append(probs.logprob)
            slot.pending_top.append(probs.top)
        return token

    def verify(self, m: LoadedModel, slot: Slot, idxs: list[int], draft: list[int]) -> None:
        """The slot's ``draft`` was decoded after its last token (batch indices ``idxs``: the last token's,
        then each drafted token's): sample position after position until a sampled token differs from the
        draft, keep the KV cells of the drafted tokens that matched and remove the others (from the
        drafters' contexts too), then hand every sampled token on in order.

        Tokens handed on after a token that ended the request are dropped, and so are the KV cells past
        what generating without a draft would have left (:attr:`Slot.spec_ahead`, cut in :meth:`finish`)."""
        sampled: list[tuple[int, tuple[float, ...], tuple[tuple[tuple[int, float], ...], ...]]] = []
        for i, idx in enumerate(idxs):
            n_lp = len(slot.pending_logprobs)
            token = self.sample_one(m, slot, idx)
            sampled.append((token, tuple(slot.pending_logprobs[n_lp:]), tuple(slot.pending_top[n_lp:])))
            del slot.pending_logprobs[n_lp:], slot.pending_top[n_lp:]
            if i >= len(draft) or token != draft[i]:
                break
        n_accepted = len(sampled) - 1
        slot.cache_tokens.extend(draft[:n_accepted])
        keep = slot.pos_next  # a position: the slot's media may hold more cells than positions (M-RoPE)
        llama_cpp.llama_memory_seq_rm(m.memory, slot.id, keep, -1)
        spec = self.sched.spec
        if spec is not None:
            spec.seq_rm(slot.id, keep, -1)
            if spec.budget is not None:
                spec.budget.observe_verify(slot.id, len(draft), n_accepted, spec.last_drafter(slot.id))
            spec.accept(slot.id, n_accepted)
        slot.draft_n += len(draft)
        slot.draft_n_accepted += n_accepted
        stats = self.sched.stats
        stats.spec_drafts += 1
        stats.spec_draft_tokens += len(draft)
        stats.spec_accepted_tokens += n_accepted
        per_pos = stats.spec_accepted_per_pos
        per_pos.extend([0] * (n_accepted - len(per_pos)))
        for i in range(n_accepted):
            per_pos[i] += 1
        for j, (token, logprobs, top) in enumerate(sampled):
            slot.spec_ahead = n_accepted - j
            slot.pending_logprobs.extend(logprobs)
            slot.pending_top.extend(top)
            self.on_token(slot, token)
            if slot.handle is None:
                break
        slot.spec_ahead = 0

    # ------------------------------------------------------------ each token
    def on_token(self, slot: Slot, token: int) -> None:
        """Hand on one sampled token of ``slot``'s request: the end of generation, text and stop strings,
        the limits (``n_predict``, ``t_max_predict_ms`` at a new line, a full context, which a context
        shift may make room in)."""
        sched, m = self.sched, self.sched.model
        assert m is not None and slot.handle is not None
        job = slot.handle.job
        # llama-server counts every sampled token, the end of generation too (``n_gen`` before
        # ``process_token`` in tools/server/server-context.cpp): predicted_n, usage.completion_tokens, metrics
        slot.n_decoded += 1
        sched.stats.tokens_predicted_total += 1
        if not job.ignore_eos and m.is_eog(token):
            lp = (slot.pending_logprobs.pop(),) if slot.pending_logprobs else ()
            top = (slot.pending_top.pop(),) if slot.pending_top else ()
            self.finish(slot, "stop", stop_reason="eos", eog=TextDelta("", (token,), lp, top, eog=True))
            return
        if slot.n_decoded == 1:
            sched.events.publish(
                "slot.first_token",
                job.request_id,
                slot=slot.id,
                ms=round((time.perf_counter() - slot.t_start) * 1e3, 3),
            )
        slot.pending_tokens.append(token)
        text, stopped = slot.stopper.push(slot.utf8.decode(m.token_bytes(token, special=job.special)))
        slot.has_new_line = slot.has_new_line or "\n" in text
        if text or job.logprobs:  # logprob jobs (Hydra DECODE) want every token at once
            self.emit_text(slot, text)
        if stopped:
            self.finish(slot, "stop", flush=False, stop_reason="stop")
            return
        slot.last_token = token
        slot.state = SlotState.GENERATING
        if job.n_predict >= 0 and slot.n_decoded >= job.n_predict:  # n_predict 0: after one token, as llama-server
            self.finish(slot, "length")
        elif (
            job.t_max_predict_ms > 0
            and "\n" in text
            and (time.perf_counter() - slot.t_first) * 1e3 > job.t_max_predict_ms
        ):
            self.finish(slot, "length")  # llama-server: the time limit acts at a new line
        elif slot.n_past + 1 >= slot.n_ctx and not (
            sched.context_shift and shift_context(m, slot, sched.n_keep, shared_cells(m, sched.slots, slot))
        ):
            self.finish(slot, "length", stop_reason="n_tokens_limit")

    def emit_text(self, slot: Slot, text: str) -> None:
        assert slot.handle is not None
        slot.handle.emit(
            TextDelta(text, tuple(slot.pending_tokens), tuple(slot.pending_logprobs), tuple(slot.pending_top))
        )
        slot.pending_tokens = []
        slot.pending_logprobs = []
        slot.pending_top = []

    # ---------------------------------------------------------- ends
    def finish(
        self, slot: Slot, reason: str, flush: bool = True, stop_reason: str = "length", eog: TextDelta | None = None
    ) -> None:
        """The request on ``slot`` ended with ``reason`` (``stop``/``length``): its last text, the
        end-of-generation token's delta (``eog``, when one ended it), its timings (one log line, llama-server's
        ``print_timings``), the slot released and published, then the :class:`Finished` event."""
        sched, m = self.sched, self.sched.model
        handle = slot.handle
        assert handle is not None and m is not None
        self.drop_ahead(m, slot)
        if flush:
            # bytes of a character the generation stopped inside of are dropped, never
            # sent as U+FFFD (llama-server's behaviour); held-back stop-string text is sent
            tail = slot.stopper.flush()
            if tail or slot.pending_tokens:
                self.emit_text(slot, tail)
        if eog is not None:
            handle.emit(eog)
        now = time.perf_counter()
        t_first = slot.t_first or now
        done = Finished(
            finish_reason=reason,
            id_slot=slot.id,
            n_prompt=slot.n_prompt,
            cache_n=slot.cache_n,
            prompt_n=slot.n_prompt - slot.cache_n,
            prompt_ms=(t_first - slot.t_start) * 1e3,
            predicted_n=slot.n_decoded,
            predicted_ms=(now - t_first) * 1e3 if slot.n_decoded else 0.0,
            stop_reason=stop_reason,
            n_past=slot.n_past,
            truncated=slot.n_shifts > 0,
            stopping_word=slot.stopper.matched if stop_reason == "stop" else "",
            state=save_slot(m, slot, sched.model_hash) if handle.job.save_state else None,
            draft_n=slot.draft_n or None,  # llama-server's timings carry them once a token was drafted
            draft_n_accepted=slot.draft_n_accepted if slot.draft_n else None,
        )
        # one line per finished request, whatever protocol it came by (llama-server's print_timings, on one line)
        t = done.timings()
        log.info(
            "slot %d | %s | prompt %d tokens (%d cached) %.1f ms, %.1f tok/s | generated %d tokens %.1f ms, "
            "%.1f tok/s%s | finish %s (%s)",
            slot.id,
            handle.job.request_id or "-",
            t["prompt_n"],
            t["cache_n"],
            t["prompt_ms"],
            t["prompt_per_second"],
            t["predicted_n"],
            t["predicted_ms"],
            t["predicted_per_second"],
            f" | draft {slot.draft_n_accepted}/{slot.draft_n} accepted" if slot.speculative else "",
            reason,
            stop_reason,
            extra={
                "trace_id": handle.job.request_id or None,
                "slot": slot.id,
                "ms": round(t["prompt_ms"] + t["predicted_ms"], 3),
            },
        )
        sched.events.publish(
            "slot.finished",
            handle.job.request_id,
            slot=slot.id,
            finish_reason=reason,
            stop_reason=stop_reason,
            timings=t,
        )
        if sched.spec is not None and slot.speculative:
            sched.spec.end(slot.id, list(slot.text_tokens()))
        # the slot is idle, and published so, before the client hears of the end: a
        # follow-up request on the same slot never sees it busy, nor a status read stale
        self.release(slot)
        self.end([handle], done)

    def drop_ahead(self, m: LoadedModel, slot: Slot) -> None:
        """A request that ended in the middle of a verified draft: remove the accepted drafted tokens it
        did not reach, so the slot holds what it would hold after generating without a draft (the prompt
        and the tokens sent but the last)."""
        if slot.spec_ahead > 0:
            keep = slot.n_past - slot.spec_ahead
            del slot.cache_tokens[keep:]
            llama_cpp.llama_memory_seq_rm(m.memory, slot.id, slot.pos_next, -1)
            if self.sched.spec is not None:
                self.sched.spec.seq_rm(slot.id, slot.pos_next, -1)
            slot.spec_ahead = 0

    def release(self, slot: Slot) -> None:
        """Free the slot's request state (its sampler); its cached tokens stay (they match its KV cells, so a
        request cut off mid-prompt leaves a valid prefix)."""
        if slot.sampler is not None:
            llama_cpp.llama_sampler_free(slot.sampler)
        slot.last_used = time.monotonic()
        slot.reset_job()

    def publish_end(self, slot: Slot, type_: str, error: Exception) -> None:
        """``slot.failed`` / ``slot.cancelled`` for the request running on ``slot`` (before its release)."""
        assert slot.handle is not None
        self.sched.events.publish(
            type_, slot.handle.job.request_id, slot=slot.id, n_decoded=slot.n_decoded, error=str(error)
        )

    def fail(self, slot: Slot, type_: str, error: HydraTrioError) -> JobHandle:
        """End ``slot``'s request with ``error`` (published as ``type_``); the caller sends the event."""
        handle = slot.handle
        assert handle is not None
        self.publish_end(slot, type_, error)
        self.release(slot)
        return handle

    def end(self, handles: list[JobHandle], event: Finished | Failed) -> None:
        """Tell ``handles`` (whose slots are released) that they ended with ``event``, after the scheduler's
        ``publish()`` (the engine's snapshot), so a client's next status read sees its slot as the engine
        left it."""
        if not handles:
            return
        self.sched.publish()
        for handle in handles:
            handle.emit(event)


def sample_token(m: LoadedModel, slot: Slot, idx: int) -> int:
    """The next token of ``slot``'s request from the logits at batch index ``idx``: sampled by the slot's
    chain, or the token its thinking budget forces (:mod:`.thinking_budget`; the chain accepts it, so
    penalties and a grammar see it as llama-server's budget sampler lets them).  A forced token the
    request's grammar refuses ends the forcing (the grammar wins: llama-server's grammar comes first in
    its chain and would leave no candidate)."""
    assert slot.handle is not None
    spec = slot.handle.job.reasoning_budget
    if slot.budget is None and spec is not None:
        slot.budget = ThinkingBudget(spec)
    forced = slot.budget.forced if slot.budget is not None else None
    if forced is not None and slot.handle.job.grammar and not grammar_allows(slot.sampler, forced):
        assert slot.budget is not None
        slot.budget.give_up()
        forced = None
    if forced is None:
        token = sample_next(slot.sampler, m.ctx, idx, m.n_vocab, constrained=bool(slot.handle.job.grammar))
    else:
        token = forced
        llama_cpp.llama_sampler_accept(slot.sampler, token)
    if slot.budget is not None:
        slot.budget.accept(token, m.token_bytes(token))
    return int(token)
