"""What a model takes in memory once a node serves it, read from its GGUF header without loading it: its
weights (the bytes of its files, mapped from them) and its KV cache at a context size, by the formula the
node's own memory check uses (``LoadedModel.kv_bytes_per_token`` in ``hydra_trio/engine/llama/model.py``).
Router mode sums them over the models ``--models-max`` lets run at once (docs/router.md, "Memory").
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs

from ..engine.llama.ggml_backend import GgufHeader, type_traits
from ..engine.settings import KV_CACHE_TYPES


@attrs.frozen
class Footprint:
    """One model's memory in bytes.

    Attributes:
        weights: its files' sizes (the model, and a projector or draft it loads): resident once used, but mapped
            from the files, so the OS can page them back in.
        kv: its KV cache at ``n_ctx`` tokens: allocated, the part the node's memory check refuses to overcommit.
        kv_per_token: bytes of KV cache one token takes over all layers.
        n_ctx: the context the KV cache is sized for.
    """

    weights: int
    kv: int
    kv_per_token: int
    n_ctx: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def kv_bytes_per_token(header: GgufHeader, cache_type_k: str = "f16", cache_type_v: str = "f16") -> int:
    """Bytes of KV cache a token takes, as the node computes it: ``n_layer × (row(type_k, n_head_kv × key_length)
    + row(type_v, n_head_kv × value_length))`` with ``row(t, n) = ceil(n / blck_size(t)) × type_size(t)``, the
    head sizes from ``{arch}.attention.key_length`` / ``value_length``, else ``n_embd / n_head``; a per-layer
    ``head_count_kv`` counts its first layer's, as ``llama_model_n_head_kv``.

    Raises:
        KeyError: a cache type that is none of llama-server's (``-ctk`` / ``-ctv``).
    """
    from ..protocol.ggml_rpc import GGML_TYPE_COUNT

    traits = type_traits(GGML_TYPE_COUNT)  # this ggml's own sizes (not gguf's table: it imports numpy)

    def number(key: str, default: int) -> int:
        value = header.numbers.get(f"{header.arch}.{key}", default)
        return (value[0] if value else default) if isinstance(value, tuple) else value

    n_head = max(1, number("attention.head_count", 1))
    head = number("embedding_length", 0) // n_head
    k, v = number("attention.key_length", head), number("attention.value_length", head)
    n_head_kv = number("attention.head_count_kv", n_head)

    def row(type_name: str, n: int) -> int:
        blck, size = traits[KV_CACHE_TYPES[type_name]]
        return -(-n // blck) * size

    return (header.block_count or 0) * (row(cache_type_k, n_head_kv * k) + row(cache_type_v, n_head_kv * v))


def model_footprint(
    path: Path,
    n_ctx: int,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    other_files: Iterable[Path] = (),
) -> Footprint:
    """The :class:`Footprint` of the model at ``path`` with a ``n_ctx``-token KV cache (0: its training context,
    ``{arch}.context_length``, as ``-c 0``); ``other_files`` (a projector, a draft model) count as weights.

    Raises:
        OSError: a file that cannot be read, or no GGUF.
        KeyError: an unknown cache type.
    """
    header = GgufHeader(path)
    per_token = kv_bytes_per_token(header, cache_type_k, cache_type_v)
    if n_ctx == 0:
        trained = header.numbers.get(f"{header.arch}.context_length", 0)
        n_ctx = trained if isinstance(trained, int) else 0
    weights = path.stat().st_size + sum(Path(p).stat().st_size for p in other_files)
    return Footprint(weights=weights, kv=n_ctx * per_token, kv_per_token=per_token, n_ctx=n_ctx)
