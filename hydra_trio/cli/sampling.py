"""llama-server's sampling parameters: the node's defaults for every request that does not set them
(``EngineConfig.sampling``, shown in ``/props`` ``default_generation_settings``).  Bounds are the engine's
(:class:`hydra_trio.engine.settings.SamplingParams`), checked when the command line is parsed."""

from __future__ import annotations

import functools
from typing import Any

from . import _types as t
from ._flags import ACCEPTED, WIRED, Flag

S = functools.partial(Flag, group="sampling")  # a table row of this group


# flag dest -> SamplingParams field
FIELDS = {
    "seed": "seed",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "top_n_sigma": "top_n_sigma",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "typical_p": "typical_p",
    "repeat_last_n": "repeat_last_n",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_penalty_last_n",
    "dynatemp_range": "dynatemp_range",
    "dynatemp_exponent": "dynatemp_exponent",
    "mirostat": "mirostat",
    "mirostat_eta": "mirostat_eta",
    "mirostat_tau": "mirostat_tau",
}

_num = t.float_range()


def _clamp(lo: float, hi: float) -> Any:
    return lambda v: min(max(v, lo), hi)


_SAME_AS = {
    "temperature": lambda v: max(v, 0.0),  # llama-server: std::max(temp, 0)
    "top_k": lambda v: max(v, -1),  # llama.cpp: top_k <= 0 is off
    "top_p": _clamp(0.0, 1.0),  # llama.cpp: p >= 1 is off; p <= 0 keeps the top token
    "typical_p": _clamp(0.0, 1.0),  # the same for locally typical sampling
    "min_p": lambda v: max(v, 0.0),  # llama.cpp: p <= 0 is off
    "xtc_probability": _clamp(0.0, 1.0),  # a chance: <= 0 never, >= 1 always
    "xtc_threshold": _clamp(0.0, 1.0),  # > 0.5 is off; <= 0 counts every token
}


def as_llama_server_reads(given: dict[str, Any]) -> dict[str, Any]:
    """The sampling flags' values as llama-server takes them (``common/arg.cpp``, the samplers of
    ``src/llama-sampler.cpp``): a value past a sampler's range that llama.cpp treats as the range's end
    becomes that end (``--top-p 1.5`` is top-p off, as 1.0), a negative ``--temp`` is 0 as llama-server
    makes it, and ``--dry-base`` below 1 is ignored (the default stays), as llama-server ignores it."""
    out = {k: _SAME_AS[k](v) if k in _SAME_AS else v for k, v in given.items()}
    if out.get("dry_base", 1.0) < 1.0:
        del out["dry_base"]
    return out


_int = t.int_range(-(2**31), 2**31 - 1)


def _s(names: tuple[str, ...], field: str, note: str, type_=_num, env: str | None = None) -> Flag:
    return S(
        names, WIRED, note, value="N", type=type_, dest=field, env=env, lands=f"EngineConfig.sampling.{FIELDS[field]}"
    )


