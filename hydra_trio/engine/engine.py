"""The engine: one thread that owns llama.cpp, its lifecycle, and the door trio code talks through.

The split follows llama.cpp's own server (``server-queue`` / ``server-task`` /
``server-context``): this module is the lifecycle (load, hash, warm up, serve,
stop), the stages ``/health`` reports, the engine thread and its inbox, and
the calls trio code makes — :meth:`Engine.submit` (a completion),
:meth:`Engine.cancel`, :meth:`Engine.run_task` (a typed task of :mod:`~hydra_trio.engine.tasks`,
run between two batching steps) and :meth:`Engine.call` (any function; for the engine package's
own use).  The batching itself is :class:`~hydra_trio.engine.batching.scheduler.Scheduler`;
SOLO / COMBINED is :class:`~hydra_trio.engine.experts.combined.ExpertModes`.

Only the engine thread touches the models, the contexts, the batch and the
samplers.
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import llama_cpp
import trio

from ..observability.events import EventBus
from ..observability import progress
from ..errors import Busy, Cancelled, EngineFailure, InvalidRequest, NotReady
from . import quants
from .kv import state
from .kv.blobbuf import BlobBuffer, BlobPool
from .bridge import Call
from .experts.combined import ExpertModes
from .kv.kv_identity import identity_hash, kv_identity
from .llama.model import LoadedModel, ModelIdentity, release_free_memory, resident_bytes, sha256_file
from .batching.prompt_cache import PromptCache
from .requests import CompletionJob, LiveRequests, RequestHandle, StepHandOff
from .batching.scheduler import Scheduler, check_prompt_fits, erase_slot
from .settings import INT32_MAX, EngineConfig, RequestDefaults, SamplingParams, check_n_parallel
from .batching.slots import Slot
from .snapshot import EMPTY, EngineSnapshot, next_snapshot
from .speculative.build import build_speculative, target_options
from .tasks import CancelCompletion, EngineTask, StartCompletion, Stop

log = logging.getLogger("hydra_trio.engine")
T = TypeVar("T")


class Stage(enum.StrEnum):
    """Where the engine is in its life (``/health``'s ``stage``)."""

    STARTING = "starting"
    LOADING_MODEL = "loading_model"
    HASHING_MODEL = "hashing_model"
    WARMUP = "warmup"
    READY = "ready"
    ERROR = "error"
    STOPPED = "stopped"


@attrs.define
class EngineStats:
    """Counters behind ``/metrics`` (llama-server's metric names)."""

    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    """Prompt tokens a request found in its slot's cache (or the prompt cache) and did not evaluate."""
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_tokens_max: int = 0
    """The most tokens a slot has held (prompt + generated) after a decode step."""
    requests_deferred: int = 0
    requests_total: int = 0
    mode_switches: int = 0
    combined_fallbacks: int = 0
    peer_losses: int = 0
    tasks: dict[str, int] = attrs.Factory(dict)
    """Engine tasks run (:mod:`~hydra_trio.engine.tasks`), by kind (``hydra_trio:engine_tasks_total{type}``)."""
    spec_draft_tokens: int = 0
    """Speculative decoding: tokens drafted, drafted tokens the target accepted, verification steps, and
    accepted tokens by draft position (llama-server's ``spec_decode_num_*_total``)."""
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0
    spec_accepted_per_pos: list[int] = attrs.Factory(list)
    control: dict[str, int] = attrs.Factory(lambda: {"applied": 0, "refused_busy": 0, "failed": 0})
    """Exclusive tasks (the serialized control channel) by result (``hydra_trio:control_changes_total{result}``)."""


EMBEDDING_ONLY = ("this node serves embeddings (--embedding): use POST /v1/embeddings or /embedding; "
                  "start a node without --embedding for completions")
NO_EMBEDDINGS = "This server does not support embeddings. Start it with `--embeddings` (--embedding)"


def check_serves_completions(engine: Engine) -> None:
    """NotReady before the model serves; InvalidRequest on an embedding-only node (``--embedding``)."""
    engine.check_ready()
    if engine.config.embeddings:
        raise InvalidRequest(EMBEDDING_ONLY)


def _trim_heap(when: str) -> None:
    """:func:`~.model.release_free_memory` (glibc ``malloc_trim``, about 20 µs), logged at DEBUG with the
    resident set size: after the load and each time the last busy slot goes idle, never between two
    decode steps of a request."""
    if not log.isEnabledFor(logging.DEBUG):
        release_free_memory()
        return
    before = resident_bytes()
    released = release_free_memory()
    after = resident_bytes()
    if before is not None and after is not None:
        log.debug("heap trimmed %s: resident %.1f MiB (%+.1f MiB)%s", when, after / 2**20, (after - before) / 2**20,
                  "" if released else ", nothing to release")


def _at_idle(experts: ExpertModes) -> None:
    """Every slot idle after a request: :func:`_trim_heap`, and a COMBINED peer's worker frees its OpenMP team
    (:meth:`ExpertModes.rest`: a peer lost before the next request then leaves no second team behind)."""
    _trim_heap("idle")
    experts.rest()


def _warmup(m: LoadedModel) -> None:
    """One tiny decode so the first request does not pay for lazy init (like llama-server), then
    :func:`_trim_heap`: the load's temporaries go back to the system."""
    tokens = (llama_cpp.llama_token * 1)(m.bos_id if m.bos_id >= 0 else 0)  # alive while the batch points at it
    llama_cpp.llama_decode(m.ctx, llama_cpp.llama_batch_get_one(tokens, 1))
    llama_cpp.llama_memory_clear(m.memory, True)
    _trim_heap("after loading")


def new_scheduler(cfg: EngineConfig, experts: ExpertModes, model: LoadedModel, stats: EngineStats, model_hash: str,
                  events: EventBus, prompt_cache: PromptCache | None = None,
                  hand_off: StepHandOff | None = None) -> Scheduler:
    """The scheduler over ``model``'s slots, with ``cfg``'s slot and cache settings and ``prompt_cache``;
    ``hand_off`` carries each step's token events to trio in one go.

    As llama-server, ``context_shift`` and ``n_cache_reuse`` are dropped with a
    warning when the model's memory cannot shift positions (recurrent or hybrid).
    """
    context_shift, n_cache_reuse = cfg.context_shift, cfg.n_cache_reuse
    if not llama_cpp.llama_memory_can_shift(model.memory):
        if context_shift:
            log.warning("context shift is not supported by this model's memory; it is disabled")
            context_shift = False
        if n_cache_reuse:
            log.warning("cache reuse is not supported by this model's memory; it is disabled")
            n_cache_reuse = 0
    log.info("initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = '%s'", model.n_parallel, model.n_ctx_slot,
             "true" if model.options.kv_unified else "false")  # llama-server's line
    spec, spec_cap = build_speculative(cfg.speculative, model, model.n_parallel)
    return Scheduler(experts, model.n_parallel, model.n_ctx_slot, model.n_batch, stats, model_hash, events=events,
                     spec=spec, spec_cap=spec_cap,
                     context_shift=context_shift, n_keep=cfg.n_keep, n_cache_reuse=n_cache_reuse,
                     slot_prompt_similarity=cfg.slot_prompt_similarity, n_ctx_checkpoints=cfg.n_ctx_checkpoints,
                     checkpoint_min_step=cfg.checkpoint_min_step, prompt_cache=prompt_cache,
                     hand_off=hand_off)


def kv_cache(e: Engine) -> dict[str, str]:
    """The serving model's KV cache: ``{"type_k", "type_v", "flash_attn"}`` (``q8_0``, ``on``/``off``;
    :meth:`~hydra_trio.engine.llama.model.LoadedModel.kv_cache_info`) for ``/props``, ``/slots``, INFO and
    ``/metrics``; ``{}`` before a model loads."""
    m = e.model or e.solo_model
    return m.kv_cache_info() if m is not None else {}


def memory_use(e: Engine) -> dict[str, dict[str, int]]:
    """Bytes the loaded models take per device: ``{"CPU": {"weights", "kv", "compute"}}``, the SOLO
    model's plus a COMBINED one's while loaded (:attr:`~hydra_trio.engine.llama.model.LoadedModel.memory_use`,
    llama.cpp's own buffer sizes); ``{}`` before a model loads."""
    out: dict[str, dict[str, int]] = {}
    for m in (e.experts.solo, getattr(e.experts, "combined", None)):
        for dev, use in (getattr(m, "memory_use", None) or {}).items():
            mine = out.setdefault(dev, {"weights": 0, "kv": 0, "compute": 0})
            for kind, n in use.items():
                mine[kind] = mine.get(kind, 0) + n
    return out


def model_kwargs(config: EngineConfig) -> dict[str, Any]:
    """The :class:`LoadedModel` keyword arguments every model of this engine is built with (SOLO at start
    and on reload, COMBINED, PIPELINE) besides its path, context and slots."""
    return {"n_batch": config.n_batch, "n_threads": config.n_threads, "chat_template": config.chat_template,
            "options": target_options(config.speculative, config.llama),
            "chat_template_kwargs": config.chat_template_kwargs}


class Engine:
    """N slots over one llama.cpp context, served by one worker thread.

    Lifecycle: ``await nursery.start(engine.run)`` returns at once; the
    model then loads on the engine thread while :attr:`stage` moves through
    ``loading_model`` (with :attr:`progress` 0..1), ``hashing_model``,
    ``warmup`` and ``ready``.  Cancelling :meth:`run` stops the thread after
    its current step and frees llama.cpp's objects.
    """

    def __init__(self, config: EngineConfig, events: EventBus | None = None) -> None:
        self.config = config
        self.events = events if events is not None else EventBus()
        """Where the engine publishes ``load.*``, ``slot.*``, ``mode.*`` and ``peer.*`` events."""
        self.stage = Stage.STARTING
        self.progress = 0.0
        self.error: str | None = None
        self.identity: ModelIdentity | None = None
        self.allow_cross_model_kv = config.allow_cross_model_kv  # STATE_PUT: blobs of other files, same KV identity
        self.quants = quants.QuantSet(config.quants, config.model_path, config.model_alias)
        """The node's quantizations by key (``--quant KEY=PATH_OR_ALIAS``) and the active one."""
        self.stats = EngineStats()
        self.stage_times: dict[str, float] = {}
        self.request_defaults = RequestDefaults(config.sampling, config.n_predict, config.generation)
        """What a request leaves out gets (CONFIGURE tier 1 swaps a new immutable object in: one assignment, so
        a thread that reads it once sees one consistent pair; :meth:`defaults`, :meth:`default_n_predict`)."""
        self.experts = ExpertModes(config.peer, config.combined_pattern, self.stats, model_kwargs(config),
                                   events=self.events)
        self.scheduler: Scheduler | None = None
        self.prompt_cache = PromptCache(config.cache_ram_mib, config.cache_idle_slots, self.events)
        """Slots' KV states kept in host RAM (``--cache-ram``); emptied whenever a new model or context serves."""
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = False
        self._ready = trio.Event()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._hand_off = StepHandOff()  # the requests' token events, one hand-over to trio per step
        self.live = LiveRequests()  # the requests in flight (trio side); live.end_all ends them as the node stops
        self.snapshot: EngineSnapshot = EMPTY
        """The slots and queue as of the engine's last step (:mod:`~hydra_trio.engine.snapshot`): the engine
        thread swaps a new immutable object in after every step and call; any thread reads it without waiting."""
        self._state_sizes: dict[int, tuple[tuple[int, int], int]] = {}  # slot id -> ((model id, n_past), size)

    # ---------------------------------------------------------------- views
    @property
    def model(self) -> LoadedModel | None:
        """The model that serves new work (SOLO or COMBINED)."""
        return self.experts.active

    @property
    def solo_model(self) -> LoadedModel | None:
        return self.experts.solo

    @property
    def slots(self) -> list[Slot]:
        return self.scheduler.slots if self.scheduler is not None else []

    @property
    def n_ctx_slot(self) -> int:
        """Tokens of context per slot (0 before the model loads)."""
        m = self.experts.solo
        return m.n_ctx_slot if m is not None else 0

    @property
    def ready(self) -> bool:
        return self.stage == Stage.READY

    def slots_info(self, params: Callable[[CompletionJob], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """``/slots``: one dict per slot from :attr:`snapshot` (any thread, never waits: :meth:`SlotSnapshot.info`,
        ``params`` formats a slot's request), with the KV cache's ``kv_cache`` (:meth:`kv_cache`) and the
        host-RAM ``prompt_cache`` (:meth:`PromptCache.info`); an embeddings request's too (``LiveRequests.busy``)."""
        kv, pc, busy = kv_cache(self), self.prompt_cache.info(), self.live.busy
        return [{**s.info(params), "kv_cache": kv, "prompt_cache": pc, **busy(s.id)} for s in self.snapshot.slots]

    def slot_meta_now(self, id_slot: int) -> dict[str, Any] | None:
        """STATE_META's keys for a slot from :attr:`snapshot` (any thread, never waits), without model
        identity; None when the snapshot has no such slot."""
        s = self.snapshot.slot(id_slot)
        return s.meta() if s is not None else None

    @property
    def n_slots(self) -> int:
        """Slots, as of the last publication (0 before the model serves)."""
        return len(self.snapshot.slots)

    @property
    def requests_processing(self) -> int:  # embeddings requests too, as llama-server's slots run them
        return self.snapshot.requests_processing + self.live.embeddings

    @property
    def requests_waiting(self) -> int:
        return self.snapshot.requests_waiting

    def _publish(self) -> None:
        """Engine thread: swap a new :attr:`snapshot` in (one atomic assignment; :func:`next_snapshot`)."""
        self.snapshot = next_snapshot(self.snapshot, self.scheduler, self.model, self.stats.n_decode_total,
                                      self._state_sizes)

    # ------------------------------------------------------------ trio side
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
            # the engine thread: a trio worker with its own limiter (never waits for the shared 40; bridge.py)
            await trio.to_thread.run_sync(self._thread_main, limiter=trio.CapacityLimiter(1))
            nursery.cancel_scope.cancel()

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self._stop = True
            self._inbox.put(Stop())

    async def wait_ready(self) -> None:
        """Wait until the model serves (stage ``ready``)."""
        await self._ready.wait()

    def check_ready(self) -> None:
        """Raise NotReady unless the model serves."""
        if not self.ready:
            raise NotReady(f"model not ready (stage: {self.stage})", str(self.stage))

    def submit(self, job: CompletionJob) -> RequestHandle:
        """Queue a completion; events arrive on ``handle.events`` (see :class:`~hydra_trio.engine.requests.JobRun`).

        Raises:
            NotReady: before the model serves.
            InvalidRequest: the node serves embeddings only, or the job is invalid for this engine (empty prompt,
                prompt longer than a slot's context, a continuation without a slot).

        ``id_slot`` takes any integer, as llama-server's ``get_available_slot`` (``tools/server/server-context.cpp``):
        ``id_slot`` >= the slot count wraps around (``id_slot % n_slots``); one below -1 names no slot, and the
        job takes the least recently used idle slot (without -1's prompt-similarity choice).
        """
        check_serves_completions(self)
        if not job.prompt_tokens and not job.continue_slot:
            raise InvalidRequest("the prompt is empty")
        if job.continue_slot and job.id_slot < 0:
            raise InvalidRequest("id_slot: continuing a slot's KV cache needs a slot id")
        check_prompt_fits(len(job.prompt_tokens), self.n_ctx_slot)
        if job.id_slot >= len(self.slots):
            job = attrs.evolve(job, id_slot=job.id_slot % len(self.slots))
        assert self._trio_token is not None
        handle = RequestHandle(job, self._trio_token, self._hand_off, self.live)  # Stopping once the node stopped
        self._inbox.put(StartCompletion(handle, trace_id=job.request_id))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request and free its slot at the next step (idempotent): the handle is marked at once (a
        step in progress sees it) and a :class:`~.tasks.CancelCompletion` wakes an idle engine thread."""
        if not handle.cancelled:
            handle.cancelled = True
            self._inbox.put(CancelCompletion(handle))

    async def run_task(self, task: EngineTask) -> Any:
        """Queue ``task`` (:mod:`~hydra_trio.engine.tasks`) on the engine's inbox and wait for its result; it
        runs on the engine thread between two steps, in the order queued (:meth:`execute`).

        A caller cancelled while it waits stops waiting at once; the task still runs when its turn
        comes and its result is dropped (:mod:`hydra_trio.engine.bridge`), so a task must leave the
        engine consistent on its own.

        Raises:
            NotReady: before the model serves.
            Busy: an exclusive task found a slot processing.
            Exception: what the task raises (InvalidRequest, StateError, ...).
        """
        self.check_ready()
        call: Call[Any] = Call(functools.partial(self.execute, task))
        self._inbox.put(call)
        return await call.wait()

    def execute(self, task: EngineTask) -> Any:
        """Engine thread: dispatch ``task`` by its type (``task.run``), counted in ``stats.tasks`` by its
        kind and logged (llama-server's ``process_single_task`` switch over ``server_task_type``).  An
        exclusive task runs only when every slot is idle (:meth:`EngineTask.perform`)."""
        log.debug("task %s: %r", task.kind, task)
        return task.perform(self)

    # -------------------------------------------------------- engine thread
    def _set_stage(self, stage: Stage) -> None:
        now = time.monotonic()
        previous: dict[str, Any] = {}
        if self.stage_times:
            prev, t0 = self.stage, self.stage_times[self.stage]
            log.info("stage %s done in %.2f s", prev, now - t0)
            previous = {"previous": str(prev), "previous_s": round(now - t0, 3)}
        self.stage = stage
        self.stage_times[stage] = now
        log.info("stage %s", stage)
        self.events.publish("load.stage", stage=str(stage), **previous, **({"error": self.error} if self.error else {}))

    def _thread_main(self) -> None:
        cfg = self.config
        try:
            self._set_stage(Stage.LOADING_MODEL)
            size = cfg.model_path.stat().st_size
            with progress.step("loading model", total=size, unit="B") as bar:

                def on_load(p: float) -> bool:  # llama.cpp's fraction of the weights loaded
                    self.progress = p
                    bar.update(p * size)
                    return not self._stop  # False aborts the load (shutdown during load)

                model = LoadedModel(cfg.model_path, n_ctx=cfg.n_ctx, n_parallel=cfg.n_parallel, progress=on_load,
                                    log_chat_template=True, **self.experts.model_kwargs)
            self.experts.set_solo(model)
            self.progress = 1.0
            self._set_stage(Stage.HASHING_MODEL)
            with progress.step("hashing model", total=size, unit="B") as bar:
                model_hash = sha256_file(cfg.model_path, stop=lambda: self._stop, on_block=bar.advance)
            self.identity = ModelIdentity(
                model_alias=cfg.model_alias,
                model_path=str(cfg.model_path),
                model_hash=model_hash,
                kv_identity_hash=identity_hash(kv_identity(model)),
            )
            self.scheduler = new_scheduler(cfg, self.experts, model, self.stats, self.identity.model_hash, self.events,
                                           self.prompt_cache, self._hand_off)
            self.scheduler.publish = self._publish_quietly
            self._set_stage(Stage.WARMUP)
            with progress.step("warm-up"):
                _warmup(model)
        except Exception as exc:
            self.experts.close()
            if self._stop:  # the node is stopping: the load was aborted on purpose, not a failure
                self._set_stage(Stage.STOPPED)
                log.info("model load stopped: the node is shutting down")
                return
            self.error = str(exc)
            self._set_stage(Stage.ERROR)
            log.error("model load failed: %s", exc)
            raise
        try:
            if not self._stop:
                self._publish()
                self._set_stage(Stage.READY)
                assert self._trio_token is not None
                try:  # a one-way notice with no result to carry back: run_sync_soon (bridge.py, "Thread crossings")
                    self._trio_token.run_sync_soon(self._ready.set)
                except trio.RunFinishedError:
                    pass
                self._loop()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close(Cancelled("the server is shutting down"))
        self.experts.close()
        log.info("engine stopped")

    def stop_loop(self) -> None:
        """Engine thread: leave the loop after the current inbox item (the :class:`~.tasks.Stop` task)."""
        self._stop = True

    def _loop(self) -> None:
        sched = self.scheduler
        assert sched is not None
        while not self._stop:
            self._drain_inbox(block=not sched.busy)
            if self._stop:
                return
            sched = self.scheduler  # a reconfigure may have built a new one
            assert sched is not None
            if not sched.busy and not sched.pending:
                continue  # nothing to do: the inbox's items published what they changed
            try:
                sched.step()
            except Exception as exc:  # never let one bad request take the engine down
                log.exception("engine step failed; failing the requests in flight")
                sched.fail_all(EngineFailure(f"engine error: {exc}"))
            self._publish()
            if not sched.busy and not sched.pending:  # the last request finished: every slot idle
                _at_idle(self.experts)

    def _drain_inbox(self, block: bool) -> None:
        """Take everything in the inbox: new requests join the queue, calls run (each publishes
        :attr:`snapshot` before its caller hears back, so a caller's next read sees its change)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        queued = False
        while True:
            if isinstance(item, EngineTask):  # queued without a waiter: a completion's start or cancel, the stop
                self.execute(item)
                queued = queued or isinstance(item, StartCompletion)
            else:  # a Call of run_task: published before its caller hears back
                item.run(after=self._publish_quietly)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        if queued:
            self._publish_quietly()

    def _publish_quietly(self) -> None:
        """:meth:`_publish`, logging instead of raising (a failed publication keeps the previous snapshot)."""
        try:
            self._publish()
        except Exception:
            log.exception("publishing the engine's snapshot failed")

    # ----------------------------------------------- engine-thread operations
    def save_slot(self, id_slot: int, *, pool: BlobPool | None = None) -> tuple[int, BlobBuffer]:
        """Engine thread: the idle slot's KV state blob, ``(n_past, blob)``, its buffer from ``pool``
        (:func:`state.save_slot`).  Raises Busy."""
        slot = self._idle_slot(id_slot)
        assert self.model is not None and self.identity is not None
        spec = self.scheduler.spec if self.scheduler is not None else None
        return state.save_slot(self.model, slot, self.identity.model_hash, pool=pool,
                               extra=spec.get_state(id_slot) if spec is not None and slot.n_past else None)

    def restore_slot(self, id_slot: int, blob: bytearray | BlobBuffer, *,
                     checksum_verified: bool = False) -> state.Restored:
        """Engine thread: apply a blob to the idle slot, all or nothing (:func:`state.restore_slot`).

        A blob of another model file with the same KV identity is applied only
        while :attr:`allow_cross_model_kv` is on.  Raises Busy, StateError.
        """
        slot = self._idle_slot(id_slot)
        assert self.model is not None and self.identity is not None
        m, sched = self.model, self.scheduler
        done = state.restore_slot(m, slot, blob, self.identity.model_hash,
                                  allow_cross_model_kv=self.allow_cross_model_kv, checksum_verified=checksum_verified,
                                  make_room=None if sched is None else lambda: sched.make_room(m, keep=slot))
        if sched is not None and sched.spec is not None:  # the drafters follow: the blob's part, else nothing
            sched.spec.seq_rm(id_slot, -1, -1)
            if done.extra:
                try:
                    sched.spec.set_state(id_slot, done.extra)
                except ValueError as exc:
                    log.warning("slot %d: the blob's drafters' state was not applied (%s); it drafts afresh",
                                id_slot, exc)
        return done

    def _idle_slot(self, id_slot: int) -> Slot:
        """The slot, idle: InvalidRequest when it is gone (the slot count changed), Busy when it works."""
        if not 0 <= id_slot < len(self.slots):
            raise InvalidRequest(f"id_slot: slot {id_slot} no longer exists (slots 0..{len(self.slots) - 1})")
        slot = self.slots[id_slot]
        if slot.is_processing:
            raise Busy(f"slot {id_slot} is processing a request", [id_slot])
        return slot

    def erase_slot(self, id_slot: int) -> int:
        """Engine thread: drop a slot's KV cache and the prompt-cache entries of its tokens; the number of
        tokens erased.  Raises Busy."""
        assert self.model is not None
        return erase_slot(self.model, self.slots[id_slot], self.prompt_cache)

    @property
    def defaults(self) -> SamplingParams:
        """Sampling settings for the fields a request leaves out (``request_defaults.sampling``)."""
        return self.request_defaults.sampling

    @property
    def default_n_predict(self) -> int:
        """Tokens for a request that sets no budget (``request_defaults.n_predict``, -1: until done)."""
        return self.request_defaults.n_predict

    def set_defaults(self, **params: Any) -> None:
        """CONFIGURE tier 1 (any thread): new sampling defaults (and ``n_predict``) for requests that omit
        them, swapped in as one new :class:`RequestDefaults`.  Bounds: :mod:`hydra_trio.engine.settings` (the
        HTTP API's too).  Raises ParameterError (an InvalidRequest) naming the field; nothing changes then."""
        self.request_defaults = self.request_defaults.evolve(**params)

    def reconfigure(self, *, n_ctx: int | None = None, n_parallel: int | None = None,
                    model_path: Path | None = None, model_alias: str | None = None) -> dict[str, Any]:
        """Engine thread, every slot idle: CONFIGURE tiers 2 and 3 (:func:`reconfigure`)."""
        return reconfigure(self, n_ctx=n_ctx, n_parallel=n_parallel, model_path=model_path, model_alias=model_alias)

    def install_model(self, new: LoadedModel, identity: ModelIdentity) -> None:
        """Engine thread, every slot idle: ``new`` serves from now on and the old model is freed.

        The slots start empty (their KV belonged to the old context), and so does the prompt cache;
        requests waiting in the queue stay.  Used by CONFIGURE and SWAP_QUANT.
        """
        assert self.scheduler is not None and self.experts.solo is not None
        old = self.experts.solo
        pending, self.scheduler.pending = self.scheduler.pending, collections.deque()
        self.scheduler.close(Cancelled("the engine is being reconfigured"))  # no slot is busy: frees the batch
        self.experts.set_solo(new)
        old.close()
        self.identity = identity
        self.prompt_cache.clear("reload")
        self.scheduler = new_scheduler(self.config, self.experts, new, self.stats, identity.model_hash,
                                       self.events, self.prompt_cache, self._hand_off)
        self.scheduler.publish = self._publish_quietly
        self.scheduler.pending = pending
        self.config = attrs.evolve(self.config, model_path=new.path, model_alias=identity.model_alias)
        self.quants.loaded(new.path)


def reconfigure(
self: Engine, *, n_ctx: int | None = None, n_parallel: int | None = None,
    model_path: Path | None = None, model_alias: str | None = None,
) -> dict[str, Any]:
    """Engine thread, every slot idle (an exclusive task: :class:`~.tasks.Reconfigure`): CONFIGURE tiers 2 and 3.

    ``n_ctx`` / ``n_parallel`` rebuild the context; ``model_path`` (already
    resolved from a path or preset alias by the caller) reloads the model.
    The new context or model is built before the old one is freed, so a
    failure leaves the engine as it was.  Slots' KV caches are dropped
    (they belong to the old context); requests waiting in the queue stay.
    Returns the applied values.

    Raises:
        InvalidRequest: a value out of range, or llama.cpp refused the new settings.
    """
    old = self.experts.solo
    assert old is not None and self.scheduler is not None
    n_ctx = old.n_ctx if n_ctx is None else n_ctx
    n_parallel = old.n_parallel if n_parallel is None else n_parallel
    check_n_parallel(n_parallel)  # the bound -np has too
    if not 16 * n_parallel <= n_ctx <= INT32_MAX:  # a slot's cap (the training context) is the model's, as at start
        raise InvalidRequest(f"n_ctx: {n_ctx} is out of range ({16 * n_parallel}..{INT32_MAX} for {n_parallel} slots)")
    path = model_path or old.path
    alias = model_alias or self.config.model_alias
    try:
        new = LoadedModel(path, n_ctx=n_ctx, n_parallel=n_parallel, log_chat_template=True,
                          **self.experts.model_kwargs)
    except Exception as exc:
        raise InvalidRequest(f"llama.cpp refused the new settings: {exc}") from None
    identity = self.identity
    assert identity is not None
    if path != old.path:
        identity = ModelIdentity(model_alias=alias, model_path=str(path), model_hash=sha256_file(path),
                                 kv_identity_hash=identity_hash(kv_identity(new)))
    self.install_model(new, identity)
    self.config = attrs.evolve(self.config, n_ctx=n_ctx, n_parallel=n_parallel)
    log.info("reconfigured: model %s, n_ctx %d, %d slots", path.name, new.n_ctx, n_parallel)
    return {"n_ctx": new.n_ctx, "n_parallel": n_parallel, "model_path": str(path)}

