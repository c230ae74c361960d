"""The Hydra binary protocol, server side: the node's handler over the connection loop (:mod:`.session`),
one protocol object per connection (:mod:`.connection`: trust, payload policy, dispatch) and the
operations (:mod:`.ops`).

Framing rules (docs/hydra-protocol.md §2): every
request gets exactly one well-formed reply, non-OK replies carry
``{"error": ...}``; a payload is always consumed before the next header
(over its cap: reply BAD_REQUEST, then close); bad magic closes without a
reply; unknown and Store opcodes answer NOT_IMPLEMENTED and the connection
stays usable.  Opcodes: docs/hydra-protocol.md §3.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..engine import Engine
from ..rpc_backend.backend import RpcBackend
from ..service.metrics import NodeMetrics
from ..transport.access import AccessSettings, Peer, Refusals, new_refusals
from ..transport.frontdoor import AcceptedStream
from ..transport.tls import peer_of
from .connection import ServerConnection
from .gate import Gate
from .ops import OpTarget, info_meta
from .session import Drain, HydraSettings, serve_connection

log = logging.getLogger("hydra_trio.hydra")

__all__ = ["HydraHandler", "HydraSettings"]


class HydraHandler:
    """Serves Hydra connections for one node (``engine`` None: a node without a model).

    A :class:`hydra_trio.transport.frontdoor.ConnectionHandler`: each connection gets its
    own :class:`~hydra_trio.hydra.connection.ServerConnection` (its trust,
    payload policy and dispatch) under the connection loop
    (:func:`~hydra_trio.hydra.session.serve_connection`).  ``access``
    (``control_allow``, ``hydra_token``) decides which connections may run the
    ops that change the node (:mod:`hydra_trio.hydra.gate`); refusals are
    counted in ``refused`` at ``("hydra", reason)``.
    """

    def __init__(
        self,
        engine: Engine | None,
        settings: HydraSettings = HydraSettings(),
        rpc: RpcBackend | None = None,
        metrics: NodeMetrics | None = None,
        access: AccessSettings = AccessSettings(),
        refused: Refusals | None = None,
    ) -> None:
        self.target = OpTarget(engine, rpc, settings)
        self.settings = settings
        self.metrics = metrics or NodeMetrics(engine)  # each request counted once, by its ServerConnection
        self._drain = Drain()
        self.gate = Gate(access.control_allow, access.hydra_token, refused if refused is not None else new_refusals())

    async def __call__(self, stream: AcceptedStream) -> None:
        """Serve requests on ``stream`` until the peer closes, a timeout, a framing error or a drain."""
        await self.serve(stream, peer_of(stream))

    def connection(self, stream: trio.abc.Stream, peer: Peer) -> ServerConnection:
        """The protocol object for a new connection from ``peer`` (its trust starts as the gate says)."""
        return ServerConnection(self.target, stream, self.gate.connection(peer), self.metrics)

    async def serve(self, stream: trio.abc.Stream, peer: Peer) -> None:
        """Serve one connection from ``peer`` (any trio stream: the front door's, or a memory stream in tests)
        until the peer closes, a timeout, a framing error or a drain; the caller closes ``stream``."""
        await serve_connection(stream, self.settings, self.connection(stream, peer), self._drain)

    def drain(self) -> None:
        """Graceful shutdown: connections close between requests (idle ones now); requests in flight finish."""
        self._drain.start()

    @property
    def draining(self) -> bool:
        return self._drain.draining

    @property
    def requests(self) -> int:
        """Hydra requests answered (or broken off) on every connection so far (``hydra_trio:hydra_requests``)."""
        return sum(self.metrics.hydra_requests.values())

    def info(self) -> dict[str, Any]:
        """INFO meta (see :func:`hydra_trio.hydra.ops.info_meta`)."""
        return info_meta(self.target)
