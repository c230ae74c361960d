"""A tiny vision-language test model, ``tiny-vision``: a ``qwen2vl`` language model and its projector, via ``gguf``.

No package ships a vision model small enough for tests, so one is generated,
of the Qwen-VL family the cluster serves, as two GGUF files (the layout
llama.cpp's ``convert_hf_to_gguf.py`` writes for Qwen2-VL):

- the language model, ``general.architecture`` ``qwen2vl`` (llama.cpp's
  ``src/models/qwen2vl.cpp``): a Qwen2 decoder with M-RoPE
  (``rope.dimension_sections``), so each token has four position components;
  text tokens use the same value in all four, an image's embeddings their
  temporal, row and column positions;
- the multimodal projector (``mmproj``), ``general.architecture`` ``clip``
  with ``clip.projector_type`` ``qwen2vl_merger`` (the vendored llama.cpp's
  ``tools/mtmd/models/qwen2vl.cpp``): 14-pixel patches (a two-frame
  ``patch_embd`` pair), a ViT with 2D M-RoPE, and the merger that folds each
  2 × 2 block of patches into one embedding of the language model's width.

``mtmd`` frames each image with the text ``<|vision_start|>`` ...
``<|vision_end|>`` (``tools/mtmd/mtmd.cpp``), tokenized with special tokens
parsed; the language model's vocabulary is SmolLM2's (tokenizer and chat
template copied as :mod:`hydra_trio.models.hybrid` copies them) plus these two
control tokens, so each is one token as in Qwen2-VL's own vocabulary.

An image of W × H pixels is resized (keeping its aspect ratio) to multiples
of 28 pixels with at least 8 and at most 4096 merged cells (llama.cpp's
Qwen-VL limits, ``--image-min-tokens`` / ``--image-max-tokens`` change them),
and gives ``(W/28) · (H/28)`` embeddings: 112 × 84 pixels → 12 image tokens.

The weights are random with a fixed seed.  The output matrix is separate from
the token embedding and scaled so that logits lie far apart (greedy choices
do not flip on rounding differences between CPUs or batch splits); the
attention layers write to the residual stream at full scale, so what the
last token attends to (the image's embeddings among it) changes the greedy
continuation: a different image gives a different text.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .files import atomic_path, copy_field
from .hybrid import random_matrix, source_tokenizer

log = logging.getLogger("hydra_trio.models.tiny_vision")

ARCH = "qwen2vl"
PROJECTOR_TYPE = "qwen2vl_merger"
IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>")
"""The text mtmd puts before and after an image's embeddings for this projector type: control tokens appended to
the vocabulary."""

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
ROPE_SECTIONS = [2, 3, 3, 0]
"""M-RoPE sections (temporal, height, width, unused) in rotary pairs, summing to ``HEAD_DIM / 2`` as Qwen2-VL's."""
N_FF = 128
N_LAYER = 2

V_EMBD = 32
V_HEAD = 2
V_FF = 64
"""Must differ from :data:`V_EMBD`: clip takes an ``ffn_down`` whose input width is the model's for a legacy
export and swaps up and down."""
V_LAYER = 2
PATCH_SIZE = 14
MERGE = 2
"""Patches per side folded into one image token (``clip.vision.spatial_merge_size``)."""
IMAGE_SIZE = PATCH_SIZE * MERGE * 2
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
"""OpenAI CLIP's normalization, which Qwen2-VL's preprocessor uses."""
SEED = 41


