"""The engine's door for trio code: one object that submits, cancels, runs tasks and reports.

The split follows llama.cpp's own server (``server-queue`` / ``server-task`` / ``server-context`` /
``server_slot``): :class:`Engine` is what trio code calls — :meth:`Engine.submit` (a completion),
:meth:`Engine.cancel`, :meth:`Engine.run_task` (a typed task of :mod:`~hydra_trio.engine.tasks`, run
between two batching steps) — and what it reads (the stage ``/health`` reports, the published snapshot,
the counters, the request defaults).  The engine thread and its one inbox are
:class:`~hydra_trio.engine.loop.EngineLoop`; the model's load, reload, reconfigure and quant swaps are
:class:`~hydra_trio.engine.lifecycle.ModelLifecycle`; the batching is
:class:`~hydra_trio.engine.batching.scheduler.Scheduler`, each slot's token handling
:class:`~hydra_trio.engine.batching.generation.Generation`; SOLO / COMBINED is
:class:`~hydra_trio.engine.experts.combined.ExpertModes`.

Only the engine thread touches the models, the contexts, the batch and the samplers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ..errors import InvalidRequest, NotReady
from ..observability.events import EventBus
from .batching.prompt_cache import PromptCache
from .batching.scheduler import Scheduler, check_prompt_fits
from .batching.slots import Slot
from .bridge import Call
from .experts.combined import ExpertModes
from .lifecycle import ModelLifecycle, Stage
from .llama.model import LoadedModel, ModelIdentity
from .loop import EngineLoop
from .quants import QuantSet
from .requests import CompletionJob, JobHandle, LiveJobs, StepHandOff
from .settings import EngineConfig, RequestDefaults, SamplingParams
from .snapshot import EngineSnapshot
from .stats import EngineStats
from .tasks import CancelCompletion, EngineTask, StartCompletion, Stop
from .view import ModelView

log = logging.getLogger("hydra_trio.engine")

__all__ = ["EMBEDDING_ONLY", "NO_EMBEDDINGS", "Engine", "Stage"]


EMBEDDING_ONLY = (
    "this node serves embeddings (--embedding): use POST /v1/embeddings or /embedding; "
    "start a node without --embedding for completions"
)
NO_EMBEDDINGS = "This server does not support embeddings. Start it with `--embeddings` (--embedding)"


class Engine:
    """N slots over one llama.cpp context, served by one worker thread.

    Lifecycle: ``await nursery.start(engine.run)`` returns at once; the
    model then loads on the engine thread while :attr:`stage` moves through
    ``loading_model`` (with :attr:`progress` 0..1), ``hashing_model``,
    ``warmup`` and ``ready``.  Cancelling :meth:`run` stops the thread after
    its current step and frees llama.cpp's objects.
    """

    def __init__(self, config: EngineConfig, events: EventBus | None = None) -> None:
        self.events = events if events is not None else EventBus()
        """Where the engine publishes ``load.*``, ``slot.*``, ``mode.*`` and ``peer.*`` events."""
        self.allow_cross_model_kv = config.allow_cross_model_kv  # STATE_PUT: blobs of other files, same KV identity
        self.stats = EngineStats()
        self.request_defaults = RequestDefaults(config.sampling, config.n_predict, config.generation)
        """What a request leaves out gets (CONFIGURE tier 1 swaps a new immutable object in: one assignment, so
        a thread that reads it once sees one consistent pair; :meth:`defaults`, :meth:`default_n_predict`)."""
        self._hand_off = StepHandOff()  # the jobs' token events, one hand-over to trio per step
        self.live = LiveJobs()  # the jobs in flight (trio side); live.end_all ends them as the node stops
        self.models = ModelLifecycle(config, self.events, self.stats, self._hand_off)
        """The served model, its identity, its scheduler and the prompt cache (engine thread)."""
        self.loop = EngineLoop(self.models, self.execute, lambda: self.stats.n_decode_total, self._hand_off)
        """The engine thread and its one inbox."""
        self._ready = trio.Event()
        self._trio_token: trio.lowlevel.TrioToken | None = None

    # ---------------------------------------------------------------- views
    @property
    def config(self) -> EngineConfig:
        """The configuration as of the last model change (CONFIGURE evolves it)."""
        return self.models.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.models.config = config

    @property
    def stage(self) -> Stage:
        return self.models.stage

    @property
    def progress(self) -> float:
        return self.models.progress

    @property
    def error(self) -> str | None:
        return self.models.error

    @property
    def stage_times(self) -> dict[str, float]:
        return self.models.stage_times

    @property
    def identity(self) -> ModelIdentity | None:
        return self.models.identity

    @property
    def quants(self) -> QuantSet:
        """The node's quantizations by key (``--quant KEY=PATH_OR_ALIAS``) and the active one."""
        return self.models.quants

    @property
    def experts(self) -> ExpertModes:
        return self.models.experts

    @property
    def scheduler(self) -> Scheduler | None:
        return self.models.scheduler

    @property
    def prompt_cache(self) -> PromptCache:
        """Slots' KV states kept in host RAM (``--cache-ram``); emptied whenever a new model or context serves."""
        return self.models.prompt_cache

    @property
    def snapshot(self) -> EngineSnapshot:
        """The slots and queue as of the engine's last step (:attr:`EngineLoop.snapshot`; any thread, never waits)."""
        return self.loop.snapshot

    @property
    def model(self) -> LoadedModel | None:
        """The model that serves new work (SOLO or COMBINED)."""
        return self.experts.active

    @property
    def solo_model(self) -> LoadedModel | None:
        return self.experts.solo

    @property
    def model_view(self) -> ModelView | None:
        """The served model as a front end sees it (:class:`~hydra_trio.engine.view.ModelView`: chat template,
        tokenizer, vocabulary, grammar check, facts; any thread): the SOLO model, whose file, vocabulary and
        template a COMBINED one shares; None before the model loads.  :attr:`model` and :attr:`solo_model`
        (llama.cpp's handles) are the engine's own."""
        return self.solo_model or self.model

    @property
    def slots(self) -> list[Slot]:
        return self.models.slots

    @property
    def n_ctx_slot(self) -> int:
        """Tokens of context per slot (0 before the model loads)."""
        m = self.experts.solo
        return m.n_ctx_slot if m is not None else 0

    @property
    def ready(self) -> bool:
        return self.stage == Stage.READY

    def kv_cache(self) -> dict[str, str]:
        """The serving model's KV cache: ``{"type_k", "type_v", "flash_attn"}`` (``q8_0``, ``on``/``off``;
        :meth:`~hydra_trio.engine.llama.model.LoadedModel.kv_cache_info`) for ``/props``, ``/slots``, INFO and
        ``/metrics``; ``{}`` before a model loads."""
        m = self.model or self.solo_model
        return m.kv_cache_info() if m is not None else {}

    def memory_use(self) -> dict[str, dict[str, int]]:
        """Bytes the loaded models take per device: ``{"CPU": {"weights", "kv", "compute"}}``, the SOLO
        model's plus a COMBINED one's while loaded (:attr:`~hydra_trio.engine.llama.model.LoadedModel.memory_use`,
        llama.cpp's own buffer sizes); ``{}`` before a model loads."""
        out: dict[str, dict[str, int]] = {}
        for m in (self.experts.solo, getattr(self.experts, "combined", None)):
            for dev, use in (getattr(m, "memory_use", None) or {}).items():
                mine = out.setdefault(dev, {"weights": 0, "kv": 0, "compute": 0})
                for kind, n in use.items():
                    mine[kind] = mine.get(kind, 0) + n
        return out

    def slots_info(self, params: Callable[[CompletionJob], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """``/slots``: one dict per slot from :attr:`snapshot` (any thread, never waits: :meth:`SlotSnapshot.info`,
        ``params`` formats a slot's job), with the KV cache's ``kv_cache`` (:meth:`kv_cache`) and the
        host-RAM ``prompt_cache`` (:meth:`PromptCache.info`); an embeddings request's too (``LiveJobs.busy``)."""
        kv, pc, busy = self.kv_cache(), self.prompt_cache.info(), self.live.busy
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
            await trio.to_thread.run_sync(self.loop.run, self._signal_ready, limiter=trio.CapacityLimiter(1))
            nursery.cancel_scope.cancel()

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.loop.stopping = True
            self.loop.inbox.put(Stop())

    def _signal_ready(self) -> None:
        """Engine thread, the model serves: wake :meth:`wait_ready`'s waiters."""
        assert self._trio_token is not None
        try:  # a one-way notice with no result to carry back: run_sync_soon (bridge.py, "Thread crossings")
            self._trio_token.run_sync_soon(self._ready.set)
        except trio.RunFinishedError:
            pass

    async def wait_ready(self) -> None:
        """Wait until the model serves (stage ``ready``)."""
        await self._ready.wait()

    def check_ready(self) -> None:
        """Raise NotReady unless the model serves."""
        if not self.ready:
            raise NotReady(f"model not ready (stage: {self.stage})", str(self.stage))

    def check_serves_completions(self) -> None:
        """NotReady before the model serves; InvalidRequest on an embedding-only node (``--embedding``)."""
        self.check_ready()
        if self.config.embeddings:
            raise InvalidRequest(EMBEDDING_ONLY)

    def submit(self, job: CompletionJob) -> JobHandle:
        """Queue a completion; events arrive on ``handle.events`` (see :class:`~hydra_trio.engine.requests.JobRun`).

        Raises:
            NotReady: before the model serves.
            InvalidRequest: the node serves embeddings only, or the job is invalid for this engine (empty prompt,
                prompt longer than a slot's context, a continuation without a slot).

        ``id_slot`` takes any integer, as llama-server's ``get_available_slot`` (``tools/server/server-context.cpp``):
        ``id_slot`` >= the slot count wraps around (``id_slot % n_slots``); one below -1 names no slot, and the
        job takes the least recently used idle slot (without -1's prompt-similarity choice).
        """
        self.check_serves_completions()
        if not job.prompt_tokens and not job.continue_slot:
            raise InvalidRequest("the prompt is empty")
        if job.continue_slot and job.id_slot < 0:
            raise InvalidRequest("id_slot: continuing a slot's KV cache needs a slot id")
        check_prompt_fits(len(job.prompt_tokens), self.n_ctx_slot)
        if job.id_slot >= len(self.slots):
            job = attrs.evolve(job, id_slot=job.id_slot % len(self.slots))
        assert self._trio_token is not None
        handle = JobHandle(job, self._trio_token, self._hand_off, self.live)  # Stopping once the node stopped
        self.loop.inbox.put(StartCompletion(handle, trace_id=job.request_id))
        return handle

    def cancel(self, handle: JobHandle) -> None:
        """Stop a job and free its slot at the next step (idempotent): the handle is marked at once (a
        step in progress sees it) and a :class:`~.tasks.CancelCompletion` wakes an idle engine thread."""
        if not handle.cancelled:
            handle.cancelled = True
            self.loop.inbox.put(CancelCompletion(handle))

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
        self.loop.inbox.put(call)
        return await call.wait()

    def execute(self, task: EngineTask) -> Any:
        """Engine thread: dispatch ``task`` by its type (``task.run``), counted in ``stats.tasks`` by its
        kind and logged (llama-server's ``process_single_task`` switch over ``server_task_type``).  An
        exclusive task runs only when every slot is idle (:meth:`EngineTask.perform`)."""
        log.debug("task %s: %r", task.kind, task)
        return task.perform(self)

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
