"""The Hydra binary protocol over sockets: the server side (connections, operations), the client, its CLI."""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".server": ["HydraHandler"],
        ".session": ["HydraSettings"],
        ".client": ["HydraClient"],
        ".errors": ["HydraError"],
        ".streams": ["DecodeStream", "ResponseStream"],
    },
)
