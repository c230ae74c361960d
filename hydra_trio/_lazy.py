"""Lazy re-exports for package ``__init__`` files (PEP 562), so importing a package stays light.

``import hydra_trio.protocol`` must not load llama.cpp; a package re-exports
its public names, and each is imported from its module on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, modules: dict[str, list[str]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``.

    ``modules`` maps a module (relative to the package, e.g. ``".server"``)
    to the names it exports.
    """
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return sorted(exports), __getattr__, __dir__
