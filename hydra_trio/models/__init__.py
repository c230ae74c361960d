"""Model presets (packages that ship GGUF files), the test MoE made from SmolLM2, a tiny random hybrid, and
the tiny MTP and vision models."""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".presets": ["PRESETS", "Preset", "PresetError", "resolve_model"],
        ".moe": ["ensure_test_moe", "make_test_moe"],
        ".hybrid": ["ensure_test_hybrid", "ensure_test_swa", "make_test_hybrid", "make_test_swa"],
        ".tiny_mtp": ["ensure_test_mtp", "make_test_mtp"],
        ".tiny_vision": ["ensure_tiny_vision", "make_tiny_vision"],
    },
)
