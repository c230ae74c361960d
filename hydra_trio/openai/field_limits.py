"""llama-server's numeric request fields: the C type each one is read as, and its limits.

llama-server reads the numbers of a completion request through its schema
(``tools/server/server-schema.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors,
``field_num<T>::eval``).  A field that is absent or ``null`` keeps the default; otherwise its JSON
value is converted to the field's C type -- its JSON library takes an integer, a float (truncated
toward zero for an integer field) or a boolean (``true`` is 1, ``false`` 0); a string, an array or
an object is a 400 naming the field -- and then

* **soft limits** (``set_limits``): a value outside ``[lo, hi]`` is clamped into it, silently;
* **hard limits** (``set_hard_limits``): a value outside ``[lo, hi]`` is a 400 naming the field and
  the range;
* **no limits**: any value of the type.

Where llama-server's C++ conversion would wrap an integer to 32 bits (``2**32 + 5`` read as 5) or is
undefined (a float beyond the type), this module does not wrap: it clamps into the soft limits, refuses
outside the hard ones, and clamps a field without limits into its type's range.  ``seed`` is the one
field converted modulo ``2**32`` (an unsigned type, where C++'s conversion is defined: ``-1`` is
4294967295, llama.cpp's "random seed").  A float field holds at most the largest finite 32-bit float
(``FLT_MAX``; llama-server would read ``1e39`` as infinity, which turns logits into NaN): for
``temperature``, whose soft maximum is infinity, and for the fields without limits.
``repeat_penalty``, ``frequency_penalty`` and ``presence_penalty`` are not clamped: llama.cpp's sampler
(``common/sampling.cpp``, ``common_sampler_init``) refuses them when they are not finite, and so does
:class:`~hydra_trio.engine.settings.SamplingParams`.

:func:`read_number` converts (and applies soft limits) when a body is parsed, for every field present;
:func:`check_hard` refuses a hard-limited value, and is called only for the field that is read (of a
setting under several names only that one is checked, as llama-server checks only that one).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import attrs

from ..engine.settings import FLT_MAX, INT32_MAX, INT32_MIN, UINT32_MAX, ParameterError
from ..validation.strict import TypeMismatch, type_name

INT64_MAX = 2**63 - 1
N_PROBS_MAX = 100
"""The most alternatives per token a reply carries (``n_probs``, ``logprobs``, ``top_logprobs``): a larger
value is read as this.  llama-server has no limit (it returns at most the vocabulary, 49152 tokens for
SmolLM2); each alternative costs work on the engine thread, which every slot shares, and memory in a reply
that is not streamed, so the node keeps it bounded.  llama-server's README says a reply has "at maximum"
``n_probs`` alternatives, so this is within its contract."""


@attrs.frozen
class NumField:
    """One numeric request field as llama-server's schema declares it.

    Attributes:
        ctype: the C type the value is read as: ``int32``, ``uint32`` (modulo ``2**32``), ``int64`` or
            ``float`` (32-bit).
        lo, hi: its limits (inclusive); a field without limits has its type's range.
        hard: out-of-range values are refused (:func:`check_hard`); otherwise they are clamped.
        clamp_float: a float beyond ``FLT_MAX`` becomes ``FLT_MAX`` (False: it stays infinite and
            :class:`~hydra_trio.engine.settings.SamplingParams` refuses it).
    """

    ctype: str
    lo: float = -math.inf
    hi: float = math.inf
    hard: bool = False
    clamp_float: bool = True

    def __attrs_post_init__(self) -> None:
        if self.ctype in ("int32", "uint32", "int64"):
            lo, hi = {"int32": (INT32_MIN, INT32_MAX), "uint32": (0, UINT32_MAX), "int64": (-INT64_MAX - 1, INT64_MAX)}[
                self.ctype
            ]
            object.__setattr__(self, "lo", max(lo, self.lo))
            object.__setattr__(self, "hi", min(hi, self.hi))
        elif self.clamp_float:
            object.__setattr__(self, "lo", max(-FLT_MAX, self.lo))
            object.__setattr__(self, "hi", min(FLT_MAX, self.hi))


_SOFT_01 = NumField("float", 0.0, 1.0)
_ANY_FLOAT = NumField("float")
_COUNT = NumField("int32", 0, INT32_MAX, hard=True)
_BUDGET = NumField("int32", -1, INT32_MAX, hard=True)
_WINDOW = NumField("int32", -1, INT32_MAX, hard=True)
"""A penalty window: llama-server's hard limits are 0 .. 2**31-1; -1 is also taken here, meaning the slot's
context, as earlier llama-server versions took it (their README's default for ``dry_penalty_last_n``), so that
clients written for those keep working."""
_ANY_INT = NumField("int32")
_PENALTY = NumField("float", clamp_float=False)

FIELDS: dict[str, NumField] = {
    # the token budget and its aliases (read: n_predict, max_completion_tokens, max_tokens)
    "n_predict": _BUDGET,
    "max_completion_tokens": _BUDGET,
    "max_tokens": _BUDGET,
    "n_keep": _BUDGET,
    "n_discard": _COUNT,
    "n_cache_reuse": _COUNT,
    # completions per request (hard 1 .. the slot count in llama-server; only 1 here, checked by the body)
    "n_cmpl": _ANY_INT,
    "n": _ANY_INT,
    "t_max_predict_ms": NumField("int64", -1, INT64_MAX, hard=True),
    "top_k": NumField("int32", 0, INT32_MAX),
    "top_p": _SOFT_01,
    "min_p": _SOFT_01,
    "xtc_probability": _SOFT_01,
    "xtc_threshold": _SOFT_01,
    "top_n_sigma": _ANY_FLOAT,
    "typical_p": _ANY_FLOAT,
    "temperature": NumField("float", 0.0),
    "dynatemp_range": _ANY_FLOAT,
    "dynatemp_exponent": _ANY_FLOAT,
    "repeat_last_n": _WINDOW,
    "repeat_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "presence_penalty": _PENALTY,
    "dry_multiplier": _ANY_FLOAT,
    "dry_base": _ANY_FLOAT,  # below 1: the node's default (llama-server's handler; SamplingParams' caller)
    "dry_allowed_length": _COUNT,
    "dry_penalty_last_n": _WINDOW,
    "mirostat": NumField("int32", 0, 2),
    "mirostat_tau": _ANY_FLOAT,
    "mirostat_eta": _ANY_FLOAT,
    "adaptive_target": NumField("float", -FLT_MAX, 1.0),
    "adaptive_decay": NumField("float", 0.0, 0.99, hard=True),
    "seed": NumField("uint32"),
    # alternatives per token: n_probs, its alias logprobs (completions); a chat's top_logprobs becomes n_probs
    "n_probs": _ANY_INT,
    "logprobs": _ANY_INT,
    "top_logprobs": _ANY_INT,
    "min_keep": _COUNT,
    "reasoning_budget_tokens": _BUDGET,
    "thinking_budget_tokens": _BUDGET,
}
"""Every numeric request field, under each of its names, as ``tools/server/server-schema.cpp`` declares it."""


def f32(x: float) -> float:
    """``x`` rounded to a 32-bit float, as llama.cpp stores it (beyond ``FLT_MAX``: infinity)."""
    return ctypes.c_float(x).value


def read_number(name: str, v: Any) -> int | float | None:
    """A JSON value of numeric field ``name`` (:data:`FIELDS`) converted to its C type, soft limits applied.

    ``None`` stays ``None`` (the default).  A hard-limited value is returned unchecked (:func:`check_hard`).
    A float beyond a double's range (the JSON number ``1e999``) is read as infinity, as llama-server reads it.

    Raises:
        TypeMismatch: not a number or a boolean; a ``seed`` that is not finite.
    """
    if v is None:
        return None
    if isinstance(v, bool):
        v = int(v)
    elif not isinstance(v, (int, float)):
        raise TypeMismatch(f"expected a number, got {type_name(v)}")
    spec = FIELDS[name]
    if spec.ctype == "float":
        try:
            x: float = float(v)
        except OverflowError:  # an integer beyond a double
            x = math.copysign(math.inf, v)
        if spec.clamp_float and math.isinf(f32(x)):
            x = math.copysign(FLT_MAX, x)
    elif isinstance(v, float) and not math.isfinite(v):
        if spec.ctype == "uint32":
            raise TypeMismatch(f"expected a finite number, got {v}")
        x = v
    else:
        x = math.trunc(v)
        if spec.ctype == "uint32":
            return x % (UINT32_MAX + 1)
    if spec.hard:
        return x
    y = min(spec.hi, max(spec.lo, x))
    return int(y) if spec.ctype != "float" else float(y)


def check_hard(name: str, value: int | float | None, spec_name: str | None = None) -> None:
    """Raise ParameterError naming ``name`` when ``value`` is outside the hard limits of field ``spec_name``
    (default ``name``): ``"n_keep: must be between -1 and 2147483647, got -2"``.  A float field is compared
    as llama-server compares it, in 32-bit floats.  ``None`` (absent) passes."""
    spec = FIELDS[spec_name or name]
    if value is None or not spec.hard:
        return
    if spec.ctype == "float":
        ok = f32(spec.lo) <= f32(value) <= f32(spec.hi)
    else:
        ok = spec.lo <= value <= spec.hi
    if not ok:
        lo, hi = (f"{spec.lo:g}", f"{spec.hi:g}") if spec.ctype == "float" else (spec.lo, spec.hi)
        raise ParameterError(f"{name}: must be between {lo} and {hi}, got {value}")


def n_probs(value: int | None) -> int:
    """Alternatives per token for an ``n_probs`` value (any 32-bit integer): at most :data:`N_PROBS_MAX`,
    and none for 0 or less (llama-server: "if greater than 0")."""
    return 0 if value is None else max(0, min(value, N_PROBS_MAX))
