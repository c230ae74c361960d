"""Embeddings on the engine thread: one input's tokens in, its vector (or one vector per token) out.

A node started with ``--embedding`` creates its context with
``llama_context_params.embeddings`` on and the pooling of ``--pooling``
(default: the model's; llama.cpp falls back to ``none`` for a model without
one).  Each input is decoded in its own ``llama_batch`` on its own sequence,
every token marked as an output, as llama-server's ``send_embedding``
(``tools/server/server-context.cpp``) does: a pooled context yields one vector
per sequence (``llama_get_embeddings_seq``), pooling ``none`` one vector per
token (``llama_get_embeddings_ith``).  The sequence's KV cells are dropped
before and after, so an input never sees another's tokens.

Pooled vectors are normalized as llama.cpp's ``common_embd_normalize``
(``common/common.cpp``), selected by ``--embd-normalize`` or a request's
``embd_normalize``: -1 none, 0 max-abs scaled to the int16 range, 1 taxicab,
2 Euclidean (L2, the default), p > 2 the p-norm.  Per-token vectors
(pooling ``none``) are returned as they are, as llama-server returns them.

Everything but :func:`normalize` and the constants runs on the engine thread.
"""

from __future__ import annotations

import array
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import llama_cpp

from ...errors import EngineFailure, InvalidRequest
from ..stats import EngineStats
from .model import LoadedModel

POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
"""``--pooling`` names -> ``enum llama_pooling_type`` (``LLAMA_POOLING_TYPE_*``)."""
DEFAULT_NORMALIZE = 2
"""llama-server's ``--embd-normalize`` default: Euclidean (L2)."""


def normalize(vec: Sequence[float], mode: int) -> list[float]:
    """``vec`` scaled as llama.cpp's ``common_embd_normalize(inp, out, n, mode)``, rounded to float32.

    ``mode``: -1 none; 0 max absolute value mapped to 32760 (the int16 range);
    2 Euclidean; any other value p (1 = taxicab) the p-norm ``(sum |x|^p)^(1/p)``.
    A zero vector stays zero.  Sums in double precision, as llama.cpp does.
    """
    if mode == -1:
        total = 1.0
    elif mode == 0:
        total = max((abs(x) for x in vec), default=0.0) / 32760.0
    elif mode == 2:
        total = math.sqrt(math.fsum(x * x for x in vec))
    else:
        try:
            total = math.fsum(abs(x) ** mode for x in vec) ** (1.0 / mode)
        except OverflowError:  # llama.cpp's double sum becomes inf, and so the scale 0
            total = math.inf
    scale = 1.0 / total if 0.0 < total < math.inf else 0.0
    return as_float32([x * scale for x in vec])


def as_float32(values: Sequence[float]) -> list[float]:
    """Each value rounded to the nearest float32 (what llama.cpp's vectors hold and base64 carries)."""
    return array.array("f", values).tolist()


