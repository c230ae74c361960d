"""hydra-trio: a trio-based engine node for Hydra LLM clusters.

Public API::

    from hydra_trio import serve, ServerConfig, EngineConfig

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, ServerConfig(port=0, engine=EngineConfig(path, "my-model")))
        print(server.port)

Names are imported lazily (PEP 562), so ``import hydra_trio.protocol`` or
``hydra_trio.hydra.client`` does not load llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "EngineConfig": "hydra_trio.engine.engine",
    "FrontDoorSettings": "hydra_trio.frontdoor",
    "Server": "hydra_trio.server",
    "ServerConfig": "hydra_trio.server",
    "serve": "hydra_trio.server",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hydra_trio' has no attribute {name!r}")
