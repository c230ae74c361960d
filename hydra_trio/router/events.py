"""The router's model events for ``GET /models/sse``, as llama-server's router broadcasts them (``notify_sse`` in
``tools/server/server-models.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors).

Each event is ``{"model": NAME, "event": KIND[, "data": {...}]}``; the kinds a router without downloads sends:

* ``model_status``, ``{"status": "loading"}``: the model's child was started (a load);
* ``status_change``, ``{"status": "loaded", "info": {...}}``: it serves (``info``: its child's ``/v1/models``
  entry); ``{"status": "unloaded", "exit_code": N}``: its child exited (N not 0: it failed);
* ``download_finished`` (no data): ``POST /models`` added it (its files were already here);
* ``models_reload`` (``model`` is ``*``, no data): the list of models changed (``POST /models`` added one);
* ``model_remove`` (no data): ``DELETE /models`` removed it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

log = logging.getLogger("hydra_trio.router")

SUBSCRIBER_QUEUE = 256
"""Events one subscriber may have unread; past it the subscriber is closed (a client that does not read)."""


class ModelEvents:
    """Broadcast of the events of the module docstring to every subscriber of ``GET /models/sse``."""

    def __init__(self) -> None:
        self._subscribers: set[trio.MemorySendChannel[dict[str, Any]]] = set()
        self.closed = False

    def notify(self, event: str, model: str, data: dict[str, Any] | None = None) -> None:
        """Send ``{"model", "event"[, "data"]}`` to every subscriber (``data`` None: no ``data`` key)."""
        message: dict[str, Any] = {"model": model, "event": event}
        if data is not None:
            message["data"] = data
        for send in list(self._subscribers):
            try:
                send.send_nowait(message)
            except trio.WouldBlock:
                log.warning("a /models/sse client reads no events: closing it")
                self._drop(send)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._drop(send)

    @contextmanager
    def subscribe(self) -> Iterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
        """A channel of the events from now on; it ends when :meth:`close` is called (the router stops)."""
        send, receive = trio.open_memory_channel[dict[str, Any]](SUBSCRIBER_QUEUE)
        if self.closed:
            send.close()
        else:
            self._subscribers.add(send)
        try:
            yield receive
        finally:
            self._drop(send)
            receive.close()

    def close(self) -> None:
        """End every subscriber's stream (the router stops)."""
        self.closed = True
        for send in list(self._subscribers):
            self._drop(send)

    def _drop(self, send: trio.MemorySendChannel[dict[str, Any]]) -> None:
        self._subscribers.discard(send)
        send.close()
