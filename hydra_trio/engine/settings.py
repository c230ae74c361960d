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
temperature            finite, 0 .. 2                  0: greedy
top_k                  -1 .. 2**31-1                   <= 0: off; above the vocabulary: all
top_p, min_p           finite, 0 .. 1
seed                   -1 .. 2**32-1, or null          -1, null, 2**32-1: a random seed
repeat_penalty         finite, > 0 and <= 10           1: off
repeat_last_n          -1 .. 1048576                   -1: the slot's context; 0: off
presence_penalty,      finite, -2 .. 2                 0: off
frequency_penalty
n_predict              -1 .. 2**31-1                   -1: until end of generation / context
max_tokens,            0 .. 2**31-1                    0: process the prompt only
max_completion_tokens
stop                   at most 16 strings of at most
                       512 characters each
=====================  ==============================  =======================================

The penalty window is also clamped to the slot's context (a window larger
than the context sees the same tokens), so the sampler's ring buffer is at
most ``n_ctx_slot`` tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from ..errors import InvalidRequest

DEFAULT_PATTERN = r"ffn_(up|down|gate)_exps"
"""The tensors a COMBINED head places on its peer: the MoE experts (``--combined-pattern``)."""

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
REPEAT_LAST_N_MAX = 1 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512


class ParameterError(InvalidRequest, ValueError):
    """A parameter is out of its bounds; the message names it (HTTP 400 / Hydra BAD_REQUEST)."""


def check_int(name: str, value: int, lo: int, hi: int) -> None:
    """Raise ParameterError unless ``lo <= value <= hi``."""
    if not lo <= value <= hi:
        raise ParameterError(f"{name}: must be between {lo} and {hi}, got {value}")


def check_float(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Raise ParameterError unless ``value`` is finite and in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if not math.isfinite(value):
        raise ParameterError(f"{name}: must be a finite number, got {value}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise ParameterError(f"{name}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}")


def _int(lo: int, hi: int) -> Any:
    def v(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check_int(attr.name, value, lo, hi)

    return v


def _float(lo: float, hi: float, *, lo_open: bool = False) -> Any:
    def v(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_float(attr.name, value, lo, hi, lo_open=lo_open)

    return v


@attrs.frozen
class SamplingParams:
    """Sampler settings; names, defaults and meanings follow llama-server, bounds in the module docstring.

    ``temperature <= 0`` means greedy.  ``seed`` None (or -1) picks a random seed.

    Raises:
        ParameterError: a value out of its bounds (also from ``attrs.evolve``).
    """

    temperature: float = attrs.field(default=0.8, validator=_float(0.0, 2.0))
    top_k: int = attrs.field(default=40, validator=_int(-1, INT32_MAX))
    top_p: float = attrs.field(default=0.95, validator=_float(0.0, 1.0))
    min_p: float = attrs.field(default=0.05, validator=_float(0.0, 1.0))
    seed: int | None = attrs.field(default=None, validator=_int(-1, UINT32_MAX))
    repeat_penalty: float = attrs.field(default=1.0, validator=_float(0.0, 10.0, lo_open=True))
    repeat_last_n: int = attrs.field(default=64, validator=_int(-1, REPEAT_LAST_N_MAX))
    presence_penalty: float = attrs.field(default=0.0, validator=_float(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_float(-2.0, 2.0))

    def penalty_window(self, n_ctx_slot: int) -> int:
        """Tokens the repetition penalties look back over: ``repeat_last_n`` (-1: the context), at most ``n_ctx_slot``."""
        n = n_ctx_slot if self.repeat_last_n < 0 else self.repeat_last_n
        return min(n, n_ctx_slot)

    def seed_u32(self) -> int:
        """The seed for llama.cpp's ``dist`` sampler: ``LLAMA_DEFAULT_SEED`` (0xFFFFFFFF, random) when unset or -1."""
        return UINT32_MAX if self.seed is None or self.seed < 0 else self.seed


def check_n_predict(name: str, value: int | None, lo: int = -1) -> None:
    """Token budgets: ``n_predict`` in [-1, 2**31-1], ``max_tokens`` / ``max_completion_tokens`` in [0, 2**31-1]."""
    if value is not None:
        check_int(name, value, lo, INT32_MAX)


def check_stop(stop: tuple[str, ...]) -> None:
    """Stop strings: at most 16, each at most 512 characters (the matcher holds back up to that much text)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ParameterError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_CHARS:
            raise ParameterError(f"stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(s)}")


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
            (see :class:`~hydra_trio.engine.model.ChatTemplate`).
        allow_cross_model_kv: STATE_PUT takes a blob of another model file
            with the same KV identity (``--allow-cross-model-kv``; e.g. another
            quantization of the same model); also CONFIGURE ``allow_cross_model_kv``.
        quants: the node's other quantizations for SWAP_QUANT, ``(key, GGUF
            path, alias)`` each (``--quant KEY=PATH_OR_ALIAS``); the model
            loaded at start is the one whose path matches, else key ``default``.
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
    """

    model_path: Path
    model_alias: str
    n_parallel: int = 4
    n_ctx: int = 8192
    n_batch: int = 512
    n_threads: int | None = None
    peer: str | None = None
    combined_pattern: str = DEFAULT_PATTERN
    chat_template: str | None = None
    allow_cross_model_kv: bool = False
    quants: tuple[tuple[str, Path, str], ...] = ()
    context_shift: bool = False
    n_keep: int = attrs.field(default=0, validator=_int(-1, INT32_MAX))
    n_cache_reuse: int = attrs.field(default=0, validator=_int(0, INT32_MAX))
    slot_prompt_similarity: float = attrs.field(default=0.1, validator=_float(0.0, 1.0))
