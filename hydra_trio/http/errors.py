"""OpenAI's error body, for every HTTP reply and refused WebSocket handshake of the node."""

from __future__ import annotations

import re
from collections.abc import Mapping

from starlette.responses import JSONResponse

_SURROGATE = re.compile("[\ud800-\udfff]")


def error_response(
    status: int, message: str, type_: str, code: int | str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "code"}}`` (``code`` defaults to ``status``).

    A message with a lone surrogate (echoed from a request; requests refuse them, see
    :func:`hydra_trio.protocol.strict.check_unicode`) is sent with it escaped: never a 500 for a 400."""
    if _SURROGATE.search(message) is not None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": status if code is None else code}},
        status_code=status,
        headers=headers,
    )