def default_paths() -> tuple[Path, Path]:
    """``(language model, projector)`` where :func:`ensure_tiny_vision` keeps the pair
    (``$XDG_CACHE_HOME/hydra-trio/models``, side by side)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"
    name = f"tiny-{ARCH}-{N_LAYER}l-{N_EMBD}"
    return cache / f"{name}.gguf", cache / f"mmproj-{name}.gguf"


def make_tiny_vision(src: Path, model: Path, mmproj: Path, seed: int = SEED) -> tuple[Path, Path]:
    """Write the tiny ``qwen2vl`` language model with ``src``'s tokenizer (any GGUF with ``tokenizer.*``
    metadata, a BPE vocabulary) plus :data:`IMAGE_TOKENS` to ``model``, and its ``qwen2vl_merger`` projector to
    ``mmproj``; returns ``(model, mmproj)``.

    About 21 MB and 0.3 MB (F16 token embedding, F32 elsewhere), written in about four seconds; each to a
    temporary file first and renamed, so a crash never leaves a half-written file.  Raises ValueError if
    ``src`` has no tokenizer.
    """
    rng = np.random.default_rng(seed)
    write_language_model(src, model, rng)
    _write_mmproj(mmproj, rng)
    log.info("wrote tiny vision model %s and projector %s (%s + %s)", model, mmproj, ARCH, PROJECTOR_TYPE)
    return model, mmproj


def write_language_model(
    src: Path,
    dst: Path,
    rng: np.random.Generator,
    arch: str = ARCH,
    extra_tokens: tuple[str, ...] = IMAGE_TOKENS,
    rope_sections: list[int] | None = ROPE_SECTIONS,
) -> None:
    """The tiny Qwen2-style decoder (``arch`` ``qwen2vl`` with M-RoPE ``rope_sections``, or ``qwen2`` with
    ``rope_sections`` None) with ``src``'s tokenizer plus ``extra_tokens`` as control tokens, written to ``dst``."""
    import gguf

    n_src, tok_fields = source_tokenizer(src)
    n_vocab = n_src + len(extra_tokens)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32).astype(np.float16),
        "output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        # logits = output · norm(h): rows of norm ~1 per element, so logits have a standard deviation of ~6
        "output.weight": random_matrix(rng, n_vocab, N_EMBD, 6.0),  # F32: greedy picks do not hang on F16 rounding
    }
    for il in range(N_LAYER):
        b = f"blk.{il}"
        tensors.update(
            {
                f"{b}.attn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
                f"{b}.attn_q.weight": random_matrix(rng, N_HEAD * HEAD_DIM, N_EMBD),
                f"{b}.attn_q.bias": random_matrix(rng, 1, N_HEAD * HEAD_DIM, 0.1)[0],
                f"{b}.attn_k.weight": random_matrix(rng, N_HEAD_KV * HEAD_DIM, N_EMBD),
                f"{b}.attn_k.bias": random_matrix(rng, 1, N_HEAD_KV * HEAD_DIM, 0.1)[0],
                f"{b}.attn_v.weight": random_matrix(rng, N_HEAD_KV * HEAD_DIM, N_EMBD),
                f"{b}.attn_v.bias": random_matrix(rng, 1, N_HEAD_KV * HEAD_DIM, 0.1)[0],
                f"{b}.attn_output.weight": random_matrix(rng, N_EMBD, N_HEAD * HEAD_DIM, 2.0),
                f"{b}.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
                f"{b}.ffn_gate.weight": random_matrix(rng, N_FF, N_EMBD),
                f"{b}.ffn_up.weight": random_matrix(rng, N_FF, N_EMBD),
                f"{b}.ffn_down.weight": random_matrix(rng, N_EMBD, N_FF, 0.5),
            }
        )
    with atomic_path(dst) as tmp, contextlib.closing(gguf.GGUFWriter(str(tmp), arch)) as w:
        w.add_string("general.name", f"tiny {arch} (random weights, test)")
        w.add_context_length(8192)
        w.add_embedding_length(N_EMBD)
        w.add_feed_forward_length(N_FF)
        w.add_block_count(N_LAYER)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD_KV)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        if rope_sections is not None:
            w.add_rope_dimension_sections(rope_sections)
        for field in tok_fields:
            if field.name == "tokenizer.ggml.tokens":
                w.add_token_list([*field.contents(), *extra_tokens])
            elif field.name == "tokenizer.ggml.token_type":
                w.add_token_types([*field.contents(), *[gguf.TokenType.CONTROL] * len(extra_tokens)])
            elif field.name == "tokenizer.ggml.scores":
                w.add_token_scores([*field.contents(), *[0.0] * len(extra_tokens)])
            else:
                copy_field(w, field)
        for name, data in tensors.items():
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


