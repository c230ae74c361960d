"""Reading HTTP requests and writing JSON replies, for every route module: the body within its limits
(:class:`RequestReader`), the slot id in a path (:func:`slot_in_path`), the stop of a request's work
(:func:`stop_of`), and JSON rendered off the event loop (:func:`json_body`, :func:`json_reply`).

Refusals are typed errors (:mod:`hydra_trio.errors`): a body too large (BodyTooLarge, 413), a client that
stalls (BodyTimeout, 408), a connection that ends inside the body (BodyError, 400), an invalid body
(MessageError, 400).
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import trio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..engine import TRANSFER_POOL, BlobBuffer, RunningChecksum
from ..errors import BodyError, BodyTimeout, BodyTooLarge, InvalidRequest
from ..openai.schemas import parse_body
from .settings import HttpSettings, waiting_for_client

PARSE_INLINE_MAX = 1 << 20
"""Bytes of request body parsed on the event loop; a larger one is parsed in a worker thread
(:meth:`RequestReader.read`)."""
STATE_CHUNK = 1024 * 1024
"""Bytes of a KV state body from which it is read into a buffer of the transfer pool
(:meth:`RequestReader.read_blob`); ``GET /slots/{id}/state`` sends its blob in slices of this size."""


def slot_in_path(request: Request) -> int:
    """The path's ``{id_slot}``: a decimal integer of at most 9 digits.  Raises InvalidRequest naming
    ``id_slot`` for anything else (a sign, spaces)."""
    raw = request.path_params["id_slot"]
    if not (raw.isascii() and raw.isdigit() and len(raw) < 10):
        raise InvalidRequest(f"id_slot: {raw!r} is not a slot id (a decimal integer)")
    return int(raw)


def stop_of(request: Request) -> threading.Event | None:
    """The event set when the request's work should stop (its client left, the node stops it:
    :class:`~hydra_trio.http.inflight.TrackedRequest`); None for a request that is not tracked."""
    tracked = getattr(request.state, "tracked", None)
    return tracked.stop if tracked is not None else None


class RequestReader:
    """Reads request bodies under the HTTP settings' limits (``max_body``, ``max_state_body``) and their
    stall timeout (``body_timeout``)."""

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings

    async def read(self, request: Request, cls: type[Any]) -> Any:
        """Read and parse the body into ``cls``: at most ``max_body`` bytes, no gap longer than ``body_timeout``;
        a body over :data:`PARSE_INLINE_MAX` is parsed in a worker thread (16 MiB of token ids take seconds to
        parse, which would stall every other request on the event loop).

        Raises MessageError (an invalid body), BodyTooLarge, BodyTimeout, BodyError."""
        raw = bytes(await self.read_bytes(request, self.settings.max_body))
        if len(raw) > PARSE_INLINE_MAX:
            return await trio.to_thread.run_sync(parse_body, raw, cls)
        return parse_body(raw, cls)

    async def read_bytes(self, request: Request, limit: int) -> bytearray:
        """The raw body: at most ``limit`` bytes, no gap longer than ``body_timeout``.
        Raises BodyTooLarge, BodyTimeout, BodyError."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"the body is {declared} bytes; the limit is {limit}")
        raw = bytearray()
        async for chunk in body_chunks(request, self.settings.body_timeout):
            raw += chunk
            if len(raw) > limit:
                raise BodyTooLarge(f"the body is over the limit of {limit} bytes")
        return raw

    async def read_blob(self, request: Request) -> tuple[bytearray | BlobBuffer, RunningChecksum | None]:
        """A KV state body (at most ``max_state_body`` bytes).  One of a declared ``Content-Length`` of at least
        :data:`STATE_CHUNK` goes into one buffer of the transfer pool, each chunk copied in and hashed (the
        blob checksum, while it is in cache) as it arrives: ``(blob, its running checksum)``; any other into a
        bytearray (:meth:`read_bytes`), with None.  Raises BodyTooLarge, BodyTimeout, BodyError (also for a
        body whose length is not the declared one)."""
        limit = self.settings.max_state_body
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit() or not STATE_CHUNK <= int(declared) <= limit:
            return await self.read_bytes(request, limit), None
        n, pos = int(declared), 0
        blob = TRANSFER_POOL.take(n)
        running = RunningChecksum()
        try:
            view = blob.view()
            async for chunk in body_chunks(request, self.settings.body_timeout):
                if pos + len(chunk) > n:
                    raise BodyError(f"the body is longer than its Content-Length ({n} bytes)")
                view[pos : pos + len(chunk)] = chunk
                running.update(view[pos : pos + len(chunk)])
                pos += len(chunk)
            del view
            if pos != n:
                raise BodyError(f"the body ended after {pos} of its {n} bytes (Content-Length)")
        except BaseException:
            blob.release()  # nothing else has seen it
            raise
        return blob, running


async def body_chunks(request: Request, timeout: float | None) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive.  Raises BodyTimeout when no chunk comes for ``timeout``
    seconds (a stalled client; None: no limit, 0: no waiting, :func:`.settings.waiting_for_client`), and
    BodyError when the connection ends before the body does: the client went away, or sent a body h11
    cannot read (a malformed chunk), which hypercorn has answered with its own 400 and a close.  Either way
    no reply reaches the client; the 400 keeps that request out of the 500s and its traceback out of the
    error log (starlette's ``ClientDisconnect`` was unhandled there)."""
    chunks = request.stream().__aiter__()
    got = 0
    while True:
        async with waiting_for_client(timeout) as waited:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except ClientDisconnect:
                raise BodyError(
                    f"the connection ended after {got} bytes of the request body "
                    "(the client went away, or the body was malformed)"
                ) from None
        if waited.cancelled_caught:
            raise BodyTimeout(
                f"the request body stalled: no data for {timeout:g} s"
                if timeout
                else "the request body stalled: no data waiting (--timeout 0: no waiting)"
            )
        got += len(chunk)
        yield chunk


def json_body(obj: Any) -> bytes:
    """``obj`` as Starlette's ``JSONResponse`` renders it (compact UTF-8, no NaN), for a reply rendered in a
    worker thread (a large one: :func:`json_reply`)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def json_reply(body: bytes) -> Response:
    """A 200 ``application/json`` reply of a body :func:`json_body` rendered."""
    return Response(body, media_type="application/json")
