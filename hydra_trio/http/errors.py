"""The HTTP front end's error boundary: every refusal, a typed error (:mod:`hydra_trio.errors`), becomes OpenAI's
error body here and nowhere else.

* :func:`error_reply`: the reply for a typed error, its class's
  :attr:`~hydra_trio.errors.HydraTrioError.http_status` with ``{"error": {"message", "type", "code"}}`` and the
  error's :meth:`~hydra_trio.errors.HydraTrioError.reply_meta` keys (``busy_slots``, ``stage``, a state blob's
  ``expected_hash`` ...); a body that could not be read whole (:class:`~hydra_trio.errors.BodyError`) closes
  the connection.
* :func:`guarded`: a route handler whose typed errors become that reply (every route of the app is one).
* :func:`guarded_stream`: a streamed reply whose typed errors, once its 200 is out, become one last event
  with the same body, as llama-server ends a stream that fails.
* The HTTP layer's own refusals (no route, a method the route does not take, a WebSocket address asked
  without the upgrade) use the same body.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import BodyError, HydraTrioError, InvalidRequest, NotFound
from ..openai.replies import sse

_SURROGATE = re.compile("[\ud800-\udfff]")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    501: "not_supported_error",
    503: "unavailable_error",
}

Handler = Callable[[Request], Awaitable[Response]]


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status, as llama-server names them (tools/server/server-common.cpp
    ``format_error_response``; ``conflict_error`` is hydra-trio's, and a body too large (413) or too slow
    (408) is the request's fault): ``server_error`` for any other."""
    return _TYPES.get(status, "server_error")


def error_body(
    status: int,
    message: str,
    type_: str | None = None,
    code: int | str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "code"}}`` (``type`` named after ``status``,
    ``code`` defaults to ``status``); ``extra`` keys join the ``error`` object (never replacing those three).

    A message with a lone surrogate (echoed from a request; requests refuse them, see
    :func:`hydra_trio.validation.strict.check_unicode`) is sent with it escaped: never a 500 for a 400."""
    if _SURROGATE.search(message) is not None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    error: dict[str, Any] = {
        "message": message,
        "type": type_ or error_type(status),
        "code": status if code is None else code,
    }
    error.update((k, v) for k, v in (extra or {}).items() if k not in error)
    return {"error": error}


def error_response(
    status: int,
    message: str,
    type_: str,
    code: int | str | None = None,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> JSONResponse:
    """:func:`error_body` as a reply of ``status``."""
    return JSONResponse(error_body(status, message, type_, code, extra), status_code=status, headers=headers)


def error_reply(exc: HydraTrioError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The HTTP reply for a typed error (this module's docstring)."""
    if isinstance(exc, BodyError):
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse(error_event(exc), status_code=exc.http_status, headers=headers)


def error_event(exc: HydraTrioError) -> dict[str, Any]:
    """The error body of a typed error (:func:`error_reply`'s, also a stream's last event)."""
    return error_body(exc.http_status, str(exc), extra=exc.reply_meta())


def guarded(handler: Handler) -> Handler:
    """``handler`` with its typed errors answered by :func:`error_reply`."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except HydraTrioError as exc:
            return error_reply(exc)

    route.__name__ = route.__qualname__ = getattr(handler, "__name__", "route")
    route.__doc__ = handler.__doc__
    return route


async def guarded_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events`` (server-sent events), ended by an error event when they raise a typed error: the 200 is out,
    so the error goes in the stream."""
    try:
        async for event in events:
            yield event
    except HydraTrioError as exc:
        yield sse(error_event(exc))


# ----------------------------------------------------------------------------- the HTTP layer's own


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's routing refusals in OpenAI's body: no route (404), a method the route does not take (405)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == NotFound.http_status:
        return error_reply(no_route(request.url.path))
    if exc.status_code == 405:
        return error_response(
            405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        )
    return error_response(exc.status_code, exc.detail, error_type(InvalidRequest.http_status))


def no_route(path: str) -> NotFound:
    """The error for an address the app has no route for."""
    return NotFound(f"no route for {path}")


async def upgrade_required(request: Request) -> Response:
    """``GET /v1/events`` without a WebSocket upgrade: 426 with ``Upgrade: websocket`` (RFC 9110 §15.5.22)."""
    return error_response(
        426,
        "GET /v1/events is a WebSocket: send the upgrade (Connection: Upgrade, Upgrade: websocket)",
        "invalid_request_error",
        headers={"Upgrade": "websocket"},
    )
