"""A tiny test model of the cluster's architecture with one MTP (NextN) layer: ``tiny-mtp``, made with ``gguf``.

No packaged model has next-token-prediction layers, so one is generated, of
the architecture the cluster serves: ``qwen35moe`` (Qwen3.5/3.6 MoE,
llama.cpp's ``src/models/qwen35moe.cpp``).  It is a hybrid: three of every
four trunk layers are gated delta-net linear attention (recurrent state,
``ssm_*`` tensors), the fourth full attention with a gated query; every layer's
FFN is a routed MoE plus a gated shared expert.  ``qwen35moe.nextn_predict_layers``
= 1 appends one more block (the last ``blk.N``): a full-attention MoE block
with ``nextn.eh_proj`` / ``nextn.enorm`` / ``nextn.hnorm`` in front, which
llama.cpp loads only with ``load_mtp`` and runs only in a context of type
``LLAMA_CONTEXT_TYPE_MTP``.  A context of the default type never sees it.

The weights are random with a fixed seed, shaped so that drafting is worth
testing: each layer adds a small update to the residual stream
(:data:`RESIDUAL_SCALE`), so the next token depends mostly on the current one
and a little on the context, and the MTP block's ``eh_proj`` passes its token
half through.  The MTP head then predicts the target's greedy token often but
not always (about 60 % of its drafted tokens are accepted on the tests' prompts): a test sees drafts
accepted and rejected.  The output matrix is
separate from the token embedding and scaled so that logits lie far apart
(greedy choices do not flip on rounding differences between batch splits).
The tokenizer and chat template are the source model's (SmolLM2), copied as
:mod:`hydra_trio.models.hybrid` copies them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from .hybrid import random_matrix, source_tokenizer, write_gguf

log = logging.getLogger("hydra_trio.models.tiny_mtp")

ARCH = "qwen35moe"
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_ROT = 8
ROPE_SECTIONS = [2, 1, 1, 0]
"""Partial rotary embedding as Qwen3.5's (IMRoPE sections summing to ``N_ROT / 2``)."""
N_LAYER = 4
"""Trunk layers; with ``full_attention_interval`` 4 the first three are linear attention, the fourth full."""
N_EXPERT = 4
N_EXPERT_USED = 2
N_FF_EXP = 32
N_FF_SHEXP = 64
SSM_D_CONV = 4
SSM_D_STATE = 16
SSM_N_GROUP = 2
SSM_DT_RANK = 4
RESIDUAL_SCALE = 0.05
"""Scale of each layer's output projections (``ssm_out``, ``attn_output``, the experts' ``ffn_down``)."""
SEED = 37


