"""The speculative-decoding settings: ``--spec-type`` and every ``--spec-*`` parameter, as data.

Names, spellings, environment variables, defaults and value checks are llama-server's
(``common_params_speculative`` in ``common/common.h``, the ``--spec-*``, ``-lcs``/``-lcd`` and ``--draft*``
options of ``common/arg.cpp``, ``common_speculative_types_from_names`` in ``common/speculative.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors), plus hydra-trio's own ``suffix`` type and its
``--spec-suffix-*`` parameters.  :data:`SPEC_OPTIONS` is the table the command line is generated from;
:func:`apply_option` applies one option's text to a :class:`SpecSettings`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs

SPEC_TYPES = (
    "none",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)
"""llama-server's ``--spec-type`` names, in its enum's order (``common_speculative_type``)."""
OWN_SPEC_TYPES = ("suffix",)
"""hydra-trio's own types."""
ALL_SPEC_TYPES = SPEC_TYPES + OWN_SPEC_TYPES
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
"""Types that need a draft context (a draft model or the model's MTP layers)."""
PRIORITY = (
    "suffix",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
)
"""The order drafters are asked in (``common_speculative_init``'s, with ``suffix`` first)."""

KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
"""``--spec-draft-type-k``/``-v`` values (``kv_cache_types`` of ``common/arg.cpp``)."""


def all_types_str() -> str:
    """Every type, comma-separated (the ``--spec-type`` value hint, ``common_speculative_all_types_str``)."""
    return ",".join(ALL_SPEC_TYPES)


def types_from_names(names: Iterable[str]) -> tuple[str, ...]:
    """``common_speculative_types_from_names``: the types named, in order; ``("none",)`` as soon as ``none``
    is met (names after it are not checked).

    Raises:
        ValueError: ``unknown speculative type: NAME`` (llama-server's message; names are case-sensitive and
            not stripped, so ``""`` from ``a,,b`` is unknown too).
    """
    out = []
    for name in names:
        if name not in ALL_SPEC_TYPES:
            raise ValueError(f"unknown speculative type: {name}")
        if name == "none":
            return ("none",)
        out.append(name)
    return tuple(out)


def parse_spec_type(text: str) -> tuple[str, ...]:
    """One ``--spec-type`` value: a comma-separated list (split as ``string_split``: no stripping)."""
    return types_from_names(text.split(","))


# --- value parsers, as llama-server's std::stoi / std::stof / its checks -------------------------------

_INT = re.compile(r"\s*([+-]?\d+)")
_FLOAT = re.compile(r"\s*([+-]?(?:inf(?:inity)?|nan|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?))", re.IGNORECASE)


def stoi(text: str) -> int:
    """``std::stoi``: leading space, a sign and digits; what follows is ignored.  Raises ValueError:
    ``stoi`` (no digits, or outside int32)."""
    m = _INT.match(text)
    if not m or not -(2**31) <= int(m.group(1)) < 2**31:
        raise ValueError("stoi")
    return int(m.group(1))


def stof(text: str) -> float:
    """``std::stof``: a float prefix (``inf``, ``nan`` too).  Raises ValueError: ``stof``."""
    m = _FLOAT.match(text)
    if not m:
        raise ValueError("stof")
    return float(m.group(1))


def _stod_whole(text: str) -> float:
    """``std::stod`` of the stripped text, which it must consume whole.  Raises ValueError: invalid value."""
    text = text.strip()
    m = _FLOAT.fullmatch(text)
    if not m:
        raise ValueError("invalid value")
    return float(m.group(1))


