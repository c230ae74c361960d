"""In-place switches between presets that differ only in their quantization (docs/router.md, "Which
switches are in place").

Two presets are **quantization siblings** when every option but the model file is equal (after
precedence; ``alias``, ``tags``, ``stop-timeout`` and ``load-on-startup`` do not count) and their model files
are two quantizations of one model (:func:`hydra_trio.models.family.weights_layout`: the same tensors,
hyperparameters and tokenizer; so the same KV identity).  The router starts such a preset's child with a
``--quant NAME=MODEL`` for itself and each sibling and ``--alias`` its own name, so that the node names each
quantization by the router's name of it; when the child of one must give way to another, the router asks it
for SWAP_QUANT (a Hydra op on the child's port) instead of stopping it and starting a new one.
llama-server's router always restarts (``tools/server/server-models.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from ..errors import HydraTrioError
from ..hydra.client import HydraBusy, HydraClient, HydraConnectError, HydraError
from ..models.family import weights_layout
from ..models.presets import resolve_model
from ..transport.access import read_key_file
from .presets import LOAD_ON_STARTUP, STOP_TIMEOUT, ModelPreset

log = logging.getLogger("hydra_trio.router")

IGNORED = ("--model", "--alias", "--tags", LOAD_ON_STARTUP, STOP_TIMEOUT)
"""Options that may differ between two siblings (by their rendered spelling): the model file, and what only
the router reads."""

SWAP_TIMEOUT_S = 600.0
"""Seconds one SWAP_QUANT may take (it loads the new file)."""

BUSY_RETRY_S = 0.05
"""Seconds between two SWAP_QUANT answered BUSY (a slot still finishing the last request)."""


class SwapFailed(Exception):
    """The child did not swap (the message says why); it still serves the model it served."""


def _others(preset: ModelPreset) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, o.value) for k, o in preset.options.items() if o.spec.name not in IGNORED))


def _layout(model: str) -> tuple[Path, str] | None:
    """The resolved file of a preset's ``model`` and its layout, None when it cannot be read."""
    try:
        path = resolve_model(model)[0].resolve()
        return path, weights_layout(path)
    except (HydraTrioError, OSError, ValueError) as exc:
        log.info("model %s: its file is not compared with the other presets' (%s)", model, exc)
        return None


def quant_siblings(presets: Sequence[ModelPreset]) -> dict[str, dict[str, str]]:
    """For each preset with siblings (the module docstring), ``{name: model}`` of itself and its siblings,
    in the order given; a preset without any is left out.  Two presets of one file are no siblings (nor is a
    name holding ``=``, which ``--quant KEY=MODEL`` cannot carry).  Reads each candidate's GGUF header once."""
    groups: dict[tuple[tuple[str, str], ...], list[ModelPreset]] = {}
    for p in presets:
        if p.get("--model") is not None and "=" not in p.name:
            groups.setdefault(_others(p), []).append(p)
    out: dict[str, dict[str, str]] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        by_layout: dict[str, list[tuple[ModelPreset, Path]]] = {}
        for p in group:
            found = _layout(p.get("--model") or "")
            if found is not None:
                by_layout.setdefault(found[1], []).append((p, found[0]))
        for members in by_layout.values():
            files = [path for _, path in members]
            kept = [p for p, path in members if files.count(path) == 1]
            if len(kept) > 1:
                family = {p.name: p.get("--model") or "" for p in kept}
                out.update({p.name: family for p in kept})
    return out


def quant_argv(quants: Mapping[str, str]) -> list[str]:
    """The ``--quant NAME=MODEL`` flags of a child whose preset has siblings (none without)."""
    return [a for name, model in quants.items() for a in ("--quant", f"{name}={model}")] if len(quants) > 1 else []


def swap_quant_key(payload: bytes | bytearray) -> str | None:
    """The quant key of a SWAP_QUANT payload (``[u16 LE len][quant_key][tensor_pattern]``), None when it is
    cut short or no UTF-8 (the child refuses it as it would)."""
    if len(payload) < 2:
        return None
    (n,) = struct.unpack_from("<H", payload)
    if len(payload) < 2 + n:
        return None
    try:
        return bytes(payload[2 : 2 + n]).decode("utf-8")
    except UnicodeDecodeError:
        return None


def hydra_token(preset: ModelPreset) -> str | None:
    """The child's ``--hydra-token`` (or the first key of its ``--hydra-token-file``), which SWAP_QUANT needs."""
    token = preset.get("--hydra-token")
    path = preset.get("--hydra-token-file")
    if path is not None:
        try:
            return read_key_file(path)[0]
        except (OSError, ValueError, IndexError):
            return token
    return token


async def swap_quant(host: str, port: int, key: str, token: str | None, patience: float) -> dict[str, Any]:
    """SWAP_QUANT ``key`` on the node at ``host:port`` (:meth:`HydraClient.swap_quant
    <hydra_trio.hydra.client.HydraClient.swap_quant>`, presenting ``token`` when the node has a
    ``--hydra-token``); returns the reply's meta.  Answered BUSY (a slot works), it is asked again every
    :data:`BUSY_RETRY_S` for ``patience`` seconds (the wait of an unload: the model's ``stop-timeout``).

    Raises:
        SwapFailed: the node refused (its status and ``error``), failed to load the file (it still serves
            the old one), stayed busy, could not be reached or broke the protocol.
    """
    deadline = trio.current_time() + patience
    try:
        async with HydraClient(host, port, timeout=SWAP_TIMEOUT_S, token=token) as client:
            while True:
                try:
                    return await client.swap_quant(key, "")
                except HydraBusy:
                    if trio.current_time() >= deadline:
                        raise SwapFailed(f"the node stayed busy for {patience:g} s") from None
                await trio.sleep(BUSY_RETRY_S)
    except HydraError as exc:
        raise SwapFailed(f"SWAP_QUANT answered {exc.status_name}: {exc.message}") from exc
    except HydraConnectError as exc:
        raise SwapFailed(f"the node could not be reached: {exc}") from exc
