"""Request and engine parameters that reach llama.cpp, with their bounds, in one place.

Every parameter that sizes an allocation or a loop in llama.cpp (a sampler's
window, a count, a token budget) is checked here *before* it reaches
llama.cpp, and integers that llama.cpp takes as 32-bit are checked against
that range instead of being wrapped by ctypes.  The HTTP API (400), the Hydra
protocol (BAD_REQUEST) and CONFIGURE all go through these checks, and their
errors name the field.

=====================  ==============================  =======================================
field                  accepted                        meaning at the edges
=====================  ==============================  =======================================
temperature            0 .. FLT_MAX                    0: greedy
top_k                  -1 .. 2**31-1                   <= 0: off; above the vocabulary: all
top_p, min_p           0 .. 1
seed                   -1 .. 2**32-1, or null          -1, null, 2**32-1: a random seed
repeat_penalty         > 0, finite, 1/value finite     1: off (llama.cpp's own rule)
repeat_last_n          -1 .. 2**31-1                   -1: the slot's context; 0: off
presence_penalty,      finite                          0: off
frequency_penalty
min_keep               0 .. 2**31-1                    tokens top-p, min-p, typical, XTC keep
typical_p              finite                          >= 1: off
top_n_sigma            finite                          <= 0: off
xtc_probability        0 .. 1                          0: off
xtc_threshold          0 .. 1                          > 0.5: off
dry_multiplier         finite                          0: off
dry_base               1 .. FLT_MAX                    (a request's value < 1: the default)
dry_allowed_length     0 .. 2**31-1
dry_penalty_last_n     -1 .. 2**31-1                   -1: the slot's context; 0: off
dry_sequence_breakers  at most 16 strings of 1 to 40   none: DRY never stops at a breaker
                       UTF-8 bytes each
mirostat               0, 1, 2                         0: off; 1, 2: Mirostat 1.0 / 2.0
mirostat_tau           finite                          target surprise, bits
mirostat_eta           finite                          learning rate
dynatemp_range         finite                          <= 0: off
dynatemp_exponent      finite
n_predict              -1 .. 2**31-1                   -1: until end of generation / context
max_tokens,            -1 .. 2**31-1                   as n_predict (llama-server's aliases);
max_completion_tokens                                  0: process the prompt only
stop                   at most 16 strings of at most
                       512 characters each
=====================  ==============================  =======================================

"finite" is finite as a 32-bit float, the type llama.cpp holds these in (at most ``FLT_MAX``, about
3.4e38).  These are the values the engine runs: the node's flags and CONFIGURE are refused outside them.
A request's fields are first read as llama-server reads them (:mod:`hydra_trio.openai.field_limits`: soft
limits clamp, hard limits refuse), which gives a value inside but for the penalties, refused here as
llama.cpp's ``common_sampler_init`` refuses them (``common/sampling.cpp``).

The penalty windows (``repeat_last_n``, ``dry_penalty_last_n``) are clamped to the slot's context when
the sampler is built (a window larger than the context sees the same tokens), so the samplers' ring
buffers are at most ``n_ctx_slot`` tokens (llama.cpp would allocate the whole window up front).
llama.cpp truncates a DRY sequence breaker to 40 bytes; a longer one is
refused here instead.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import attrs

from ..errors import InvalidRequest, ModelLoadError
from ..protocol.media import MediaSettings
from .speculative.settings import SpecSettings

DEFAULT_PATTERN = r"ffn_(up|down|gate)_exps"
"""The tensors a COMBINED head places on its peer: the MoE experts (``--combined-pattern``)."""

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
UINT32_MAX = 2**32 - 1
FLT_MAX = 3.4028234663852886e38
"""The largest finite 32-bit float (C's ``FLT_MAX``): llama.cpp holds sampler settings as ``float``."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_BYTES = 40  # llama.cpp's MAX_CHAR_LEN in llama_sampler_init_dry
DEFAULT_DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")
"""llama-server's default DRY sequence breakers (``common/common.h``)."""
SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
"""The sampler chain's order, llama-server's default ``samplers`` under its names (``common/sampling.cpp``)."""
SAMPLER_CHARS = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "t": "temperature",
    "x": "xtc",
    "i": "infill",
    "e": "penalties",
    "a": "adaptive_p",
}
"""llama-server's one-letter sampler names (``common_sampler_type_to_chr``): ``samplers`` as a string."""
SAMPLER_NAMES: dict[str, str] = {
    **{c: c for c in SAMPLER_CHARS.values()},
    **{c.replace("_", "-"): c for c in SAMPLER_CHARS.values() if "_" in c},
    **{c.replace("_", ""): c for c in SAMPLER_CHARS.values() if "_" in c},
    "nucleus": "top_p",
    "temp": "temperature",
    "typ": "typ_p",
}
"""Every sampler name llama-server accepts (``common_sampler_types_from_names``: canonical, kebab-case,
without the underscore, and three aliases; matched case-insensitively) -> the canonical name."""
MAX_SAMPLERS = 64
N_PARALLEL_MAX = 256
"""The most slots a node runs: llama.cpp's most sequences per context (``LLAMA_MAX_SEQ``,
src/llama-cparams.h).  ``-np`` / ``--parallel``, :class:`EngineConfig` and CONFIGURE ``n_parallel`` all take
1 .. this (:func:`check_n_parallel`)."""


