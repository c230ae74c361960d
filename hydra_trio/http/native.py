"""llama-server's native HTTP routes beyond the OpenAI API (the shapes live in :mod:`hydra_trio.openai.native`).

* ``POST /completion``, ``POST /completions``: llama-server's completion, whole or streamed.
* ``POST /apply-template``: ``{"messages": [...]}`` -> ``{"prompt": text}``, the chat template in effect.
* ``POST /props``: llama-server at this version sets no property through it and ignores the body:
  ``{"success": true}`` with ``--props``, else 501 (llama-server's message).
* ``GET /v1/health``: ``GET /health``.
* ``GET /slots/{id}/state``: the idle slot's KV state blob (``application/octet-stream``, the bytes
  Hydra ``STATE_GET`` sends; headers ``X-Slot-Id``, ``X-N-Past``, ``X-Model-Hash``);
  ``PUT /slots/{id}/state``: restore one, all or nothing (Hydra ``STATE_PUT``'s checks: checksum,
  model / KV identity, tokens that fit) -> ``{"restored": true, "id_slot", "bytes", "n_past",
  "model_hash_match", "kv_identity_match", ...identity}``.  A blob that cannot be applied is 400
  (with STATE_PUT's error keys), a slot that is processing 409, no such slot 404.
* ``/infill``, ``/rerank``, ``/reranking``, ``/v1/rerank``, ``/v1/reranking``, ``/lora-adapters``,
  ``/v1/responses``, ``/responses``, ``/v1/messages``, ``/v1/messages/count_tokens``: 501 naming the endpoint and why.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..service.jobs import chat_prompt, job_from_completion
from ..openai.native import NativeCompletion, generation_settings
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..protocol.strict import MessageError
from ..engine.requests import JobRun
from ..engine.blobbuf import TRANSFER_POOL, BlobBuffer
from ..engine.state import RunningChecksum, verify_checksum_off_engine
from ..engine.tasks import RestoreSlot, SaveSlot
from ..errors import HydraTrioError
from ._common import _BodyError, body_chunks, _sse, _unavailable, error_for, off_loop
from .errors import error_response

STATE_TYPE = "application/octet-stream"

NOT_IMPLEMENTED: dict[str, str] = {
    "/infill": "fill-in-the-middle completion is not implemented by this node (use /completion with the "
               "model's FIM tokens in the prompt)",
    "/rerank": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/reranking": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/v1/rerank": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/v1/reranking": "reranking needs a reranker model served with --pooling rank, which this node does not offer",
    "/lora-adapters": "this node loads no LoRA adapters (there is no --lora here)",
    "/v1/responses": "the OpenAI Responses API is not implemented by this node (use /v1/chat/completions)",
    "/responses": "the OpenAI Responses API is not implemented by this node (use /v1/chat/completions)",
    "/v1/messages": "the Anthropic Messages API is not implemented by this node (use /v1/chat/completions)",
    "/v1/messages/count_tokens": "the Anthropic Messages API is not implemented by this node (use /tokenize)",
}
"""llama-server endpoints this node answers 501 (``not_supported_error``), and why."""


class NativeRoutes:
    """The handlers, bound to the app's :class:`~hydra_trio.http.app.Api` (engine, settings, body reader)."""

    def __init__(self, api: Any) -> None:  # an app.Api (not imported: app imports this module)
        self.api = api

    # ------------------------------------------------------------- /completion
    async def completion(self, request: Request) -> Response:
        api, e = self.api, self.api.engine
        if e is None:
            return error_response(501, "this node has no model (compute-only)", "not_supported_error")
        if not e.ready:
            return _unavailable(e)
        request_id = "cmpl-" + uuid.uuid4().hex
        request.state.trace_id = request_id
        try:
            body = await api._read(request, CompletionRequest)
            if body.echo:
                raise MessageError("echo: an OpenAI field; /completion always returns the prompt in 'prompt'")
            # tokenizing reads only the vocabulary: a worker thread that stops with the request (bridge.py)
            job = await off_loop(request, lambda: job_from_completion(e, body))
            n_probs = body.top_logprobs_n  # n_probs, else its alias logprobs (llama-server's order)
            job = attrs.evolve(job, request_id=request_id, logprobs=n_probs > 0, n_probs=n_probs)
            run = JobRun(e, job).submit()
        except _BodyError as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", headers={"Connection": "close"})
        except HydraTrioError as exc:
            return error_for(exc)
        m = e.model
        assert m is not None and e.identity is not None
        prompt_text = b"".join(m.token_bytes(t, special=True) for t in job.prompt_tokens).decode("utf-8", "replace")
        reply = NativeCompletion(
            model=e.identity.model_alias, return_tokens=body.return_tokens, n_probs=n_probs,
            response_fields=body.response_fields, timings_per_token=body.timings_per_token, piece=m.token_bytes,
            prompt_text=prompt_text, settings=generation_settings(body, job, body.stream),
        )
        if body.stream:
            return StreamingResponse(self._stream(run, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:  # a client that disconnects cancels the handler at once (.inflight)
            async for _ in self._events(run, reply):
                pass
        except HydraTrioError as exc:
            return error_for(exc)
        finally:
            run.close()
        assert run.finished is not None
        return JSONResponse(reply.final(run.finished, stream=False))

    @staticmethod
    async def _events(run: JobRun, reply: NativeCompletion) -> AsyncIterator[dict[str, Any]]:
        """Read the engine's deltas into ``reply``; yields each stream event."""
        async for delta in run:
            if run.assigned is not None and reply.id_slot < 0:
                reply.assigned(run.assigned)
            chunk = reply.add(delta)
            if chunk is not None:
                yield chunk

    async def _stream(self, run: JobRun, reply: NativeCompletion) -> AsyncIterator[str]:
        try:
            async for chunk in self._events(run, reply):
                yield _sse(chunk)
            assert run.finished is not None
            yield _sse(reply.final(run.finished, stream=True))
        except HydraTrioError as exc:  # the 200 is out: the error goes in the stream, as llama-server's
            yield _sse(json.loads(error_for(exc).body))
        finally:
            run.close()

    # -------------------------------------------------------- other native routes
    async def apply_template(self, request: Request) -> Response:
        """``{"messages": [...]}`` -> ``{"prompt": the chat rendered by the template in effect}``, as the
        chat endpoint would render it (generation prompt included)."""
        e, body = await self.api._simple_body(request, ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        try:  # templating: a worker thread that stops with the request
            prompt, _ = await off_loop(request, lambda: chat_prompt(e, body))
        except HydraTrioError as exc:  # the template failed (ChatTemplateError: 400) or rejected a field
            return error_for(exc)
        return JSONResponse({"prompt": prompt})

    async def post_props(self, request: Request) -> Response:
        """As llama-server's ``post_props`` (``tools/server/server-context.cpp`` of the llama.cpp that
        llama-cpp-python 0.3.36 vendors): it changes no property and does not look at the body, so any body
        gets ``{"success": true}`` with ``--props`` and 501 without; 503 while the model loads (llama-server's
        middleware), 501 on a compute-only node.  The body is read (413 over the body limit, 408 when the
        client stalls), so the connection stays open for the next request, as llama-server's."""
        api, e = self.api, self.api.engine
        try:
            await api._read_bytes(request, api.settings.max_body)
        except _BodyError as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", headers={"Connection": "close"})
        if e is None:
            return error_response(501, "this node has no model (compute-only)", "not_supported_error")
        if not e.ready:
            return _unavailable(e)
        if not api.settings.endpoint_props:
            return error_response(501, "This server does not support changing global properties. "
                                  "Start it with `--props`", "not_supported_error")
        return JSONResponse({"success": True})

    async def not_implemented(self, request: Request) -> Response:
        path = request.url.path
        return error_response(501, f"{request.method} {path}: {NOT_IMPLEMENTED[path]}", "not_supported_error")

    # --------------------------------------------------------------- slot state
    async def get_state(self, request: Request) -> Response:
        """The blob is saved into a buffer of the transfer pool (:func:`~hydra_trio.engine.state.save_slot`)
        and streamed from it in :data:`STATE_CHUNK` slices (the server copies each as it frames it), with
        its ``Content-Length``; the buffer goes back to the pool when the body is sent or the client left."""
        e = self.api.engine
        id_slot = self.api._slot_id(request)
        if isinstance(id_slot, Response):
            return id_slot
        assert e is not None and e.identity is not None
        try:
            n_past, blob = await e.run_task(SaveSlot(id_slot, pool=TRANSFER_POOL))
        except HydraTrioError as exc:
            return error_for(exc)
        return StreamingResponse(_slices(blob), media_type=STATE_TYPE, headers={
            "Content-Length": str(len(blob)), "X-Slot-Id": str(id_slot), "X-N-Past": str(n_past),
            "X-Model-Hash": e.identity.model_hash})

    async def put_state(self, request: Request) -> Response:
        """The body goes into one buffer (:meth:`_read_blob`, hashed as it arrives), is checked off the engine
        thread (:func:`~hydra_trio.engine.state.verify_checksum_off_engine`) and applied on the engine thread,
        as Hydra STATE_PUT."""
        e = self.api.engine
        id_slot = self.api._slot_id(request)
        if isinstance(id_slot, Response):
            return id_slot
        assert e is not None and e.identity is not None
        blob: bytearray | BlobBuffer | None = None
        try:
            blob, running = await self._read_blob(request, self.api.settings.max_state_body)
            size = len(blob)  # restore_slot consumes the blob (frames it in place)
            # integrity first, never on the engine thread (a body hashed as it arrived: only its header is read)
            await verify_checksum_off_engine(blob, running)
            done = await e.run_task(RestoreSlot(id_slot, blob, checksum_verified=True))
        except _BodyError as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", headers={"Connection": "close"})
        except HydraTrioError as exc:  # a blob this node cannot take: 400 with its meta (StateError)
            _release(blob)
            return error_for(exc)
        _release(blob)  # the worker thread and the engine are done with it (cancelled: dropped, not pooled)
        return JSONResponse({"restored": True, "id_slot": id_slot, "bytes": size, "n_past": done.n_past,
                             "model_hash_match": done.model_hash_match, "kv_identity_match": done.kv_identity_match,
                             **e.identity.as_meta()})

    async def _read_blob(self, request: Request, limit: int) -> tuple[bytearray | BlobBuffer, RunningChecksum | None]:
        """A state body of a declared ``Content-Length`` (at least :data:`STATE_CHUNK`) into one buffer of
        the transfer pool, each chunk copied in and hashed (the blob checksum, while it is in cache) as it
        arrives: ``(blob, its running checksum)``; otherwise into a bytearray (``Api._read_bytes``), with
        None.  Raises _BodyError: over ``limit`` (413), a stall (408), a body whose length is not the
        declared one (400)."""
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit() or not STATE_CHUNK <= int(declared) <= limit:
            return await self.api._read_bytes(request, limit), None
        n, pos, timeout = int(declared), 0, self.api.settings.body_timeout
        blob = TRANSFER_POOL.take(n)
        running = RunningChecksum()
        try:
            view = blob.view()
            async for chunk in body_chunks(request, timeout):
                if pos + len(chunk) > n:
                    raise _BodyError(400, f"the body is longer than its Content-Length ({n} bytes)")
                view[pos : pos + len(chunk)] = chunk
                running.update(view[pos : pos + len(chunk)])
                pos += len(chunk)
            del view
            if pos != n:
                raise _BodyError(400, f"the body ended after {pos} of its {n} bytes (Content-Length)")
        except BaseException:
            blob.release()  # nothing else has seen it
            raise
        return blob, running


STATE_CHUNK = 1024 * 1024
"""Bytes per body slice of ``GET /slots/{id}/state``; smaller ``PUT`` bodies are read into a bytearray."""


async def _slices(blob: BlobBuffer) -> AsyncIterator[memoryview]:
    """The blob in :data:`STATE_CHUNK` slices; the buffer goes back to its pool at the end (the ASGI
    server has copied each slice before it asks for the next)."""
    try:
        view = blob.view()
        for i in range(0, len(view), STATE_CHUNK):
            yield view[i : i + STATE_CHUNK]
        del view
    finally:
        blob.release()


def _release(blob: bytearray | BlobBuffer | None) -> None:
    if isinstance(blob, BlobBuffer):
        blob.release()


def native_routes(api: Any) -> list[Route]:
    """The routes of this module, for :func:`hydra_trio.http.app.build_app`."""
    h = NativeRoutes(api)
    routes = [
        Route("/completion", h.completion, methods=["POST"]),
        Route("/completions", h.completion, methods=["POST"]),
        Route("/apply-template", h.apply_template, methods=["POST"]),
        Route("/props", h.post_props, methods=["POST"]),
        Route("/v1/health", api.health, methods=["GET"]),
        Route("/slots/{id_slot}/state", h.get_state, methods=["GET"]),
        Route("/slots/{id_slot}/state", h.put_state, methods=["PUT"]),
    ]
    routes += [Route(path, h.not_implemented, methods=["GET", "POST"]) for path in NOT_IMPLEMENTED]
    return routes
