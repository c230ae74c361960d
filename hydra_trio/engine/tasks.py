"""Typed engine work: everything trio code hands the engine thread is one frozen class on one inbox.

As llama-server has task types (``server_task_type`` in ``tools/server/server-task.h``:
``SERVER_TASK_TYPE_COMPLETION``, ``..._CANCEL``, ``..._SLOT_SAVE``, ...), the engine gets an
:class:`EngineTask` instance, not an anonymous function, on its one inbox, first in, first out:
:meth:`Engine.run_task <hydra_trio.engine.engine.Engine.run_task>` queues a task and waits for its
result, :meth:`Engine.submit <hydra_trio.engine.engine.Engine.submit>` and :meth:`Engine.cancel
<hydra_trio.engine.engine.Engine.cancel>` queue a completion's start and cancel.  The engine thread
dispatches each by its type (:meth:`Engine.execute <hydra_trio.engine.engine.Engine.execute>`), which
logs it by :attr:`EngineTask.kind` and counts it in ``EngineStats.tasks`` (``/metrics``:
``hydra_trio:engine_tasks_total{type}``).

The serialized control channel (mode switches, reconfigurations, quant swaps, pipeline attach) is
this inbox: such a task is :attr:`EngineTask.exclusive`, and runs only when every slot is idle, else
it raises :class:`~hydra_trio.errors.Busy` and nothing changes.  While it runs the engine thread is
inside it, so no slot starts new work: tasks that arrive meanwhile wait in the inbox and then run
on the new state.

Every task runs on the engine thread between two batching steps; ``run`` returns what the caller
gets back and raises what the caller sees (the engine's errors: Busy, InvalidRequest, StateError, ...),
and must leave the engine as it was when it raises.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from ..errors import Busy
from .experts.combined import PeerLost
from .llama.embedding import EmbeddingJob, embed_counted, max_input_tokens, pooling_type

if TYPE_CHECKING:
    from .kv.state import Restored
    from .llama.embedding import Embedding

log = logging.getLogger("hydra_trio.control")

__all__ = [
    "AttachPeerAtStart",
    "CancelCompletion",
    "Embed",
    "EmbeddingLimits",
    "EngineTask",
    "EraseSlot",
    "PeerGone",
    "PipelineAttach",
    "Reconfigure",
    "RestoreSlot",
    "SaveSlot",
    "SetExpertMode",
    "StartCompletion",
    "Stop",
    "SwapQuant",
]


@attrs.frozen
class EngineTask:
    """One piece of work for the engine thread; subclasses set :attr:`kind` and implement :meth:`run`."""

    kind: ClassVar[str] = "task"
    """The task's type as logs and ``/metrics`` name it (``save_slot``, ``restore_slot``, ...)."""
    exclusive: ClassVar[bool] = False
    """Runs only when every slot is idle, else Busy (the serialized control channel): counted in
    ``EngineStats.control`` and published as ``control.applied`` / ``.busy`` / ``.failed``."""
    trace_id: str = attrs.field(default="", kw_only=True, repr=False)
    """The request's trace id, for the logs and events (Hydra's ``trace_id``)."""

    def label(self) -> str:
        """What the logs call this task (the kind, and for a change what it changes)."""
        return self.kind

    def perform(self, engine: Any) -> Any:
        """Engine thread: :meth:`run`, counted in ``engine.stats.tasks`` by :attr:`kind`, and for an
        :attr:`exclusive` task first the check that every slot is idle and no request waits for one (else
        Busy: nothing changed, and the task did not run), with its count, log line and ``control.*`` event."""
        kind = self.kind
        if not self.exclusive:
            engine.stats.tasks[kind] = engine.stats.tasks.get(kind, 0) + 1
            return self.run(engine)
        counts, label, trace = engine.stats.control, self.label(), self.trace_id
        busy = [s.id for s in engine.slots if s.is_processing]
        waiting = len(engine.scheduler.pending) if engine.scheduler is not None else 0
        if busy or waiting:  # a request queued for a slot was made for the model as it is: it runs on it
            counts["refused_busy"] += 1
            why = f"slots {busy} busy" if busy else f"{waiting} request(s) waiting for a slot"
            log.info("[%s] %s refused: %s", trace, label, why, extra={"trace_id": trace, "op": label})
            engine.events.publish("control.busy", trace, change=label, busy_slots=busy)
            raise Busy(
                f"slots {busy} are processing; retry when every slot is idle"
                if busy
                else f"{waiting} request(s) wait for a slot; retry when they have run",
                busy,
                waiting,
            )
        engine.stats.tasks[kind] = engine.stats.tasks.get(kind, 0) + 1
        t0 = time.perf_counter()
        try:
            result = self.run(engine)
        except BaseException as exc:
            counts["failed"] += 1
            engine.events.publish("control.failed", trace, change=label, error=str(exc))
            raise
        counts["applied"] += 1
        ms = round((time.perf_counter() - t0) * 1e3, 3)
        log.info("[%s] %s applied", trace, label, extra={"trace_id": trace, "op": label, "ms": ms})
        success = {"success": result["success"]} if isinstance(result, dict) and "success" in result else {}
        engine.events.publish("control.applied", trace, change=label, ms=ms, **success)
        return result

    def run(self, engine: Any) -> Any:  # pragma: no cover - every subclass overrides it
        """Engine thread: do the work on ``engine`` (the :class:`~hydra_trio.engine.engine.Engine`; typed Any,
        since ``engine.py`` imports this module): its ``scheduler`` (the slots), ``models`` (the model's
        lifecycle), ``experts`` or ``loop``; return the caller's result, raise the caller's error."""
        raise NotImplementedError


