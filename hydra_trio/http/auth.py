"""API keys on the HTTP API: a pure ASGI middleware, as llama-server's ``--api-key``.

With keys configured, every HTTP request but the open ones must carry
``Authorization: Bearer KEY`` with one of the keys (``X-Api-Key: KEY`` is
accepted too, as llama-server does for Anthropic-style clients).  Otherwise
the reply is llama-server's (``tools/server/server-http.cpp`` of the llama.cpp
that llama-cpp-python 0.3.36 vendors, ``middleware_validate_api_key``)::

    401 {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}

plus ``WWW-Authenticate: Bearer realm="hydra-trio"`` (RFC 6750 §3; with
``error="invalid_token"`` when a key was sent but is wrong).

Open without a key, llama-server's public set: ``/health`` and ``/v1/health``
(orchestrators and load balancers probe them), every ``OPTIONS`` request (CORS
preflights carry no credentials; llama-server answers them before its key
check too), and the status page's files (``/`` and ``/static/...``: fixed files
with no node data in them, as llama-server leaves its web UI's assets open).
Everything else needs the key, ``/metrics`` included, as in llama-server;
``metrics_auth=False`` (``--no-metrics-auth``) opens ``/metrics`` for a
Prometheus that sends no credentials.  The status page's data, the event
stream ``/v1/events``, needs the key.

A browser cannot set ``Authorization`` on a WebSocket, so ``GET /v1/events``
also takes the key as the query parameter ``?api_key=KEY`` (the status page
sends the key given in its URL fragment, ``/#key=KEY``).  A header, when
present, wins.  Query strings can end up in proxies' logs: prefer the header
where the client can send one.

Keys are compared in constant time against every key
(:class:`hydra_trio.transport.access.Secrets`).  A header that is not valid in any
encoding is simply a wrong key: the reply is 401, never 500.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from ..transport.access import Refusals, Secrets

log = logging.getLogger("hydra_trio.http.auth")

OPEN_PATHS = frozenset({"/health", "/v1/health", "/"})
"""Paths served without a key: llama-server's public endpoints and the status page (``/metrics`` joins them
when ``metrics_auth`` is off)."""
OPEN_PREFIXES = ("/static/",)
"""Path prefixes served without a key: the status page's files."""

_BODY = json.dumps(
    {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}, separators=(",", ":")
).encode()
_REALM = b'Bearer realm="hydra-trio"'


def bearer_key(headers: Mapping[bytes, bytes] | list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries, read as llama-server reads it: ``Authorization``, or ``X-Api-Key`` when
    ``Authorization`` is absent or empty; a ``Bearer`` scheme (any case, RFC 6750 §2.1) is taken off either,
    any other value is the key as it is.  None when it carries neither.  Header names are lower-case bytes
    (ASGI); the first of a repeated header counts."""
    auth: bytes | None = None
    x_api_key: bytes | None = None
    for name, value in headers.items() if isinstance(headers, Mapping) else headers:
        if name == b"authorization" and auth is None:
            auth = value
        elif name == b"x-api-key" and x_api_key is None:
            x_api_key = value
    key = auth if auth is not None and auth.strip() else x_api_key
    if key is None:
        return None
    scheme, _, token = key.strip().partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return key.strip()  # llama-server: a bare key without "Bearer " is compared as it is


SECRET_PARAMS = frozenset({"api_key", "apikey", "api-key", "key", "token", "access_token", "auth", "password"})
"""Query parameter names (percent-decoded, any case) whose values :func:`redact_query` hides."""


def redact_query(query_string: bytes) -> bytes:
    """``query_string`` with the value of every secret-looking parameter (:data:`SECRET_PARAMS`) as ``***``.

    Names are compared as a server decodes them (``+`` and ``%XX`` decoded,
    any case), so ``api%5Fkey=K`` (which :func:`query_key` accepts as
    ``api_key``) or ``API_KEY=K`` is hidden too; everything else is kept
    byte for byte.  For log lines (an access log must not hold credentials,
    OWASP Logging Cheat Sheet).
    """
    parts = query_string.split(b"&")
    for i, part in enumerate(parts):
        name, eq, _ = part.partition(b"=")
        if eq and urllib.parse.unquote_plus(name.decode("latin-1")).strip().lower() in SECRET_PARAMS:
            parts[i] = name + b"=***"
    return b"&".join(parts)


def query_key(query_string: bytes) -> bytes | None:
    """The first ``api_key`` parameter of a query string (percent-decoded, as UTF-8 bytes), or None."""
    values = urllib.parse.parse_qs(query_string.decode("latin-1"), keep_blank_values=True).get("api_key")
    return values[0].encode() if values else None


class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests need one of ``keys`` (see the module docstring).

    Args:
        app: the ASGI app it protects.
        keys: the accepted keys; empty lets everything through.
        metrics_auth: ``/metrics`` needs a key, as in llama-server (the default); False serves it without one.
        refused: counter bumped at ``("http", "missing_api_key" | "invalid_api_key")``.

    WebSocket handshakes without a valid key get the same 401 (:func:`send_refusal`)
    before the app sees them; lifespan events pass through.
    """

    def __init__(self, app: Any, keys: Secrets, metrics_auth: bool = True, refused: Refusals | None = None) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}
        self.refused = refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or not self.keys:
            await self.app(scope, receive, send)
            return
        if kind == "http" and (
            scope["method"] == "OPTIONS" or scope["path"] in self.open_paths or scope["path"].startswith(OPEN_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        key = bearer_key(scope.get("headers") or [])
        if key is None and kind == "websocket":
            key = query_key(scope.get("query_string") or b"")
        if self.keys.matches(key):
            await self.app(scope, receive, send)
            return
        reason = "missing_api_key" if key is None else "invalid_api_key"
        if self.refused is not None:
            self.refused["http", reason] += 1
        client = scope.get("client")
        log.warning(
            "%s: %s %s refused: %s",
            f"{client[0]}:{client[1]}" if client else "-",
            scope.get("method", "WEBSOCKET"),
            scope["path"],
            reason.replace("_", " "),
        )
        challenge = _REALM if key is None else _REALM + b', error="invalid_token"'
        await send_refusal(scope, send, 401, _BODY, [(b"www-authenticate", challenge)])


async def send_refusal(
    scope: Mapping[str, Any], send: Any, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer an HTTP request, or refuse a WebSocket handshake, with ``status`` and a JSON ``body``.

    A WebSocket handshake gets the same HTTP response as a plain request
    (the ASGI *WebSocket Denial Response* extension, which hypercorn
    implements), so a client learns the status and the reason; a server
    without the extension could only close it, which reaches the client as a
    bare 403.
    """
    head = [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    if scope["type"] == "websocket":
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "websocket.http.response.start", "status": status, "headers": head})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
