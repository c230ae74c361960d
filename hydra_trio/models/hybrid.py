"""Tiny random-weight test models whose memory cannot be cut back (an LFM2 hybrid, a Gemma 3 SWA), via ``gguf``.

No recurrent or hybrid model is small enough to ship, so one is generated:
LFM2 (``general.architecture`` ``lfm2``, llama.cpp's ``src/models/lfm2.cpp``)
alternates short-convolution layers (``shortconv.{conv,in_proj,out_proj}``,
whose rolling conv state is recurrent memory) with attention layers
(``attn_{q,k,v,output}`` plus per-head ``attn_{q,k}_norm``); a layer is
recurrent where ``lfm2.attention.head_count_kv`` is 0.  llama.cpp gives it a
hybrid memory (``llama_memory_hybrid``): a partial ``llama_memory_seq_rm``
fails, as on the cluster's production hybrid model, which is what context
checkpoints are for (:mod:`hydra_trio.engine.batching.checkpoints`).

A tiny Gemma 3 (``gemma3``) is made the same way for the sliding-window
case (:func:`make_test_swa`): its SWA layers keep only the last
:data:`SWA_WINDOW` tokens' KV cells (without ``--swa-full``).

The weights are random (a fixed seed: the file is the same on every machine
with the same numpy), so the text is nonsense, but greedy output is
deterministic.  The output matrix is separate from the token embedding and
scaled so that logits are far apart (greedy choices do not flip on
rounding differences between batch splits).  The tokenizer and chat template
are the source model's (SmolLM2): ``tokenizer.*`` metadata is copied, as
:mod:`hydra_trio.models.moe` does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np

from .files import atomic_path, copy_field

log = logging.getLogger("hydra_trio.models.hybrid")

ARCH = "lfm2"
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
L_CACHE = 3
LAYERS = ("conv", "attn", "conv", "attn")
"""The layer pattern: ``conv`` = short convolution (recurrent state), ``attn`` = attention (KV cache)."""
SEED = 23
SWA_LAYERS = 6
SWA_WINDOW = 32
"""The test SWA model's layers (Gemma 3's pattern: five sliding-window layers, then one global) and window."""


def default_path(kind: str = "hybrid") -> Path:
    """Where :func:`ensure_test_hybrid` (``kind`` "hybrid") or :func:`ensure_test_swa` ("swa") keeps its
    model (``$XDG_CACHE_HOME/hydra-trio/models``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"
    if kind == "swa":
        return cache / f"tiny-gemma3-swa{SWA_WINDOW}-{SWA_LAYERS}l-{N_EMBD}.gguf"
    return cache / f"tiny-{ARCH}-hybrid-{len(LAYERS)}l-{N_EMBD}.gguf"


def make_test_hybrid(src: Path, dst: Path, seed: int = SEED) -> Path:
    """Write the tiny LFM2 hybrid with ``src``'s tokenizer (any GGUF with ``tokenizer.*`` metadata) to ``dst``.

    About 13 MB (F16 embedding and output, F32 elsewhere), written in about a
    second; to a temporary file first and renamed, so a crash never leaves a
    half-written model.  Returns ``dst``.  Raises ValueError if ``src`` has
    no tokenizer.
    """
    n_vocab, tok_fields = source_tokenizer(src)
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD
    tensors = _embedding_and_output(rng, n_vocab, "token_embd_norm")  # LFM2's name for the output norm
    for i, kind in enumerate(LAYERS):
        b = f"blk.{i}"
        tensors.update(_ffn(rng, b))
        tensors[f"{b}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        if kind == "attn":
            tensors.update(_attention(rng, b, head_dim))
        else:
            tensors[f"{b}.shortconv.conv.weight"] = random_matrix(rng, N_EMBD, L_CACHE)  # ggml {l_cache, n_embd}
            tensors[f"{b}.shortconv.in_proj.weight"] = random_matrix(rng, 3 * N_EMBD, N_EMBD)
            tensors[f"{b}.shortconv.out_proj.weight"] = random_matrix(rng, N_EMBD, N_EMBD)
    kv = {
        "context_length": 8192,
        "embedding_length": N_EMBD,
        "feed_forward_length": N_FF,
        "block_count": len(LAYERS),
        "attention.head_count": N_HEAD,
        "attention.head_count_kv": [N_HEAD_KV if k == "attn" else 0 for k in LAYERS],
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "shortconv.l_cache": L_CACHE,
        "vocab_size": n_vocab,
    }
    write_gguf(dst, ARCH, f"tiny {ARCH} hybrid (random weights, test)", kv, tok_fields, tensors)
    log.info("wrote test hybrid %s (%s, %d layers, n_embd %d)", dst, ARCH, len(LAYERS), N_EMBD)
    return dst


def make_test_swa(src: Path, dst: Path, seed: int = SEED) -> Path:
    """Write a tiny Gemma 3 (``gemma3``: sliding-window attention, :data:`SWA_WINDOW` tokens, on five of
    every six layers, llama.cpp's ``src/models/gemma3.cpp``) with ``src``'s tokenizer to ``dst``.

    Its SWA layers' KV cache keeps only the window (without ``--swa-full``),
    so it too cannot be cut back to any prefix.  As :func:`make_test_hybrid`:
    random weights, about 13 MB, written in about a second.
    """
    n_vocab, tok_fields = source_tokenizer(src)
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD
    tensors = _embedding_and_output(rng, n_vocab, "output_norm")
    for i in range(SWA_LAYERS):
        b = f"blk.{i}"
        tensors.update(_ffn(rng, b))
        tensors.update(_attention(rng, b, head_dim))
        for norm in ("attn_norm", "post_attention_norm", "post_ffw_norm"):
            tensors[f"{b}.{norm}.weight"] = np.ones(N_EMBD, dtype=np.float32)
    kv = {
        "context_length": 8192,
        "embedding_length": N_EMBD,
        "feed_forward_length": N_FF,
        "block_count": SWA_LAYERS,
        "attention.head_count": N_HEAD,
        "attention.head_count_kv": N_HEAD_KV,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.sliding_window": SWA_WINDOW,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    write_gguf(dst, "gemma3", "tiny gemma3 SWA (random weights, test)", kv, tok_fields, tensors)
    log.info("wrote test SWA model %s (gemma3, %d layers, window %d)", dst, SWA_LAYERS, SWA_WINDOW)
    return dst


def source_tokenizer(src: Path) -> tuple[int, list]:
    import gguf

    reader = gguf.GGUFReader(str(src))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{src} has no tokenizer (tokenizer.ggml.tokens)")
    return len(tokens.data), [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]


def random_matrix(
    rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0, dtype: type = np.float32
) -> np.ndarray:
    """A (rows, cols) numpy matrix = ggml {cols, rows}: ``cols`` is the input width."""
    return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(dtype)


def _embedding_and_output(rng: np.random.Generator, n_vocab: int, norm: str) -> dict[str, np.ndarray]:
    return {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32).astype(np.float16),
        f"{norm}.weight": np.ones(N_EMBD, dtype=np.float32),
        # logits = output · norm(h): rows of norm ~1 per element, so logits have a standard deviation of ~6
        "output.weight": random_matrix(rng, n_vocab, N_EMBD, 6.0, np.float16),
    }


def _ffn(rng: np.random.Generator, b: str) -> dict[str, np.ndarray]:
    return {
        f"{b}.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        f"{b}.ffn_gate.weight": random_matrix(rng, N_FF, N_EMBD),
        f"{b}.ffn_up.weight": random_matrix(rng, N_FF, N_EMBD),
        f"{b}.ffn_down.weight": random_matrix(rng, N_EMBD, N_FF),
    }


def _attention(rng: np.random.Generator, b: str, head_dim: int) -> dict[str, np.ndarray]:
    return {
        f"{b}.attn_q.weight": random_matrix(rng, N_EMBD, N_EMBD),
        f"{b}.attn_k.weight": random_matrix(rng, N_HEAD_KV * head_dim, N_EMBD),
        f"{b}.attn_v.weight": random_matrix(rng, N_HEAD_KV * head_dim, N_EMBD),
        f"{b}.attn_output.weight": random_matrix(rng, N_EMBD, N_EMBD),
        f"{b}.attn_q_norm.weight": np.ones(head_dim, dtype=np.float32),
        f"{b}.attn_k_norm.weight": np.ones(head_dim, dtype=np.float32),
    }


def write_gguf(dst: Path, arch: str, name: str, kv: dict, tok_fields: list, tensors: dict[str, np.ndarray]) -> None:
    """``{arch}.KEY`` for each of ``kv``, the tokenizer fields, the tensors; to a temporary file, then renamed."""
    import gguf

    with atomic_path(dst) as tmp, contextlib.closing(gguf.GGUFWriter(str(tmp), arch)) as writer:
        writer.add_string("general.name", name)
        for key, value in kv.items():
            if isinstance(value, list):
                writer.add_array(f"{arch}.{key}", value)
            elif isinstance(value, float):
                writer.add_float32(f"{arch}.{key}", value)
            else:
                writer.add_uint32(f"{arch}.{key}", value)
        for field in tok_fields:
            copy_field(writer, field)
        for tname, data in tensors.items():
            writer.add_tensor(tname, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def ensure_test_hybrid(source: Path) -> Path:
    """The test hybrid with ``source``'s tokenizer (the SmolLM2 GGUF) in the cache directory, made on first use."""
    dst = default_path()
    if not dst.is_file():
        make_test_hybrid(source, dst)
    return dst


def ensure_test_swa(source: Path) -> Path:
    """The test SWA model (:func:`make_test_swa`) with ``source``'s tokenizer, in the cache directory, made on
    first use."""
    dst = default_path("swa")
    if not dst.is_file():
        make_test_swa(source, dst)
    return dst
