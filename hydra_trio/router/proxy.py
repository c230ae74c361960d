"""The router's relay of one HTTP request to a child node and of its reply back, byte for byte as it comes
(a server-sent event stream passes each chunk on when it arrives, nothing is buffered), as llama-server's
``server_http_proxy`` (``tools/server/server-models.cpp`` of the llama.cpp that llama-cpp-python 0.3.36
vendors): the request's headers go on but for the hop-by-hop ones and ``Accept-Encoding`` (no compressed
replies), on a connection of its own (``Connection: close``: no kept-alive connection holds a child that is
asked to stop); the reply's go back but for ``Server``, ``Date``, ``Content-Length``, ``Transfer-Encoding``,
``Keep-Alive``, ``Connection`` and the CORS ones with their ``Vary`` (the router writes its own).  A client
that leaves closes the connection to the child, which ends its request there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import httpx
import trio
from starlette.responses import Response

from .errors import ModelUnavailable

log = logging.getLogger("hydra_trio.router")

_REQUEST_DROP = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "accept-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
}
_REPLY_DROP = {"server", "date", "content-length", "transfer-encoding", "keep-alive", "connection", "vary"}


async def open_relay(
    client: httpx.AsyncClient,
    method: str,
    base: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    timeout: float | None = 3600.0,
) -> httpx.Response:
    """Send the request to the child at ``base`` (``http://127.0.0.1:PORT``); returns its reply with the body
    still to read (:class:`RelayResponse` reads it).  ``timeout``: seconds the child may stay silent (before
    its reply starts, and between two chunks of it) or take to accept the request's body; None: no limit
    (llama-server's proxy reads its children with its ``--timeout``); connecting has 10 s.

    Raises:
        ModelUnavailable: the child cannot be reached (``proxy error: ...``, 500 as llama-server's).
    """
    url = base + path + ("?" + query.decode("latin-1") if query else "")
    kept = [(k, v) for k, v in headers if k.decode("latin-1").lower() not in _REQUEST_DROP]
    kept.append((b"connection", b"close"))  # a connection per request: a stopping child waits for none
    limits = httpx.Timeout(connect=10.0, read=timeout, write=timeout, pool=10.0)
    request = client.build_request(method, url, headers=kept, content=body, timeout=limits)
    try:
        return await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise ModelUnavailable(f"proxy error: {type(exc).__name__}: {exc}") from exc


class RelayResponse(Response):
    """The child's reply as this app's: status and headers (the module docstring), then its body chunk by
    chunk.  ``release`` runs once when the reply is over, however it ends (the client left, the child's
    connection broke)."""

    def __init__(self, upstream: httpx.Response, release: Callable[[], None]) -> None:
        self.upstream = upstream
        self.release = release
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in upstream.headers.multi_items()
            if k.lower() not in _REPLY_DROP and not k.lower().startswith("access-control-")
        ]

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                try:
                    async for chunk in self.upstream.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.HTTPError as exc:  # the child went away in the middle of its reply
                    log.warning("proxy error while relaying %s: %s", scope.get("path"), exc)
                    nursery.cancel_scope.cancel()
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.release()


async def _cancel_on_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
