"""A tiny audio-language test model, ``tiny-audio``: a ``qwen2`` language model and a Qwen2-Audio projector.

No package ships an audio model small enough for tests, so one is generated as two GGUF files (the layout
llama.cpp's ``convert_hf_to_gguf.py`` writes for Qwen2-Audio):

- the language model, ``general.architecture`` ``qwen2``: the decoder of :mod:`hydra_trio.models.tiny_vision`
  without M-RoPE (an audio clip's embeddings take one position each, as text tokens do), SmolLM2's vocabulary plus
  the control tokens ``<|audio_bos|>`` and ``<|audio_eos|>``, the text ``mtmd`` puts before and after a clip's
  embeddings for this projector type (``tools/mtmd/mtmd.cpp``);
- the multimodal projector (``mmproj``), ``general.architecture`` ``clip`` with ``clip.has_audio_encoder`` and
  ``clip.projector_type`` ``qwen2a`` (the vendored llama.cpp's ``tools/mtmd/models/whisper-enc.cpp``): a Whisper
  encoder (two 1-D convolutions over the log-mel spectrogram, the second of stride 2, learned positions, a
  pre-norm transformer, average pooling by 2, a final LayerNorm) and one linear layer to the language model's
  width.  Its fewest tensors of the Whisper-based types: no frame stacking, a one-layer projection.

``mtmd`` decodes the clip (WAV, MP3 or FLAC, resampled to 16 kHz mono), computes a 128-bin log-mel spectrogram
(the filter bank is computed in code, ``tools/mtmd/mtmd-audio.cpp``: nothing of it is in the file) with 30 s of
silence after it, and cuts it into 30 s windows of 3000 frames, dropping the last, incomplete one: a clip of up to
30 s is one window, ``3000 / 2 / 2`` = :data:`CLIP_TOKENS` = 750 embeddings.

The weights are random with a fixed seed (as :mod:`hydra_trio.models.tiny_vision`'s).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import wave
from pathlib import Path

import numpy as np

from . import tiny_vision
from .files import atomic_path
from .hybrid import random_matrix
from .tiny_vision import vec

log = logging.getLogger("hydra_trio.models.tiny_audio")

ARCH = "qwen2"
PROJECTOR_TYPE = "qwen2a"
AUDIO_TOKENS = ("<|audio_bos|>", "<|audio_eos|>")
"""The text mtmd puts before and after a clip's embeddings for this projector type: control tokens appended to
the vocabulary."""

N_MEL = 128
"""Mel bins (``clip.audio.num_mel_bins``), Qwen2-Audio's."""
A_EMBD = 32
A_HEAD = 2
A_FF = 64
A_LAYER = 2
N_FRAMES = 3000
"""Mel frames of one 30 s window (a hop of 160 samples at 16 kHz); the encoder sees ``N_FRAMES / 2`` positions."""
CLIP_TOKENS = N_FRAMES // 2 // 2
"""Embeddings of a clip of up to 30 s: halved by the stride-2 convolution, then by the average pooling."""
SAMPLE_RATE = 16000
SEED = 43


