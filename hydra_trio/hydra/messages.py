"""Typed Hydra request payloads (docs/hydra-protocol.md §3): frozen attrs classes, strict parsing.

Sans-I/O like :mod:`hydra_trio.protocol.hydra`: bytes in, frozen attrs objects
out, through this module's own :class:`~hydra_trio.validation.strict.StrictConverter`.
Every parse error is a :class:`~hydra_trio.validation.strict.MessageError`
whose message names the offending field (the BAD_REQUEST ``{"error": ...}``
text).  PREFILL and DECODE carry OpenAI chat bodies: they are parsed whole
into :mod:`hydra_trio.openai.schemas` classes, the same ones the HTTP API uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import attrs

from ..openai.schemas import (
    N_PREDICT_NAMES,
    REASONING_FORMATS,
    ChatCompletionRequest,
    CompletionRequest,
    structure_body,
)
from ..validation.address import parse_peer
from ..validation.strict import (
    Bytes,
    MessageError,
    StrictConverter,
    TypeMismatch,
    as_bool,
    as_float,
    as_int,
    as_str,
    as_str_or_str_list,
    json_kind,
    load_json_object,
    loads,
)

__all__ = [
    "STATE_CHUNK_MAX",
    "STATE_CHUNK_MIN",
    "T1_KEYS",
    "T2_KEYS",
    "T3_KEYS",
    "ConfigureRequest",
    "DecodeRequest",
    "ExpertModeName",
    "MessageError",
    "PipelineAttachRequest",
    "SetExpertModeRequest",
    "SwapQuantRequest",
    "check_tensor_regex",
    "clamp_state_chunk_size",
    "classify_configure_keys",
    "load_json_object",
    "parse_configure",
    "parse_decode",
    "parse_peer",
    "parse_prefill",
    "parse_set_expert_mode",
    "parse_swap_quant",
    "structure_json",
]

_conv = StrictConverter()
"""This module's converter: strict primitives, unknown keys rejected unless a class allows them."""


def structure_json(payload: Bytes, cls: type[Any]) -> Any:
    """Parse a JSON object payload into one of this module's classes (see :meth:`StrictConverter.structure_json`)."""
    return _conv.structure_json(payload, cls)


# --------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------


