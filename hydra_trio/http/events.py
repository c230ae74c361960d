"""``GET /v1/events``: the node's live event stream (:mod:`hydra_trio.observability.events`) over a WebSocket.

Served by hypercorn (wsproto) on the same port as the rest of HTTP.  Query
parameters:

- ``types``: comma-separated categories (``slot,mode``; see
  :data:`hydra_trio.observability.events.CATEGORIES`); all when absent.
- ``recent``: first replay up to this many recent events that pass the filter
  (0..200, default 0).
- ``queue``: this subscriber's bound, in events (1..4096, default 1024);
  past it events are dropped and a ``dropped`` event with their ``count``
  comes before the next one delivered.

A bad value (an unknown category, a number out of range) refuses the
handshake with HTTP 400 and an OpenAI-style error body naming it; a node
shutting down, or one with ``max_subscribers`` sockets open already,
answers 503; a missing or wrong API key gets 401, as on the
rest of HTTP (:mod:`hydra_trio.http.auth`).

Frames are text frames, one JSON object each; the first is ``hello``.  The
server sends and never expects anything: messages from the client are read
and ignored (so a close from the client is seen at once).  At shutdown the
server closes every subscriber with code 1001 (going away).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..errors import HydraTrioError, InvalidRequest, Overloaded, Stopping
from ..observability.events import EventBus, parse_types
from .errors import error_reply

log = logging.getLogger("hydra_trio.http.events")

MAX_RECENT = 200
MAX_QUEUE = 4096


def _int_param(ws: WebSocket, name: str, default: int, lo: int, hi: int) -> int:
    raw = ws.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) < 10) or not lo <= int(raw) <= hi:
        raise ValueError(f"{name}: {raw!r} is not an integer in {lo}..{hi}")
    return int(raw)


def events_endpoint(
    bus: EventBus, hello: Callable[[], dict[str, Any]], max_subscribers: int = 256
) -> Callable[[WebSocket], Any]:
    """The Starlette WebSocket endpoint for ``bus``; ``hello()`` builds the first event; past
    ``max_subscribers`` sockets at once (counted from the handshake on) a handshake gets 503."""
    active = 0

    async def endpoint(ws: WebSocket) -> None:
        nonlocal active
        if active >= max_subscribers:
            log.warning("event subscriber refused: %d at once already (--max-event-subscribers)", active)
            await _refuse(
                ws,
                Overloaded(
                    f"too many event subscribers ({max_subscribers} at once; --max-event-subscribers); retry later"
                ),
            )
            return
        active += 1
        try:
            await _serve(ws)
        finally:
            active -= 1

    async def _serve(ws: WebSocket) -> None:
        try:
            types = parse_types(ws.query_params.get("types"))
            recent = _int_param(ws, "recent", 0, 0, MAX_RECENT)
            maxlen = _int_param(ws, "queue", 1024, 1, MAX_QUEUE)
        except ValueError as exc:
            await _refuse(ws, InvalidRequest(str(exc)))
            return
        if bus.closed:
            await _refuse(ws, Stopping("the node is shutting down"))
            return
        client = f"{ws.client.host}:{ws.client.port}" if ws.client else "-"
        await ws.accept()
        log.info("%s: event subscriber (types %s)", client, ",".join(sorted(types)) if types else "all")
        sent = 0
        try:
            with bus.subscribe(types, maxlen) as sub:
                await ws.send_text(_dumps(hello()))
                for event in bus.recent(types, recent) if recent else ():
                    await ws.send_text(_dumps(event))
                async with trio.open_nursery() as nursery:

                    async def read_until_closed() -> None:
                        try:
                            while True:
                                msg = await ws.receive()
                                if msg["type"] == "websocket.disconnect":
                                    break
                        finally:
                            nursery.cancel_scope.cancel()

                    nursery.start_soon(read_until_closed)
                    async for event in sub:
                        await ws.send_text(_dumps(event))
                        sent += 1
                    # the bus closed (shutdown): say so and stop
                    nursery.cancel_scope.cancel()
                await ws.close(code=1001, reason="the node is shutting down")
        except (WebSocketDisconnect, trio.BrokenResourceError, trio.ClosedResourceError, RuntimeError):
            pass  # the client went away mid-send (Starlette raises RuntimeError after a close)
        finally:
            log.info("%s: event subscriber gone after %d events", client, sent)

    return endpoint


async def _refuse(ws: WebSocket, exc: HydraTrioError) -> None:
    """Refuse the handshake with the typed error's reply (:func:`~.errors.error_reply`, as ASGI's WebSocket
    Denial Response, which hypercorn implements; without it, a close with 1008 and the message as its
    reason)."""
    if "websocket.http.response" not in ws.scope.get("extensions", {}):
        await ws.close(code=1008, reason=str(exc).encode()[:123].decode(errors="ignore"))  # a reason's limit
        return
    await ws.send_denial_response(error_reply(exc))


def _dumps(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"), default=str)