def default_paths() -> tuple[Path, Path]:
    """``(language model, projector)`` where :func:`ensure_tiny_audio` keeps the pair
    (``$XDG_CACHE_HOME/hydra-trio/models``, side by side)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "models"
    name = f"tiny-{ARCH}-audio-{tiny_vision.N_LAYER}l-{tiny_vision.N_EMBD}"
    return cache / f"{name}.gguf", cache / f"mmproj-{name}.gguf"


def make_tiny_audio(src: Path, model: Path, mmproj: Path, seed: int = SEED) -> tuple[Path, Path]:
    """Write the tiny ``qwen2`` language model with ``src``'s tokenizer (any GGUF with ``tokenizer.*`` metadata,
    a BPE vocabulary) plus :data:`AUDIO_TOKENS` to ``model``, and its ``qwen2a`` projector to ``mmproj``; returns
    ``(model, mmproj)``.

    About 21 MB and 0.3 MB, each written to a temporary file first and renamed, so a crash never leaves a
    half-written file.  Raises ValueError if ``src`` has no tokenizer.
    """
    rng = np.random.default_rng(seed)
    tiny_vision.write_language_model(src, model, rng, ARCH, AUDIO_TOKENS, None)
    _write_mmproj(mmproj, rng)
    log.info("wrote tiny audio model %s and projector %s (%s + %s)", model, mmproj, ARCH, PROJECTOR_TYPE)
    return model, mmproj


def _write_mmproj(dst: Path, rng: np.random.Generator) -> None:
    """The ``qwen2a`` projector: tensor names and shapes as ``tools/mtmd/clip.cpp`` loads them (numpy
    ``(rows, cols)`` = ggml ``{cols, rows}``)."""
    import gguf

    n_pos = N_FRAMES // 2

    def conv(c_in: int) -> np.ndarray:  # ggml {kernel 3, c_in, c_out}; F16 as the converter writes convolutions
        return random_matrix(rng, A_EMBD, c_in * 3).reshape(A_EMBD, c_in, 3).astype(np.float16)

    tensors: dict[str, np.ndarray] = {
        "a.conv1d.1.weight": conv(N_MEL),
        "a.conv1d.1.bias": vec(rng, A_EMBD, 0.1).reshape(A_EMBD, 1),  # ggml {1, c_out}: added to each frame
        "a.conv1d.2.weight": conv(A_EMBD),
        "a.conv1d.2.bias": vec(rng, A_EMBD, 0.1).reshape(A_EMBD, 1),
        # small beside the convolutions' output, so that the sound and not the position makes each frame's state
        "a.position_embd.weight": random_matrix(rng, n_pos, A_EMBD, 0.1 * np.sqrt(A_EMBD)),
    }
    for il in range(A_LAYER):
        b = f"a.blk.{il}"
        for norm in ("ln1", "ln2"):
            tensors[f"{b}.{norm}.weight"] = np.ones(A_EMBD, dtype=np.float32)
            tensors[f"{b}.{norm}.bias"] = np.zeros(A_EMBD, dtype=np.float32)
        for proj in ("attn_q", "attn_k", "attn_v"):
            tensors[f"{b}.{proj}.weight"] = random_matrix(rng, A_EMBD, A_EMBD)
            if proj != "attn_k":  # Whisper's key projection has no bias
                tensors[f"{b}.{proj}.bias"] = vec(rng, A_EMBD, 0.1)
        tensors[f"{b}.attn_out.weight"] = random_matrix(rng, A_EMBD, A_EMBD)
        tensors[f"{b}.attn_out.bias"] = vec(rng, A_EMBD, 0.1)
        tensors[f"{b}.ffn_up.weight"] = random_matrix(rng, A_FF, A_EMBD)
        tensors[f"{b}.ffn_up.bias"] = vec(rng, A_FF, 0.1)
        tensors[f"{b}.ffn_down.weight"] = random_matrix(rng, A_EMBD, A_FF)
        tensors[f"{b}.ffn_down.bias"] = vec(rng, A_EMBD, 0.1)
    tensors.update(
        {
            "a.post_ln.weight": np.ones(A_EMBD, dtype=np.float32),
            "a.post_ln.bias": np.zeros(A_EMBD, dtype=np.float32),
            # embeddings larger than a token embedding (the LayerNorm before gives rows of norm ~1 per element), so
            # that the clip weighs in the last token's attention against the text
            "mm.a.fc.weight": random_matrix(rng, tiny_vision.N_EMBD, A_EMBD, 6.0),
            "mm.a.fc.bias": vec(rng, tiny_vision.N_EMBD, 0.1),
        }
    )
    with atomic_path(dst) as tmp, contextlib.closing(gguf.GGUFWriter(str(tmp), "clip")) as w:
        w.add_string("general.name", f"tiny {PROJECTOR_TYPE} projector (random weights, test)")
        w.add_bool("clip.has_audio_encoder", True)
        w.add_clip_projector_type(PROJECTOR_TYPE)
        w.add_uint32("clip.audio.num_mel_bins", N_MEL)
        w.add_uint32("clip.audio.embedding_length", A_EMBD)
        w.add_uint32("clip.audio.feed_forward_length", A_FF)
        w.add_uint32("clip.audio.block_count", A_LAYER)
        w.add_uint32("clip.audio.attention.head_count", A_HEAD)
        w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
        w.add_uint32("clip.audio.projection_dim", tiny_vision.N_EMBD)
        for name, data in tensors.items():
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


def ensure_tiny_audio(source: Path) -> tuple[Path, Path]:
    """The ``tiny-audio`` pair ``(language model, projector)`` with ``source``'s tokenizer (the SmolLM2 GGUF) in
    the cache directory, made on first use."""
    model, mmproj = default_paths()
    if not (model.is_file() and mmproj.is_file()):
        make_tiny_audio(source, model, mmproj)
    return model, mmproj


def wav_clip(seed: int, seconds: float = 1.0) -> bytes:
    """A WAV file (16 kHz mono PCM16) of ``seconds`` of a sine whose pitch ``seed`` picks (220 Hz to about 2 kHz)
    under white noise from ``seed``: an input clip for the tiny model (up to 30 s is :data:`CLIP_TOKENS`
    embeddings)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(SAMPLE_RATE * seconds)) / SAMPLE_RATE
    signal = 0.5 * np.sin(2 * np.pi * (220.0 + 97.0 * (seed % 20)) * t) + 0.1 * rng.standard_normal(t.size)
    pcm = (np.clip(signal, -1.0, 1.0) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()
