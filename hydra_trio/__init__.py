"""hydra-trio: a trio-based engine node for Hydra LLM clusters.

Public API::

    from hydra_trio import serve, ServerConfig, EngineConfig

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, ServerConfig(port=0, engine=EngineConfig(path, "my-model")))
        print(server.port)

``ServerConfig``'s parts (``EngineConfig`` and its ``SamplingParams``, ``FrontDoorSettings``,
``HttpSettings``, ``HydraSettings``, ``RpcBackendSettings``), the Hydra
client, the errors and ``resolve_model`` (a preset name or a path to a
``(path, alias)`` pair) are importable from here.  Names are imported lazily
(PEP 562), so ``import hydra_trio.protocol`` or ``hydra_trio.hydra.client``
does not load llama.cpp.  Importing the package also makes ``import llama_cpp`` load only
llama-cpp-python's ctypes bindings, not its numpy-based ``Llama`` half, until something asks for
a name of that half (:mod:`hydra_trio.engine.llama.bindings`).
"""

from __future__ import annotations

from ._lazy import lazy_exports
from ._version import __version__
from .engine.llama.bindings import install as _install_llama_bindings

_install_llama_bindings()

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".node.server": ["serve", "Server"],
        ".config": ["ServerConfig"],
        ".engine.settings": ["EngineConfig", "SamplingParams"],
        ".models.presets": ["resolve_model"],
        ".transport.frontdoor": ["FrontDoorSettings"],
        ".http.settings": ["HttpSettings"],
        ".hydra.session": ["HydraSettings"],
        ".rpc_backend.backend": ["RpcBackendSettings"],
        ".hydra.client": ["HydraClient"],
        ".errors": ["HydraTrioError", "InvalidRequest", "Busy", "NotReady", "Cancelled", "EngineFailure"],
    },
)
__all__ = [*__all__, "__version__"]
