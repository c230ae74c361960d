"""Model presets (packages that ship GGUF files) and the test MoE made from SmolLM2."""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".presets": ["PRESETS", "Preset", "PresetError", "resolve_model"],
        ".moe": ["ensure_test_moe", "make_test_moe"],
    },
)
