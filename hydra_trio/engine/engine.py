"""The engine: one thread that owns llama.cpp and runs continuous batching.

Each step builds one ``llama_batch`` from every active slot, as llama-server's
``update_slots`` does: one token for each generating slot, then chunks of
pending prompts up to ``n_batch`` tokens in all; one ``llama_decode``; then one
sample per slot whose last token asked for logits.  Requests beyond the number
of slots wait in a FIFO queue (counted as deferred).

Only the engine thread touches the model, the context, the batch and the
samplers.  trio code talks to it through :meth:`Engine.submit` (completions)
and :meth:`Engine.call` (any function run between two steps).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import llama_cpp
import trio

from . import ggml_rpc
from .combined import DEFAULT_PATTERN, PeerError, PeerLost, PeerWorker, expert_bytes, peer_reachable
from .model import LoadedModel, ModelIdentity, sha256_file
from .sampling import GrammarError, SamplerSpec, build_sampler, token_probs
from .settings import SamplingParams, check_n_predict
from .state import save_slot
from .slots import (
    CompletionJob,
    Failed,
    Finished,
    RequestHandle,
    Slot,
    SlotAssigned,
    StopStringMatcher,
    TextDelta,
)

log = logging.getLogger("hydra_trio.engine")
T = TypeVar("T")


class EngineNotReady(RuntimeError):
    """The model is not loaded yet (or failed to load): HTTP 503."""


class SlotBusy(RuntimeError):
    """The slot is processing a request."""


@attrs.frozen
class EngineConfig:
    """Engine settings (llama-server's flag names in comments).

    Attributes:
        model_path: GGUF file (``--model``).
        model_alias: the model id in API replies (``--alias``).
        n_parallel: number of slots (``--parallel``).
        n_ctx: total context in tokens, split evenly over the slots (``--ctx-size``).
        n_batch: most tokens per decode step (``--batch-size``).
        n_threads: CPU threads, None = all cores (``--threads``).
        peer: ggml-RPC peer ``host:port`` for COMBINED mode (``--rpc-engine``).
        combined_pattern: regex of the tensors that live on the peer in
            COMBINED mode (``--combined-pattern``; MoE experts by default).
        chat_template: ``--chat-template``: None for the GGUF's own template
            (llama.cpp's built-in ``chatml`` when the GGUF has none, as
            llama-server does), a built-in template name or Jinja text
            (see :class:`~hydra_trio.engine.model.ChatTemplate`).
    """

    model_path: Path
    model_alias: str
    n_parallel: int = 4
    n_ctx: int = 8192
    n_batch: int = 512
    n_threads: int | None = None
    peer: str | None = None
    combined_pattern: str = DEFAULT_PATTERN
    chat_template: str | None = None


@attrs.define
class EngineStats:
    """Counters behind ``/metrics`` (llama-server's metric names)."""

    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    requests_deferred: int = 0
    requests_total: int = 0
    mode_switches: int = 0
    combined_fallbacks: int = 0
    peer_losses: int = 0


_STOP = object()
_WAKE = object()


class Engine:
    """N slots over one llama.cpp context, served by one worker thread.

    Lifecycle: ``await nursery.start(engine.run)`` returns at once; the
    model then loads on the engine thread while :attr:`stage` moves through
    ``loading_model`` (with :attr:`progress` 0..1), ``warmup`` and ``ready``.
    Cancelling :meth:`run` stops the thread after its current step and frees
    llama.cpp's objects.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stage = "starting"
        self.progress = 0.0
        self.error: str | None = None
        self.identity: ModelIdentity | None = None
        self.stats = EngineStats()
        self.slots: list[Slot] = []
        self.n_ctx_slot = 0
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: collections.deque[RequestHandle] = collections.deque()
        self._stop = False
        self._ready = trio.Event()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.model: LoadedModel | None = None
        self.stage_times: dict[str, float] = {}
        self.defaults = SamplingParams()
        self.default_n_predict = -1
        # expert mode (hydra-protocol.md §3 SET_EXPERT_MODE); engine thread writes, others read
        self.mode = "solo"
        self.peer: str | None = config.peer
        self.peer_reachable = False
        self.combined_pattern = config.combined_pattern
        self.fallback_reason: str | None = None
        # "none" | "pending" (start-up attach queued) | "attached" | "failed"
        self.peer_attach = "pending" if config.peer else "none"
        self.solo_model: LoadedModel | None = None
        self.combined_model: LoadedModel | None = None
        self._peer_worker: PeerWorker | None = None

    # ------------------------------------------------------------------ trio side
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model and serve until cancelled.

        Raises:
            ModelLoadError: the model could not be loaded (after :attr:`stage`
                became ``error``).
        """
        self._trio_token = trio.lowlevel.current_trio_token()
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_cancelled)
            await trio.to_thread.run_sync(self._thread_main, limiter=trio.CapacityLimiter(1))
            nursery.cancel_scope.cancel()

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self._stop = True
            self._inbox.put(_STOP)

    async def wait_ready(self) -> None:
        """Wait until the model serves (stage ``ready``)."""
        await self._ready.wait()

    @property
    def ready(self) -> bool:
        return self.stage == "ready"

    def submit(self, job: CompletionJob) -> RequestHandle:
        """Queue a completion; events arrive on ``handle.events``.

        Raises:
            EngineNotReady: before the model serves.
            ValueError: the job is invalid for this engine (empty prompt,
                prompt longer than a slot's context, slot id out of range).
        """
        if not self.ready:
            raise EngineNotReady(f"model not ready (stage: {self.stage})")
        if not job.prompt_tokens and not job.continue_slot:
            raise ValueError("the prompt is empty")
        if job.continue_slot and job.id_slot < 0:
            raise ValueError("id_slot: continuing a slot's KV cache needs a slot id")
        if len(job.prompt_tokens) >= self.n_ctx_slot:
            raise ValueError(
                f"the prompt has {len(job.prompt_tokens)} tokens; a slot's context holds "
                f"{self.n_ctx_slot} (--ctx-size / --parallel)"
            )
        if not (-1 <= job.id_slot < len(self.slots)):
            raise ValueError(f"id_slot: {job.id_slot} is out of range (0..{len(self.slots) - 1})")
        assert self._trio_token is not None
        handle = RequestHandle(job, self._trio_token)
        self._inbox.put(handle)
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request and free its slot at the next step (idempotent)."""
        if not handle.cancelled:
            handle.cancelled = True
            self._inbox.put(_WAKE)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result.

        Exceptions raised by ``fn`` are re-raised here.  Raises
        EngineNotReady before the model serves.
        """
        if not self.ready:
            raise EngineNotReady(f"model not ready (stage: {self.stage})")
        assert self._trio_token is not None
        done = trio.Event()
        box: dict[str, Any] = {}
        token = self._trio_token

        def job(engine: Engine) -> None:
            try:
                box["value"] = fn(engine)
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._inbox.put(job)
        await done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def slots_info(self) -> list[dict[str, Any]]:
        """``/slots``: one dict per slot (a snapshot; safe from any thread)."""
        return [s.info() for s in self.slots]

    @property
    def requests_processing(self) -> int:
        return sum(1 for s in self.slots if s.is_processing)

    @property
    def requests_waiting(self) -> int:
        return len(self._pending)

    # ---------------------------------------------------------- engine thread
    def _set_stage(self, stage: str) -> None:
        now = time.monotonic()
        if self.stage_times:
            prev, t0 = self.stage, self.stage_times[self.stage]
            log.info("stage %s done in %.2f s", prev, now - t0)
        self.stage = stage
        self.stage_times[stage] = now
        log.info("stage %s", stage)

    def _thread_main(self) -> None:
        cfg = self.config
        try:
            self._set_stage("loading_model")
            last_logged = [-1.0]

            def progress(p: float) -> bool:
                self.progress = p
                if p - last_logged[0] >= 0.25 or p >= 1.0:
                    last_logged[0] = p
                    log.info("loading model: %3.0f%%", 100 * p)
                return not self._stop  # False aborts the load (shutdown during load)

            model = LoadedModel(
                cfg.model_path,
                n_ctx=cfg.n_ctx,
                n_parallel=cfg.n_parallel,
                n_batch=cfg.n_batch,
                n_threads=cfg.n_threads,
                progress=progress,
                chat_template=cfg.chat_template,
                log_chat_template=True,
            )
            self.model = self.solo_model = model
            self.progress = 1.0
            self._set_stage("hashing_model")
            self.identity = ModelIdentity(
                model_alias=cfg.model_alias,
                model_path=str(cfg.model_path),
                model_hash=sha256_file(cfg.model_path, stop=lambda: self._stop),
            )
            self.n_ctx_slot = model.n_ctx_slot
            self.slots = [Slot(i, model.n_ctx_slot) for i in range(cfg.n_parallel)]
            self._batch = llama_cpp.llama_batch_init(model.n_batch, 0, 1)
            self._set_stage("warmup")
            self._warmup()
        except Exception as exc:
            if self.model is not None:
                self.model.close()
            if self._stop:  # the node is stopping: the load was aborted on purpose, not a failure
                self._set_stage("stopped")
                log.info("model load stopped: the node is shutting down")
                return
            self.error = str(exc)
            self._set_stage("error")
            log.error("model load failed: %s", exc)
            raise
        if self._stop:
            self._shutdown()
            return
        self._set_stage("ready")
        assert self._trio_token is not None
        try:
            self._trio_token.run_sync_soon(self._ready.set)
        except trio.RunFinishedError:
            pass
        try:
            self._loop()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for slot in self.slots:
            if slot.handle is not None:
                slot.handle.emit(Failed("the server is shutting down"))
                self._release(slot)
        while self._pending:
            self._pending.popleft().emit(Failed("the server is shutting down"))
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self._detach()
        if self.solo_model is not None:
            self.solo_model.close()
        log.info("engine stopped")

    def _warmup(self) -> None:
        """One tiny decode so the first request does not pay for lazy init (like llama-server)."""
        m = self.model
        assert m is not None
        tok = m.bos_id if m.bos_id >= 0 else 0
        self._batch_clear()
        self._batch_add(tok, 0, 0, True)
        llama_cpp.llama_decode(m.ctx, self._batch)
        llama_cpp.llama_memory_clear(m.memory, True)

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

    def _loop(self) -> None:
        while not self._stop:
            busy = any(s.is_processing for s in self.slots)
            self._drain_inbox(block=not busy)
            if self._stop:
                return
            try:
                self._drop_cancelled()
                self._assign_pending()
                if any(s.is_processing for s in self.slots):
                    self._step()
            except Exception as exc:  # never let one bad request take the engine down
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(f"engine error: {exc}")

    def _decode(self, m: LoadedModel) -> int:
        """``llama_decode`` on the active model; COMBINED decodes run on the peer worker thread.

        Raises PeerLost when the peer died during the call.
        """
        if m is self.combined_model and self._peer_worker is not None:
            batch = self._batch
            return self._peer_worker.call(lambda: llama_cpp.llama_decode(m.ctx, batch))
        return llama_cpp.llama_decode(m.ctx, self._batch)

    def _on_peer_lost(self, why: str) -> None:
        """Engine thread: the peer died.  Fail the requests in flight, go back to SOLO."""
        self.stats.peer_losses += 1
        log.error("COMBINED peer %s lost (%s): requests in flight fail, back to SOLO", self.peer, why)
        self.fallback_reason = f"peer {self.peer} stopped answering mid-request"
        self.peer_reachable = False
        self.combined_model = None  # its worker thread is parked; the model is leaked with it
        self._peer_worker = None
        self.peer_attach = "failed"
        self._fail_all(f"the ggml-RPC peer {self.peer} died mid-request; the node is back in SOLO mode, retry")
        self._activate(self.solo_model)
        self.mode = "solo"

    def _fail_all(self, message: str) -> None:
        m = self.model
        for slot in self.slots:
            if slot.handle is not None:
                handle = slot.handle
                if m is not None:
                    llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
                slot.cache_tokens.clear()
                self._release(slot)
                handle.emit(Failed(message))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is _STOP:
                self._stop = True
            elif item is _WAKE:
                pass
            elif isinstance(item, RequestHandle):
                self.stats.requests_total += 1
                self._pending.append(item)
            else:
                item(self)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        """Engine thread: end cancelled requests, queued or running, with ``Failed(code="cancelled")``.

        The terminal event closes the request's channel, so whoever still
        reads it (a handler whose client went away) ends too.
        """
        if any(h.cancelled for h in self._pending):
            keep: collections.deque[RequestHandle] = collections.deque()
            for h in self._pending:
                if h.cancelled:
                    h.emit(Failed("the request was cancelled while it waited for a slot", "cancelled"))
                else:
                    keep.append(h)
            self._pending = keep
        for slot in self.slots:
            handle = slot.handle
            if handle is not None and handle.cancelled:
                log.info("slot %d: request cancelled (client gone); slot freed", slot.id)
                self._release(slot)
                handle.emit(Failed("the request was cancelled", "cancelled"))

    def _assign_pending(self) -> None:
        waiting: collections.deque[RequestHandle] = collections.deque()
        while self._pending:
            handle = self._pending.popleft()
            job = handle.job
            if job.id_slot >= len(self.slots):  # the slot count shrank while it waited
                handle.emit(Failed(f"id_slot: slot {job.id_slot} no longer exists", "invalid_request"))
                continue
            if job.fail_if_busy and self.slots[job.id_slot].is_processing:
                handle.emit(Failed(f"slot {job.id_slot} is processing a request", "busy"))
                continue
            slot = self._pick_slot(job)
            if slot is None:
                if not handle.deferred:
                    handle.deferred = True
                    self.stats.requests_deferred += 1
                waiting.append(handle)
                continue
            self._start(slot, handle)
        self._pending = waiting

    def _pick_slot(self, job: CompletionJob) -> Slot | None:
        if job.id_slot >= 0:
            slot = self.slots[job.id_slot]
            return None if slot.is_processing else slot
        idle = [s for s in self.slots if not s.is_processing]
        if not idle:
            return None

        def score(s: Slot) -> tuple[int, float]:
            lcp = _common_prefix(s.cache_tokens, job.prompt_tokens) if job.cache_prompt else 0
            return (lcp, -s.last_used)

        return max(idle, key=score)

    def _start(self, slot: Slot, handle: RequestHandle) -> None:
        m = self.model
        assert m is not None
        job = handle.job
        prompt = list(slot.cache_tokens) if job.continue_slot else list(job.prompt_tokens)
        if not prompt:
            handle.emit(Failed(f"slot {slot.id} holds no tokens to continue from (PREFILL or STATE_PUT first)",
                               "invalid_request"))
            return
        spec = SamplerSpec(job.sampling, job.logit_bias, tuple(m.eog_tokens) if job.ignore_eos else (), job.grammar)
        try:
            sampler = build_sampler(spec, m.vocab, m.n_vocab, slot.n_ctx, prompt)
        except GrammarError as exc:  # checked when the job was built: only a bug gets here
            handle.emit(Failed(f"grammar: {exc}", "invalid_request"))
            return
        slot.reset_request()
        slot.sampler = sampler
        slot.handle = handle
        slot.t_start = time.perf_counter()
        cache_n = _common_prefix(slot.cache_tokens, prompt) if job.cache_prompt else 0
        if job.n_predict != 0 and cache_n >= len(prompt):
            cache_n = len(prompt) - 1  # re-evaluate the last token to get its logits
        if not llama_cpp.llama_memory_seq_rm(m.memory, slot.id, cache_n, -1):
            llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
            cache_n = 0
        del slot.cache_tokens[cache_n:]
        slot.cache_n = cache_n
        slot.n_prompt = len(prompt)
        slot.pending_prompt = prompt[cache_n:]
        slot.stopper = StopStringMatcher(job.stop)
        handle.emit(SlotAssigned(slot.id, len(prompt), cache_n))
        log.debug("slot %d: start, prompt %d tokens, cache_n %d", slot.id, len(prompt), cache_n)
        if not slot.pending_prompt:  # prefill-only request fully cached
            slot.t_first = time.perf_counter()
            self._finish(slot, "length")

    def _step(self) -> None:
        m = self.model
        assert m is not None
        self._batch_clear()
        budget = m.n_batch
        to_sample: list[tuple[Slot, int]] = []
        fed: list[tuple[Slot, list[int]]] = []
        for slot in self.slots:
            if slot.generating and budget > 0:
                assert slot.last_token is not None
                idx = self._batch_add(slot.last_token, slot.n_past, slot.id, True)
                to_sample.append((slot, idx))
                fed.append((slot, [slot.last_token]))
                budget -= 1
        for slot in self.slots:
            if budget <= 0:
                break
            if slot.handle is None or not slot.pending_prompt:
                continue
            chunk = slot.pending_prompt[:budget]
            last_chunk = len(chunk) == len(slot.pending_prompt)
            for j, tok in enumerate(chunk):
                want = last_chunk and j == len(chunk) - 1 and slot.handle.job.n_predict != 0
                idx = self._batch_add(tok, slot.n_past + j, slot.id, want)
                if want:
                    to_sample.append((slot, idx))
            fed.append((slot, chunk))
            budget -= len(chunk)
        n_tokens = self._batch.n_tokens
        if n_tokens == 0:
            return
        t0 = time.perf_counter()
        try:
            rc = self._decode(m)
        except PeerLost as exc:
            self._on_peer_lost(str(exc))
            return
        dt = time.perf_counter() - t0
        self.stats.n_decode_total += 1
        self.stats.n_busy_slots_total += len(fed)
        if rc != 0:
            log.error("llama_decode failed (code %d) on a batch of %d tokens", rc, n_tokens)
            for slot, _ in fed:
                handle = slot.handle
                assert handle is not None
                llama_cpp.llama_memory_seq_rm(m.memory, slot.id, -1, -1)
                slot.cache_tokens.clear()
                self._release(slot)
                handle.emit(Failed(f"llama_decode failed (code {rc})"))
            return
        n_prompt_fed = 0
        for slot, toks in fed:
            slot.cache_tokens.extend(toks)
            if slot.pending_prompt:
                del slot.pending_prompt[: len(toks)]
                n_prompt_fed += len(toks)
                if not slot.pending_prompt:
                    slot.t_first = time.perf_counter()
                    if slot.handle is not None and slot.handle.job.n_predict == 0:
                        self._finish(slot, "length")
        self.stats.prompt_tokens_total += n_prompt_fed
        share = n_prompt_fed / n_tokens if n_tokens else 0.0
        self.stats.prompt_seconds_total += dt * share
        self.stats.tokens_predicted_seconds_total += dt * (1 - share)
        for slot, idx in to_sample:
            if slot.handle is None:
                continue
            token = llama_cpp.llama_sampler_sample(slot.sampler, m.ctx, idx)
            job = slot.handle.job
            if job.logprobs or job.n_probs:
                probs = token_probs(m.ctx, idx, m.n_vocab, token, job.n_probs)
                slot.pending_logprobs.append(probs.logprob)
                slot.pending_top.append(probs.top)
            self._on_token(slot, token)

    def _on_token(self, slot: Slot, token: int) -> None:
        m = self.model
        assert m is not None and slot.handle is not None
        job = slot.handle.job
        if not job.ignore_eos and m.is_eog(token):
            if slot.pending_logprobs:
                slot.pending_logprobs.pop()
                slot.pending_top.pop()
            self._finish(slot, "stop", stop_reason="eos")
            return
        slot.n_decoded += 1
        self.stats.tokens_predicted_total += 1
        slot.pending_tokens.append(token)
        text, stopped = slot.stopper.push(slot.utf8.decode(m.token_bytes(token)))
        if text or job.logprobs:  # logprob jobs (Hydra DECODE) want every token at once
            self._emit_text(slot, text)
        if stopped:
            self._finish(slot, "stop", flush=False, stop_reason="stop")
            return
        slot.last_token = token
        if job.n_predict > 0 and slot.n_decoded >= job.n_predict:
            self._finish(slot, "length")
        elif slot.n_past + 1 >= slot.n_ctx:
            self._finish(slot, "length", stop_reason="n_tokens_limit")

    def _finish(self, slot: Slot, reason: str, flush: bool = True, stop_reason: str = "length") -> None:
        handle = slot.handle
        assert handle is not None
        if flush:
            # bytes of a character the generation stopped inside of are dropped, never
            # sent as U+FFFD (llama-server's behaviour); held-back stop-string text is sent
            tail = slot.stopper.flush()
            if tail or slot.pending_tokens:
                self._emit_text(slot, tail)
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
            state=save_slot(self, slot.id) if handle.job.snapshot else None,
        )
        # one line per finished request, whatever protocol it came by (llama-server's print_timings, on one line)
        t = done.timings()
        log.info("slot %d | %s | prompt %d tokens (%d cached) %.1f ms, %.1f tok/s | generated %d tokens %.1f ms, "
                 "%.1f tok/s | finish %s (%s)", slot.id, handle.job.request_id or "-", t["prompt_n"], t["cache_n"],
                 t["prompt_ms"], t["prompt_per_second"], t["predicted_n"], t["predicted_ms"],
                 t["predicted_per_second"], reason, stop_reason)
        # the slot is idle before the client hears of the end: a follow-up
        # request on the same slot never sees it busy
        self._release(slot)
        handle.emit(done)

    def _emit_text(self, slot: Slot, text: str) -> None:
        assert slot.handle is not None
        slot.handle.emit(TextDelta(text, tuple(slot.pending_tokens), tuple(slot.pending_logprobs), tuple(slot.pending_top)))
        slot.pending_tokens = []
        slot.pending_logprobs = []
        slot.pending_top = []

    def _release(self, slot: Slot) -> None:
        if slot.sampler is not None:
            llama_cpp.llama_sampler_free(slot.sampler)
        # cache_tokens tracks exactly what was decoded, so a request cut off
        # mid-prompt leaves a valid prefix in the slot's KV cache.
        slot.last_used = time.monotonic()
        slot.reset_request()

    # ------------------------------------------------------- slot operations
    def erase_slot(self, id_slot: int) -> int:
        """Engine thread: drop a slot's KV cache.  Returns the number of tokens erased.

        Raises SlotBusy when the slot is processing.
        """
        slot = self.slots[id_slot]
        if slot.is_processing:
            raise SlotBusy(f"slot {id_slot} is processing a request")
        n = slot.n_past
        assert self.model is not None
        llama_cpp.llama_memory_seq_rm(self.model.memory, slot.id, -1, -1)
        slot.cache_tokens.clear()
        return n


    # ------------------------------------------------------------ expert mode
    def _activate(self, m: LoadedModel | None) -> None:
        """Engine thread, all slots idle: make ``m`` serve new work.

        Each model has its own context and KV cache, so the slots' cached
        prompts do not carry over: they are dropped (never reused wrongly).
        """
        if m is None or m is self.model:
            return
        llama_cpp.llama_memory_clear(m.memory, True)
        for slot in self.slots:
            slot.cache_tokens.clear()
        self.model = m
        self.stats.mode_switches += 1

    def _detach(self) -> None:
        """Engine thread: free the COMBINED model (on the peer's worker: it frees buffers on the peer)."""
        model, worker = self.combined_model, self._peer_worker
        if self.model is model and model is not None:
            self._activate(self.solo_model)
            self.mode = "solo"
        self.combined_model = None
        self._peer_worker = None
        if self.peer_attach == "attached":
            self.peer_attach = "none"
        if model is not None and worker is not None:
            try:
                worker.call(model.close, timeout=30)
            except (PeerLost, TimeoutError) as exc:
                log.warning("peer %s: could not free the COMBINED model (%s); leaked", worker.peer, exc)
            worker.stop()

    def _attach(self, peer: str) -> None:
        """Engine thread: build the COMBINED model with the expert tensors on ``peer``.

        Raises PeerError (unreachable, too little memory, load failed); the
        engine is unchanged then.
        """
        solo = self.solo_model
        assert solo is not None
        t_probe = time.perf_counter()
        if not peer_reachable(peer):
            self.peer_reachable = False
            raise PeerError(f"peer {peer} does not answer ggml-RPC")
        self.peer_reachable = True
        t_bytes = time.perf_counter()
        need = expert_bytes(solo.path, self.combined_pattern)
        log.info("attach %s: probe %.0f ms, expert bytes counted in %.0f ms", peer,
                 (t_bytes - t_probe) * 1e3, (time.perf_counter() - t_bytes) * 1e3)
        if need == 0:
            raise PeerError(f"no tensor of {solo.path.name} matches {self.combined_pattern!r} (not a MoE model?)")
        worker = PeerWorker(peer)
        cfg = self.config

        def build() -> LoadedModel:
            devs = ggml_rpc.add_peer(peer)
            if not devs:
                raise PeerError(f"peer {peer} has no ggml devices")
            free, _total = ggml_rpc.device_memory(devs[0])
            if free < need:
                raise PeerError(f"peer {peer} has {free} bytes free; the expert tensors need {need}")
            buft = ggml_rpc.libs()[0].ggml_backend_dev_buffer_type(devs[0])
            m = LoadedModel(
                solo.path, n_ctx=solo.n_ctx, n_parallel=solo.n_parallel, n_batch=cfg.n_batch,
                n_threads=cfg.n_threads, devices=[devs[0], ggml_rpc.cpu_device()],
                overrides=[(self.combined_pattern, buft)],
            )
            return m

        t0 = time.perf_counter()
        try:
            model = worker.call(build, timeout=600)
        except PeerLost as exc:
            raise PeerError(f"peer {peer} died while the experts were uploaded: {exc}") from None
        except PeerError:
            worker.stop()
            raise
        except Exception as exc:
            worker.stop()
            raise PeerError(f"COMBINED model failed to load on {peer}: {exc}") from None
        self.combined_model, self._peer_worker = model, worker
        self.peer_attach = "attached"
        log.info("COMBINED model ready: %d bytes of %r on peer %s, built in %.2f s",
                 need, self.combined_pattern, peer, time.perf_counter() - t0)

    def set_expert_mode(self, mode: str, peer: str | None) -> dict[str, Any]:
        """Engine thread, every slot idle (the control channel checks): switch SOLO / COMBINED.

        ``peer`` different from the current one detaches the old peer (frees
        what lives there) and attaches the new one.  COMBINED without a usable
        peer answers ``mode: "solo"`` with a ``fallback_reason``
        (hydra-protocol.md §3, SET_EXPERT_MODE).  Returns the reply meta.
        """
        t0 = time.perf_counter()
        if mode == "solo":
            self._activate(self.solo_model)
            self.mode = "solo"
            self.fallback_reason = None
            return {"success": True, "mode": "solo", "peer": self.peer}
        target = peer or self.peer
        if target is None:
            return self._fallback("no peer: start with --rpc-engine HOST:PORT or send {\"mode\": \"combined\", \"peer\": ...}")
        if target != self.peer or self.combined_model is None or self._peer_worker is None or self._peer_worker.dead:
            if self.combined_model is not None:
                log.info("detaching peer %s", self.peer)
            self._detach()
            self.peer = target
            try:
                self._attach(target)
            except PeerError as exc:
                return self._fallback(str(exc))
        self._activate(self.combined_model)
        self.mode = "combined"
        self.fallback_reason = None
        log.info("expert mode COMBINED (peer %s), switch took %.1f ms", self.peer, (time.perf_counter() - t0) * 1e3)
        return {"success": True, "mode": "combined", "peer": self.peer, "switch_ms": round((time.perf_counter() - t0) * 1e3, 3)}

    def peer_gone(self) -> None:
        """Engine thread, slots idle: the watchdog found the peer unreachable; back to SOLO."""
        if self.mode != "combined":
            return
        self.fallback_reason = f"peer {self.peer} became unreachable"  # before the mode flips: INFO is read concurrently
        self.stats.combined_fallbacks += 1
        self._detach()
        self.peer_attach = "failed"

    def _fallback(self, reason: str) -> dict[str, Any]:
        """COMBINED was asked for and SOLO stays in effect: ``success`` is false (the mode in
        effect is not the one asked for); ``mode`` and ``fallback_reason`` say what and why."""
        self.stats.combined_fallbacks += 1
        self.peer_attach = "failed" if self.peer else "none"
        self._activate(self.solo_model)
        self.mode = "solo"
        self.fallback_reason = reason
        log.warning("COMBINED unavailable, staying in SOLO: %s", reason)
        return {"success": False, "mode": "solo", "peer": self.peer, "fallback_reason": reason}

    # ------------------------------------------------ engine-wide settings
    def set_defaults(self, **params: Any) -> None:
        """CONFIGURE tier 1: new sampling defaults (and ``n_predict``) for requests that omit them.

        Bounds: :mod:`hydra_trio.engine.settings` (the HTTP API's too).
        Raises ParameterError (a ValueError) naming the field; nothing changes then.
        """
        n_predict = params.pop("n_predict", self.default_n_predict)
        check_n_predict("n_predict", n_predict)
        new = attrs.evolve(self.defaults, **params)  # validators check each field
        self.defaults = new
        self.default_n_predict = n_predict

    def reconfigure(self, **params: Any) -> dict[str, Any]:
        """Engine thread, every slot idle (the control channel checks): CONFIGURE tiers 2 and 3.

        ``n_ctx`` / ``n_parallel`` rebuild the context; ``model_path`` (or
        ``model``, a path or preset alias) reloads the model.  The new
        context or model is built before the old one is freed, so a failure
        leaves the engine as it was.  Slots' KV caches are dropped (they
        belong to the old context).  Returns the applied values.

        Raises ValueError for a key this node cannot apply, or when
        llama.cpp refuses the new settings.
        """
        from ..models.presets import PresetError, resolve_model

        unsupported = sorted(set(params) - {"n_ctx", "n_parallel", "model_path", "model"})
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported by this node (CPU only, default KV types)")
        old = self.solo_model
        assert old is not None
        n_ctx = int(params.get("n_ctx", old.n_ctx))
        n_parallel = int(params.get("n_parallel", old.n_parallel))
        if not 1 <= n_parallel <= 64:
            raise ValueError(f"n_parallel: {n_parallel} is out of range (1..64)")
        if not 16 * n_parallel <= n_ctx <= old.n_ctx_train * n_parallel:
            raise ValueError(
                f"n_ctx: {n_ctx} is out of range ({16 * n_parallel}..{old.n_ctx_train * n_parallel} "
                f"for {n_parallel} slots: 16 to n_ctx_train tokens each)"
            )
        target = params.get("model_path") or params.get("model")
        path, alias = old.path, self.config.model_alias
        if target is not None:
            try:
                path, alias = resolve_model(str(target))
            except PresetError as exc:
                raise ValueError(str(exc)) from None
        try:
            new = LoadedModel(
                path, n_ctx=n_ctx, n_parallel=n_parallel, n_batch=old.n_batch, n_threads=self.config.n_threads,
                chat_template=self.config.chat_template, log_chat_template=True,
            )
        except Exception as exc:
            raise ValueError(f"llama.cpp refused the new settings: {exc}") from None
        identity = self.identity
        if path != old.path:
            identity = ModelIdentity(model_alias=alias, model_path=str(path), model_hash=sha256_file(path))
        if self.combined_model is not None:
            log.info("reconfigure: detaching the COMBINED model (SET_EXPERT_MODE combined rebuilds it)")
            self._detach()
        old.close()
        self.model = self.solo_model = new
        self.identity = identity
        self.n_ctx_slot = new.n_ctx_slot
        self.slots = [Slot(i, new.n_ctx_slot) for i in range(n_parallel)]
        self.config = attrs.evolve(self.config, model_path=path, model_alias=identity.model_alias if identity else alias,
                                   n_ctx=n_ctx, n_parallel=n_parallel)
        log.info("reconfigured: model %s, n_ctx %d, %d slots", path.name, new.n_ctx, n_parallel)
        return {"n_ctx": new.n_ctx, "n_parallel": n_parallel, "model_path": str(path)}


def _common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
