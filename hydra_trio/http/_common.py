"""Helpers shared by the HTTP route modules (:mod:`.app`, :mod:`.native`): typed errors as HTTP replies,
SSE framing, the body-read error, and cancelling a request when its client goes away."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from ..engine.engine import Engine
from ..engine.requests import JobRun
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


async def prepare_unless_gone(request: Request, work: Callable[[], T]) -> T | None:
    """``work()`` (preparing a prompt: rendering, tokenizing) in a worker thread; None when the client
    disconnects first.  Then the thread's tokenizing stops at its next chunk
    (:func:`hydra_trio.engine.tokenize.stop_when`) and this returns at once, without waiting for it."""
    from ..engine.tokenize import stop_when

    stop = threading.Event()

    def run() -> T:
        with stop_when(stop):
            return work()

    result: list[T] = []
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                stop.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            result.append(await trio.to_thread.run_sync(run, abandon_on_cancel=True))
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the work's own error (the watcher never fails): raised as it is
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return result[0] if result else None


@asynccontextmanager
async def _cancel_on_disconnect(request: Request, run: JobRun) -> AsyncIterator[None]:
    """Run the body until it ends or the client disconnects, whichever comes first.

    On a disconnect the body is cancelled at once (it does not wait for the
    engine) and the request is cancelled in the engine, which frees its slot
    or its place in the queue.  The request is cancelled on every exit.
    """
    try:
        with trio.CancelScope() as body_scope:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    while True:
                        msg = await request.receive()
                        if msg["type"] == "http.disconnect":
                            run.close()
                            body_scope.cancel()
                            return

                nursery.start_soon(watch)
                try:
                    yield
                finally:
                    run.close()
                    nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # the watcher never fails: a group holds the body's own error, which the
        # caller handles as it is (an engine error becomes its HTTP status)
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


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
