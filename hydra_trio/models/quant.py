"""Other quantizations of a packaged model, made on first use with llama.cpp's own quantizer.

No second quantization of SmolLM2 ships as a package, so one is made from the
packaged Q4_1 file: ``llama_model_quantize`` (llama.cpp's ``llama-quantize``,
in the llama-cpp-python build) with ``allow_requantize``, which dequantizes
each tensor to F32 and quantizes it again to the target type.  The result
keeps the architecture, the tokenizer and the KV cache layout of the source;
only the weights' type changes.  The file is written to a temporary name and
renamed, so an interrupted run never leaves a half-made model.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..observability import progress
from .files import atomic_path

log = logging.getLogger("hydra_trio.models.quant")

FTYPES = {"Q8_0": 7, "F16": 1}
"""Target types by name: ``enum llama_ftype`` values (``LLAMA_FTYPE_MOSTLY_Q8_0``, ``LLAMA_FTYPE_MOSTLY_F16``)."""


def quant_path(name: str, qtype: str) -> Path:
    """The cached file for model ``name`` in type ``qtype`` (e.g. ``smollm2-135m``, ``Q8_0``), in the
    models' cache folder (``$XDG_CACHE_HOME/hydra-trio/models``, where the engine writes its merged files too)."""
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "hydra-trio"
        / "models"
        / f"{name}-{qtype.lower()}.gguf"
    )


def make_quant(src: Path, dst: Path, qtype: str, threads: int | None = None) -> Path:
    """Write ``src`` quantized to ``qtype`` (a key of :data:`FTYPES`) to ``dst``; returns ``dst``.

    Logs a line when it starts and when it is done (size, seconds): about 2 s
    for SmolLM2-135M on 2 cores; meanwhile a :func:`hydra_trio.observability.progress.step`
    shows the bytes written (the total is not known beforehand).

    Raises:
        ValueError: unknown ``qtype``.
        RuntimeError: llama.cpp's quantizer failed (its return code in the message).
    """
    import llama_cpp

    from ..engine import init_backend

    if qtype not in FTYPES:
        raise ValueError(f"unknown quantization {qtype!r}; known: {', '.join(FTYPES)}")
    init_backend()  # llama.cpp's log lines (one per tensor here) go to Python logging, not across the bar
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.allow_requantize = True
    params.nthread = threads or os.cpu_count() or 1
    log.info("making %s (%s) from %s with llama.cpp's quantizer ...", dst.name, qtype, src.name)
    t0 = time.perf_counter()
    # llama.cpp's quantizer reports nothing while it runs: the bar follows the bytes it has written
    with (
        atomic_path(dst) as tmp,
        progress.step(f"quantizing {src.name} to {qtype}", unit="B") as bar,
        progress.polling(bar, lambda: tmp.stat().st_size),
    ):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) failed with code {rc}")
        bar.update(tmp.stat().st_size)
    log.info("made %s: %.1f MB in %.1f s", dst, dst.stat().st_size / 1e6, time.perf_counter() - t0)
    return dst


def ensure_quant(src: Path, name: str, qtype: str) -> Path:
    """The cached ``qtype`` version of ``src`` (made by :func:`make_quant` the first time)."""
    dst = quant_path(name, qtype)
    if not dst.is_file():
        make_quant(src, dst, qtype)
    return dst
