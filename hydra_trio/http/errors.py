"""OpenAI's error body, for every HTTP reply and refused WebSocket handshake of the node."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

_SURROGATE = re.compile("[\ud800-\udfff]")


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 501: "not_supported_error", 503: "unavailable_error"}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status, as llama-server names them (tools/server/server-common.cpp
    ``format_error_response``; ``conflict_error`` is hydra-trio's): ``server_error`` for any other."""
    return _TYPES.get(status, "server_error")


def error_response(
    status: int, message: str, type_: str, code: int | str | None = None, headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "code"}}`` (``code`` defaults to ``status``);
    ``extra`` keys join the ``error`` object (never replacing those three).

    A message with a lone surrogate (echoed from a request; requests refuse them, see
    :func:`hydra_trio.protocol.strict.check_unicode`) is sent with it escaped: never a 500 for a 400."""
    if _SURROGATE.search(message) is not None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    error: dict[str, Any] = {"message": message, "type": type_, "code": status if code is None else code}
    error.update((k, v) for k, v in (extra or {}).items() if k not in error)
    return JSONResponse(
        {"error": error},
        status_code=status,
        headers=headers,
    )