FLAGS: list[Flag] = [
    S(
        ("--samplers",),
        WIRED,
        "the sampler chain's order for every request that sends no samplers: names "
        "separated by ';' (top_k;top_p;temperature, any case, llama-server's spellings); an unknown name is left "
        "out, said at start-up (default: penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature)",
        value="SAMPLERS",
        type=t.sampler_names,
        dest="samplers",
        lands="EngineConfig.generation.samplers",
    ),
    S(
        ("-s", "--seed"),
        WIRED,
        "RNG seed (-1 = random)",
        value="SEED",
        type=t.int_range(-1, 2**32 - 1),
        dest="seed",
        lands="EngineConfig.sampling.seed",
    ),
    S(
        ("--sampler-seq", "--sampling-seq"),
        WIRED,
        "--samplers as one letter per sampler (e dry s k y p m x t, i infill, a adaptive_p; default: edskypmxt)",
        value="SEQUENCE",
        type=t.sampler_chars,
        dest="samplers",
        lands="EngineConfig.generation.samplers",
    ),
    S(
        ("--ignore-eos",),
        WIRED,
        "keep generating past end of generation, for every request that sends no "
        "ignore_eos and no grammar (not with --grammar/-j: exit 2)",
        lands="EngineConfig.generation.ignore_eos",
    ),
    _s(("--temp", "--temperature"), "temperature", "temperature (default: 0.8)", env="LLAMA_ARG_TEMPERATURE"),
    _s(("--top-k",), "top_k", "top-k sampling (default: 40, 0 = off)", _int, env="LLAMA_ARG_TOP_K"),
    _s(("--top-p",), "top_p", "top-p sampling (default: 0.95, 1.0 = off)", env="LLAMA_ARG_TOP_P"),
    _s(("--min-p",), "min_p", "min-p sampling (default: 0.05, 0.0 = off)", env="LLAMA_ARG_MIN_P"),
    _s(("--top-nsigma", "--top-n-sigma"), "top_n_sigma", "top-n-sigma sampling (default: -1 = off)"),
    _s(("--xtc-probability",), "xtc_probability", "XTC probability (default: 0 = off)"),
    _s(("--xtc-threshold",), "xtc_threshold", "XTC threshold (default: 0.1)"),
    _s(("--typical", "--typical-p"), "typical_p", "locally typical sampling p (default: 1.0 = off)"),
    _s(
        ("--repeat-last-n",),
        "repeat_last_n",
        "tokens the penalties look back over (default: 64, 0 = off, -1 = context)",
        _int,
    ),
    _s(
        ("--repeat-penalty",),
        "repeat_penalty",
        "repetition penalty (default: 1.0 = off)",
        env="LLAMA_ARG_REPEAT_PENALTY",
    ),
    _s(
        ("--presence-penalty",),
        "presence_penalty",
        "presence penalty (default: 0.0 = off)",
        env="LLAMA_ARG_PRESENCE_PENALTY",
    ),
    _s(
        ("--frequency-penalty",),
        "frequency_penalty",
        "frequency penalty (default: 0.0 = off)",
        env="LLAMA_ARG_FREQUENCY_PENALTY",
    ),
    _s(("--dry-multiplier",), "dry_multiplier", "DRY multiplier (default: 0.0 = off)"),
    _s(("--dry-base",), "dry_base", "DRY base (default: 1.75)"),
    _s(("--dry-allowed-length",), "dry_allowed_length", "DRY allowed length (default: 2)", _int),
    _s(("--dry-penalty-last-n",), "dry_penalty_last_n", "DRY look-back (default: 64; -1 = the context, 0 = off)", _int),
    S(
        ("--dry-sequence-breaker",),
        WIRED,
        "a DRY sequence breaker, repeatable; the first replaces the defaults ('none': no breakers)",
        value="STRING",
        action="append",
        dest="dry_sequence_breakers",
        lands="EngineConfig.sampling.dry_sequence_breakers",
    ),
    S(
        ("--adaptive-target",),
        WIRED,
        "adaptive-p: select tokens near this probability, 0.0-1.0 (negative: off; "
        "default: -1); used where the sampler order names adaptive_p",
        value="N",
        type=_num,
        lands="EngineConfig.generation.adaptive_target",
    ),
    S(
        ("--adaptive-decay",),
        WIRED,
        "adaptive-p: decay of its target's adaptation, 0.0-0.99 (clamped there, as llama.cpp does; default: 0.9)",
        value="N",
        type=_num,
        lands="EngineConfig.generation.adaptive_decay",
    ),
    _s(("--dynatemp-range",), "dynatemp_range", "dynamic temperature range (default: 0.0 = off)"),
    _s(("--dynatemp-exp",), "dynatemp_exponent", "dynamic temperature exponent (default: 1.0)"),
    _s(("--mirostat",), "mirostat", "Mirostat: 0 off, 1 Mirostat, 2 Mirostat 2.0 (default: 0)", _int),
    _s(("--mirostat-lr",), "mirostat_eta", "Mirostat learning rate eta (default: 0.1)"),
    _s(("--mirostat-ent",), "mirostat_tau", "Mirostat target entropy tau (default: 5.0)"),
    S(
        ("-l", "--logit-bias"),
        WIRED,
        "a logit bias for every request that sends no logit_bias, repeatable: "
        "15043+1 raises token 15043, 15043-inf bans it",
        value="TOKEN_ID(+/-)BIAS",
        type=t.logit_bias,
        action="append",
        dest="logit_bias",
        lands="EngineConfig.generation.logit_bias",
    ),
    S(
        ("--grammar",),
        WIRED,
        "GBNF grammar every reply follows unless the request sends its own grammar, "
        "json_schema or JSON response_format",
        value="GRAMMAR",
        dest="grammar",
        lands="EngineConfig.generation.grammar",
    ),
    S(
        ("--grammar-file",),
        WIRED,
        "--grammar from a file",
        value="FNAME",
        type=t.grammar_file,
        dest="grammar",
        lands="EngineConfig.generation.grammar",
    ),
    S(
        ("-j", "--json-schema"),
        WIRED,
        "JSON schema every reply follows, as --grammar (converted to a grammar at start; one that cannot be: exit 2)",
        value="SCHEMA",
        type=t.json_schema_grammar,
        dest="grammar",
        lands="EngineConfig.generation.grammar",
    ),
    S(
        ("-jf", "--json-schema-file"),
        WIRED,
        "-j from a file",
        value="FILE",
        type=t.json_schema_file,
        dest="grammar",
        lands="EngineConfig.generation.grammar",
    ),
    S(
        ("-bs", "--backend-sampling"),
        ACCEPTED,
        "sampling runs on the CPU after each decode",
        env="LLAMA_ARG_BACKEND_SAMPLING",
    ),
]