def default_path() -> Path:
    """Where :func:`ensure_test_mtp` keeps the model (``$XDG_CACHE_HOME/hydra-trio/models``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"
    return cache / f"tiny-{ARCH}-mtp1-{N_LAYER}l-{N_EMBD}.gguf"


def make_test_mtp(src: Path, dst: Path, seed: int = SEED) -> Path:
    """Write the tiny ``qwen35moe`` with one MTP layer and ``src``'s tokenizer (any GGUF with ``tokenizer.*``
    metadata) to ``dst``; returns ``dst``.

    About 22 MB (F16 token embedding, F32 elsewhere), written in about two seconds; to a temporary file
    first and renamed, so a crash never leaves a half-written model.  Raises ValueError if ``src`` has no
    tokenizer.
    """
    n_vocab, tok_fields = source_tokenizer(src)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32).astype(np.float16),
        "output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        # logits = output · norm(h): rows of norm ~1 per element, so logits have a standard deviation of ~6
        "output.weight": random_matrix(rng, n_vocab, N_EMBD, 6.0),  # F32: greedy picks do not hang on F16 rounding
    }
    for il in range(N_LAYER + 1):
        b = f"blk.{il}"
        tensors[f"{b}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        tensors[f"{b}.post_attention_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        if il < N_LAYER and (il + 1) % 4 != 0:
            tensors.update(_linear_attention(rng, b))
        else:
            tensors.update(_attention(rng, b))
        tensors.update(_moe(rng, b))
    tensors.update(_nextn(rng, f"blk.{N_LAYER}"))
    kv = {
        "context_length": 8192,
        "embedding_length": N_EMBD,
        "feed_forward_length": N_FF_SHEXP,
        "block_count": N_LAYER + 1,
        "nextn_predict_layers": 1,
        "attention.head_count": N_HEAD,
        "attention.head_count_kv": N_HEAD_KV,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
        "rope.dimension_count": N_ROT,
        "rope.dimension_sections": ROPE_SECTIONS,
        "expert_count": N_EXPERT,
        "expert_used_count": N_EXPERT_USED,
        "expert_feed_forward_length": N_FF_EXP,
        "expert_shared_feed_forward_length": N_FF_SHEXP,
        "ssm.conv_kernel": SSM_D_CONV,
        "ssm.state_size": SSM_D_STATE,
        "ssm.group_count": SSM_N_GROUP,
        "ssm.time_step_rank": SSM_DT_RANK,
        "ssm.inner_size": SSM_D_STATE * SSM_DT_RANK,
        "full_attention_interval": 4,
        "vocab_size": n_vocab,
    }
    write_gguf(dst, ARCH, f"tiny {ARCH} with one MTP layer (random weights, test)", kv, tok_fields, tensors)
    log.info("wrote test MTP model %s (%s, %d layers + 1 MTP, n_embd %d)", dst, ARCH, N_LAYER, N_EMBD)
    return dst


def _out(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """An output projection: a small update to the residual stream."""
    return random_matrix(rng, rows, cols, RESIDUAL_SCALE)


def _linear_attention(rng: np.random.Generator, b: str) -> dict[str, np.ndarray]:
    """A gated delta-net layer (``build_layer_attn_linear``): head_k = head_v = ``SSM_D_STATE``,
    ``SSM_N_GROUP`` key heads, ``SSM_DT_RANK`` value heads."""
    key_dim = SSM_D_STATE * SSM_N_GROUP
    value_dim = SSM_D_STATE * SSM_DT_RANK
    conv_dim = 2 * key_dim + value_dim
    return {
        f"{b}.attn_qkv.weight": random_matrix(rng, conv_dim, N_EMBD),
        f"{b}.attn_gate.weight": random_matrix(rng, value_dim, N_EMBD),
        f"{b}.ssm_conv1d.weight": random_matrix(rng, conv_dim, SSM_D_CONV),  # ggml {d_conv, conv_dim}
        f"{b}.ssm_dt.bias": np.zeros(SSM_DT_RANK, dtype=np.float32),
        f"{b}.ssm_a": -rng.uniform(0.5, 2.0, SSM_DT_RANK).astype(np.float32),  # -exp(A_log): a decay
        f"{b}.ssm_beta.weight": random_matrix(rng, SSM_DT_RANK, N_EMBD),
        f"{b}.ssm_alpha.weight": random_matrix(rng, SSM_DT_RANK, N_EMBD),
        f"{b}.ssm_norm.weight": np.ones(SSM_D_STATE, dtype=np.float32),
        f"{b}.ssm_out.weight": _out(rng, N_EMBD, value_dim),
    }


def _attention(rng: np.random.Generator, b: str) -> dict[str, np.ndarray]:
    """Full attention with the gated query (``attn_q`` gives query and gate, ``HEAD_DIM`` each per head)."""
    return {
        f"{b}.attn_q.weight": random_matrix(rng, 2 * N_HEAD * HEAD_DIM, N_EMBD),
        f"{b}.attn_k.weight": random_matrix(rng, N_HEAD_KV * HEAD_DIM, N_EMBD),
        f"{b}.attn_v.weight": random_matrix(rng, N_HEAD_KV * HEAD_DIM, N_EMBD),
        f"{b}.attn_output.weight": _out(rng, N_EMBD, N_HEAD * HEAD_DIM),
        f"{b}.attn_q_norm.weight": np.ones(HEAD_DIM, dtype=np.float32),
        f"{b}.attn_k_norm.weight": np.ones(HEAD_DIM, dtype=np.float32),
    }


def _moe(rng: np.random.Generator, b: str) -> dict[str, np.ndarray]:
    """Routed experts (numpy ``(E, rows, cols)`` = ggml ``{cols, rows, E}``) and the gated shared expert."""

    def experts(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return np.stack([random_matrix(rng, rows, cols, scale) for _ in range(N_EXPERT)])

    return {
        f"{b}.ffn_gate_inp.weight": random_matrix(rng, N_EXPERT, N_EMBD),
        f"{b}.ffn_gate_exps.weight": experts(N_FF_EXP, N_EMBD),
        f"{b}.ffn_up_exps.weight": experts(N_FF_EXP, N_EMBD),
        f"{b}.ffn_down_exps.weight": experts(N_EMBD, N_FF_EXP, RESIDUAL_SCALE),
        f"{b}.ffn_gate_inp_shexp.weight": random_matrix(rng, 1, N_EMBD)[0],  # ggml {n_embd}: one gate value per token
        f"{b}.ffn_gate_shexp.weight": random_matrix(rng, N_FF_SHEXP, N_EMBD),
        f"{b}.ffn_up_shexp.weight": random_matrix(rng, N_FF_SHEXP, N_EMBD),
        f"{b}.ffn_down_shexp.weight": _out(rng, N_EMBD, N_FF_SHEXP),
    }


def _nextn(rng: np.random.Generator, b: str) -> dict[str, np.ndarray]:
    """The MTP block's front: ``eh_proj`` maps ``concat(enorm(embed(x_{p+1})), hnorm(h_p))`` (2 × n_embd)
    to n_embd; here the token half passes through and the hidden half adds a small random term."""
    eh = np.concatenate([np.eye(N_EMBD, dtype=np.float32), random_matrix(rng, N_EMBD, N_EMBD, RESIDUAL_SCALE)], axis=1)
    return {
        f"{b}.nextn.eh_proj.weight": eh,  # ggml {2 n_embd, n_embd}
        f"{b}.nextn.enorm.weight": np.ones(N_EMBD, dtype=np.float32),
        f"{b}.nextn.hnorm.weight": np.ones(N_EMBD, dtype=np.float32),
        f"{b}.nextn.shared_head_norm.weight": np.ones(N_EMBD, dtype=np.float32),
    }


def ensure_test_mtp(source: Path) -> Path:
    """The ``tiny-mtp`` model with ``source``'s tokenizer (the SmolLM2 GGUF) in the cache directory, made on
    first use."""
    dst = default_path()
    if not dst.is_file():
        make_test_mtp(source, dst)
    return dst