def float32_bytes(values: Sequence[float]) -> bytes:
    """``values`` as little-endian float32 bytes (OpenAI's ``encoding_format: base64`` payload)."""
    arr = array.array("f", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


@attrs.frozen
class EmbeddingJob:
    """One input for the engine.

    Attributes:
        tokens: the input, in tokens (at least one; the caller tokenized it, BOS
            added as llama-server adds it).
        normalize: the normalization of a pooled vector (see :func:`normalize`).
    """

    tokens: tuple[int, ...]
    normalize: int = DEFAULT_NORMALIZE


@attrs.frozen
class Embedding:
    """What one input gives: ``vectors`` holds one pooled vector, or one per token for pooling ``none``.

    ``n_tokens`` is the input's length in tokens (``usage.prompt_tokens``), ``ms`` the decode time.
    """

    vectors: tuple[tuple[float, ...], ...]
    n_tokens: int
    ms: float = 0.0


def n_embd_out(m: LoadedModel) -> int:
    """The width of the model's embeddings (``llama_model_n_embd_out``; 576 for SmolLM2-135M)."""
    return int(llama_cpp.llama_model_n_embd_out(m.model))


def pooling_type(m: LoadedModel) -> int:
    """The context's pooling (``llama_pooling_type``), the model's default already resolved."""
    return int(llama_cpp.llama_pooling_type(m.ctx))


def max_input_tokens(m: LoadedModel) -> tuple[int, str]:
    """The longest input this context embeds, and what limits it.

    Pooling ``last`` (and ``rank`` on a causal model) reads the final token, so a
    long input may be decoded in several batches and the slot's context is the
    limit; any other pooling sees one micro-batch only (llama.cpp pools each
    micro-batch on its own), so the limit is also ``n_ubatch`` (llama-server's
    ``can_split``).
    """
    n_ctx = m.n_ctx_slot
    pooling = pooling_type(m)
    splittable = m.memory is not None and (
        pooling == llama_cpp.LLAMA_POOLING_TYPE_LAST
        or (pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK and bool(llama_cpp.llama_get_causal_attn(m.ctx)))
    )
    if splittable:
        return n_ctx, "the slot's context, --ctx-size / --parallel"
    n_ubatch = int(llama_cpp.llama_n_ubatch(m.ctx))
    if n_ubatch < n_ctx:
        return n_ubatch, "the physical batch size, --ubatch-size: this pooling needs the whole input in one batch"
    return n_ctx, "the slot's context, --ctx-size / --parallel"


def check_input(m: LoadedModel, n_tokens: int, field: str) -> None:
    """Raise InvalidRequest (naming ``field``) for an empty input or one longer than :func:`max_input_tokens`."""
    if n_tokens == 0:
        raise InvalidRequest(f"{field}: the input is empty (no tokens to embed)")
    limit, why = max_input_tokens(m)
    if n_tokens > limit:
        raise InvalidRequest(f"{field}: the input has {n_tokens} tokens; at most {limit} fit ({why})")


def embed(m: LoadedModel, job: EmbeddingJob, seq: int, decode: Callable[[Any], int]) -> Embedding:
    """Engine thread: decode ``job.tokens`` on sequence ``seq`` (which must hold nothing of value) and
    read the embedding.  The sequence is empty again afterwards.

    ``decode``: runs ``llama_decode`` of a batch on ``m`` (the engine's
    :meth:`ExpertModes.decode <hydra_trio.engine.experts.combined.ExpertModes.decode>`, which runs a COMBINED
    model's decodes on its peer's worker thread).

    Raises:
        InvalidRequest: the input is empty or too long (:func:`check_input`).
        EngineFailure: ``llama_decode`` failed, or llama.cpp gave no embedding.
    """
    n = len(job.tokens)
    check_input(m, n, "input")
    pooling = pooling_type(m)
    n_embd = n_embd_out(m)
    chunk = max(1, min(int(llama_cpp.llama_n_batch(m.ctx)), int(llama_cpp.llama_n_ubatch(m.ctx))))
    batch = llama_cpp.llama_batch_init(min(n, chunk), 0, 1)
    vectors: list[tuple[float, ...]] = []
    t0 = time.perf_counter()
    if m.memory:
        llama_cpp.llama_memory_seq_rm(m.memory, seq, -1, -1)
    try:
        for start in range(0, n, chunk):
            part = job.tokens[start : start + chunk]
            for i, token in enumerate(part):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1  # every token is an output (llama-server's need_embd)
            batch.n_tokens = len(part)
            rc = decode(batch)
            if rc != 0:
                raise EngineFailure(f"llama_decode failed (code {rc}) while embedding {n} tokens")
            if pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
                for i in range(len(part)):
                    ptr = llama_cpp.llama_get_embeddings_ith(m.ctx, i)
                    if not ptr:
                        raise EngineFailure(f"llama.cpp gave no embedding for token {start + i}")
                    vectors.append(tuple(as_float32(ptr[:n_embd])))
        if pooling != llama_cpp.LLAMA_POOLING_TYPE_NONE:
            ptr = llama_cpp.llama_get_embeddings_seq(m.ctx, seq)
            if not ptr:
                raise EngineFailure("llama.cpp gave no pooled embedding for the input")
            width = (
                int(llama_cpp.llama_model_n_cls_out(m.model))
                if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK
                else n_embd
            )
            vectors.append(tuple(normalize(ptr[:width], job.normalize)))
    finally:
        llama_cpp.llama_batch_free(batch)
        if m.memory:
            llama_cpp.llama_memory_seq_rm(m.memory, seq, -1, -1)
    return Embedding(tuple(vectors), n, (time.perf_counter() - t0) * 1e3)


def embed_counted(m: LoadedModel, stats: EngineStats, job: EmbeddingJob, decode: Callable[[Any], int]) -> Embedding:
    """Engine thread: :func:`embed` on sequence 0 (with ``decode``), counted in the engine's prompt metrics
    (``stats``: ``EngineStats``).  Inputs go one at a time and no slot of an embedding node holds tokens,
    so sequence 0 is always free."""
    out = embed(m, job, seq=0, decode=decode)
    stats.prompt_tokens_total += out.n_tokens
    stats.prompt_seconds_total += out.ms / 1e3
    return out