def parse_samplers(value: Any) -> tuple[str, ...]:
    """llama-server's ``samplers``: a list of names (:data:`SAMPLER_NAMES`, any case) or a string of
    one-letter names (:data:`SAMPLER_CHARS`), in the chain's order -> canonical names.

    llama-server drops a name it does not know with a warning; here it is an error, as every
    other field that would be silently ignored.

    Raises:
        ParameterError: not a list of strings or a string, an unknown name, or more than 64 stages.
    """
    if isinstance(value, str):
        unknown = [c for c in value if c not in SAMPLER_CHARS]
        if unknown:
            raise ParameterError(f"samplers: unknown sampler letter {unknown[0]!r} (letters: {''.join(SAMPLER_CHARS)})")
        out = tuple(SAMPLER_CHARS[c] for c in value)
    elif isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        names: list[str] = []
        for x in value:
            name = SAMPLER_NAMES.get(x.lower())
            if name is None:
                raise ParameterError(
                    f"samplers: unknown sampler {x[:40]!r} (known: {', '.join(SAMPLER_CHARS.values())})"
                )
            names.append(name)
        out = tuple(names)
    else:
        raise ParameterError("samplers: expected a list of sampler names or a string of sampler letters")
    if len(out) > MAX_SAMPLERS:
        raise ParameterError(f"samplers: at most {MAX_SAMPLERS} stages, got {len(out)}")
    return out


class ParameterError(InvalidRequest, ValueError):
    """A parameter is out of its bounds; the message names it (HTTP 400 / Hydra BAD_REQUEST)."""


def check_int(name: str, value: int, lo: int, hi: int) -> None:
    """Raise ParameterError unless ``lo <= value <= hi``."""
    if not lo <= value <= hi:
        raise ParameterError(f"{name}: must be between {lo} and {hi}, got {value}")


def check_n_parallel(value: int) -> None:
    """Raise ParameterError unless ``1 <= value <=`` :data:`N_PARALLEL_MAX` (the one bound of the slot count)."""
    check_int("n_parallel", value, 1, N_PARALLEL_MAX)


