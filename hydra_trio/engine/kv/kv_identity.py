"""The KV identity of a loaded model: what llama.cpp's per-sequence KV state depends on.

Two GGUF files with the same KV identity can exchange a slot's KV cache
(a STATE_GET blob of one restores on the other), although their weights
differ: e.g. two quantizations of one model.  The file hash (``model_hash``)
still says whether they are the same file; whether a node accepts another
file's KV is its policy (``--allow-cross-model-kv``).

The identity is an ordered mapping of facts:

* the architecture and the attention's shapes: ``n_layer``, ``n_embd``,
  ``n_head_kv``, the key and value head sizes;
* the KV cache's types (ggml type ids of K and V);
* the positions' encoding: RoPE type, dimensions, base frequency, scaling and
  the training context (YaRN-style scaling depends on it);
* the tokenizer: vocabulary size and a SHA-256 over every token's text and
  attributes (the token ids in a blob must mean the same text).

:func:`identity_hash` is the SHA-256 of its canonical JSON; a blob carries
both the hash and the facts, so a refusal can name the first fact that
differs (:func:`first_difference`).
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import TYPE_CHECKING, Any

import llama_cpp

from ..llama.model import remember_digest, remembered_digest

if TYPE_CHECKING:
    from ..llama.model import LoadedModel


_known: weakref.WeakKeyDictionary[LoadedModel, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Each loaded model's KV identity, computed once (it hashes the whole vocabulary); gone with the model."""

_vocab_digests: dict[tuple[str, int, int], str] = {}
"""The vocabulary's SHA-256 by model file (path, modification time, size): a file loaded again (SWAP_QUANT back
and forth) is not hashed token by token again (about 0.1 s for 49,152 tokens)."""


def _file_key(m: LoadedModel) -> tuple[str, int, int] | None:
    try:
        st = os.stat(m.path)
    except (OSError, TypeError):
        return None
    return (os.path.realpath(m.path), st.st_mtime_ns, st.st_size)


def _vocab_sha256(m: LoadedModel) -> str:
    """The vocabulary's SHA-256 over each token's text and attributes; kept per file in memory and on disk
    (:func:`~hydra_trio.engine.llama.model.remember_digest`)."""
    key = _file_key(m)
    if key is not None and key in _vocab_digests:
        return _vocab_digests[key]
    if key is not None and (known := remembered_digest(m.path, "vocab-sha256")) is not None:
        _vocab_digests[key] = known
        return known
    vocab = hashlib.sha256()
    for t in range(m.n_vocab):
        vocab.update(llama_cpp.llama_vocab_get_text(m.vocab, t) or b"")
        vocab.update(b"\0%d\0" % llama_cpp.llama_vocab_get_attr(m.vocab, t))
    digest = vocab.hexdigest()
    if key is not None:
        _vocab_digests[key] = digest
        remember_digest(m.path, "vocab-sha256", digest)
    return digest


def kv_identity(m: LoadedModel) -> dict[str, Any]:
    """The KV identity of ``m`` (computed once per model): an ordered dict of JSON values."""
    cached = _known.get(m)
    if cached is not None:
        return cached
    arch = m.meta("general.architecture") or ""
    n_head = max(1, llama_cpp.llama_model_n_head(m.model))
    head = llama_cpp.llama_model_n_embd(m.model) // n_head

    def meta(key: str) -> str | None:
        return m.meta(f"{arch}.{key}")

    identity: dict[str, Any] = {
        "architecture": arch,
        "n_layer": llama_cpp.llama_model_n_layer(m.model),
        "n_embd": llama_cpp.llama_model_n_embd(m.model),
        "n_head_kv": llama_cpp.llama_model_n_head_kv(m.model),
        "n_embd_head_k": int(meta("attention.key_length") or head),
        "n_embd_head_v": int(meta("attention.value_length") or head),
        "type_k": m.type_k,
        "type_v": m.type_v,
        "rope_type": llama_cpp.llama_model_rope_type(m.model),
        "rope_dimension_count": meta("rope.dimension_count"),
        "rope_freq_base": meta("rope.freq_base"),
        "rope_freq_scale_train": round(float(llama_cpp.llama_model_rope_freq_scale_train(m.model)), 9),
        "rope_scaling_type": meta("rope.scaling.type"),
        "n_ctx_train": m.n_ctx_train,
        "n_vocab": m.n_vocab,
        "vocab_sha256": _vocab_sha256(m),
    }
    _known[m] = identity
    return identity


def canonical(identity: dict[str, Any]) -> bytes:
    """The identity as canonical JSON bytes (its order kept, no spaces)."""
    return json.dumps(identity, separators=(",", ":")).encode()


def identity_hash(identity: dict[str, Any]) -> str:
    """SHA-256 (hex) of :func:`canonical`."""
    return hashlib.sha256(canonical(identity)).hexdigest()


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """``"field: this node X, the blob Y"`` for the first fact that differs, or None when all agree."""
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        if ours.get(key) != theirs.get(key):
            return f"{key}: this node {ours.get(key)!r}, the blob {theirs.get(key)!r}"
    return None
