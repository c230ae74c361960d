"""Multimodal projector files (``--mmproj``): what their header says, read without loading them."""

from __future__ import annotations

from pathlib import Path


class ProjectorError(ValueError):
    """The file is not a multimodal projector llama.cpp's ``clip`` would load."""


def projector_modalities(path: Path) -> tuple[bool, bool]:
    """``(vision, audio)``: whether the projector has an image and an audio encoder (its GGUF keys
    ``clip.has_vision_encoder`` / ``clip.has_audio_encoder``, which ``tools/mtmd/clip.cpp`` of the vendored
    llama.cpp reads to build each encoder; absent: false).

    Raises ProjectorError: not a GGUF file, ``general.architecture`` not ``clip``, or neither encoder."""
    import gguf  # here: only a node with a projector reads one

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ProjectorError(f"{path}: not a GGUF file ({exc})") from None

    def value(key: str) -> object:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    if arch != "clip":
        raise ProjectorError(f"{path}: not a multimodal projector (general.architecture is {arch!r}, not 'clip')")
    vision, audio = bool(value("clip.has_vision_encoder")), bool(value("clip.has_audio_encoder"))
    if not (vision or audio):
        raise ProjectorError(f"{path}: the projector has neither a vision nor an audio encoder")
    return vision, audio
