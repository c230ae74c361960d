"""Helpers shared by the HTTP route modules (:mod:`.app`, :mod:`.native`): typed errors as HTTP replies,
SSE framing, the body-read error, and work off the event loop that stops with its request (its client
leaving cancels the request itself: :mod:`.inflight`)."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..engine.engine import Engine
from ..errors import HydraTrioError
from .errors import error_response, error_type
from .settings import waiting_for_client

T = TypeVar("T")


def error_for(exc: HydraTrioError) -> JSONResponse:
    """The HTTP reply for a typed error: its class's :attr:`~hydra_trio.errors.HydraTrioError.http_status`
    with OpenAI's body (:func:`.errors.error_response`; the type named after the status), the error's
    :meth:`~hydra_trio.errors.HydraTrioError.wire_meta` keys added to the ``error`` object (``busy_slots``,
    ``stage``, a state blob's ``expected_hash`` / ``got_hash`` ...; never over message, type or code)."""
    return error_response(exc.http_status, str(exc), error_type(exc.http_status), extra=exc.wire_meta())


def _bad_request(msg: str) -> JSONResponse:
    return error_response(400, msg, "invalid_request_error")


def _unavailable(engine: Engine) -> JSONResponse:
    return error_response(503, f"Loading model (stage: {engine.stage})", "unavailable_error")


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`` with one encoder for every call
(``json.dumps`` with options builds a new encoder each time: once per streamed token)."""


def _sse(obj: dict[str, Any]) -> str:
    """One server-sent event: ``data: <compact JSON>`` and a blank line."""
    return f"data: {_encode(obj)}\n\n"


class _BodyError(Exception):
    """The body could not be read: ``status`` 413 (too large), 408 (the client stalled) or 400 (the client left)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def json_body(obj: Any) -> bytes:
    """``obj`` as Starlette's ``JSONResponse`` renders it (compact UTF-8, no NaN), for a reply rendered in a
    worker thread (a large one: :func:`json_reply`)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def json_reply(body: bytes) -> Response:
    """A 200 ``application/json`` reply of a body :func:`json_body` rendered."""
    return Response(body, media_type="application/json")


async def off_loop(request: Request, work: Callable[[], T]) -> T:
    """``work()`` (preparing a prompt, tokenizing, templating: work that only reads the vocabulary) in a trio
    worker thread, stopped with its request (:class:`~hydra_trio.http.inflight.Work`): once the request's
    ``stop`` is set (its client left, the node stopped it) tokenizing in the thread raises Cancelled at its next
    chunk (:func:`hydra_trio.engine.tokenize.stop_when`, as do loops that call
    :func:`~hydra_trio.engine.tokenize.check_stop`), and a cancelled caller stops waiting at once."""
    from ..engine.tokenize import stop_when

    tracked = getattr(request.state, "work", None)
    stop = tracked.stop if tracked is not None else threading.Event()

    def run() -> T:
        with stop_when(stop):
            return work()

    return await trio.to_thread.run_sync(run, abandon_on_cancel=True)


async def body_chunks(request: Request, timeout: float | None) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive.  Raises _BodyError 408 when no chunk comes for
    ``timeout`` seconds (a stalled client; None: no limit, 0: no waiting, :func:`.settings.waiting_for_client`),
    and 400 when the connection ends before the body does:
    the client went away, or sent a body h11 cannot read (a malformed chunk), which hypercorn has
    answered with its own 400 and a close.  Either way no reply reaches the client; the 400 keeps
    that request out of the 500s and its traceback out of the error log (starlette's ``ClientDisconnect``
    was unhandled there)."""
    chunks = request.stream().__aiter__()
    got = 0
    while True:
        async with waiting_for_client(timeout) as waited:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except ClientDisconnect:
                raise _BodyError(400, f"the connection ended after {got} bytes of the request body "
                                      "(the client went away, or the body was malformed)") from None
        if waited.cancelled_caught:
            raise _BodyError(408, f"the request body stalled: no data for {timeout:g} s" if timeout
                             else "the request body stalled: no data waiting (--timeout 0: no waiting)")
        got += len(chunk)
        yield chunk
