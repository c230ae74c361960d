"""GGUF metadata overrides (llama-server's ``--override-kv KEY=TYPE:VALUE,...``) as
``llama_model_params.kv_overrides``."""

from __future__ import annotations

from typing import Any

import llama_cpp

_TAGS = {
    "int": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT,
    "float": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_FLOAT,
    "bool": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL,
    "str": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR,
}


def apply(mparams: Any, overrides: tuple[tuple[str, str, Any], ...]) -> Any:
    """Point ``mparams.kv_overrides`` at ``overrides`` (``(key, "int"|"float"|"bool"|"str", value)`` each,
    as :class:`~hydra_trio.engine.settings.LlamaOptions` holds them), ended by an empty key as llama.cpp
    reads the array.  Returns the ctypes array, which the caller keeps alive while the model loads (None
    when there is nothing to override)."""
    if not overrides:
        return None
    arr = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()
    for item, (key, kind, value) in zip(arr, overrides, strict=False):  # arr ends with a terminator
        item.key = key.encode("utf-8")
        item.tag = _TAGS[kind]
        if kind == "int":
            item.value.val_i64 = value
        elif kind == "float":
            item.value.val_f64 = value
        elif kind == "bool":
            item.value.val_bool = value
        else:
            item.value.val_str = value.encode("utf-8")
    arr[len(overrides)].key = b""  # the end of the list
    mparams.kv_overrides = arr
    return arr
