"""Typed engine work: each kind of work trio code hands the engine thread is one frozen class.

As llama-server has task types (``server_task_type`` in ``tools/server/server-task.h``:
``SERVER_TASK_TYPE_SLOT_SAVE``, ``..._SLOT_RESTORE``, ``..._SLOT_ERASE``, ...), the engine gets
a :class:`EngineTask` instance, not an anonymous function: :meth:`Engine.run_task
<hydra_trio.engine.engine.Engine.run_task>` queues it, and the engine thread dispatches it by its
type (:meth:`Engine.execute <hydra_trio.engine.engine.Engine.execute>`), which logs it by
:attr:`EngineTask.kind` and counts it in ``EngineStats.tasks`` (``/metrics``:
``hydra_trio:engine_tasks_total{type}``).  Engine-wide changes go through the control channel
(:class:`hydra_trio.engine.control.Change` takes a task as its ``apply``), which dispatches the same way.

Every task runs on the engine thread between two batching steps; ``run`` returns what the caller
gets back and raises what the caller sees (the engine's errors: Busy, InvalidRequest, StateError, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from . import quants
from .combined import PeerLost
from .embedding import EmbeddingJob, embed_counted, max_input_tokens, pooling_type

if TYPE_CHECKING:
    from .embedding import Embedding
    from .state import Restored

__all__ = [
    "AttachPeerAtStart", "Embed", "EmbeddingLimits", "EngineTask", "EraseSlot", "PeerGone", "PipelineAttach", "Reconfigure",
    "RestoreSlot", "SaveSlot", "SetExpertMode", "SwapQuant",
]


@attrs.frozen
class EngineTask:
    """One piece of work for the engine thread; subclasses set :attr:`kind` and implement :meth:`run`."""

    kind: ClassVar[str] = "task"
    """The task's type as logs and ``/metrics`` name it (``save_slot``, ``restore_slot``, ...)."""

    def run(self, engine: Any) -> Any:  # pragma: no cover - every subclass overrides it
        """Engine thread: do the work on ``engine`` (the :class:`~hydra_trio.engine.engine.Engine`; typed Any
        as in :mod:`.quants`, since ``engine.py`` imports this module); return the caller's result, raise
        the caller's error."""
        raise NotImplementedError

    def __call__(self, engine: Any) -> Any:
        """Dispatch through the engine (counted and logged): what a control-channel change calls."""
        return engine.execute(self)


@attrs.frozen
class SaveSlot(EngineTask):
    """The idle slot's KV state blob, ``(n_past, blob)`` (STATE_GET, ``/slots?action=save``). Raises Busy."""

    kind: ClassVar[str] = "save_slot"
    id_slot: int
    pool: Any = None  # a BlobPool (engine/blobbuf.py): the blob's buffer comes from it; None: a new one

    def run(self, engine: Any) -> tuple[int, Any]:
        return engine.save_slot(self.id_slot, pool=self.pool)


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
        return engine.restore_slot(self.id_slot, self.blob, checksum_verified=self.checksum_verified)


@attrs.frozen
class EraseSlot(EngineTask):
    """Drop a slot's KV cache (``/slots?action=erase``); the number of tokens erased."""

    kind: ClassVar[str] = "erase_slot"
    id_slot: int

    def run(self, engine: Any) -> int:
        return engine.erase_slot(self.id_slot)


@attrs.frozen
class Reconfigure(EngineTask):
    """CONFIGURE tiers 2 and 3 (every slot idle: the control channel checks); the applied values."""

    kind: ClassVar[str] = "configure"
    n_ctx: int | None = None
    n_parallel: int | None = None
    model_path: Path | None = None
    model_alias: str | None = None

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.reconfigure(n_ctx=self.n_ctx, n_parallel=self.n_parallel, model_path=self.model_path,
                                  model_alias=self.model_alias)


@attrs.frozen
class SetExpertMode(EngineTask):
    """SET_EXPERT_MODE: SOLO / COMBINED (``peer``: host:port of the ggml-RPC peer); the reply's meta."""

    kind: ClassVar[str] = "set_expert_mode"
    mode: str
    peer: str | None = None

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.experts.set_mode(self.mode, self.peer)


@attrs.frozen
class AttachPeerAtStart(EngineTask):
    """Start-up: COMBINED with the configured peer (``--peer``)."""

    kind: ClassVar[str] = "set_expert_mode"

    def run(self, engine: Any) -> dict[str, Any]:
        return engine.experts.set_mode("combined", engine.experts.peer)


@attrs.frozen
class PeerGone(EngineTask):
    """The watchdog found the peer unreachable: back to SOLO."""

    kind: ClassVar[str] = "peer_gone"

    def run(self, engine: Any) -> None:
        engine.experts.peer_gone()


@attrs.frozen
class SwapQuant(EngineTask):
    """SWAP_QUANT to quant ``key``: :func:`~hydra_trio.engine.quants.swap_quant`, or with ``experts_only`` only the
    tensors on a COMBINED head's peer (:func:`~hydra_trio.engine.quants.swap_peer_tensors`)."""

    kind: ClassVar[str] = "swap_quant"
    key: str
    experts_only: bool = False

    def run(self, engine: Any) -> dict[str, Any]:
        return (quants.swap_peer_tensors if self.experts_only else quants.swap_quant)(engine, self.key)


@attrs.frozen
class PipelineAttach(EngineTask):
    """PIPELINE_ATTACH (``peer`` None: detach; ``ot_split``: the tensor-split regex)."""

    kind: ClassVar[str] = "pipeline_attach"
    peer: str | None
    ot_split: str

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
