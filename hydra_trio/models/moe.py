"""A faithful test MoE model made from a dense llama-arch GGUF (Mixtral layout), with the ``gguf`` package.

No MoE model is small enough to ship, so one is made: every layer's dense FFN
(``ffn_gate``, ``ffn_up``, ``ffn_down``) becomes ``E`` identical experts
(``ffn_{gate,up,down}_exps``, the dense rows stacked as raw quantized bytes)
plus an all-zero router ``ffn_gate_inp``; ``llama.expert_count`` = E and
``llama.expert_used_count`` = K.  llama.cpp normalises the top-K expert
weights, so the MoE computes exactly the dense FFN: greedy output equals the
dense model's token for token, which lets SOLO, COMBINED and dense runs be
compared.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..observability import progress
from .files import atomic_path, copy_field

log = logging.getLogger("hydra_trio.models.moe")

_DENSE_FFN = re.compile(r"^(blk\.\d+)\.ffn_(gate|up|down)\.weight$")


def default_path(n_expert: int = 4, n_expert_used: int = 2) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"
    return cache / f"smollm2-135m-moe-{n_expert}x{n_expert_used}.gguf"


def make_test_moe(src: Path, dst: Path, n_expert: int = 4, n_expert_used: int = 2) -> Path:
    """Write the MoE version of ``src`` (a llama-arch GGUF) to ``dst``; returns ``dst``.

    Written to a temporary file first and renamed, so a crash never leaves a
    half-written model.  Raises ValueError if ``src`` is not a dense llama model.

    Progress: one :func:`hydra_trio.observability.progress.step` ("building test MoE"); its total (the
    tensor bytes to write) is known once ``src`` is read (about 3 s of the 4 s for SmolLM2).
    """
    if not 1 <= n_expert_used <= n_expert:
        raise ValueError(f"need 1 <= expert_used_count ({n_expert_used}) <= expert_count ({n_expert})")
    with progress.step(f"building test MoE {dst.name}", unit="B") as bar:
        _make(src, dst, n_expert, n_expert_used, bar)
    log.info("wrote test MoE %s (%d experts, top-%d)", dst, n_expert, n_expert_used)
    return dst


def _make(src: Path, dst: Path, n_expert: int, n_expert_used: int, bar: progress.Step) -> None:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields.get("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else ""
    if arch != "llama":
        raise ValueError(f"{src} is a {arch!r} model; the generator needs a dense llama-arch GGUF")
    if f"{arch}.expert_count" in reader.fields:
        raise ValueError(f"{src} is already a MoE model")
    n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())

    with atomic_path(dst) as tmp, contextlib.closing(gguf.GGUFWriter(str(tmp), arch)) as writer:
        _write_moe(writer, reader, arch, n_expert, n_expert_used, n_embd, src, bar)


def _write_moe(
    writer: Any, reader: Any, arch: str, n_expert: int, n_expert_used: int, n_embd: int, src: Path, bar: progress.Step
) -> None:
    """The MoE's keys, its tensor infos, then each tensor's data (stacked experts, zero routers)."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.name"):
            continue
        copy_field(writer, field)
    writer.add_uint32(f"{arch}.expert_count", n_expert)
    writer.add_uint32(f"{arch}.expert_used_count", n_expert_used)
    name = reader.fields["general.name"].contents() if "general.name" in reader.fields else src.stem
    writer.add_string("general.name", f"{name} MoE {n_expert}x{n_expert_used} (test)")

    # Each tensor is declared first and written afterwards, one at a time (gguf's streaming writer:
    # add_tensor_info, then write_tensor_data in the same order): memory holds one stacked tensor, and the
    # bytes written drive the progress bar.
    planned: list[tuple[int, Callable[[], np.ndarray]]] = []
    routers: set[str] = set()
    for t in reader.tensors:
        m = _DENSE_FFN.match(t.name)
        if m is None:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            planned.append((t.data.nbytes, functools.partial(_as_is, t.data)))
            continue
        block, kind = m.groups()
        shape = (n_expert, *t.data.shape)  # (E, rows, row bytes or elements)
        writer.add_tensor_info(
            f"{block}.ffn_{kind}_exps.weight", shape, t.data.dtype, n_expert * t.data.nbytes, raw_dtype=t.tensor_type
        )
        planned.append((n_expert * t.data.nbytes, functools.partial(_stacked, t.data, n_expert)))
        if block not in routers:
            routers.add(block)
            router = np.zeros((n_expert, n_embd), dtype=np.float32)
            writer.add_tensor_info(f"{block}.ffn_gate_inp.weight", router.shape, router.dtype, router.nbytes)
            planned.append((router.nbytes, functools.partial(_as_is, router)))
    if not routers:
        raise ValueError(f"{src} has no dense FFN tensors")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    bar.update(0, total=sum(n for n, _ in planned))
    for nbytes, make in planned:
        writer.write_tensor_data(make())
        bar.advance(nbytes)


def _as_is(data: np.ndarray) -> np.ndarray:
    return data


def _stacked(data: np.ndarray, n: int) -> np.ndarray:
    """``n`` copies of ``data`` stacked on a new first axis: ``(n, *data.shape)``, contiguous."""
    return np.ascontiguousarray(np.stack([data] * n))


def ensure_test_moe(source: Path, n_expert: int = 4, n_expert_used: int = 2) -> Path:
    """The test MoE made from ``source`` (the SmolLM2 GGUF) in the cache directory, made on first use."""
    dst = default_path(n_expert, n_expert_used)
    if not dst.is_file():
        make_test_moe(source, dst, n_expert, n_expert_used)
    return dst