@attrs.frozen
class StartCompletion(EngineTask):
    """A completion joins the scheduler's queue (llama-server's ``SERVER_TASK_TYPE_COMPLETION``); it
    starts when a slot is free, its events go out on its handle."""

    kind: ClassVar[str] = "completion"
    handle: Any  # a JobHandle (engine/requests.py)

    def run(self, engine: Any) -> None:
        engine.scheduler.add(self.handle)


@attrs.frozen
class CancelCompletion(EngineTask):
    """A completion's client is gone (llama-server's ``SERVER_TASK_TYPE_CANCEL``): the handle is marked
    cancelled when the task is queued, so a step in progress sees it; the scheduler ends the job
    and frees its slot at the next step, and this task wakes an idle engine thread for it."""

    kind: ClassVar[str] = "cancel"
    handle: Any

    def run(self, engine: Any) -> None:
        pass  # the scheduler drops cancelled jobs at every step


@attrs.frozen
class Stop(EngineTask):
    """The node is stopping: the engine thread leaves its loop after this task."""

    kind: ClassVar[str] = "stop"

    def run(self, engine: Any) -> None:
        engine.loop.stop()


@attrs.frozen
class SaveSlot(EngineTask):
    """The idle slot's KV state blob, ``(n_past, blob)`` (STATE_GET, ``/slots?action=save``). Raises Busy."""

    kind: ClassVar[str] = "save_slot"
    id_slot: int
    pool: Any = None  # a BlobPool (engine/kv/blobbuf.py): the blob's buffer comes from it; None: a new one

    def run(self, engine: Any) -> tuple[int, Any]:
        return engine.scheduler.save_slot(self.id_slot, pool=self.pool)


@attrs.frozen
class RestoreSlot(EngineTask):
    """Apply a KV state blob to the idle slot, all or nothing (STATE_PUT, ``/slots?action=restore``).

    ``checksum_verified``: the caller already checked the blob's checksum off the engine thread.
    Raises Busy, StateError.
    """

    kind: ClassVar[str] = "restore_slot"
    id_slot: int
    blob: Any = attrs.field(repr=lambda b: f"<{len(b)} bytes>", eq=False)  # bytearray or BlobBuffer
    checksum_verified: bool = False

    def run(self, engine: Any) -> Restored:
        return engine.scheduler.restore_slot(
            self.id_slot,
            self.blob,
            allow_cross_model_kv=engine.allow_cross_model_kv,
            checksum_verified=self.checksum_verified,
        )


@attrs.frozen
class EraseSlot(EngineTask):
    """Drop a slot's KV cache (``/slots?action=erase``); the number of tokens erased."""

    kind: ClassVar[str] = "erase_slot"
    id_slot: int

    def run(self, engine: Any) -> int:
        return engine.scheduler.erase_slot(self.id_slot)


