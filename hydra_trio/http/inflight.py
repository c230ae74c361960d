"""HTTP requests that do work: counted while they work, stopped when their client leaves, ended when the node stops.

:class:`InFlight` is an ASGI middleware around the whole app.  Every request
to a route of :data:`WORK_ROUTES` (completions, embeddings, tokenizing,
templating, slot files, KV state) is a :class:`TrackedRequest` for as long as the app
handles it, reply included:

* **Counted**: ``/metrics`` shows the requests in flight by route
  (``hydra_trio:http_requests_in_flight{route}``, :meth:`InFlight.counts`).
* **Stopped when its client leaves.**  The middleware alone reads the
  connection (the app reads through it: body chunks pass one at a time, so a
  large upload keeps its flow control), and once the body has arrived it
  watches for the end of the connection.  When the client goes away after
  its request arrived whole and before its reply is out, the app is
  cancelled at once (llama-server checks ``is_connection_closed`` likewise
  and cancels the request's tasks; a body cut short is left to the app's body
  read, which ends with a 400), and :attr:`TrackedRequest.stop` is set for work in
  worker threads, which checks it
  (tokenizing stops at its next chunk: :func:`hydra_trio.engine.llama.tokenize.stop_when`).
  Work already handed to the engine thread finishes its current step (an
  engine task is all or nothing), and nothing more follows it: an embeddings
  request stops after the input being decoded.
* **Ended when the node stops.**  At the end of the shutdown grace
  (:meth:`InFlight.stop_all`) a request whose reply has not started is
  cancelled and answered ``503`` with OpenAI's error body, type
  ``unavailable_error``, saying the node is stopping (and ``Connection:
  close``).  A reply already streaming is left to end itself: a completion's
  stream gets an error event from its engine request
  (:meth:`LiveJobs.end_all <hydra_trio.engine.requests.LiveJobs.end_all>`).

Other requests (``/health``, ``/metrics``, ``/props``, ``/slots`` and the
other reads, the status page, WebSockets) pass through untouched.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import attrs
import trio

from ..errors import Stopping
from .errors import error_reply

log = logging.getLogger("hydra_trio.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

WORK_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("POST",),
    "/chat/completions": ("POST",),
    "/v1/completions": ("POST",),
    "/completion": ("POST",),
    "/completions": ("POST",),
    "/v1/embeddings": ("POST",),
    "/embeddings": ("POST",),
    "/embedding": ("POST",),
    "/tokenize": ("POST",),
    "/detokenize": ("POST",),
    "/apply-template": ("POST",),
    "/slots/{id_slot}": ("POST",),
    "/slots/{id_slot}/state": ("GET", "PUT"),
}
"""The routes whose requests do work, by path template, with their methods (``/metrics``' ``route`` label)."""

_SLOT_PATH = re.compile(r"/slots/[^/]+")
_DISCONNECT: Message = {"type": "http.disconnect"}


def work_route(method: str, path: str) -> str | None:
    """The :data:`WORK_ROUTES` template that ``method path`` is a request of, or None."""
    template = _SLOT_PATH.sub("/slots/{id_slot}", path, count=1) if path.startswith("/slots/") else path
    return template if method in WORK_ROUTES.get(template, ()) else None


@attrs.define(eq=False)
class TrackedRequest:
    """One request of a work route while the app handles it (the app finds it as ``request.state.tracked``).

    Attributes:
        route: its :data:`WORK_ROUTES` template.
        stop: set once the work is to stop (its client left, the node stopped it, or its handling ended):
            worker threads check it (:func:`hydra_trio.service.completions.in_worker`).
        client_gone: the client closed its connection before the reply was out.
        stopping: the node's stop message, once :meth:`InFlight.stop_all` ended the request.
        started, complete: the reply's start, and its last body message, went out.
    """

    route: str
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    stop: threading.Event = attrs.Factory(threading.Event)
    client_gone: bool = False
    stopping: str | None = None
    started: bool = False
    complete: bool = False

    def cancel(self) -> None:
        """Stop the work: its worker threads at their next check, the app at once."""
        self.stop.set()
        self.scope.cancel()


class InFlight:
    """The node's HTTP requests of work routes in flight (this module's docstring); :meth:`wrap` puts it around
    an ASGI app."""

    def __init__(self) -> None:
        self.tracked: set[TrackedRequest] = set()

    def counts(self) -> dict[str, int]:
        """Requests in flight now by route template (every route of :data:`WORK_ROUTES`, 0 included)."""
        now = collections.Counter(w.route for w in self.tracked)
        return {route: now[route] for route in WORK_ROUTES}

    def stop_all(self, why: str) -> int:
        """End every request in flight whose reply has not started: cancelled, then answered 503 (``why``).
        Returns how many."""
        n = 0
        for w in list(self.tracked):
            if not w.started and not w.client_gone:
                w.stopping = why
                w.cancel()
                n += 1
        return n

    def wrap(self, app: App) -> App:
        """``app`` with its work routes' requests tracked."""

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            route = work_route(scope["method"], scope["path"]) if scope["type"] == "http" else None
            if route is None:
                await app(scope, receive, send)
                return
            tracked = TrackedRequest(route)
            scope.setdefault("state", {})["tracked"] = tracked
            self.tracked.add(tracked)
            try:
                await _serve(app, scope, receive, send, tracked)
            except Exception as exc:  # an ExceptionGroup too
                if not tracked.scope.cancel_called:
                    raise
                # what a handler raises as it unwinds from the cancel (its engine request ended meanwhile)
                log.debug("%s %s: %r after it was stopped", scope["method"], scope["path"], exc)
            finally:
                self.tracked.discard(tracked)
                tracked.stop.set()  # anything it left in a worker thread stops at its next check
            if tracked.stopping is not None and not tracked.started:
                reply = error_reply(Stopping(tracked.stopping), headers={"Connection": "close"})
                await reply(scope, receive, send)

        return wrapped


async def _serve(app: App, scope: Scope, receive: Receive, send: Send, tracked: TrackedRequest) -> None:
    """Run ``app`` for ``tracked`` with the connection watched (:func:`_watch`); a cancelled app ends quietly."""

    async def tracked_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            tracked.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            tracked.complete = True
        await send(message)

    try:
        async with trio.open_nursery() as nursery:
            app_receive = await nursery.start(_watch, receive, tracked)
            with tracked.scope:
                await app(scope, app_receive, tracked_send)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the watcher never fails: the app's own error, raised as it is
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _watch(receive: Receive, tracked: TrackedRequest, *, task_status: trio.TaskStatus[Receive]) -> None:
    """The one reader of the connection: hands the body to the app one message at a time, then waits for the
    client to leave, and then cancels ``tracked`` unless its reply is out.  Starts with the app's ``receive``:
    the request's messages, then ``http.disconnect`` (for as many readers as ask) once the client left."""
    to_app, from_watch = trio.open_memory_channel[Message](1)
    gone = trio.Event()
    body_taken = False

    async def app_receive() -> Message:
        nonlocal body_taken
        if body_taken:  # nothing comes after the body but the end of the connection
            await gone.wait()
            return dict(_DISCONNECT)
        try:
            message = await from_watch.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return dict(_DISCONNECT)
        if message["type"] == "http.request" and not message.get("more_body", False):
            body_taken = True
        return message

    task_status.started(app_receive)
    body_done = False
    async with to_app:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                tracked.client_gone = not tracked.complete
                gone.set()
                # a body cut short is the app's to see (its reader ends with a 400); after it, the work stops
                if tracked.client_gone and body_done:
                    tracked.cancel()
                return
            body_done = message["type"] == "http.request" and not message.get("more_body", False)
            await to_app.send(message)  # one message ahead at most: the upload's flow control stays the app's