def check_float(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Raise ParameterError unless ``value`` is finite and in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if not math.isfinite(value):
        raise ParameterError(f"{name}: must be a finite number, got {value}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise ParameterError(f"{name}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}")


def check_float32(name: str, value: float, lo: float = -FLT_MAX, hi: float = FLT_MAX) -> None:
    """Raise ParameterError unless ``value`` is finite as a 32-bit float (what llama.cpp receives) and, as
    that float, in ``[lo, hi]``."""
    v = ctypes.c_float(value).value
    if not math.isfinite(v):
        raise ParameterError(f"{name}: must be a finite number (at most {FLT_MAX:.8g} in size), got {value:g}")
    if not lo <= v <= hi:
        at_least = f"at least {lo:g}" if hi == FLT_MAX else f"in [{lo:g}, {hi:g}]"
        raise ParameterError(f"{name}: must be {at_least}, got {value:g}")


def check_repeat_penalty(value: float) -> None:
    """llama.cpp's rule for ``repeat_penalty`` (``common_sampler_init``, ``common/sampling.cpp``): finite,
    greater than 0, and 1/value finite, all as 32-bit floats (the penalty divides positive logits)."""
    v = ctypes.c_float(value).value
    if not (math.isfinite(v) and v > 0.0 and math.isfinite(ctypes.c_float(1.0 / v).value)):
        raise ParameterError(f"repeat_penalty: must be finite and greater than 0 (1/value finite too), got {value:g}")


def _int(lo: int, hi: int) -> Any:
    def v(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check_int(attr.name, value, lo, hi)

    return v


def _float(lo: float, hi: float, *, lo_open: bool = False) -> Any:
    def v(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_float(attr.name, value, lo, hi, lo_open=lo_open)

    return v


def _float32(lo: float = -FLT_MAX, hi: float = FLT_MAX) -> Any:
    def v(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_float32(attr.name, value, lo, hi)

    return v


def _repeat_penalty(_inst: Any, _attr: attrs.Attribute[Any], value: float) -> None:
    check_repeat_penalty(value)


def check_dry_sequence_breakers(breakers: tuple[str, ...]) -> None:
    """DRY sequence breakers: at most 16 strings, each 1 to 40 UTF-8 bytes (llama.cpp's own limit) without NUL."""
    name = "dry_sequence_breakers"
    if len(breakers) > MAX_DRY_BREAKERS:
        raise ParameterError(f"{name}: at most {MAX_DRY_BREAKERS} sequence breakers, got {len(breakers)}")
    for i, s in enumerate(breakers):
        if not isinstance(s, str):
            raise ParameterError(f"{name}[{i}]: expected a string, got {type(s).__name__}")
        try:
            n = len(s.encode("utf-8"))
        except UnicodeEncodeError:
            raise ParameterError(f"{name}[{i}]: not valid Unicode (a lone surrogate)") from None
        if not 1 <= n <= MAX_DRY_BREAKER_BYTES or "\0" in s:
            raise ParameterError(
                f"{name}[{i}]: must be 1 to {MAX_DRY_BREAKER_BYTES} UTF-8 bytes without NUL, got {n} bytes"
            )


def _breakers_tuple(value: Any) -> tuple[str, ...]:
    """attrs converter: a list of strings becomes a tuple; a bare string is refused (not split into characters)."""
    if isinstance(value, (str, bytes)):
        raise ParameterError("dry_sequence_breakers: expected a list of strings, got a string")
    return tuple(value)


def _breakers(_inst: Any, _attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    check_dry_sequence_breakers(value)


@attrs.frozen
class SamplingParams:
    """Sampler settings; names, defaults and meanings follow llama-server, bounds in the module docstring.

    Defaults are llama.cpp's ``common_params_sampling`` (``common/common.h``)
    at the version this package runs; the sampler order is llama-server's
    (:func:`hydra_trio.engine.batching.sampling.build_sampler`).
    ``temperature <= 0`` means greedy.  ``seed`` None (or -1) picks a random seed.

    Raises:
        ParameterError: a value out of its bounds (also from ``attrs.evolve``).
    """

    temperature: float = attrs.field(default=0.8, validator=_float32(0.0))
    top_k: int = attrs.field(default=40, validator=_int(-1, INT32_MAX))
    top_p: float = attrs.field(default=0.95, validator=_float(0.0, 1.0))
    min_p: float = attrs.field(default=0.05, validator=_float(0.0, 1.0))
    seed: int | None = attrs.field(default=None, validator=_int(-1, UINT32_MAX))
    repeat_penalty: float = attrs.field(default=1.0, validator=_repeat_penalty)
    repeat_last_n: int = attrs.field(default=64, validator=_int(-1, INT32_MAX))
    presence_penalty: float = attrs.field(default=0.0, validator=_float32())
    frequency_penalty: float = attrs.field(default=0.0, validator=_float32())
    min_keep: int = attrs.field(default=0, validator=_int(0, INT32_MAX))
    typical_p: float = attrs.field(default=1.0, validator=_float32())
    top_n_sigma: float = attrs.field(default=-1.0, validator=_float32())
    xtc_probability: float = attrs.field(default=0.0, validator=_float(0.0, 1.0))
    xtc_threshold: float = attrs.field(default=0.1, validator=_float(0.0, 1.0))
    dry_multiplier: float = attrs.field(default=0.0, validator=_float32())
    dry_base: float = attrs.field(default=1.75, validator=_float32(1.0))
    dry_allowed_length: int = attrs.field(default=2, validator=_int(0, INT32_MAX))
    dry_penalty_last_n: int = attrs.field(default=64, validator=_int(-1, INT32_MAX))
    dry_sequence_breakers: tuple[str, ...] = attrs.field(
        default=DEFAULT_DRY_SEQUENCE_BREAKERS, converter=_breakers_tuple, validator=_breakers
    )
    mirostat: int = attrs.field(default=0, validator=_int(0, 2))
    mirostat_tau: float = attrs.field(default=5.0, validator=_float32())
    mirostat_eta: float = attrs.field(default=0.1, validator=_float32())
    dynatemp_range: float = attrs.field(default=0.0, validator=_float32())
    dynatemp_exponent: float = attrs.field(default=1.0, validator=_float32())

    def penalty_window(self, n_ctx_slot: int) -> int:
        """Tokens the repetition penalties look back over: ``repeat_last_n`` (-1: the context), at most
        ``n_ctx_slot``."""
        n = n_ctx_slot if self.repeat_last_n < 0 else self.repeat_last_n
        return min(n, n_ctx_slot)

    def dry_window(self, n_ctx_slot: int) -> int:
        """Tokens DRY scans for repetitions: ``dry_penalty_last_n`` (-1: the context), at most ``n_ctx_slot``."""
        n = n_ctx_slot if self.dry_penalty_last_n < 0 else self.dry_penalty_last_n
        return min(n, n_ctx_slot)

    @property
    def dry_enabled(self) -> bool:
        """DRY changes logits: llama.cpp's own test (``multiplier != 0``, ``base >= 1``, a non-empty window)."""
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    def to_json(self) -> dict[str, Any]:
        """Every field under llama-server's name (``task_params::to_json``): ``seed`` -1 when unset, lists for
        tuples, a float field a JSON float (``1.0``, as llama-server writes it, though a request gave ``1``)."""
        out: dict[str, Any] = attrs.asdict(self, recurse=False)
        for name in _FLOAT_FIELDS:
            out[name] = float(out[name])
        out["seed"] = -1 if self.seed is None else self.seed
        out["dry_sequence_breakers"] = list(self.dry_sequence_breakers)
        return out

    def seed_u32(self) -> int:
        """The seed for llama.cpp's ``dist`` sampler: ``LLAMA_DEFAULT_SEED`` (0xFFFFFFFF, random) when unset or -1."""
        return UINT32_MAX if self.seed is None or self.seed < 0 else self.seed


_FLOAT_FIELDS = tuple(a.name for a in attrs.fields(SamplingParams) if a.type == "float")


def check_n_predict(name: str, value: int | None, lo: int = -1) -> None:
    """Token budgets: ``n_predict`` in [-1, 2**31-1], ``max_tokens`` / ``max_completion_tokens`` the same (``lo`` raises
    the floor)."""
    if value is not None:
        check_int(name, value, lo, INT32_MAX)


@attrs.frozen
class GenerationDefaults:
    """What llama-server's command line sets for every request besides the sampler settings: its
    ``params_base``, which a request's own field replaces (``tools/server/server-schema.cpp`` of the
    llama.cpp that llama-cpp-python 0.3.36 vendors).

    Attributes:
        samplers: the chain's order under llama-server's canonical names (``--samplers``, ``--sampler-seq``);
            None: llama-server's default order (:data:`SAMPLER_ORDER`).
        ignore_eos: keep generating past end-of-generation tokens (``--ignore-eos``).
        logit_bias: ``(token id, bias)`` pairs (``-l/--logit-bias``); a request's ``logit_bias`` replaces them
            (an id outside the vocabulary does nothing, as in llama.cpp's logit-bias sampler).
        grammar: GBNF every reply follows (``--grammar``, ``--grammar-file``, or ``-j/--json-schema``,
            ``-jf`` turned into GBNF); a request's ``grammar``, ``json_schema`` or JSON ``response_format``
            replaces it.
        adaptive_target, adaptive_decay: the ``adaptive_p`` sampler's settings (``--adaptive-target``,
            ``--adaptive-decay``; used only where ``samplers`` names it).
        stop: stop strings for a request whose stop list (with its chat template's) is empty
            (``-r/--reverse-prompt``, llama-server's ``antiprompt``).
        cache_prompt: reuse a slot's cached prefix (``--cache-prompt`` / ``--no-cache-prompt``).
        special: write generated special tokens into the reply's text (``-sp/--special``; not a request field).
    """

    samplers: tuple[str, ...] | None = None
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    adaptive_target: float = attrs.field(default=-1.0, validator=_float(-math.inf, 1.0))
    adaptive_decay: float = attrs.field(default=0.9, validator=_float(0.0, 0.99))
    stop: tuple[str, ...] = ()
    cache_prompt: bool = True
    special: bool = False


@attrs.frozen
class RequestDefaults:
    """What a request that leaves fields out gets: the sampling settings and the token budget
    (``EngineConfig.sampling`` / ``n_predict``; CONFIGURE tier 1 replaces them).

    Immutable, and held by the engine as one attribute: CONFIGURE swaps a new object in with one
    assignment, so a worker thread that builds a job reads the pair as it was before or after the
    change, never half of each (llama-server's ``params_base``, which its ``/props`` POST changes,
    is read by the HTTP threads the same way).
    """

    sampling: SamplingParams
    n_predict: int = -1
    """Tokens for a request that sets no budget (-1: until done)."""
    generation: GenerationDefaults = GenerationDefaults()
    """The other fields' defaults (``EngineConfig.generation``; CONFIGURE leaves them)."""

    def evolve(self, **params: Any) -> RequestDefaults:
        """These defaults with ``params`` (SamplingParams' fields, and ``n_predict``) replaced.

        Raises ParameterError naming the first field out of bounds (nothing changes).
        """
        params = dict(params)
        n_predict = params.pop("n_predict", self.n_predict)
        check_n_predict("n_predict", n_predict)
        # the validators check each field
        return RequestDefaults(attrs.evolve(self.sampling, **params), n_predict, self.generation)


def check_stop(stop: tuple[str, ...]) -> None:
    """Stop strings: at most 16, each at most 512 characters (the matcher holds back up to that much text)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ParameterError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_CHARS:
            raise ParameterError(f"stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(s)}")


KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
"""llama-server's KV cache types (``-ctk`` / ``-ctv``, ``kv_cache_types`` in ``common/arg.cpp``) -> ggml type id
(``ggml.h``)."""
UNQUANTIZED_KV_TYPES = ("f32", "f16", "bf16")
"""The KV cache types that are not quantized: the only V cache types llama.cpp allows without flash attention."""


def kv_type_name(type_id: int) -> str:
    """The KV cache type name of a ggml type id (``q8_0``), or ``type N`` for one llama-server does not name."""
    return next((name for name, tid in KV_CACHE_TYPES.items() if tid == type_id), f"type {type_id}")


def kv_cache_problem(flash_attn: str, cache_type_k: str, cache_type_v: str) -> str | None:
    """Why llama.cpp would refuse this KV cache, or None: an unknown type, or a quantized V cache with
    flash attention off (``llama_init_from_model``: "quantized V cache requires flash_attn"; with ``auto``
    llama.cpp switches flash attention on for it).  The same text for ``hydra-trio run`` (exit 2) and
    :class:`LlamaOptions` (ModelLoadError)."""
    for name, value in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
        if value not in KV_CACHE_TYPES:
            return f"{name}: unknown KV cache type {value!r} (one of {', '.join(KV_CACHE_TYPES)})"
    if flash_attn not in ("on", "off", "auto"):
        return f"flash_attn: expected on, off or auto, got {flash_attn!r}"
    if flash_attn == "off" and cache_type_v not in UNQUANTIZED_KV_TYPES:
        return (
            f"a quantized V cache (-ctv/--cache-type-v {cache_type_v}) needs flash attention, which is off "
            f"(-fa/--flash-attn off): use -fa on or auto, or a V cache of type {', '.join(UNQUANTIZED_KV_TYPES)} "
            "(llama.cpp would refuse the context)"
        )
    return None


@attrs.frozen
class LlamaOptions:
    """llama.cpp model and context parameters from llama-server's flags (names in comments).

    Applied when a model loads (:class:`hydra_trio.engine.llama.model.LoadedModel`); the placement ones
    (``n_gpu_layers``, ``split_mode``, ``tensor_split``, ``main_gpu``, ``devices``, ``tensor_overrides``,
    ``cpu_moe``, ``n_cpu_moe``, ``n_cpu_ffn``) as :class:`hydra_trio.engine.llama.placement.Placement` builds them,
    in llama-server's way (without a GPU nothing is offloaded; the overrides still apply).

    Raises:
        ModelLoadError: a KV cache llama.cpp would refuse (:func:`kv_cache_problem`: an unknown
            ``cache_type_k`` / ``cache_type_v``, or a quantized V cache with ``flash_attn`` off).
    """

    n_threads_batch: int | None = None  # -tb; None = n_threads
    n_ubatch: int | None = None  # -ub; None = n_batch
    swa_full: bool = False  # --swa-full
    flash_attn: str = "auto"  # -fa on|off|auto
    kv_offload: bool = True  # -kvo / -nkvo
    op_offload: bool = True  # --op-offload / --no-op-offload
    repack: bool = True  # --repack / -nr
    no_host: bool = False  # --no-host
    check_tensors: bool = False  # --check-tensors
    load_mode: str = "auto"  # -lm auto|none|mmap|mlock|mmap+mlock|dio
    numa: str | None = None  # --numa distribute|isolate|numactl (set once per process); None: off
    cache_type_k: str = "f16"  # -ctk
    cache_type_v: str = "f16"  # -ctv
    kv_unified: bool = False  # -kvu: one KV stream for every slot; a slot may fill all of it
    kv_unified_per_slot: int = 0  # --kv-unified-per-slot: the most tokens one slot holds (0 = no cap)
    load_mtp: bool = False  # the model's MTP (NextN) layers are loaded too (--spec-type draft-mtp)
    n_rs_seq: int = 0  # recurrent-state copies per slot, so the last n positions can be removed again (drafts)
    rope_scaling: str | None = None  # --rope-scaling none|linear|yarn; None = the model's
    rope_freq_base: float = 0.0  # --rope-freq-base; 0 = the model's
    rope_freq_scale: float = 0.0  # --rope-freq-scale (--rope-scale N = 1/N); 0 = the model's
    yarn_orig_ctx: int = 0  # --yarn-orig-ctx; 0 = the model's training context
    yarn_ext_factor: float = -1.0  # --yarn-ext-factor; -1 = the model's
    yarn_attn_factor: float = -1.0  # --yarn-attn-factor; -1 = the model's
    yarn_beta_slow: float = -1.0  # --yarn-beta-slow; -1 = the model's
    yarn_beta_fast: float = -1.0  # --yarn-beta-fast; -1 = the model's
    n_gpu_layers: int | str = "auto"  # -ngl N|all|auto
    split_mode: str = "layer"  # -sm none|layer|row|tensor
    tensor_split: tuple[float, ...] = ()  # -ts
    main_gpu: int = 0  # -mg
    devices: tuple[str, ...] | None = None  # -dev; None = llama.cpp's choice
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # -ot PATTERN=BUFT
    cpu_moe: bool = False  # -cmoe
    n_cpu_moe: int = 0  # -ncmoe
    n_cpu_ffn: int = 0  # -ncffn
    embeddings: bool = False  # --embedding: the context outputs embeddings (llama_context_params.embeddings)
    pooling: str | None = None  # --pooling none|mean|cls|last|rank; None = the model's
    kv_overrides: tuple[tuple[str, str, Any], ...] = ()  # --override-kv: (key, int|float|bool|str, value)
    mmproj: str = ""  # -mm/--mmproj: the multimodal projector loaded with the model ("": none)
    mmproj_offload: bool = True  # --mmproj-offload / --no-mmproj-offload: the projector on the GPU
    image_min_tokens: int = -1  # --image-min-tokens; -1 = the projector's own
    image_max_tokens: int = -1  # --image-max-tokens; -1 = the projector's own
    mmproj_batch_max_tokens: int = 1024  # --mtmd-batch-max-tokens: most image tokens in one encode batch
    mmproj_device: str = ""  # -mmdev/--mmproj-device: the projector's device ("": mtmd's choice)
    video_fps: float = 4.0  # --video-fps: frames a second read from a video (<= 0: the video's own rate)
    video_timestamp_interval_ms: int = 5000  # --video-timestamp-interval: ms between timestamp texts (<= 0: none)
    video_ffmpeg_dir: str = ""  # --video-ffmpeg-dir: where ffmpeg and ffprobe are ("": on PATH)

    def __attrs_post_init__(self) -> None:
        problem = kv_cache_problem(self.flash_attn, self.cache_type_k, self.cache_type_v)
        if problem is not None:
            raise ModelLoadError(problem)


@attrs.frozen
class EngineConfig:
    """Engine settings (llama-server's flag names in comments).

    Attributes:
        model_path: GGUF file (``--model``).
        model_alias: the model id in API replies (``--alias``).
        n_parallel: number of slots (``--parallel``).
        n_ctx: total context in tokens, split evenly over the slots (``--ctx-size``).
        n_batch: most tokens per decode step (``--batch-size``).
        n_threads: CPU threads, None = all cores (``--threads``).
        peer: ggml-RPC peer ``host:port`` for COMBINED mode (``--rpc-engine``).
        combined_pattern: regex of the tensors that live on the peer in
            COMBINED mode (``--combined-pattern``; MoE experts by default).
        chat_template: ``--chat-template``: None for the GGUF's own template
            (llama.cpp's built-in ``chatml`` when the GGUF has none, as
            llama-server does), a built-in template name or Jinja text
            (see :class:`~hydra_trio.engine.llama.model.ChatTemplate`).
        allow_cross_model_kv: STATE_PUT takes a blob of another model file
            with the same KV identity (``--allow-cross-model-kv``; e.g. another
            quantization of the same model); also CONFIGURE ``allow_cross_model_kv``.
        quants: the node's other quantizations for SWAP_QUANT, ``(key, GGUF
            path, alias)`` each (``--quant KEY=PATH_OR_ALIAS``); the model
            loaded at start is the one whose path matches, else key ``default``.
        llama: llama.cpp model and context parameters (:class:`LlamaOptions`).
        chat_template_kwargs: extra variables for a Jinja chat template
            (``--chat-template-kwargs``; ``--reasoning on|off`` sets ``enable_thinking``).
        slot_save_path: the directory of slot files, ``POST /slots/{id}?action=save|restore``
            (``--slot-save-path``); None: those actions answer 501, as llama-server's without the flag
            (see :mod:`hydra_trio.service.slot_files`).
        sampling: the node's sampling defaults, for every request field a
            request leaves out or sends as null (``--temp``, ``--top-k``, ...;
            CONFIGURE tier 1 changes them at run time).
        n_predict: tokens to generate for a request that sets no
            ``max_tokens`` / ``max_completion_tokens`` / ``n_predict``
            (``-n`` / ``--n-predict``; -1: until end of generation or a full context).
        context_shift: when a generating slot's context is full, discard half of
            the tokens after the first ``n_keep`` and go on generating instead of
            stopping with ``length`` (``--context-shift``; off by default, as
            llama-server at this version).  Only on a memory that can shift
            positions (``llama_memory_can_shift``); otherwise ignored.
        n_keep: prompt tokens a context shift keeps, -1 = the whole prompt
            (``--keep``; a request's ``n_keep`` overrides it).  As llama-server,
            the BOS token is kept on top of these when the model adds one, and
            at most ``n_ctx_slot - 4`` tokens are kept.
        n_cache_reuse: the shortest chunk of a slot's cached tokens, after the
            common prefix, that is moved into place by a KV shift rather than
            evaluated again when a new prompt holds it further on (``--cache-reuse``;
            0 = off; a request's ``n_cache_reuse`` overrides it).  Only on a
            memory that can shift.
        slot_prompt_similarity: an idle slot is picked for its cached prompt
            when its common prefix with the new prompt is more than this
            fraction of the new prompt's tokens (the best such slot); otherwise
            the least recently used idle slot (``-sps``; 0.0 = always the least
            recently used).
        n_ctx_checkpoints: context checkpoints kept per slot for a model whose memory cannot be
            cut back (recurrent, hybrid, SWA without ``--swa-full``): a diverging prompt restores the
            latest one at or before the common prefix instead of evaluating everything again
            (``--ctx-checkpoints``; 0 = none; default 32 as llama-server;
            :mod:`hydra_trio.engine.batching.checkpoints`).
        checkpoint_min_step: once a slot's checkpoints are full, earlier requests' checkpoints
            closer than this many tokens to the previous one are dropped first
            (``--checkpoint-min-step``; default 8192 as llama-server).
        cache_ram_mib: the host-RAM prompt cache's budget in MiB (``--cache-ram``; -1 no limit, 0 off;
            8192 as llama-server): slots' KV states kept, keyed by their tokens, and restored for a
            prompt that starts with them (:mod:`hydra_trio.engine.batching.prompt_cache`).
        cache_idle_slots: keep idle slots' states in that cache too, when the engine goes idle
            (``--cache-idle-slots``; on as llama-server; nothing without ``cache_ram_mib``).
        embd_normalize: how pooled embeddings are normalized when a request does not say
            (``--embd-normalize``: -1 none, 0 max-abs int16, 1 taxicab, 2 Euclidean, p > 2 p-norm;
            see :func:`hydra_trio.engine.llama.embedding.normalize`).  ``embeddings`` (``--embedding``) and
            ``pooling`` (``--pooling``) are context parameters and live in :attr:`llama`.
        max_embedding_inputs: the most inputs one embeddings request may hold (``--max-embedding-inputs``;
            2048, OpenAI's limit on an ``input`` array; llama-server has none): more are a 400 naming it.
        reasoning_format: how chat replies are split into ``reasoning_content`` and ``content``
            (``--reasoning-format``: ``none``, ``deepseek``, ``deepseek-legacy`` or ``auto``;
            :mod:`hydra_trio.openai.reasoning`); a request's ``reasoning_format`` overrides it.
        reasoning_budget: thinking budget in tokens (``--reasoning-budget``): -1 unrestricted,
            0 no thinking (``enable_thinking`` false for the template, as llama-server), N > 0: after
            N tokens inside the thinking block its end marker is forced
            (:mod:`hydra_trio.engine.batching.thinking_budget`); a request's ``thinking_budget_tokens`` /
            ``reasoning_budget_tokens`` overrides it.
        reasoning_budget_message: text forced before the end marker when the budget is spent
            (``--reasoning-budget-message``; a request's ``reasoning_budget_message`` overrides it).
        generation: the defaults of a request's other fields: sampler order, ``ignore_eos``, logit biases,
            grammar, stop strings, ``cache_prompt`` (:class:`GenerationDefaults`).
        skip_chat_parsing: a chat reply is content whole: no thinking split off, no tool calls parsed and
            no tool-call grammar (``--skip-chat-parsing``, llama-server's pure content parser).
        prefill_assistant: a chat whose last message is the assistant's continues that message
            (``--[no-]prefill-assistant``, on as in llama-server; :mod:`hydra_trio.openai.prefill`).
        speculative: speculative decoding: ``--spec-type`` and the ``--spec-*`` parameters
            (:class:`hydra_trio.engine.speculative.settings.SpecSettings`; ``draft_model`` is a resolved path).
        media: the multimodal projector and its settings (``--mmproj`` ...;
            :class:`hydra_trio.protocol.media.MediaSettings`); its ``mmproj`` None: the node takes no media.

    Raises:
        ParameterError: ``n_parallel`` out of 1 .. :data:`N_PARALLEL_MAX`, ``n_predict`` out of -1 .. 2**31-1.
    """

    model_path: Path
    model_alias: str
    n_parallel: int = attrs.field(default=4, validator=_int(1, N_PARALLEL_MAX))
    n_ctx: int = 8192
    n_batch: int = 512
    n_threads: int | None = None
    peer: str | None = None
    combined_pattern: str = DEFAULT_PATTERN
    chat_template: str | None = None
    allow_cross_model_kv: bool = False
    quants: tuple[tuple[str, Path, str], ...] = ()
    llama: LlamaOptions = LlamaOptions()
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict, hash=False)
    slot_save_path: Path | None = None
    sampling: SamplingParams = SamplingParams()
    n_predict: int = attrs.field(default=-1, validator=_int(-1, INT32_MAX))
    context_shift: bool = False
    n_keep: int = attrs.field(default=0, validator=_int(-1, INT32_MAX))
    n_cache_reuse: int = attrs.field(default=0, validator=_int(0, INT32_MAX))
    slot_prompt_similarity: float = attrs.field(default=0.1, validator=_float(0.0, 1.0))
    n_ctx_checkpoints: int = attrs.field(default=32, validator=_int(0, INT32_MAX))
    checkpoint_min_step: int = attrs.field(default=8192, validator=_int(0, INT32_MAX))
    cache_ram_mib: int = attrs.field(default=8192, validator=_int(-1, INT32_MAX))
    cache_idle_slots: bool = True
    embd_normalize: int = attrs.field(default=2, validator=_int(-1, INT32_MAX))
    max_embedding_inputs: int = attrs.field(default=2048, validator=_int(1, INT32_MAX))

    @property
    def embeddings(self) -> bool:
        """The node serves embeddings only (``--embedding``): completions are refused."""
        return self.llama.embeddings

    @property
    def pooling(self) -> str | None:
        """``--pooling``: None for the model's own."""
        return self.llama.pooling

    reasoning_format: str = attrs.field(
        default="auto", validator=attrs.validators.in_(("none", "deepseek", "deepseek-legacy", "auto"))
    )
    reasoning_budget: int = attrs.field(default=-1, validator=_int(-1, INT32_MAX))
    reasoning_budget_message: str = ""
    generation: GenerationDefaults = GenerationDefaults()
    skip_chat_parsing: bool = False
    prefill_assistant: bool = True
    speculative: SpecSettings = SpecSettings()
    media: MediaSettings = MediaSettings()
