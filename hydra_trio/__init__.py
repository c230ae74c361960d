"""hydra-trio: a trio-based engine node for Hydra LLM clusters.

Public API::

    from hydra_trio import serve, ServerConfig, EngineConfig

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, ServerConfig(port=0, engine=EngineConfig(path, "my-model")))
        print(server.port)
"""

__version__ = "0.1.0"

from .engine.batch import EngineConfig  # noqa: E402
from .frontdoor import FrontDoorSettings  # noqa: E402
from .server import Server, ServerConfig, serve  # noqa: E402

__all__ = ["EngineConfig", "FrontDoorSettings", "Server", "ServerConfig", "serve", "__version__"]
