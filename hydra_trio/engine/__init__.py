"""The engine: llama.cpp through llama-cpp-python, N slots with continuous batching; no networking.

What the rest of the package uses of the engine is named here (a module outside ``engine/`` imports
``hydra_trio.engine``, not its modules; ``tests/test_architecture.py`` checks it): :class:`Engine` (the door
trio code talks through: submit, cancel, run_task), the typed tasks (:mod:`.tasks`), the requests and
their events (:mod:`.requests`), the served model as a front end sees it (:class:`ModelView`), and the
errors and values those carry.  Inside, by what each part does:

* ``engine.py``, ``loop.py``, ``lifecycle.py``: the trio-side door, the engine thread and its one inbox,
  the model's load, reconfigure and quant swaps; ``tasks.py``, ``requests.py``, ``bridge.py``,
  ``snapshot.py``, ``stats.py``, ``settings.py``, ``quants.py``: the work, its results, the published state
  view, the counters and the settings;
* ``batching/``: the scheduler (continuous batching), each slot's token handling, sampling, the slots' KV
  cells, context checkpoints and the host-RAM prompt cache;
* ``llama/``: llama.cpp's bindings, model loading and placement, OpenMP teams, ggml backends, the chat
  template, tokenization and embeddings;
* ``kv/``: a slot's KV cache as a blob (save, restore, buffers, KV identity);
* ``experts/``: SOLO, COMBINED and PIPELINE (the MoE experts on a ggml-RPC peer);
* ``speculative/``: the drafters of speculative decoding.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".engine": ["Engine", "NO_EMBEDDINGS"],
        ".stats": ["EngineStats"],
        ".lifecycle": ["Stage"],
        ".tasks": [
            "AttachPeerAtStart",
            "Embed",
            "EmbeddingLimits",
            "EraseSlot",
            "PeerGone",
            "PipelineAttach",
            "Reconfigure",
            "RestoreSlot",
            "SaveSlot",
            "SetExpertMode",
            "SwapQuant",
        ],
        ".requests": ["CompletionJob", "Failed", "Finished", "JobRun", "SlotAssigned", "TextDelta"],
        ".view": ["ModelView"],
        ".settings": ["EngineConfig", "SamplingParams"],
        ".batching.scheduler": ["Scheduler"],
        ".batching.sampling": ["GrammarError", "MAX_GRAMMAR_BYTES"],
        ".batching.thinking_budget": ["BudgetSpec"],
        ".llama.model": [
            "builtin_chat_templates",
            "ChatTemplate",
            "check_chat_template",
            "init_backend",
            "LoadedModel",
            "ModelIdentity",
        ],
        ".llama.media": ["MEDIA_MARKER", "MediaChunk", "MediaTokens"],
        ".llama.tokenize": ["PromptTooLong", "raise_if_stopped", "stop_when"],
        ".llama.placement": ["check_placement", "PlacementError"],
        ".llama.embedding": ["Embedding", "EmbeddingJob", "float32_bytes", "n_embd_out", "POOLING"],
        ".kv.state": ["RunningChecksum", "StateError", "verify_checksum_off_engine"],
        ".kv.blobbuf": ["BlobBuffer", "BlobPool", "TRANSFER_POOL"],
        ".experts.combined": ["ExpertMode", "ExpertModes", "peer_listening", "PeerAttach"],
        ".speculative.reasons": ["UNSUPPORTED"],
    },
)
