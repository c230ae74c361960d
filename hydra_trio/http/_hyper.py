"""Serve one already-accepted, already-classified trio stream with hypercorn.

hypercorn's trio worker is built for its own accept loop; its per-connection
server (``hypercorn.trio.tcp_server.TCPServer``) works on any trio
``SocketStream``, which is how the front door hands HTTP connections over.
This uses hypercorn internals (not public API): pyproject pins hypercorn's
minor version and ``tests/test_frontdoor.py`` exercises the path (split
request lines included).
"""

from __future__ import annotations

import logging

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext


class HttpHandler:
    """One hypercorn config and one ASGI app for the whole process."""

    def __init__(self, app: object, *, keep_alive_timeout: float = 5.0, read_timeout: float | None = 120.0) -> None:
        config = Config()
        config.keep_alive_timeout = keep_alive_timeout
        config.read_timeout = read_timeout
        config.accesslog = logging.getLogger("hydra_trio.http.access")
        config.errorlog = logging.getLogger("hydra_trio.http.error")
        config.access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'
        self.config = config
        self.app = ASGIWrapper(app)  # type: ignore[arg-type]
        self.context = WorkerContext(None)

    async def __call__(self, stream: trio.SocketStream) -> None:
        """Serve HTTP/1.1 on ``stream`` until the client or the server closes it."""
        await TCPServer(self.app, self.config, self.context, {}, stream).run()  # type: ignore[arg-type]
