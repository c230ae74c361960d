"""The node's configuration: :class:`ServerConfig`, which holds every layer's settings.

``hydra-trio run`` builds one from its flags (:mod:`hydra_trio.cli.run`); an embedding trio app
builds one itself and passes it to :func:`hydra_trio.serve`.
"""

from __future__ import annotations

import ssl

import attrs

from .engine.settings import EngineConfig
from .http.settings import HttpSettings
from .hydra.session import HydraSettings
from .rpc_backend.backend import RpcBackendSettings
from .transport.access import AccessSettings
from .transport.frontdoor import FrontDoorSettings


@attrs.frozen
class ServerConfig:
    """Where to listen and what to serve.

    Attributes:
        host: address to bind (``--host``).
        port: TCP port for all three protocols (``--port``); 0 picks a free one.
        extra_ports: more ports served by the same front door, every protocol on
            each (``--rpc-port`` and ``--ggml-rpc-port`` of the cluster's llama-server
            fork, which its clients still dial); 0 picks a free one.
        engine: the model to serve; None runs a node without a model.
        frontdoor: connection limits and the classify timeout.
        http: HTTP timeouts and the body cap.
        hydra: Hydra protocol limits and timeouts.
        rpc_backend: the ggml-RPC backend this node lends to peers; None: off.
        access: API keys, allow-lists and the Hydra token (all open by default).
        rpc_tls: a client TLS context (``--rpc-tls``): every peer the engine dials (``--rpc-engine``,
            SET_EXPERT_MODE, PIPELINE_ATTACH) is reached through a local
            :class:`~hydra_trio.transport.tunnel.RpcTunnel` over TLS (:class:`~hydra_trio.transport.tunnel.TunnelPool`).
        reuse_port: listen with ``SO_REUSEPORT`` (``--reuse-port``): other processes may share the ports.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    extra_ports: tuple[int, ...] = ()
    engine: EngineConfig | None = None
    frontdoor: FrontDoorSettings = FrontDoorSettings()
    http: HttpSettings = HttpSettings()
    hydra: HydraSettings = HydraSettings()
    rpc_backend: RpcBackendSettings | None = RpcBackendSettings()
    access: AccessSettings = AccessSettings()
    rpc_tls: ssl.SSLContext | None = None
    reuse_port: bool = False
