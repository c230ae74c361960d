"""``import llama_cpp`` without the high-level half of llama-cpp-python: 15 MiB less resident memory.

llama-cpp-python's ``llama_cpp/__init__.py`` star-imports the ctypes bindings
(``llama_cpp.llama_cpp``, all a node calls) and then the ``Llama`` class
(``llama_cpp.llama``), which imports numpy, jinja2, diskcache, sqlite3 and
multiprocessing: about 130 modules and 15 MiB of a process's VmRSS (``python -c
'import llama_cpp'``: 40 MiB; the bindings alone: 25 MiB), a tenth of an idle
node's memory next to llama-server's.

:func:`install` (called when :mod:`hydra_trio` is imported) puts the package
into ``sys.modules`` without running its ``__init__``: the module has its real
spec, ``__file__`` and ``__path__``, so ``import llama_cpp`` and
``import llama_cpp.llama_grammar`` work as before.  Its names come on first use
(PEP 562 ``__getattr__``):

- a name of the bindings loads ``llama_cpp.llama_cpp`` (the shared libraries)
  and copies its public names into the package, as ``__init__``'s first line does;
- ``__version__`` is read from ``__init__.py``'s text;
- any other name (``Llama``, ``LlamaGrammar``...) runs the real ``__init__`` in
  the package's module, so a caller that wants the whole package gets it, numpy
  included.

When ``llama_cpp`` is already imported (a program that imported it first),
:func:`install` leaves it as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
import types
from typing import Any

PACKAGE = "llama_cpp"
BINDINGS = "llama_cpp.llama_cpp"

_lock = threading.RLock()


def install() -> None:
    """Put llama-cpp-python's package into ``sys.modules`` unexecuted (see the module docstring); a no-op
    when it is already imported, or not installed (the import then fails where it is used, as before)."""
    if PACKAGE in sys.modules:
        return
    with _lock:
        if PACKAGE in sys.modules:
            return
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return
        package = importlib.util.module_from_spec(spec)
        package.__dict__["__getattr__"] = _loader(package)  # the module's own __getattr__ (PEP 562)
        sys.modules[PACKAGE] = package


def _loader(package: types.ModuleType) -> Any:
    state = {"bindings": False, "whole": False}

    def __getattr__(name: str) -> Any:
        dunder = name.startswith("__") and name.endswith("__")
        with _lock:
            if name == "__version__" and not state["whole"]:
                version = _version(package)
                if version is not None:
                    package.__dict__["__version__"] = version
                    return version
            if dunder and name != "__all__":  # the real package defines no other: nothing to load for them
                raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
            if not state["bindings"]:
                state["bindings"] = True
                for key, value in vars(importlib.import_module(BINDINGS)).items():
                    if not key.startswith("_"):  # ``from .llama_cpp import *`` (the module has no __all__)
                        package.__dict__.setdefault(key, value)
                if name in package.__dict__:
                    return package.__dict__[name]
            if not state["whole"]:
                state["whole"] = True
                spec = package.__spec__
                assert spec is not None and spec.loader is not None  # install() made it from a spec with a loader
                spec.loader.exec_module(package)
                if name in package.__dict__:
                    return package.__dict__[name]
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")

    return __getattr__


def _version(package: types.ModuleType) -> str | None:
    """``__version__ = "..."`` from the package's ``__init__.py``, or None."""
    try:
        with open(package.__file__ or "", encoding="utf-8") as f:
            found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None
