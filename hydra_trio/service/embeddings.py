"""The embeddings use case: answer one body (OpenAI's ``POST /v1/embeddings``, llama-server's
``POST /embedding(s)``) on the engine, input by input; the shapes are :mod:`hydra_trio.openai.embeddings`'s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..engine import NO_EMBEDDINGS, POOLING, Embed, EmbeddingJob, EmbeddingLimits, Engine
from ..errors import NotSupported
from ..openai.embeddings import (
    OAI_NONE_POOLING,
    EmbeddingsRequest,
    check_input_count,
    native_body,
    openai_body,
    tokenize_inputs,
)
from ..validation.strict import MessageError


def check_offered(e: Engine) -> None:
    """Raise NotSupported (HTTP 501, as llama-server) unless the node serves embeddings (``--embedding``)."""
    if not e.config.embeddings:
        raise NotSupported(NO_EMBEDDINGS)


async def embed_request(
    e: Engine,
    body: EmbeddingsRequest,
    *,
    oai: bool,
    prepare: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Answer one embeddings body: the OpenAI list (``oai``: ``/v1/embeddings`` with ``input``) or the native list.

    At most ``--max-embedding-inputs`` inputs (``EngineConfig.max_embedding_inputs``), counted before any is
    tokenized.  Each input is one engine call (:func:`~hydra_trio.engine.llama.embedding.embed_counted`), in order;
    every input is tokenized and checked first, so a bad one costs no decoding.  ``prepare(fn)`` runs the
    tokenizing off the event loop (the HTTP app's runs it in a worker thread that stops with the request;
    default: a trio worker thread).  Cancelled, it embeds no further input.  While it works it counts in
    ``Engine.live.embeddings`` (``/slots``, ``/metrics``: the inputs decode on slot 0's sequence).

    Raises:
        MessageError: the body or an input is invalid, too many inputs (400), or ``oai`` on a node with
            pooling ``none``.
        NotSupported: the node does not serve embeddings (no ``--embedding``).
        NotReady, EngineFailure: from the engine.
    """
    check_offered(e)
    max_inputs = e.config.max_embedding_inputs
    check_input_count(body, max_inputs)  # before anything is tokenized or queued
    e.live.embeddings += 1
    try:
        return await _embed(e, body, oai, prepare or trio.to_thread.run_sync, max_inputs)
    finally:
        e.live.embeddings -= 1


async def _embed(
    e: Engine,
    body: EmbeddingsRequest,
    oai: bool,
    prepare: Callable[[Callable[[], Any]], Awaitable[Any]],
    max_inputs: int,
) -> dict[str, Any] | list[dict[str, Any]]:
    pooling, limit, why = await e.run_task(EmbeddingLimits())
    oai = oai and body.input is not None  # llama-server: "content" is its own field, answered in its own shape
    if oai and pooling == POOLING["none"]:
        raise MessageError(OAI_NONE_POOLING)
    m = e.model_view
    assert m is not None and e.identity is not None
    # tokenizing reads only the vocabulary: off the event loop and the engine thread (bridge.py)
    inputs = await prepare(lambda: tokenize_inputs(m, body, limit, why, max_inputs))
    normalize = e.config.embd_normalize if body.embd_normalize is None else body.embd_normalize
    results = []
    for _, tokens in inputs:  # one engine call each: other requests' inputs may run in between
        job = EmbeddingJob(tuple(tokens), normalize)
        results.append(await e.run_task(Embed(job)))
    if oai:
        return openai_body(results, body.model or e.identity.model_alias, base64_floats=body.base64)
    return native_body(results)
