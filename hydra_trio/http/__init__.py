"""The HTTP front end: the ASGI app (OpenAI API, health, slots, metrics) served by hypercorn."""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".app": ["build_app"],
        "._hyper": ["HttpHandler"],
        ".settings": ["HttpSettings"],
    },
)