@attrs.frozen
class Reconfigure(EngineTask):
    """CONFIGURE tiers 2 and 3 (exclusive: every slot idle); the applied values."""

    kind: ClassVar[str] = "configure"
    exclusive: ClassVar[bool] = True
    n_ctx: int | None = None
    n_parallel: int | None = None
    model_path: Path | None = None
    model_alias: str | None = None

    def label(self) -> str:
        return "configure " + ",".join(
            k for k in ("n_ctx", "n_parallel", "model_path", "model_alias") if getattr(self, k) is not None
        )

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.models.reconfigure(
            n_ctx=self.n_ctx, n_parallel=self.n_parallel, model_path=self.model_path, model_alias=self.model_alias
        )


@attrs.frozen
class SetExpertMode(EngineTask):
    """SET_EXPERT_MODE: SOLO / COMBINED (``peer``: host:port of the ggml-RPC peer); the reply's meta."""

    kind: ClassVar[str] = "set_expert_mode"
    exclusive: ClassVar[bool] = True
    mode: str
    peer: str | None = None

    def label(self) -> str:
        return f"set_expert_mode {self.mode}" + (f" peer={self.peer}" if self.peer else "")

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.experts.set_mode(self.mode, self.peer)


@attrs.frozen
class AttachPeerAtStart(EngineTask):
    """Start-up: COMBINED with the configured peer (``--rpc-engine``)."""

    kind: ClassVar[str] = "set_expert_mode"
    exclusive: ClassVar[bool] = True

    def label(self) -> str:
        return "attach peer at start"

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.experts.set_mode("combined", engine.experts.peer)


@attrs.frozen
class PeerGone(EngineTask):
    """The watchdog found the peer unreachable: back to SOLO."""

    kind: ClassVar[str] = "peer_gone"
    exclusive: ClassVar[bool] = True

    def run(self, engine: Any) -> None:
        engine.experts.peer_gone()


@attrs.frozen
class SwapQuant(EngineTask):
    """SWAP_QUANT to quant ``key``: :meth:`~hydra_trio.engine.lifecycle.ModelLifecycle.swap_quant`, or with
    ``experts_only`` only the tensors on a COMBINED head's peer
    (:meth:`~hydra_trio.engine.lifecycle.ModelLifecycle.swap_peer_tensors`)."""

    kind: ClassVar[str] = "swap_quant"
    exclusive: ClassVar[bool] = True
    key: str
    experts_only: bool = False

    def label(self) -> str:
        return f"swap_quant {self.key}" + (" (peer tensors)" if self.experts_only else "")

    def run(self, engine: Any) -> dict[str, Any]:
        models = engine.models
        return (models.swap_peer_tensors if self.experts_only else models.swap_quant)(self.key)


@attrs.frozen
class PipelineAttach(EngineTask):
    """PIPELINE_ATTACH (``peer`` None: detach; ``ot_split``: the tensor-split regex)."""

    kind: ClassVar[str] = "pipeline_attach"
    exclusive: ClassVar[bool] = True
    peer: str | None
    ot_split: str

    def label(self) -> str:
        return f"pipeline_attach peer={self.peer or '-'} ot_split={self.ot_split!r}"

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.experts.attach_pipeline(self.peer, self.ot_split)


@attrs.frozen
class EmbeddingLimits(EngineTask):
    """``(pooling, max input tokens, what limits them)`` of the serving context (:func:`max_input_tokens`)."""

    kind: ClassVar[str] = "embedding_limits"

    def run(self, engine: Any) -> tuple[int, int, str]:
        m = engine.model
        assert m is not None
        return (pooling_type(m), *max_input_tokens(m))


@attrs.frozen
class Embed(EngineTask):
    """One input's embedding (:func:`embed_counted`, llama-server's ``SERVER_TASK_TYPE_EMBEDDING``)."""

    kind: ClassVar[str] = "embed"
    job: EmbeddingJob

    def run(self, engine: Any) -> Embedding:
        assert engine.model is not None
        experts = engine.experts
        try:
            out = embed_counted(engine.model, engine.stats, job=self.job, decode=experts.decode)
            experts.rest()  # inputs come one at a time: free the peer worker's OpenMP team as after a request
            return out
        except PeerLost as exc:  # as a completion's step does (Scheduler._step): back to SOLO, this request fails
            raise experts.peer_lost(str(exc)) from None
