"""The engine: llama.cpp through llama-cpp-python, N slots with continuous batching; no networking.

:class:`Engine` (lifecycle, the engine thread, submit / cancel / run_task; typed tasks in :mod:`.tasks`),
:class:`~hydra_trio.engine.batching.scheduler.Scheduler` (batching), the expert modes
(SOLO / COMBINED), sampling, slot KV state blobs, model loading.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".engine": ["Engine", "EngineStats"],
        ".lifecycle": ["Stage"],
        ".settings": ["EngineConfig", "SamplingParams"],
        ".batching.scheduler": ["Scheduler"],
        ".experts.combined": ["ExpertModes", "ExpertMode", "PeerAttach"],
        ".requests": ["CompletionJob", "JobRun", "SlotAssigned", "TextDelta", "Finished", "Failed"],
        ".llama.model": ["LoadedModel", "ModelIdentity"],
        ".kv.state": ["StateError"],
    },
)