def _int_in(lo: int, hi: int | None, message: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = stoi(text)
        if v < lo or (hi is not None and v > hi):
            raise ValueError(message)
        return v

    return parse


def _uint16_at_least_1(text: str) -> int:
    """``--spec-ngram-*-min-hits``: at least 1, stored in a uint16 (wraps as llama-server's does)."""
    v = stoi(text)
    if v < 1:
        raise ValueError("ngram min hits must be at least 1")
    return v & 0xFFFF


def _threads(text: str) -> int:
    v = stoi(text)
    return v if v > 0 else (os.cpu_count() or 1)


def _gpu_layers(text: str) -> int:
    return -1 if text == "auto" else -2 if text == "all" else stoi(text)


def _cache_type(text: str) -> str:
    if text not in KV_CACHE_TYPES:
        raise ValueError(f"Unsupported cache type: {text}")
    return text


def _synth_len(text: str) -> float:
    v = _stod_whole(text)
    if v == -1.0:
        raise ValueError("invalid value")
    return v


def _synth_rates(text: str) -> tuple[float, ...]:
    return tuple(_stod_whole(part) for part in text.split(","))


def _row_cost(text: str) -> float:
    """``--spec-budget-row-cost``: ``auto`` (-1) or a number in [0, 100]."""
    return -1.0 if text == "auto" else _float_in(0.0, 100.0)(text)


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        v = stof(text)
        if not (lo <= v <= hi) or math.isnan(v):
            raise ValueError(f"must be between {lo} and {hi}")
        return v

    return parse


@attrs.frozen
class SpecSettings:
    """Every speculative-decoding parameter, llama-server's defaults (``common_params_speculative``).

    ``types`` is the list as llama-server keeps it: ``("none",)`` then what each ``--spec-type`` added
    (:attr:`enabled` is what runs).  Draft-model fields that mean "the main model's value" hold None;
    CPU masks, devices and tensor overrides hold the option's text as given (the command line checks them
    with the main model's parsers).  Counts are tokens; probabilities are in [0, 1].
    """

    types: tuple[str, ...] = ("none",)
    synth_len: float = -1.0
    synth_rates: tuple[float, ...] = ()
    # draft model (draft-simple) and MTP / EAGLE3 / DFlash drafting
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_split: float = 0.1
    draft_p_min: float = 0.0
    draft_backend_sampling: bool = True
    draft_model: str = ""
    draft_hf_repo: str = ""
    draft_n_gpu_layers: int = -1  # -1: auto, -2: all
    draft_cache_type_k: str = "f16"
    draft_cache_type_v: str = "f16"
    draft_threads: int | None = None
    draft_threads_batch: int | None = None
    draft_cpu_mask: str | None = None
    draft_cpu_range: str | None = None
    draft_cpu_strict: int | None = None
    draft_prio: int | None = None
    draft_poll: int | None = None
    draft_cpu_mask_batch: str | None = None
    draft_cpu_strict_batch: int | None = None
    draft_prio_batch: int | None = None
    draft_poll_batch: int | None = None
    draft_devices: str | None = None
    draft_override_tensor: tuple[str, ...] = ()
    draft_cpu_moe: bool = False
    draft_n_cpu_moe: int = 0
    # n-gram types
    ngram_mod_n_match: int = 24
    ngram_mod_n_max: int = 64
    ngram_mod_n_min: int = 48
    ngram_simple_size_n: int = 12
    ngram_simple_size_m: int = 48
    ngram_simple_min_hits: int = 1
    ngram_map_k_size_n: int = 12
    ngram_map_k_size_m: int = 48
    ngram_map_k_min_hits: int = 1
    ngram_map_k4v_size_n: int = 12
    ngram_map_k4v_size_m: int = 48
    ngram_map_k4v_min_hits: int = 1
    lookup_cache_static: str = ""
    lookup_cache_dynamic: str = ""
    # suffix (hydra-trio's own)
    suffix_n_max: int = 64
    suffix_max_depth: int = 64
    suffix_min_match: int = 3
    suffix_max_spec_factor: float = 1.0
    suffix_max_spec_offset: float = 0.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_tokens: int = 262144
    # the draft budget (hydra-trio's own, every type)
    budget_row_cost: float = -1.0  # -1: auto (speculative/budget.py)

    @property
    def enabled(self) -> tuple[str, ...]:
        """The types that run, in :data:`PRIORITY` order (``none`` in the list disables nothing)."""
        return tuple(t for t in PRIORITY if t in self.types)

    def n_max(self) -> int:
        """The most tokens any enabled type drafts (``common_speculative_n_max``)."""
        per_type = {
            "ngram-simple": self.ngram_simple_size_m,
            "ngram-map-k": self.ngram_map_k_size_m,
            "ngram-map-k4v": self.ngram_map_k4v_size_m,
            "ngram-mod": max(0, self.ngram_mod_n_max),
            "ngram-cache": 8,
            "suffix": max(0, self.suffix_n_max),
        }
        return max((per_type.get(t, max(0, self.draft_n_max)) for t in self.enabled), default=0)


@attrs.frozen
class SpecOption:
    """One option of :data:`SPEC_OPTIONS`.

    Attributes:
        names: the spellings, llama-server's order.
        field: the :class:`SpecSettings` field it sets (None: ``--spec-default`` and removed options).
        meaning: the help text.
        value: the value hint; None for a switch.
        env: llama-server's environment variable, if any.
        parse: text -> field value; raises ValueError with llama-server's message (None: the text as is).
        neg: the negative spellings of a switch.
        removed: for an option llama-server removed, the advice of its error.
        own: hydra-trio's option, not llama-server's.
    """

    names: tuple[str, ...]
    field: str | None
    meaning: str
    value: str | None = "N"
    env: str | None = None
    parse: Callable[[str], Any] | None = None
    neg: tuple[str, ...] = ()
    removed: str = ""
    own: bool = False

    @property
    def default(self) -> Any:
        """The field's default (:class:`SpecSettings`)."""
        return attrs.fields_dict(SpecSettings)[self.field].default if self.field else None


def _o(names: tuple[str, ...], field: str | None, meaning: str, value: str | None = "N", **kw: Any) -> SpecOption:
    return SpecOption(names, field, meaning, value, **kw)


def _ngram(kind: str, field: str) -> list[SpecOption]:
    return [
        _o(
            (f"--spec-{kind}-size-n",),
            f"{field}_size_n",
            f"ngram size N for {kind} speculative decoding, length of lookup n-gram",
            parse=_int_in(1, 1024, "ngram size N must be between 1 and 1024 inclusive"),
        ),
        _o(
            (f"--spec-{kind}-size-m",),
            f"{field}_size_m",
            f"ngram size M for {kind} speculative decoding, length of draft m-gram",
            parse=_int_in(1, 1024, "ngram size M must be between 1 and 1024 inclusive"),
        ),
        _o(
            (f"--spec-{kind}-min-hits",),
            f"{field}_min_hits",
            f"minimum hits for {kind} speculative decoding",
            parse=_uint16_at_least_1,
        ),
    ]


_PRIO = _int_in(0, 3, "invalid value")
_BOOL01 = stoi

SPEC_OPTIONS: tuple[SpecOption, ...] = (
    _o(
        ("-lcs", "--lookup-cache-static"),
        "lookup_cache_static",
        "path to static lookup cache to use for lookup decoding (not updated by generation)",
        "FNAME",
    ),
    _o(
        ("-lcd", "--lookup-cache-dynamic"),
        "lookup_cache_dynamic",
        "path to dynamic lookup cache to use for lookup "
        "decoding (loaded at start; llama-server does not write it back)",
        "FNAME",
    ),
    _o(
        ("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"),
        "draft_hf_repo",
        "Same as --hf-repo, but for the draft model (default: unused)",
        "<user>/<model>[:quant]",
        env="LLAMA_ARG_SPEC_DRAFT_HF_REPO",
    ),
    _o(
        ("--spec-draft-threads", "-td", "--threads-draft"),
        "draft_threads",
        "number of threads to use during generation (default: same as --threads)",
        parse=_threads,
    ),
    _o(
        ("--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"),
        "draft_threads_batch",
        "number of threads to use during batch and prompt processing (default: same as --threads-draft)",
        parse=_threads,
    ),
    _o(
        ("--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft"),
        "draft_cpu_mask",
        "Draft model CPU affinity mask. Complements cpu-range-draft (default: same as --cpu-mask)",
        "M",
    ),
    _o(
        ("--spec-draft-cpu-range", "-Crd", "--cpu-range-draft"),
        "draft_cpu_range",
        "Ranges of CPUs for affinity. Complements --cpu-mask-draft",
        "lo-hi",
    ),
    _o(
        ("--spec-draft-cpu-strict", "--cpu-strict-draft"),
        "draft_cpu_strict",
        "Use strict CPU placement for draft model (default: same as --cpu-strict)",
        "<0|1>",
        parse=_BOOL01,
    ),
    _o(
        ("--spec-draft-prio", "--prio-draft"),
        "draft_prio",
        "set draft process/thread priority : 0-normal, 1-medium, 2-high, 3-realtime (default: 0)",
        parse=_PRIO,
    ),
    _o(
        ("--spec-draft-poll", "--poll-draft"),
        "draft_poll",
        "Use polling to wait for draft model work (default: same as --poll)",
        "<0|1>",
        parse=_BOOL01,
    ),
    _o(
        ("--spec-draft-cpu-mask-batch", "-Cbd", "--cpu-mask-batch-draft"),
        "draft_cpu_mask_batch",
        "Draft model CPU affinity mask. Complements cpu-range-draft (default: same as --cpu-mask)",
        "M",
    ),
    _o(
        ("--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft"),
        "draft_cpu_strict_batch",
        "Use strict CPU placement for draft model (default: --cpu-strict-draft)",
        "<0|1>",
        parse=_BOOL01,
    ),
    _o(
        ("--spec-draft-prio-batch", "--prio-batch-draft"),
        "draft_prio_batch",
        "set draft process/thread priority : 0-normal, 1-medium, 2-high, 3-realtime (default: 0)",
        parse=_PRIO,
    ),
    _o(
        ("--spec-draft-poll-batch", "--poll-batch-draft"),
        "draft_poll_batch",
        "Use polling to wait for draft model work (default: --poll-draft)",
        "<0|1>",
        parse=_BOOL01,
    ),
    _o(
        ("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"),
        "draft_cache_type_k",
        f"KV cache data type for K for the draft model (allowed values: {', '.join(KV_CACHE_TYPES)})",
        "TYPE",
        env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
        parse=_cache_type,
    ),
    _o(
        ("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"),
        "draft_cache_type_v",
        f"KV cache data type for V for the draft model (allowed values: {', '.join(KV_CACHE_TYPES)})",
        "TYPE",
        env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
        parse=_cache_type,
    ),
    _o(
        ("--spec-draft-override-tensor", "-otd", "--override-tensor-draft"),
        "draft_override_tensor",
        "override tensor buffer type for draft model",
        "<tensor name pattern>=<buffer type>,...",
    ),
    _o(
        ("--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft"),
        "draft_cpu_moe",
        "keep all Mixture of Experts (MoE) weights in the CPU for the draft model",
        None,
        env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE",
    ),
    _o(
        ("--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft"),
        "draft_n_cpu_moe",
        "keep the Mixture of Experts (MoE) weights of the first N layers in the CPU for the draft model",
        env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",
        parse=_int_in(0, None, "invalid value"),
    ),
    _o(
        ("--spec-draft-n-max",),
        "draft_n_max",
        "number of tokens to draft for speculative decoding",
        env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
        parse=_int_in(0, None, "invalid value"),
    ),
    _o(
        ("--spec-draft-n-min",),
        "draft_n_min",
        "minimum number of draft tokens to use for speculative decoding",
        env="LLAMA_ARG_SPEC_DRAFT_N_MIN",
        parse=stoi,
    ),
    _o(
        ("--spec-synth-len",),
        "synth_len",
        "target mean synthetic acceptance length, including the target token (benchmarking only)",
        "L",
        env="LLAMA_ARG_SPEC_SYNTH_LEN",
        parse=_synth_len,
    ),
    _o(
        ("--spec-synth-rates",),
        "synth_rates",
        "comma-separated unconditional per-position synthetic acceptance probabilities (benchmarking only)",
        "P0,P1,...",
        env="LLAMA_ARG_SPEC_SYNTH_RATES",
        parse=_synth_rates,
    ),
    _o(
        ("--spec-draft-p-split", "--draft-p-split"),
        "draft_p_split",
        "speculative decoding split probability",
        "P",
        env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT",
        parse=stof,
    ),
    _o(
        ("--spec-draft-p-min", "--draft-p-min"),
        "draft_p_min",
        "minimum speculative decoding probability (greedy)",
        "P",
        env="LLAMA_ARG_SPEC_DRAFT_P_MIN",
        parse=stof,
    ),
    _o(
        ("--spec-draft-backend-sampling",),
        "draft_backend_sampling",
        "offload draft sampling to the backend",
        None,
        env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING",
        neg=("--no-spec-draft-backend-sampling",),
    ),
    _o(
        ("--spec-draft-device", "-devd", "--device-draft"),
        "draft_devices",
        "comma-separated list of devices to "
        "use for offloading the draft model (none = don't offload, default: follows --device)",
        "<dev1,dev2,..>",
    ),
    _o(
        ("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"),
        "draft_n_gpu_layers",
        "max. number of draft model layers to store in VRAM, either an exact number, 'auto', or 'all'",
        env="LLAMA_ARG_N_GPU_LAYERS_DRAFT",
        parse=_gpu_layers,
    ),
    _o(
        ("--spec-draft-model", "-md", "--model-draft"),
        "draft_model",
        "draft model for speculative decoding (default: unused)",
        "FNAME",
        env="LLAMA_ARG_SPEC_DRAFT_MODEL",
    ),
    _o(
        ("--spec-type",),
        "types",
        "comma-separated list of types of speculative decoding to use; repeatable, each adds to the list",
        all_types_str(),
        env="LLAMA_ARG_SPEC_TYPE",
        parse=parse_spec_type,
    ),
    _o(
        ("--spec-ngram-mod-n-min",),
        "ngram_mod_n_min",
        "minimum number of ngram tokens to use for ngram-based speculative decoding",
        parse=_int_in(0, 1024, "ngram n-min must be between 0 and 1024 inclusive"),
    ),
    _o(
        ("--spec-ngram-mod-n-max",),
        "ngram_mod_n_max",
        "maximum number of ngram tokens to use for ngram-based speculative decoding",
        parse=_int_in(0, 1024, "ngram n-max must be between 0 and 1024 inclusive"),
    ),
    _o(
        ("--spec-ngram-mod-n-match",),
        "ngram_mod_n_match",
        "ngram-mod lookup length",
        parse=_int_in(1, 1024, "ngram size N must be between 1 and 1024 inclusive"),
    ),
    *_ngram("ngram-simple", "ngram_simple"),
    *_ngram("ngram-map-k", "ngram_map_k"),
    *_ngram("ngram-map-k4v", "ngram_map_k4v"),
    _o(
        ("--draft", "--draft-n", "--draft-max"),
        None,
        "the argument has been removed. use --spec-draft-n-max or --spec-ngram-mod-n-max",
        env="LLAMA_ARG_DRAFT_MAX",
        removed="use --spec-draft-n-max or --spec-ngram-mod-n-max",
    ),
    _o(
        ("--draft-min", "--draft-n-min"),
        None,
        "the argument has been removed. use --spec-draft-n-min or --spec-ngram-mod-n-min",
        env="LLAMA_ARG_DRAFT_MIN",
        removed="use --spec-draft-n-min or --spec-ngram-mod-n-min",
    ),
    _o(
        ("--spec-ngram-size-n",),
        None,
        "the argument has been removed. use the respective --spec-ngram-*-size-n or --spec-ngram-mod-n-match",
        removed="use the respective --spec-ngram-*-size-n",
    ),
    _o(
        ("--spec-ngram-size-m",),
        None,
        "the argument has been removed. use the respective --spec-ngram-*-size-m",
        removed="use the respective --spec-ngram-*-size-m",
    ),
    _o(
        ("--spec-ngram-min-hits",),
        None,
        "the argument has been removed. use the respective --spec-ngram-*-min-hits",
        removed="use the respective --spec-ngram-*-min-hits",
    ),
    _o(
        ("--spec-default",),
        None,
        "enable default speculative decoding config (ngram-mod, n-match 24, n-min 48, n-max 64)",
        None,
    ),
    # hydra-trio's own: the suffix type
    _o(
        ("--spec-suffix-n-max",),
        "suffix_n_max",
        "suffix: most tokens drafted at a step",
        own=True,
        parse=_int_in(0, 1024, "suffix n-max must be between 0 and 1024 inclusive"),
    ),
    _o(
        ("--spec-suffix-max-depth",),
        "suffix_max_depth",
        "suffix: longest context suffix matched (tokens)",
        own=True,
        parse=_int_in(1, 1024, "suffix max depth must be between 1 and 1024 inclusive"),
    ),
    _o(
        ("--spec-suffix-min-match",),
        "suffix_min_match",
        "suffix: shortest match that drafts (tokens)",
        own=True,
        parse=_int_in(1, 64, "suffix min match must be between 1 and 64 inclusive"),
    ),
    _o(
        ("--spec-suffix-max-spec-factor",),
        "suffix_max_spec_factor",
        "suffix: a draft is at most FACTOR x the match length + OFFSET tokens",
        "FACTOR",
        own=True,
        parse=_float_in(0.0, 1024.0),
    ),
    _o(
        ("--spec-suffix-max-spec-offset",),
        "suffix_max_spec_offset",
        "suffix: see --spec-suffix-max-spec-factor",
        "OFFSET",
        own=True,
        parse=_float_in(-1024.0, 1024.0),
    ),
    _o(
        ("--spec-suffix-min-token-prob",),
        "suffix_min_token_prob",
        "suffix: a drafted token's estimated acceptance "
        "probability (match counts and the slot's observed acceptance) must reach P",
        "P",
        own=True,
        parse=_float_in(0.0, 1.0),
    ),
    _o(
        ("--spec-suffix-cache-tokens",),
        "suffix_cache_tokens",
        "suffix: tokens of finished requests kept for "
        "matching (least recently used requests evicted first; 0: only the request's own)",
        own=True,
        parse=_int_in(0, 2**31 - 1, "suffix cache tokens must be between 0 and 2147483647 inclusive"),
    ),
    _o(
        ("--spec-budget-row-cost",),
        "budget_row_cost",
        "every type: what one more verified row costs over a decode "
        "step; drafts are cut to the length that yields the most tokens per cost for the slot's observed "
        "acceptance (0: verify every draft whole, as llama-server; auto: on the CPU 0.5 plus 0.09 for each "
        "1,000 tokens of the slot's context, else 0)",
        "R|auto",
        own=True,
        parse=_row_cost,
    ),
)
"""Every speculative-decoding option of llama-server's (``common/arg.cpp``) and hydra-trio's ``suffix`` ones."""

_BY_NAME = {name: opt for opt in SPEC_OPTIONS for name in opt.names + opt.neg}


def spec_option(name: str) -> SpecOption:
    """The option spelled ``name`` (any spelling).  Raises KeyError: no such option."""
    return _BY_NAME[name]


def apply_option(settings: SpecSettings, name: str, text: str | None = None) -> SpecSettings:
    """``settings`` with option ``name`` applied (``text``: its value; None for a switch).

    ``--spec-type`` adds to :attr:`SpecSettings.types`; ``--spec-draft-override-tensor`` adds a pattern;
    ``--spec-default`` adds ``ngram-mod`` with n-match 24, n-min 48, n-max 64.

    Raises:
        ValueError: a bad value (llama-server's message), a removed option (``the argument has been
            removed. ...``), or a value missing / given to a switch.
        KeyError: no such option.
    """
    opt = _BY_NAME[name]
    if opt.removed:
        if text is not None:
            stoi(text)  # llama-server reads a removed option's value as an int before it refuses the option
        raise ValueError(f"the argument has been removed. {opt.removed}")
    if opt.value is None:
        if text is not None:
            raise ValueError(f"{name} takes no value")
        if opt.field is None:  # --spec-default
            return attrs.evolve(
                settings,
                types=settings.types + ("ngram-mod",),
                ngram_mod_n_match=24,
                ngram_mod_n_min=48,
                ngram_mod_n_max=64,
            )
        flag: dict[str, Any] = {opt.field: name not in opt.neg}
        return attrs.evolve(settings, **flag)
    if text is None:
        raise ValueError(f"{name} expects a value")
    assert opt.field is not None
    value: Any = opt.parse(text) if opt.parse else text
    if opt.field == "types":
        value = settings.types + value
    elif opt.field == "draft_override_tensor":
        value = settings.draft_override_tensor + (text,)
    changes: dict[str, Any] = {opt.field: value}
    return attrs.evolve(settings, **changes)