def vec(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return (rng.standard_normal(n, dtype=np.float32) * scale).astype(np.float32)


def _write_mmproj(dst: Path, rng: np.random.Generator) -> None:
    """The ``qwen2vl_merger`` projector: tensor names and shapes as ``tools/mtmd/clip.cpp`` loads them
    (numpy ``(rows, cols)`` = ggml ``{cols, rows}``)."""
    import gguf

    patch_in = 3 * PATCH_SIZE * PATCH_SIZE
    merged = V_EMBD * MERGE * MERGE

    def conv() -> np.ndarray:  # ggml {kw, kh, c_in, c_out}
        return random_matrix(rng, V_EMBD, patch_in).reshape(V_EMBD, 3, PATCH_SIZE, PATCH_SIZE)

    tensors: dict[str, np.ndarray] = {
        # the two temporal halves of Qwen2-VL's 3D patch convolution; a still image goes through both
        "v.patch_embd.weight": conv(),
        "v.patch_embd.weight.1": conv(),
    }
    for il in range(V_LAYER):
        b = f"v.blk.{il}"
        for norm in ("ln1", "ln2"):
            tensors[f"{b}.{norm}.weight"] = np.ones(V_EMBD, dtype=np.float32)
            tensors[f"{b}.{norm}.bias"] = np.zeros(V_EMBD, dtype=np.float32)
        for proj in ("attn_q", "attn_k", "attn_v"):
            tensors[f"{b}.{proj}.weight"] = random_matrix(rng, V_EMBD, V_EMBD)
            tensors[f"{b}.{proj}.bias"] = vec(rng, V_EMBD, 0.1)
        tensors[f"{b}.attn_out.weight"] = random_matrix(rng, V_EMBD, V_EMBD)
        tensors[f"{b}.attn_out.bias"] = vec(rng, V_EMBD, 0.1)
        tensors[f"{b}.ffn_up.weight"] = random_matrix(rng, V_FF, V_EMBD)
        tensors[f"{b}.ffn_up.bias"] = vec(rng, V_FF, 0.1)
        tensors[f"{b}.ffn_down.weight"] = random_matrix(rng, V_EMBD, V_FF)
        tensors[f"{b}.ffn_down.bias"] = vec(rng, V_EMBD, 0.1)
    tensors.update(
        {
            # the merger: LayerNorm (Qwen2-VL's ln_q), then an MLP from 2 × 2 patches to the language model's width
            "v.post_ln.weight": np.ones(V_EMBD, dtype=np.float32),
            "v.post_ln.bias": np.zeros(V_EMBD, dtype=np.float32),
            "mm.0.weight": random_matrix(rng, merged, merged, 2.0),
            "mm.0.bias": vec(rng, merged, 0.1),
            "mm.2.weight": random_matrix(rng, N_EMBD, merged, 2.0),  # embeddings of about a token embedding's size
            "mm.2.bias": vec(rng, N_EMBD, 0.1),
        }
    )
    with atomic_path(dst) as tmp, contextlib.closing(gguf.GGUFWriter(str(tmp), "clip")) as w:
        w.add_string("general.name", f"tiny {PROJECTOR_TYPE} projector (random weights, test)")
        w.add_clip_has_vision_encoder(True)
        w.add_clip_projector_type(PROJECTOR_TYPE)
        w.add_vision_image_size(IMAGE_SIZE)
        w.add_vision_patch_size(PATCH_SIZE)
        w.add_vision_embedding_length(V_EMBD)
        w.add_vision_feed_forward_length(V_FF)
        w.add_vision_block_count(V_LAYER)
        w.add_vision_head_count(V_HEAD)
        w.add_vision_attention_layernorm_eps(1e-6)
        w.add_vision_projection_dim(N_EMBD)
        w.add_vision_spatial_merge_size(MERGE)
        w.add_vision_image_mean(IMAGE_MEAN)
        w.add_vision_image_std(IMAGE_STD)
        for name, data in tensors.items():
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


def ensure_tiny_vision(source: Path) -> tuple[Path, Path]:
    """The ``tiny-vision`` pair ``(language model, projector)`` with ``source``'s tokenizer (the SmolLM2 GGUF)
    in the cache directory, made on first use."""
    model, mmproj = default_paths()
    if not (model.is_file() and mmproj.is_file()):
        make_tiny_vision(source, model, mmproj)
    return model, mmproj


def png_image(seed: int, width: int = 112, height: int = 84) -> bytes:
    """A PNG file (8-bit RGB, no interlace) of ``width`` × ``height`` random pixels from ``seed``: an input
    image for the tiny model.  112 × 84 gives 12 image tokens."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter type 0 (None) before each row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # depth 8, color type 2 (RGB)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
