"""A tiny random-weight hybrid (recurrent + attention) test model, LFM2 layout, written with the ``gguf`` package.

No recurrent or hybrid model is small enough to ship, so one is generated:
LFM2 (``general.architecture`` ``lfm2``, llama.cpp's ``src/models/lfm2.cpp``)
alternates short-convolution layers (``shortconv.{conv,in_proj,out_proj}``,
whose rolling conv state is recurrent memory) with attention layers
(``attn_{q,k,v,output}`` plus per-head ``attn_{q,k}_norm``); a layer is
recurrent where ``lfm2.attention.head_count_kv`` is 0.  llama.cpp gives it a
hybrid memory (``llama_memory_hybrid``): a partial ``llama_memory_seq_rm``
fails, as on the cluster's production hybrid model, which is what context
checkpoints are for (:mod:`hydra_trio.engine.checkpoints`).

The weights are random (a fixed seed: the file is the same on every machine
with the same numpy), so the text is nonsense, but greedy output is
deterministic.  The output matrix is separate from the token embedding and
scaled so that logits are far apart (greedy choices do not flip on
rounding differences between batch splits).  The tokenizer and chat template
are the source model's (SmolLM2): ``tokenizer.*`` metadata is copied, as
:mod:`hydra_trio.models.moe` does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

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


def default_path() -> Path:
    """Where :func:`ensure_test_hybrid` keeps the model (``$XDG_CACHE_HOME/hydra-trio/models``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"
    return cache / f"tiny-{ARCH}-hybrid-{len(LAYERS)}l-{N_EMBD}.gguf"


def make_test_hybrid(src: Path, dst: Path, seed: int = SEED) -> Path:
    """Write the tiny LFM2 model with ``src``'s tokenizer (any GGUF with ``tokenizer.*`` metadata) to ``dst``.

    About 13 MB (F16 embedding and output, F32 elsewhere), written in about a
    second; to a temporary file first and renamed, so a crash never leaves a
    half-written model.  Returns ``dst``.  Raises ValueError if ``src`` has
    no tokenizer.
    """
    import gguf

    reader = gguf.GGUFReader(str(src))
    tok_fields = [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{src} has no tokenizer (tokenizer.ggml.tokens)")
    n_vocab = len(tokens.data)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 1.0, dtype: type = np.float32) -> np.ndarray:
        """A (rows, cols) numpy matrix = ggml {cols, rows}: ``cols`` is the input width."""
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(dtype)

    head_dim = N_EMBD // N_HEAD
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32).astype(np.float16),
        "token_embd_norm.weight": np.ones(N_EMBD, dtype=np.float32),  # LFM2's output norm
        # logits = output · norm(h): rows of norm ~1 per element, so logits have a standard deviation of ~6
        "output.weight": mat(n_vocab, N_EMBD, 6.0, np.float16),
    }
    for i, kind in enumerate(LAYERS):
        b = f"blk.{i}"
        tensors[f"{b}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"{b}.ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"{b}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        tensors[f"{b}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        tensors[f"{b}.ffn_down.weight"] = mat(N_EMBD, N_FF)
        if kind == "attn":
            tensors[f"{b}.attn_q.weight"] = mat(N_EMBD, N_EMBD)
            tensors[f"{b}.attn_k.weight"] = mat(N_HEAD_KV * head_dim, N_EMBD)
            tensors[f"{b}.attn_v.weight"] = mat(N_HEAD_KV * head_dim, N_EMBD)
            tensors[f"{b}.attn_output.weight"] = mat(N_EMBD, N_EMBD)
            tensors[f"{b}.attn_q_norm.weight"] = np.ones(head_dim, dtype=np.float32)
            tensors[f"{b}.attn_k_norm.weight"] = np.ones(head_dim, dtype=np.float32)
        else:
            tensors[f"{b}.shortconv.conv.weight"] = mat(N_EMBD, L_CACHE)  # ggml {l_cache, n_embd}
            tensors[f"{b}.shortconv.in_proj.weight"] = mat(3 * N_EMBD, N_EMBD)
            tensors[f"{b}.shortconv.out_proj.weight"] = mat(N_EMBD, N_EMBD)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        writer.add_string("general.name", f"tiny {ARCH} hybrid (random weights, test)")
        writer.add_uint32(f"{ARCH}.context_length", 8192)
        writer.add_uint32(f"{ARCH}.embedding_length", N_EMBD)
        writer.add_uint32(f"{ARCH}.feed_forward_length", N_FF)
        writer.add_uint32(f"{ARCH}.block_count", len(LAYERS))
        writer.add_uint32(f"{ARCH}.attention.head_count", N_HEAD)
        writer.add_array(f"{ARCH}.attention.head_count_kv", [N_HEAD_KV if k == "attn" else 0 for k in LAYERS])
        writer.add_float32(f"{ARCH}.rope.freq_base", 10000.0)
        writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-5)
        writer.add_uint32(f"{ARCH}.shortconv.l_cache", L_CACHE)
        writer.add_uint32(f"{ARCH}.vocab_size", n_vocab)
        for field in tok_fields:
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        for name, data in tensors.items():
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dst)
    log.info("wrote test hybrid %s (%s, %d layers, n_embd %d)", dst, ARCH, len(LAYERS), N_EMBD)
    return dst


def ensure_test_hybrid(source: Path) -> Path:
    """The test hybrid with ``source``'s tokenizer (the SmolLM2 GGUF) in the cache directory, made on first use."""
    dst = default_path()
    if not dst.is_file():
        make_test_hybrid(source, dst)
    return dst
