"""The scheduler: continuous batching over the slots, on the engine thread only.

Each :meth:`Scheduler.step` builds one ``llama_batch`` from every active slot,
as llama-server's ``update_slots`` does: one token for each generating slot,
then chunks of pending prompts up to ``n_batch`` tokens in all; one
``llama_decode``; then one sample per slot whose last token asked for logits.
Requests beyond the number of slots wait in a FIFO queue (counted as
deferred); a request with ``id_slot`` -1 takes an idle slot as llama-server's
``get_available_slot`` does: the one whose cached tokens share the longest
prefix with the prompt when that prefix is more than ``slot_prompt_similarity``
of the prompt, else the least recently used one.  A slot starting a prompt
keeps its cached common prefix, and with ``n_cache_reuse`` also moves later
cached chunks that the prompt holds further on into place by a KV shift
(llama-server's ``--cache-reuse``).  With ``context_shift`` a generating slot
whose context is full discards tokens after the first ``n_keep`` and goes on
(llama-server's ``--context-shift``).  A prompt whose first :data:`SHARE_MIN_TOKENS`
or more tokens are in another slot's KV cache, or being evaluated there now,
gets them by a copy (``llama_memory_seq_cp``) instead of evaluating them
again: concurrent requests with one long system prompt evaluate it once
(not for recurrent, hybrid or SWA models: :func:`share_prefix`).  For those
models, whose memory cannot be cut back to a shorter prefix, a slot keeps
context checkpoints (:mod:`~hydra_trio.engine.batching.checkpoints`).  A slot about to lose its cached
tokens keeps them in the host-RAM prompt cache, and a prompt that an entry there serves better
gets it restored (:mod:`~hydra_trio.engine.batching.prompt_cache`).  Cancellation is here too, and an idle
slot's KV cache saved as a blob, restored from one or erased (:meth:`Scheduler.save_slot`,
:meth:`Scheduler.restore_slot`, :meth:`Scheduler.erase_slot`); each sampled token's handling, stop strings
and finishing are :class:`~hydra_trio.engine.batching.generation.Generation`'s.  Nothing here is trio code: events go
out through ``JobHandle.emit``, which never blocks.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import llama_cpp

from ...errors import Busy, Cancelled, EngineFailure, HydraTrioError, InvalidRequest, NotSupported
from ...observability.events import EventBus
from ..experts.combined import ExpertModes, PeerLost
from ..kv.blobbuf import BlobBuffer, BlobPool
from ..kv.state import Restored, restore_slot, save_slot
from ..llama.media import NO_MEDIA, MediaLayout
from ..llama.model import LoadedModel
from ..requests import CompletionJob, Failed, JobHandle, SlotAssigned, StepHandOff
from ..speculative.base import SlotDraft
from ..stats import EngineStats
from .checkpoints import Checkpoints
from .generation import Generation
from .kv_cells import SHARE_MIN_TOKENS, free_idle_cells, retry_without_room, reuse_chunks, share_prefix, shared_cells
from .prompt_cache import PromptCache
from .prompt_cache import common_prefix as _common_prefix
from .sampling import GrammarError, SamplerSpec, build_sampler
from .slots import Slot, SlotState, StopStringMatcher

if TYPE_CHECKING:  # the drafters load numpy: imported where a node speculates (speculative/build.py)
    from ..speculative.combine import Speculative

log = logging.getLogger("hydra_trio.engine")


def check_prompt_fits(n_tokens: int, n_ctx_slot: int) -> None:
    """Raise InvalidRequest unless a prompt of ``n_tokens`` leaves room in a slot of ``n_ctx_slot`` tokens.

    Checked when a request is submitted and again when it leaves the queue (a
    CONFIGURE may have made the slots smaller meanwhile).
    """
    if n_tokens >= n_ctx_slot:
        raise InvalidRequest(
            f"the prompt has {n_tokens} tokens; a slot's context holds {n_ctx_slot} (--ctx-size / --parallel)"
        )


class Scheduler:
    """The slots, the queue and the batch of one model's context (engine thread only).

    Args:
        experts: the models; ``experts.active`` is the one decoded, and
            ``experts.decode`` runs the batch (on the peer's worker in COMBINED).
        n_parallel: slots; ``n_ctx_slot``: tokens of context each; ``n_batch``:
            the most tokens per decode step.
        stats: the engine's counters (llama-server's metric names).
        model_hash: the model's SHA-256 (hex), written into the KV state blobs it saves (PREFILL's).
        events: where ``slot.*`` events go (:mod:`hydra_trio.observability.events`).
        context_shift, n_keep, n_cache_reuse, slot_prompt_similarity, n_ctx_checkpoints,
            checkpoint_min_step: as the :class:`~hydra_trio.engine.settings.EngineConfig` fields of
            those names (checkpoints: :mod:`~hydra_trio.engine.batching.checkpoints`).
        prompt_cache: the host-RAM prompt cache (:mod:`~hydra_trio.engine.batching.prompt_cache`; None: off).
        hand_off: the tokens sampled in a step reach trio through it in one hand-over
            (:class:`~hydra_trio.engine.requests.StepHandOff`); None: each event on its own.
        spec, spec_cap: speculative decoding (:mod:`~hydra_trio.engine.speculative`): the drafters, and
            the most tokens a draft may hold.
    """

    def __init__(
        self,
        experts: ExpertModes,
        n_parallel: int,
        n_ctx_slot: int,
        n_batch: int,
        stats: EngineStats,
        model_hash: str,
        events: EventBus | None = None,
        *,
        context_shift: bool = False,
        n_keep: int = 0,
        n_cache_reuse: int = 0,
        slot_prompt_similarity: float = 0.1,
        n_ctx_checkpoints: int = 32,
        checkpoint_min_step: int = 8192,
        prompt_cache: PromptCache | None = None,
        hand_off: StepHandOff | None = None,
        spec: Speculative | None = None,
        spec_cap: int = 1 << 30,
    ) -> None:
        self.experts, self.hand_off = experts, hand_off
        self.prompt_cache = prompt_cache if prompt_cache is not None else PromptCache(0)
        self.context_shift = context_shift
        self.n_keep = n_keep
        self.n_cache_reuse = n_cache_reuse
        self.slot_prompt_similarity = slot_prompt_similarity
        self.events = events if events is not None else EventBus()
        self.slots = [Slot(i, n_ctx_slot) for i in range(n_parallel)]
        self.checkpoints = Checkpoints(n_parallel, n_ctx_checkpoints, checkpoint_min_step)
        self.pending: collections.deque[JobHandle] = collections.deque()
        self.stats = stats
        self.model_hash = model_hash
        self.n_batch = n_batch
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._budget_cap = 0
        """While the KV cache had no room for a batch: the most tokens the next batch takes (halved at each
        such failure, as llama-server's ``update_slots`` does); 0 otherwise."""
        experts.on_switch = self.forget_cached_prompts
        self.make_room = functools.partial(
            free_idle_cells, slots=self.slots, prompt_cache=self.prompt_cache, events=self.events
        )
        """``make_room(m, keep=None, keep_entry=None)``:
        :func:`~hydra_trio.engine.batching.kv_cells.free_idle_cells`."""
        self.prompt_cache.make_room = self.make_room
        self.spec: Speculative | None = spec
        """The node's drafters (``--spec-type``; None: no speculative decoding)."""
        self.spec_cap = spec_cap
        """The most tokens one draft may hold besides the drafters' own limits (a recurrent memory removes
        only that many positions again: its ``n_rs_seq``)."""
        self.gen = Generation(self)
        self.publish: Callable[[], None] = lambda: None
        """Called before a request hears that it ended, once its slot is released: the engine publishes
        its snapshot (:mod:`~hydra_trio.engine.snapshot`), so the client's next status read sees the slot
        as the engine left it."""

    @property
    def model(self) -> LoadedModel | None:
        return self.experts.active

    @property
    def busy(self) -> bool:
        """A slot is processing a request."""
        return any(s.is_processing for s in self.slots)

    def add(self, handle: JobHandle) -> None:
        """Queue a submitted request (it starts at the next :meth:`step`)."""
        self.stats.requests_total += 1
        self.pending.append(handle)

    def step(self) -> None:
        """One round: drop cancelled requests, start waiting ones on free slots, decode one batch (idle: keep slots)."""
        self._drop_cancelled()
        self._assign_pending()
        if self.busy:
            self._step()
        if not self.busy and not self.pending:
            m = self.model
            assert m is not None
            if not self.checkpoints.needed(m):
                self.prompt_cache.save_idle(m, self.slots)  # idle now: keep idle slots (--cache-idle-slots)

    def forget_cached_prompts(self) -> None:
        """The model changed (each has its own KV cache): no slot nor prompt-cache entry may be reused."""
        for slot in self.slots:
            slot.cache_tokens.clear()
        self.checkpoints.clear()
        self.prompt_cache.clear("mode_switch")

    def close(self, error: HydraTrioError) -> None:
        """Fail every running and waiting request with ``error`` and free the batch (at shutdown)."""
        ended = []
        for slot in self.slots:
            if slot.handle is not None:
                self.gen.publish_end(slot, "slot.failed", error)
                ended.append(slot.handle)
                self.gen.release(slot)
        self.gen.end(ended, Failed(error))
        while self.pending:
            self.pending.popleft().emit(Failed(error))
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.spec is not None:
            self.spec.close()
            self.spec = None

    def fail_all(self, error: HydraTrioError, model: LoadedModel | None = None) -> None:
        """Fail every running request with ``error``; their slots' KV caches (in ``model``, default the
        active one) are dropped (half-decoded)."""
        m = model or self.model
        ended = []
        for slot in self.slots:
            if slot.handle is not None:
                ended.append(slot.handle)
                if m is not None:
                    llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
                slot.cache_tokens.clear()
                self.gen.publish_end(slot, "slot.failed", error)
                self.gen.release(slot)
        self.gen.end(ended, Failed(error))

    def spec_follows(self, m: LoadedModel) -> bool:
        """Speculative decoding runs on ``m``: drafters that follow the target (``draft-mtp``,
        ``draft-simple``) only on the model they were built for (SOLO's)."""
        return self.spec is not None and (m is self.experts.solo or not self.spec.follows_the_target)

    # ------------------------------------------------------------ one idle slot's KV cache
    def idle_slot(self, id_slot: int) -> Slot:
        """The slot, idle: InvalidRequest when it is gone (the slot count changed), Busy when it works."""
        if not 0 <= id_slot < len(self.slots):
            raise InvalidRequest(f"id_slot: slot {id_slot} no longer exists (slots 0..{len(self.slots) - 1})")
        slot = self.slots[id_slot]
        if slot.is_processing:
            raise Busy(f"slot {id_slot} is processing a request", [id_slot])
        return slot

    def save_slot(self, id_slot: int, *, pool: BlobPool | None = None) -> tuple[int, BlobBuffer]:
        """The idle slot's KV state blob, ``(n_past, blob)``, its buffer from ``pool``, with the drafters'
        state of the slot and, when it holds media, its media layout (:func:`~hydra_trio.engine.kv.state.save_slot`).
        Raises Busy, InvalidRequest."""
        slot = self.idle_slot(id_slot)
        m = self.model
        assert m is not None
        spec = self.spec
        return save_slot(
            m,
            slot,
            self.model_hash,
            pool=pool,
            extra=spec.get_state(id_slot) if spec is not None and slot.n_past else None,
        )

    def restore_slot(
        self, id_slot: int, blob: bytearray | BlobBuffer, *, allow_cross_model_kv: bool, checksum_verified: bool = False
    ) -> Restored:
        """Apply a blob to the idle slot, all or nothing (:func:`~hydra_trio.engine.kv.state.restore_slot`); the
        drafters take the blob's part of their state, else start afresh.

        A blob of another model file with the same KV identity is applied only with
        ``allow_cross_model_kv``.  A blob of a slot holding media (version 5) gives the slot its media layout,
        whether or not this node has a projector: the KV cache holds the embeddings, so the slot decodes on,
        and a returning prompt with the same media (by id) is a cache hit through it.  Raises Busy,
        InvalidRequest, StateError.
        """
        slot = self.idle_slot(id_slot)
        m = self.model
        assert m is not None
        done = restore_slot(
            m,
            slot,
            blob,
            self.model_hash,
            allow_cross_model_kv=allow_cross_model_kv,
            checksum_verified=checksum_verified,
            make_room=lambda: self.make_room(m, keep=slot),
        )
        if self.spec is not None:  # the drafters follow: the blob's part, else nothing
            self.spec.seq_rm(id_slot, -1, -1)
            if done.extra:
                try:
                    self.spec.set_state(id_slot, done.extra)
                except ValueError as exc:
                    log.warning(
                        "slot %d: the blob's drafters' state was not applied (%s); it drafts afresh", id_slot, exc
                    )
        return done

    def erase_slot(self, id_slot: int) -> int:
        """Drop the slot's KV cache, and the prompt-cache entries of its conversation
        (:meth:`PromptCache.forget`).  Returns the number of tokens erased.

        Raises Busy when the slot is processing.
        """
        slot = self.slots[id_slot]
        m = self.model
        assert m is not None
        if slot.is_processing:
            raise Busy(f"slot {slot.id} is processing a request", [slot.id])
        self.prompt_cache.forget(slot.cache_tokens)
        n = slot.n_past
        llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
        slot.cache_tokens.clear()
        return n

    def _drafts(self, m: LoadedModel) -> dict[int, list[int]]:
        """This step's drafts, by slot: every generating slot that speculates asks for at most as many tokens
        as leave room for one more in its context and in its ``n_predict`` (so that neither limit falls
        inside a draft), and :attr:`spec_cap`."""
        spec = self.spec
        if spec is None or not self.spec_follows(m):
            return {}
        drafts = []
        for slot in self.slots:
            if not (slot.generating and slot.speculative) or slot.last_token is None:
                continue
            assert slot.handle is not None  # a generating slot serves a request
            job = slot.handle.job
            n_max = min(
                spec.n_max,
                self.spec_cap,
                slot.n_ctx - slot.n_past - 3,
                job.n_predict - slot.n_decoded - 1 if job.n_predict >= 0 else spec.n_max,
            )
            if n_max >= 1:
                drafts.append(SlotDraft(slot.id, n_max, slot.pos_next, slot.last_token, slot.text_tokens()))
        if drafts:
            spec.draft(drafts)
        return {r.id_slot: list(r.result) for r in drafts if r.result}

    def _batch_clear(self) -> None:
        self._batch.n_tokens = 0

    def _batch_add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        b = self._batch
        i = b.n_tokens
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = 1 if logits else 0
        b.n_tokens = i + 1
        return i

    def _drop_cancelled(self) -> None:
        """End cancelled requests, queued or running, with ``Failed(Cancelled)``.

        The terminal event closes the request's channel, so whoever still
        reads it (a handler whose client went away) ends too.
        """
        if any(h.cancelled for h in self.pending):
            keep: collections.deque[JobHandle] = collections.deque()
            for h in self.pending:
                if h.cancelled:
                    self.events.publish("slot.cancelled", h.job.request_id, slot=None, queued=True)
                    h.emit(Failed(Cancelled("the request was cancelled while it waited for a slot")))
                else:
                    keep.append(h)
            self.pending = keep
        ended = []
        for slot in self.slots:
            handle = slot.handle
            if handle is not None and handle.cancelled:
                log.info("slot %d: request cancelled (client gone); slot freed", slot.id)
                self.gen.publish_end(slot, "slot.cancelled", Cancelled("the request was cancelled"))
                self.gen.release(slot)
                ended.append(handle)
        self.gen.end(ended, Failed(Cancelled("the request was cancelled")))

    def _assign_pending(self) -> None:
        waiting: collections.deque[JobHandle] = collections.deque()
        while self.pending:
            handle = self.pending.popleft()
            job = handle.job
            if job.id_slot >= len(self.slots):  # the slot count shrank while it waited
                handle.emit(Failed(InvalidRequest(f"id_slot: slot {job.id_slot} no longer exists")))
                continue
            try:  # the slots may have shrunk while it waited too
                check_prompt_fits(len(job.prompt_tokens), self.slots[0].n_ctx)
            except InvalidRequest as exc:
                handle.emit(Failed(exc))
                continue
            if job.fail_if_busy and job.id_slot >= 0 and self.slots[job.id_slot].is_processing:
                handle.emit(Failed(Busy(f"slot {job.id_slot} is processing a request", [job.id_slot])))
                continue
            slot = pick_slot(self.slots, job, self.slot_prompt_similarity)
            if slot is None:
                if not handle.deferred:
                    handle.deferred = True
                    self.stats.requests_deferred += 1
                waiting.append(handle)
                continue
            self._start(slot, handle)
        self.pending = waiting

    def _start(self, slot: Slot, handle: JobHandle) -> None:
        m = self.model
        assert m is not None
        job = handle.job
        prompt = list(slot.cache_tokens) if job.continue_slot else list(job.prompt_tokens)
        if not prompt:
            handle.emit(
                Failed(InvalidRequest(f"slot {slot.id} holds no tokens to continue from (PREFILL or STATE_PUT first)"))
            )
            return
        if job.media_chunks and m.media is None:  # the model serving now has no projector (another mode's)
            handle.emit(Failed(NotSupported("the model serving now has no multimodal projector (--mmproj)")))
            return
        if job.continue_slot and not job.prompt_only and slot.media:  # its last token's logits are computed again
            last = slot.media.chunk_at(slot.media.snap(len(prompt) - 1))
            if last is not None and last.handle is None:
                why = (
                    f"slot {slot.id} ends with media ({last.kind}) restored from a state blob: generating on "
                    "needs its last cell evaluated again, which only a prompt holding the media does (send the "
                    "next turn)"
                )
                handle.emit(Failed(InvalidRequest(why)))
                return
        spec = SamplerSpec(
            job.sampling,
            job.logit_bias,
            tuple(m.eog_tokens) if job.ignore_eos else (),
            job.grammar,
            lazy_triggers=job.grammar_triggers if job.grammar_lazy else None,
            order=job.samplers,
            adaptive_target=job.adaptive_target,
            adaptive_decay=job.adaptive_decay,
        )
        try:
            sampler = build_sampler(
                spec,
                m.vocab,
                m.n_vocab,
                slot.n_ctx,
                [t for t in prompt if t >= 0] if job.media_chunks or slot.media else prompt,
            )
        except GrammarError as exc:  # checked when the job was built: only a bug gets here
            handle.emit(Failed(InvalidRequest(f"grammar: {exc}")))
            return
        slot.start_job(job)
        slot.sampler = sampler
        slot.handle = handle
        slot.state = SlotState.STARTED
        slot.t_start = time.perf_counter()
        if not job.continue_slot:  # the prompt's media chunks: its cached prefix has the same ones
            slot.media = MediaLayout(job.media_chunks) if job.media_chunks else NO_MEDIA
        cache_n = keep_cached(m, slot, job, prompt, self.n_cache_reuse, self.checkpoints, self.prompt_cache, self.slots)
        slot.cache_n = cache_n
        if self.spec is not None:  # the drafters' own contexts follow the target's cut (llama-server's common_memory)
            self.spec.seq_rm(slot.id, slot.media.pos(cache_n), -1)
            slot.speculative = not job.prompt_only and self.spec_follows(m)
            if slot.speculative:
                self.spec.begin(slot.id, [t for t in prompt if t >= 0] if slot.media else prompt)  # text only
                if self.spec.budget is not None:
                    self.spec.budget.reset(slot.id)
        self.stats.prompt_tokens_cached_total += cache_n
        slot.n_prompt = len(prompt)
        slot.pending_prompt = prompt[cache_n:]
        slot.state = SlotState.PROCESSING_PROMPT if slot.pending_prompt else SlotState.DONE_PROMPT
        slot.stopper = StopStringMatcher(job.stop)
        slot.may_share = (
            job.cache_prompt
            and not job.continue_slot
            and len(slot.pending_prompt) > SHARE_MIN_TOKENS
            and not self.checkpoints.needed(m)
        )  # share_prefix: why not these models
        self.publish()  # the engine's snapshot shows the slot processing before its request hears anything
        handle.emit(SlotAssigned(slot.id, len(prompt), cache_n))
        self.events.publish(
            "slot.assigned",
            job.request_id,
            slot=slot.id,
            n_prompt=len(prompt),
            cache_n=cache_n,
            n_predict=job.n_predict,
        )
        log.debug("slot %d: start, prompt %d tokens, cache_n %d", slot.id, len(prompt), cache_n)
        if not slot.pending_prompt:  # prefill-only request fully cached
            slot.t_first = time.perf_counter()
            self.gen.finish(slot, "length")

    def _step(self) -> None:
        m = self.model
        assert m is not None
        self._batch_clear()
        budget = self._budget_cap or m.n_batch
        to_sample: list[tuple[Slot, int]] = []
        to_verify: list[tuple[Slot, list[int], list[int]]] = []
        fed: list[tuple[Slot, list[int]]] = []
        self._eval_media(m)
        drafts = self._drafts(m)
        for slot in self.slots:
            if slot.generating and budget > 0:
                assert slot.last_token is not None
                pos = slot.pos_next  # a position: media before may hold more cells than positions (M-RoPE)
                idx = self._batch_add(slot.last_token, pos, slot.id, True)
                draft = drafts.get(slot.id, [])[: budget - 1]
                if draft:  # verified in this batch: logits at every drafted position
                    to_verify.append(
                        (
                            slot,
                            [
                                idx,
                                *(self._batch_add(t, pos + 1 + k, slot.id, True) for k, t in enumerate(draft)),
                            ],
                            draft,
                        )
                    )
                else:
                    to_sample.append((slot, idx))
                fed.append((slot, [slot.last_token]))
                budget -= 1 + len(draft)
        for slot in self.slots:
            if budget <= 0:
                break
            if slot.handle is None or not slot.pending_prompt:
                continue
            if slot.may_share and share_prefix(self.slots, slot, m):
                continue  # another slot is evaluating this prompt's prefix: copy it when done
            room = budget
            if slot.media and (media_at := slot.media.next_start(slot.n_past)) is not None:
                room = min(room, media_at - slot.n_past)  # the text up to the next media chunk
                if room <= 0:
                    continue  # a media chunk is next: the next step evaluates it (_eval_media)
            chunk = self.checkpoints.chunk(m, slot, room)  # a context checkpoint first where one is due
            last_chunk = len(chunk) == len(slot.pending_prompt)
            pos = slot.pos_next
            for j, tok in enumerate(chunk):
                want = last_chunk and j == len(chunk) - 1 and not slot.handle.job.prompt_only
                idx = self._batch_add(tok, pos + j, slot.id, want)
                if want:
                    to_sample.append((slot, idx))
            fed.append((slot, chunk))
            budget -= len(chunk)
        n_tokens = self._batch.n_tokens
        if n_tokens == 0:
            return
        t0 = time.perf_counter()
        try:
            rc = self.experts.decode(self._batch)
        except PeerLost as exc:
            failing = self.model  # the slots' half-decoded KV lives in it
            self.fail_all(self.experts.peer_lost(str(exc)), model=failing)
            return
        if rc == 1:  # no room in the KV cache: llama.cpp applied nothing of the batch; the next step retries
            cap = retry_without_room(m, n_tokens, self.make_room)
            if cap is None:
                self.fail_all(EngineFailure("Context size has been exceeded."), model=m)
            self._budget_cap = cap or 0
            return
        self._budget_cap = 0
        if rc == 0 and self.spec is not None and self.spec_follows(m) and not self.spec.process(self._batch):
            log.warning("speculative decoding stopped: a drafter cannot follow the target's batches")
            self.spec = None
        dt = time.perf_counter() - t0
        self.stats.n_decode_total += 1
        self.stats.n_busy_slots_total += len(fed)
        if rc != 0:
            log.error("llama_decode failed (code %d) on a batch of %d tokens", rc, n_tokens)
            failure = EngineFailure(f"llama_decode failed (code {rc})")
            ended = []
            for slot, _ in fed:
                handle = slot.handle
                assert handle is not None
                llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
                slot.cache_tokens.clear()
                self.gen.publish_end(slot, "slot.failed", failure)
                self.gen.release(slot)
                ended.append(handle)
            self.gen.end(ended, Failed(failure))
            return
        n_prompt_fed = 0
        for slot, toks in fed:
            slot.cache_tokens.extend(toks)
            self.stats.n_tokens_max = max(self.stats.n_tokens_max, slot.n_past)
            if slot.pending_prompt:
                del slot.pending_prompt[: len(toks)]
                n_prompt_fed += len(toks)
                if not slot.pending_prompt:
                    slot.state = SlotState.DONE_PROMPT
                    slot.t_first = time.perf_counter()
                    if slot.handle is not None and slot.handle.job.prompt_only:
                        self.gen.finish(slot, "length")
        self.stats.prompt_tokens_total += n_prompt_fed
        share = n_prompt_fed / n_tokens if n_tokens else 0.0
        self.stats.prompt_seconds_total += dt * share
        self.stats.tokens_predicted_seconds_total += dt * (1 - share)
        self.gen.sample(m, to_sample, to_verify)

    def _eval_media(self, m: LoadedModel) -> None:
        """Each slot whose prompt goes on with a media chunk evaluates that one chunk now, on its own decode
        (``mtmd_helper_eval_chunk_single`` at the slot's next position), before this step's batch: one chunk per
        slot and step, so a request is cancelled between chunks as between text pieces (llama-server's
        ``update_slots`` evaluates media chunks the same way, outside the batch of text).  A chunk that ends a
        generating prompt gives the first token from its last embedding's logits.  A prefix that another slot
        holds or is evaluating, through the same media, is copied first (:func:`share_prefix`).  A failed chunk fails
        its request (llama-server's "failed to process mtmd chunk"), its cells removed."""
        for slot in self.slots:
            handle = slot.handle
            if handle is None or not slot.pending_prompt or not slot.media:
                continue
            if slot.media.chunk_at(slot.n_past) is not None and slot.may_share and share_prefix(self.slots, slot, m):
                continue  # another slot is evaluating this prompt's prefix, the image too: copy it when done
            chunk = slot.media.chunk_at(slot.n_past)
            if chunk is None:
                continue
            assert m.media is not None  # _start refused media on a model without a projector
            want = len(slot.pending_prompt) == chunk.n_tokens and not handle.job.prompt_only
            pos = slot.pos_next
            t0 = time.perf_counter()
            hear = self.spec.process_media if self.spec is not None and self.spec_follows(m) else None
            rc = m.media.eval_chunk(m.ctx, chunk, pos, slot.id, m.n_batch, want, hear)
            dt = time.perf_counter() - t0
            self.stats.n_decode_total += 1
            if rc != 0:
                log.error("slot %d: failed to process mtmd chunk (code %d)", slot.id, rc)
                llama_cpp.llama_memory_seq_rm(m.memory, slot.id, pos, -1)
                failure = EngineFailure("failed to process mtmd chunk")
                self.gen.publish_end(slot, "slot.failed", failure)
                self.gen.release(slot)
                self.gen.end([handle], Failed(failure))
                continue
            slot.cache_tokens.extend(slot.pending_prompt[: chunk.n_tokens])
            del slot.pending_prompt[: chunk.n_tokens]
            slot.may_share = False
            self.stats.n_tokens_max = max(self.stats.n_tokens_max, slot.n_past)
            self.stats.prompt_tokens_total += chunk.n_tokens
            self.stats.prompt_seconds_total += dt
            if not slot.pending_prompt:
                slot.state = SlotState.DONE_PROMPT
                slot.t_first = time.perf_counter()
                if handle.job.prompt_only:
                    self.gen.finish(slot, "length")
                else:
                    self.gen.sample(m, [(slot, -1)])


def pick_slot(slots: list[Slot], job: CompletionJob, similarity: float) -> Slot | None:
    """The slot ``job`` starts on now: its ``id_slot`` if idle, else :func:`pick_idle_slot` (by prompt similarity
    for ``id_slot`` -1 only, as llama-server: one below -1 takes the least recently used); None: it waits."""
    if job.id_slot >= 0:
        slot = slots[job.id_slot]
        return None if slot.is_processing else slot
    idle = [s for s in slots if not s.is_processing]
    return pick_idle_slot(idle, job.prompt_tokens, similarity if job.id_slot == -1 else 0.0) if idle else None


def keep_cached(
    m: LoadedModel,
    slot: Slot,
    job: CompletionJob,
    prompt: list[int],
    n_cache_reuse: int,
    checkpoints: Checkpoints,
    prompt_cache: PromptCache | None = None,
    slots: Sequence[Slot] = (),
) -> int:
    """How many of ``prompt``'s first tokens ``slot`` keeps from its cache; its memory and ``cache_tokens``
    are cut back to them and the caller evaluates the rest (llama-server's ``update_slots`` when a slot starts).

    The common prefix of the cache and the prompt (0 with ``cache_prompt`` false); with ``--cache-reuse``
    (``n_cache_reuse``, or the job's) later cached chunks moved into place (:func:`reuse_chunks`); for a
    generating request at least the last prompt token is evaluated again (its logits are needed).  A
    memory that cannot be cut back (recurrent, hybrid, SWA) restores the latest context checkpoint at or
    before that point (:meth:`Checkpoints.start`), and with none (or ``--ctx-checkpoints 0``) keeps
    nothing: the whole prompt is evaluated.  Other models first go through the host-RAM ``prompt_cache``
    (:meth:`PromptCache.prepare`: the slot's state kept if it is about to lose much, a better prefix
    restored; ``slots``: all of them, for what a copy would give).
    """
    cache_n = _common_prefix(slot.cache_tokens, prompt) if job.cache_prompt else 0
    if prompt_cache is not None and not job.continue_slot and not checkpoints.needed(m):
        cache_n = prompt_cache.prepare(
            m, slot, prompt, cache_n, list(slots), job.cache_prompt, SHARE_MIN_TOKENS, job.request_id
        )
    n_reuse = n_cache_reuse if job.n_cache_reuse is None else job.n_cache_reuse
    if (
        n_reuse > 0
        and job.cache_prompt
        and not job.continue_slot
        and cache_n < min(len(slot.cache_tokens), len(prompt))
        and llama_cpp.llama_memory_can_shift(m.memory)
        and not checkpoints.needed(m)
        and shared_cells(m, list(slots), slot) <= cache_n
    ):  # cells other slots share never move
        cache_n = reuse_chunks(m, slot, prompt, cache_n, n_reuse)
    if checkpoints.needed(m):  # with --ctx-checkpoints 0 too: then it finds none
        cache_n = checkpoints.start(m, slot, prompt, cache_n, need_logits=not job.prompt_only)
    if not job.prompt_only and cache_n >= len(prompt):
        cache_n = len(prompt) - 1  # re-evaluate the last token to get its logits
    cache_n = slot.media.snap(cache_n)  # a media chunk is kept or evaluated whole (llama-server's keep_first)
    if not llama_cpp.llama_memory_seq_rm(m.memory, slot.id, slot.media.pos(cache_n), -1):
        llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)  # this memory cannot be cut back there
        cache_n = 0
    del slot.cache_tokens[cache_n:]
    return cache_n


def pick_idle_slot(idle: list[Slot], prompt: tuple[int, ...], similarity: float) -> Slot:
    """llama-server's ``get_available_slot`` for a request without ``id_slot``, over the ``idle`` slots.

    The slot whose cached tokens share the longest prefix with ``prompt``, if
    that prefix is more than ``similarity`` of the prompt's tokens
    (``lcp / len(prompt) > similarity``; 0.0 skips this); else the least
    recently used slot (the lowest id among equals; llama-server takes the
    highest, which makes no difference to anything but the id).
    """
    if similarity != 0.0 and prompt:
        best, best_sim = None, 0.0
        for s in idle:
            if s.cache_tokens:
                sim = _common_prefix(s.cache_tokens, prompt) / len(prompt)
                if sim > best_sim and sim > similarity:
                    best, best_sim = s, sim
        if best is not None:
            return best
    lru = idle[0]
    for s in idle[1:]:
        if s.last_used < lru.last_used:
            lru = s
    return lru
