"""OpenAI's error body, for every HTTP reply and refused WebSocket handshake of the node."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse


def error_response(
    status: int, message: str, type_: str, code: int | str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "code"}}`` (``code`` defaults to ``status``)."""
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": status if code is None else code}},
        status_code=status,
        headers=headers,
    )
