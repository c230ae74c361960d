"""The node as every front end sees it: whether it serves a model now, which slots it has (each front end
reads a slot id in its own syntax: a path's ``{id}``, a Hydra key), and the facts both ``GET /props`` and
Hydra INFO report (its ggml backends and devices, the KV cache and memory in use).

Every refusal is a typed error (:mod:`hydra_trio.errors`) that each front end turns into its own status.
"""

from __future__ import annotations

from typing import Any

from ..engine import Engine
from ..engine.llama.ggml_backend import build_backends, local_devices
from ..errors import NoModel, NotFound, NotReady


def serving(engine: Engine | None) -> Engine:
    """The engine, once it serves its model.

    Raises:
        NoModel: the node has none (compute-only).
        NotReady: the model is loading (or failed to load); ``stage`` says where it is, the message is
            llama-server's ``Loading model`` with it.
    """
    if engine is None:
        raise NoModel()
    if not engine.ready:
        raise NotReady(f"Loading model (stage: {engine.stage})", str(engine.stage))
    return engine


def slot(engine: Engine | None, id_slot: int) -> Engine:
    """The serving engine (:func:`serving`), once it is known to have slot ``id_slot``.

    Raises NotFound (``slot N not found (this node has slots 0..M)``), besides :func:`serving`'s errors.
    The count is the engine's published one: the engine checks again where it acts."""
    e = serving(engine)
    check_slot(e, id_slot)
    return e


def check_slot(e: Engine, id_slot: int) -> None:
    """Raise NotFound unless ``e`` has slot ``id_slot`` now."""
    n_slots = e.n_slots
    if not 0 <= id_slot < n_slots:
        raise NotFound(f"slot {id_slot} not found (this node has slots 0..{n_slots - 1})")


def slot_meta(engine: Engine | None, id_slot: int) -> dict[str, Any]:
    """The slot's state meta (HTTP ``GET /slots/{id}/state/meta``, Hydra STATE_META): the engine's published
    snapshot of the slot (``slot_id``, ``n_past``, ``state_size``, ``is_processing``, ...; it never waits behind
    a prefill) and the model's identity.  Raises NotFound and :func:`serving`'s errors."""
    e = slot(engine, id_slot)
    meta = e.slot_meta_now(id_slot)
    if meta is None:  # the slot count changed since slot() looked
        check_slot(e, id_slot)
        raise NotFound(f"slot {id_slot} not found")
    assert e.identity is not None
    return {**meta, **e.identity.as_meta()}


def identity(e: Engine) -> dict[str, Any]:
    """The serving model's identity keys (``model_hash``, ``model_alias``, ``kv_identity``, ...)."""
    assert e.identity is not None
    return e.identity.as_meta()


def hardware() -> dict[str, Any]:
    """``{"backends": the ggml backends of this build (["CPU", "RPC"], "CUDA" on a GPU build), "devices":
    [{"name", "memory_free", "memory_total"} (bytes)] the devices ggml finds}`` (``/props``, INFO)."""
    return {
        "backends": build_backends(),
        "devices": [
            {"name": name, "memory_free": free, "memory_total": total} for name, free, total in local_devices()
        ],
    }


def modalities(e: Engine) -> dict[str, bool]:
    """``{"vision", "video", "audio"}``: the media the node takes (``/props`` and INFO ``modalities``, as
    llama-server's ``get_res_props``): its projector's encoders (``EngineConfig.media``); ``video``: the loaded
    projector's ``mtmd_helper_support_video`` (libmtmd built with video, and a vision encoder; whether or not
    ffmpeg is installed, as llama-server), false until it loads."""
    media = e.config.media
    m = e.model_view
    return {
        "vision": media.mmproj is not None and media.vision,
        "video": media.mmproj is not None and m is not None and m.modalities["video"],
        "audio": media.mmproj is not None and media.audio,
    }


def model_use(e: Engine) -> dict[str, Any]:
    """``{"kv_cache": {"type_k", "type_v", "flash_attn"}, "memory": {device: {"weights", "kv", "compute"}}}``
    (bytes) of the loaded models (``/props``, INFO: :func:`~hydra_trio.engine.engine.kv_cache`,
    :func:`~hydra_trio.engine.engine.memory_use`)."""
    return {"kv_cache": e.kv_cache(), "memory": e.memory_use()}
