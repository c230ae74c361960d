"""Router mode's memory check at start, the node's own over the models ``--models-max`` lets run at once.

A node refuses to load a model whose KV cache is larger than the memory available (``LoadedModel`` in
``hydra_trio/engine/llama/model.py``; its weights are mapped from the file, so they are not counted).  A router
runs up to ``--models-max`` children (every model with 0), each its own node; so at start it sums, over the
models that may run together, what each child's check would count:

* the largest ``N`` KV caches above the memory available: refused, exit 2, naming each model and size
  (each child would pass its own check alone, and the last to load would fail or swap);
* the largest ``N`` footprints (weights and KV cache) above it: a warning (the weights page in from their
  files; the models still load, slower).

Each model's sizes come from its GGUF header and its flags as the child parses them
(:func:`hydra_trio.models.footprint.model_footprint`: ``-c``, ``-np`` with ``--kv-unified-per-slot``, ``-ctk``,
``-ctv``, ``-mm``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from ..engine import EngineConfig
from ..models.footprint import Footprint, model_footprint
from ..models.presets import PresetError, resolve_model
from ..observability.memory import available_memory
from ..router.models import ModelInstance
from ..router.presets import ModelsConfigError

log = logging.getLogger("hydra_trio")

MIB = 2**20


def footprint_of(m: ModelInstance, parse: Callable[[list[str], dict[str, str]], argparse.Namespace]) -> Footprint:
    """``m``'s footprint from the flags its child runs with (``parse``: the node's parser).

    Raises:
        ModelsConfigError: its model file cannot be found or read.
    """
    args = parse(["run", *m.preset.argv()], {})
    n_parallel = 4 if args.parallel == -1 else args.parallel  # llama-server's auto: 4 slots
    n_ctx = args.ctx_size
    if n_ctx is None and args.kv_unified_per_slot is not None and args.kv_unified_per_slot > 0:
        n_ctx = n_parallel * args.kv_unified_per_slot
    if n_ctx is None:
        n_ctx = EngineConfig.__attrs_attrs__.n_ctx.default
    try:
        path, _alias = resolve_model(args.model)
        mmproj = [Path(args.mmproj)] if args.mmproj and not getattr(args, "no_mmproj", False) else []
        return model_footprint(path, n_ctx, args.cache_type_k or "f16", args.cache_type_v or "f16", mmproj)
    except (PresetError, OSError, KeyError) as exc:
        raise ModelsConfigError(f"preset '{m.name}': cannot size the model: {exc}") from exc


def check_router_memory(
    models: list[ModelInstance],
    models_max: int,
    parse: Callable[[list[str], dict[str, str]], argparse.Namespace],
    available: int | None = None,
) -> dict[str, Footprint]:
    """Check what ``models_max`` models may take at once against the memory available (the module docstring);
    returns each model's footprint by name, logs the sum (and the warning).  A model whose file cannot be read
    is not counted (a warning): it fails when it loads, as with llama-server.

    Raises:
        ModelsConfigError: their largest KV caches together exceed the memory available.
    """
    sizes: dict[str, Footprint] = {}
    for m in models:
        try:
            sizes[m.name] = footprint_of(m, parse)
        except ModelsConfigError as exc:  # its child will say why it does not load, as llama-server's would
            log.warning("memory: %s; not counted", exc)
    if not sizes:
        return sizes
    n = len(sizes) if models_max <= 0 else min(models_max, len(sizes))
    free = available_memory() if available is None else available
    by_kv = sorted(sizes.items(), key=lambda kv: kv[1].kv, reverse=True)[:n]
    by_total = sorted(sizes.items(), key=lambda kv: kv[1].total, reverse=True)[:n]
    kv = sum(f.kv for _, f in by_kv)
    total = sum(f.total for _, f in by_total)
    at_once = f"{n} model{'s' if n > 1 else ''} at once (--models-max {models_max})"
    log.info(
        "memory: %s take up to %.0f MiB (%.0f MiB of KV cache, the rest mapped from their files); %s",
        at_once,
        total / MIB,
        kv / MIB,
        "available: unknown" if free is None else f"available: {free / MIB:.0f} MiB",
    )
    if free is None:
        return sizes
    if kv > free:
        each = ", ".join(
            f"{name} {f.kv / MIB:.0f} MiB (n_ctx {f.n_ctx}, {f.kv_per_token} bytes per token)" for name, f in by_kv
        )
        raise ModelsConfigError(
            f"{at_once} need {kv / MIB:.0f} MiB of KV cache ({each}); only {free / MIB:.0f} MiB of memory is "
            "available: lower --models-max or their -c"
        )
    if total > free:
        log.warning(
            "memory: %s take up to %.0f MiB with their weights (%s), more than the %.0f MiB available: "
            "their weights will be read from their files again as they run",
            at_once,
            total / MIB,
            ", ".join(f"{name} {f.total / MIB:.0f} MiB" for name, f in by_total),
            free / MIB,
        )
    return sizes