def _peer_validator(_inst: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None:
        parse_peer(value, field=attr.name)


def _empty_to_none(v: str | None) -> str | None:
    return None if v == "" else v


# --------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------

ExpertModeName: TypeAlias = Literal["solo", "combined"]
"""A SET_EXPERT_MODE mode as the wire names it; the engine's is
:class:`hydra_trio.engine.experts.combined.ExpertMode`."""


@attrs.frozen
class SetExpertModeRequest:
    """SET_EXPERT_MODE payload (docs/hydra-protocol.md §3): ``mode`` is
    ``"solo"`` or ``"combined"``; ``peer`` is ``"host:port"`` or None (an
    empty string is read as None). Build it with `parse_set_expert_mode`.
    Raises MessageError on a bad peer."""

    mode: ExpertModeName
    peer: str | None = attrs.field(default=None, converter=_empty_to_none, validator=_peer_validator)


_conv.register(SetExpertModeRequest, forbid_extra=True)


def parse_set_expert_mode(payload: Bytes) -> SetExpertModeRequest:
    """Parse a SET_EXPERT_MODE payload (docs/hydra-protocol.md §3).

    Accepted forms: raw ``solo`` / ``combined`` (ASCII, any case, surrounding
    whitespace ignored); a JSON string of those; a JSON object
    ``{"mode": ..., "peer": "host:port"}`` (mode case-insensitive, other
    keys rejected). Raises MessageError for invalid UTF-8, bad JSON, an
    unknown mode or a bad peer: the server replies BAD_REQUEST, never a
    silent fall-back to solo (docs/hydra-protocol.md §3).
    """
    try:
        text = bytes(payload).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise MessageError("mode: payload is not valid UTF-8") from None
    if not text:
        raise MessageError("mode: missing (empty payload)")
    if text[0] in '{["':
        obj = loads(text)
        if isinstance(obj, str):
            text = obj.strip()
        elif isinstance(obj, dict):
            mode = obj.get("mode")
            if isinstance(mode, str):
                obj = {**obj, "mode": mode.strip().lower()}
            return _conv.structure(obj, SetExpertModeRequest)
        else:
            raise MessageError(f"payload must be a mode or a JSON object, got {json_kind(obj)}")
    mode = text.lower()
    if mode not in ("solo", "combined"):
        raise MessageError(f"mode: expected 'solo' or 'combined', got {text[:40]!r}")
    return SetExpertModeRequest(mode)  # type: ignore[arg-type]  # one of the two, checked above


_NOT_IN_STD_REGEX = re.compile(r"\(\?(?![:=!])|\\[AZzGP]|\(\?P")


def check_tensor_regex(pattern: str) -> None:
    """A tensor-name regex that llama.cpp (``std::regex``, ECMAScript) and Python's ``re`` read alike.

    Raises MessageError for Python-only syntax (``(?i)``, ``(?P<..>``, ``(?<=``,
    ``(?#``, ``\\A``, ``\\Z``, ...; ``(?:``, ``(?=`` and ``(?!`` are fine), for a
    pattern ``re`` cannot compile, and for one longer than 1,024 characters.
    """
    if len(pattern) > 1024:
        raise MessageError(f"the regex is {len(pattern)} characters; at most 1024")
    bad = _NOT_IN_STD_REGEX.search(pattern)
    if bad is not None:
        raise MessageError(
            f"{bad.group(0)!r} is Python-only regex syntax; llama.cpp matches tensor names with std::regex (ECMAScript)"
        )
    try:
        re.compile(pattern)
    except re.error as exc:
        raise MessageError(f"not a regular expression: {exc}") from None


@attrs.frozen
class SwapQuantRequest:
    """SWAP_QUANT payload (docs/hydra-protocol.md §3): ``[u16 LE quant_key_len][quant_key][tensor_pattern]``,
    both UTF-8; an empty ``tensor_pattern`` means the whole model."""

    quant_key: str
    tensor_pattern: str = ""


def parse_swap_quant(payload: Bytes) -> SwapQuantRequest:
    """Parse a SWAP_QUANT payload.  Raises MessageError: too short, a key length past the end, an
    empty key, or text that is not UTF-8."""
    data = bytes(payload)
    if len(data) < 2:
        raise MessageError(f"quant_key_len: the payload is {len(data)} bytes; it starts with a u16 key length")
    n = int.from_bytes(data[:2], "little")
    if n == 0 or 2 + n > len(data):
        raise MessageError(f"quant_key_len: {n} does not fit the payload ({len(data) - 2} bytes after it)")
    try:
        key, pattern = data[2 : 2 + n].decode("utf-8"), data[2 + n :].decode("utf-8")
    except UnicodeDecodeError:
        raise MessageError("quant_key / tensor_pattern: not valid UTF-8") from None
    return SwapQuantRequest(key, pattern)


def _non_empty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise MessageError(f"{attr.name}: must not be empty")


@attrs.frozen
class PipelineAttachRequest:
    """PIPELINE_ATTACH payload (docs/hydra-protocol.md §3): ``peer``
    ``"host:port"``, ``ot_split`` the tensor-override regex naming the
    tensors the peer owns (non-empty with a peer; matched with Python's
    ``re.search``, as the node counts the bytes). ``{"peer": ""}`` (peer
    None here) detaches. Unknown keys are rejected."""

    peer: str | None = attrs.field(converter=_empty_to_none, validator=_peer_validator)
    ot_split: str = ""

    def __attrs_post_init__(self) -> None:
        if self.peer is not None and not self.ot_split:
            raise MessageError("ot_split: missing (the regex of the tensors the peer holds)")
        if self.ot_split:
            try:
                check_tensor_regex(self.ot_split)
            except MessageError as exc:
                raise MessageError(f"ot_split: {exc}") from None


_conv.register(PipelineAttachRequest, forbid_extra=True)


@attrs.frozen
class DecodeRequest:
    """DECODE payload (docs/hydra-protocol.md §3), parsed whole: ``{"n_predict": N, "messages": [...]}``
    or a full OpenAI chat body.

    ``body`` is the parsed OpenAI request: a chat request when ``messages`` is
    given, a prompt-less completion request when it is null or absent
    ("continue from the slot's KV cache"; its fields set sampling).
    ``stream`` false asks for the whole reply at once (with its final meta).
    See :meth:`frame_budget` for the token count.
    """

    body: ChatCompletionRequest | CompletionRequest
    n_predict: int | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    max_completion_tokens: int | None = None

    @property
    def continues_slot(self) -> bool:
        """``messages`` was null or absent: generation continues from the slot's KV cache."""
        return isinstance(self.body, CompletionRequest)

    def budget_field(self) -> tuple[str, int] | None:
        """``(name, value)`` of the token budget: the first of ``n_predict``, ``max_completion_tokens``,
        ``max_tokens`` that is set and not null, the order llama-server reads them
        (:data:`hydra_trio.openai.schemas.N_PREDICT_NAMES`); None: none set."""
        for name in N_PREDICT_NAMES:
            v = getattr(self, name)
            if v is not None:
                return name, v
        return None

    def frame_budget(self, default: int, cap: int) -> int:
        """Tokens (= 9-byte frames) to announce: :meth:`budget_field`'s value; none set or a
        negative value (llama-server's -1 = "until EOS") means ``default``; the result is at most ``cap``."""
        got = self.budget_field()
        n = default if got is None or got[1] < 0 else got[1]
        return min(n, cap)


@attrs.frozen
class _DecodeFields:
    n_predict: int | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    max_completion_tokens: int | None = None


_conv.register(_DecodeFields, forbid_extra=False)

# keys DECODE reads itself; the rest of the object is the OpenAI body
_DECODE_KEYS = ("n_predict", "max_tokens", "max_completion_tokens", "stream", "id_slot")


def parse_decode(payload: Bytes) -> DecodeRequest:
    """Parse a DECODE payload whole (the OpenAI body included).

    Raises MessageError naming the field: bad JSON, a wrong type, an empty
    ``messages`` list, or a body field out of its bounds.
    """
    obj = load_json_object(payload)
    fields = _conv.structure(obj, _DecodeFields)
    rest = {k: v for k, v in obj.items() if k not in _DECODE_KEYS}
    if rest.get("messages") is None:
        rest.pop("messages", None)
        body: ChatCompletionRequest | CompletionRequest = structure_body(rest, CompletionRequest)
        fmt = rest.get("reasoning_format")  # a continuation's replies are split too (reasoning_tokens)
        if fmt is not None and fmt not in REASONING_FORMATS:
            raise MessageError(f"reasoning_format: {fmt!r} is not one of {', '.join(REASONING_FORMATS)}")
    else:
        if rest["messages"] == []:
            raise MessageError("messages: empty (send the conversation, or null to continue the slot's KV cache)")
        body = structure_body(rest, ChatCompletionRequest)
    return DecodeRequest(body, fields.n_predict, fields.max_tokens, fields.stream, fields.max_completion_tokens)


def parse_prefill(payload: Bytes) -> ChatCompletionRequest:
    """PREFILL payload (docs/hydra-protocol.md §3): an OpenAI chat-completions body, ``messages``
    required and non-empty, parsed whole; its length fields are ignored (PREFILL
    processes the prompt only).  Raises MessageError naming the field."""
    obj = load_json_object(payload)
    return structure_body({k: v for k, v in obj.items() if k not in _DECODE_KEYS}, ChatCompletionRequest)


# --------------------------------------------------------------------------
# CONFIGURE
# --------------------------------------------------------------------------


def _as_str_list(v: Any) -> list[str]:
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    raise TypeMismatch(f"expected a list of str, got {json_kind(v)}")


T1_KEYS: dict[str, Callable[[Any], Any]] = {
    "temperature": as_float,
    "top_p": as_float,
    "top_k": as_int,
    "min_p": as_float,
    "seed": as_int,
    "n_predict": as_int,
    "repeat_penalty": as_float,
    "repeat_last_n": as_int,
    "presence_penalty": as_float,
    "frequency_penalty": as_float,
    "min_keep": as_int,
    "typical_p": as_float,
    "top_n_sigma": as_float,
    "xtc_probability": as_float,
    "xtc_threshold": as_float,
    "dry_multiplier": as_float,
    "dry_base": as_float,
    "dry_allowed_length": as_int,
    "dry_penalty_last_n": as_int,
    "dry_sequence_breakers": _as_str_list,
    "mirostat": as_int,
    "mirostat_tau": as_float,
    "mirostat_eta": as_float,
    "dynatemp_range": as_float,
    "dynatemp_exponent": as_float,
    "state_chunk_size": as_int,
    "allow_cross_model_kv": as_bool,
}
"""CONFIGURE tier 1 (applied at once), key -> strict checker: every
:class:`~hydra_trio.engine.settings.SamplingParams` field (llama-server's
request names), ``n_predict``, ``state_chunk_size``, ``allow_cross_model_kv``."""
T2_KEYS: dict[str, Callable[[Any], Any]] = {
    "n_ctx": as_int,
    "cache_type_k": as_str,
    "cache_type_v": as_str,
    "n_parallel": as_int,
}
"""CONFIGURE tier 2 (context rebuild), key -> strict checker."""
T3_KEYS: dict[str, Callable[[Any], Any]] = {
    "model": as_str,
    "model_path": as_str,
    "n_gpu_layers": as_int,
    "tensor_overrides": as_str_or_str_list,
    "override_tensor": as_str_or_str_list,
}
"""CONFIGURE tier 3 (model reload), key -> strict checker."""

STATE_CHUNK_MIN = 64 * 1024
STATE_CHUNK_MAX = 64 * 1024 * 1024


@attrs.frozen
class ConfigureRequest:
    """CONFIGURE payload: a free JSON object of engine/sampling params
    (docs/hydra-protocol.md §3). Split it with `classify_configure_keys`."""

    params: dict[str, Any]


def parse_configure(payload: Bytes) -> ConfigureRequest:
    """Load a CONFIGURE payload. Raises MessageError unless it is a UTF-8
    JSON object (an empty payload is read as ``{}``)."""
    if not payload:
        return ConfigureRequest({})
    return ConfigureRequest(load_json_object(payload))


def classify_configure_keys(
    d: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[str]]:
    """Split CONFIGURE params into ``(t1, t2, t3, unrecognized)`` (tiers of
    docs/hydra-protocol.md §3; ``unrecognized`` keeps input order and becomes
    ``unrecognized_keys``). Values are type-checked (floats accept ints, a
    bool is not an int) and floats normalised to float; ``state_chunk_size``
    is returned unclamped (see `clamp_state_chunk_size`). Raises MessageError
    naming every key with a wrong type.
    """
    tiers: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, {}, {})
    unrecognized: list[str] = []
    errors: list[str] = []
    for key, value in d.items():
        for tier, spec in zip(tiers, (T1_KEYS, T2_KEYS, T3_KEYS), strict=True):
            check = spec.get(key)
            if check is not None:
                try:
                    tier[key] = check(value)
                except TypeMismatch as exc:
                    errors.append(f"{key}: {exc}")
                break
        else:
            unrecognized.append(key)
    if errors:
        raise MessageError(errors)
    return tiers[0], tiers[1], tiers[2], unrecognized


def clamp_state_chunk_size(n: int) -> int:
    """Clamp a state chunk size (bytes) to 64 KiB..64 MiB (docs/hydra-protocol.md §3)."""
    return max(STATE_CHUNK_MIN, min(STATE_CHUNK_MAX, n))
