"""Typed Hydra request payloads (hydra-protocol.md §3): attrs + one cattrs converter.

Sans-I/O like `hydra_trio.protocol.hydra`: bytes in, frozen attrs objects
out. Every parse error is a `MessageError` (a ValueError) whose message names
the offending field, e.g. ``"n_predict: expected int, got str"`` or
``"messages[0].role: missing"``; the server sends it as the BAD_REQUEST
``{"error": ...}`` text.

Typing is strict, unlike cattrs' defaults: a str is never turned into an int,
a bool is not an int, a number is not a str; floats accept ints.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias, TypeVar, get_args

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

__all__ = [
    "STATE_CHUNK_MAX",
    "STATE_CHUNK_MIN",
    "T1_KEYS",
    "T2_KEYS",
    "T3_KEYS",
    "ChatMessage",
    "ConfigureRequest",
    "DecodeRequest",
    "ExpertMode",
    "MessageError",
    "PipelineAttachRequest",
    "PrefillRequest",
    "SetExpertModeRequest",
    "clamp_state_chunk_size",
    "classify_configure_keys",
    "converter",
    "load_json_object",
    "parse_configure",
    "parse_peer",
    "parse_set_expert_mode",
    "structure_json",
]

T = TypeVar("T")
Bytes: TypeAlias = bytes | bytearray | memoryview


class MessageError(ValueError):
    """A request payload is malformed. ``str(exc)`` names the field(s);
    ``errors`` lists one ``"path: problem"`` string per problem."""

    def __init__(self, errors: str | list[str]) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("; ".join(self.errors))


class TypeMismatch(TypeError):
    """Raised by the strict primitive hooks; its text is the whole description."""


def type_name(v: Any) -> str:
    if v is None:
        return "null"
    return type(v).__name__


# --------------------------------------------------------------------------
# Strict primitives (shared by the converter and classify_configure_keys)
# --------------------------------------------------------------------------


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _as_int(v: Any) -> int:
    """A JSON integer within 64 bits (fields with tighter bounds check them later)."""
    if isinstance(v, int) and not isinstance(v, bool):
        if not INT64_MIN <= v <= INT64_MAX:
            raise TypeMismatch(f"expected a 64-bit integer, got one with {len(str(abs(v)))} digits")
        return int(v)
    raise TypeMismatch(f"expected int, got {type_name(v)}")


def _as_float(v: Any) -> float:
    """A finite JSON number (``1e999`` parses as infinity: refused)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)
        except OverflowError:
            raise TypeMismatch("expected a finite float, got an integer too large for a float") from None
        if not math.isfinite(f):
            raise TypeMismatch(f"expected a finite float, got {f}")
        return f
    raise TypeMismatch(f"expected float, got {type_name(v)}")


def _as_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise TypeMismatch(f"expected str, got {type_name(v)}")


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise TypeMismatch(f"expected bool, got {type_name(v)}")


def _as_str_or_str_list(v: Any) -> str | list[str]:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    raise TypeMismatch(f"expected str or list of str, got {type_name(v)}")


# --------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
"""The one cattrs converter for Hydra payloads: strict primitives, detailed
validation (errors carry field paths), unknown keys rejected except where a
class says otherwise (chat bodies)."""

converter.register_structure_hook(int, lambda v, _t: _as_int(v))
converter.register_structure_hook(float, lambda v, _t: _as_float(v))
converter.register_structure_hook(str, lambda v, _t: _as_str(v))
converter.register_structure_hook(bool, lambda v, _t: _as_bool(v))


def _is_literal(t: Any) -> bool:
    return getattr(t, "__origin__", None) is Literal


def _literal_hook(v: Any, t: Any) -> Any:
    allowed = get_args(t)
    if v in allowed and type(v) in {type(a) for a in allowed}:
        return v
    want = " or ".join(repr(a) for a in allowed)
    raise TypeMismatch(f"expected {want}, got {v!r}")


converter.register_structure_hook_func(_is_literal, _literal_hook)


def _is_list(t: Any) -> bool:
    return t is list or getattr(t, "__origin__", None) is list


def _list_hook(v: Any, t: Any) -> list[Any]:
    """A list must be a JSON array (cattrs would iterate a str)."""
    if not isinstance(v, list):
        raise TypeMismatch(f"expected list, got {type_name(v)}")
    args = get_args(t)
    elem = args[0] if args else Any
    if elem is Any:
        return list(v)
    hook = converter.get_structure_hook(elem)
    out: list[Any] = []
    errors: list[Exception] = []
    for i, x in enumerate(v):
        try:
            out.append(hook(x, elem))
        except Exception as exc:  # noqa: BLE001 - collected into the group
            exc.__notes__ = [
                *getattr(exc, "__notes__", []),
                IterableValidationNote(f"Structuring {t} @ index {i}", i, elem),
            ]
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {t!r}", errors, t)
    return out


converter.register_structure_hook_func(_is_list, _list_hook)


def _is_var_tuple(t: Any) -> bool:
    args = get_args(t)
    return getattr(t, "__origin__", None) is tuple and len(args) == 2 and args[1] is Ellipsis


def _var_tuple_hook(v: Any, t: Any) -> tuple[Any, ...]:
    """``tuple[X, ...]`` fields read a JSON array, like lists (never a string's characters)."""
    return tuple(_list_hook(v, list[get_args(t)[0]]))  # type: ignore[valid-type]


converter.register_structure_hook_func(_is_var_tuple, _var_tuple_hook)


def register(
    cls: type[Any], *, forbid_extra: bool, keep_raw: bool = False, **overrides: Any
) -> None:
    """Register a dict hook for ``cls`` that first checks for a JSON object
    and, with ``keep_raw``, stores the input dict in the ``raw`` field."""
    if keep_raw:
        overrides["raw"] = override(omit=True)
    base = make_dict_structure_fn(
        cls, converter, _cattrs_forbid_extra_keys=forbid_extra, **overrides
    )

    def hook(v: Any, t: Any) -> Any:
        if not isinstance(v, Mapping):
            raise TypeMismatch(f"expected object, got {type_name(v)}")
        obj = base(v, t)
        if keep_raw:
            obj = attrs.evolve(obj, raw=dict(v))
        return obj

    converter.register_structure_hook(cls, hook)


# --------------------------------------------------------------------------
# Error formatting and JSON loading
# --------------------------------------------------------------------------


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, (TypeMismatch, MessageError)):
        return str(exc)
    if isinstance(exc, KeyError):
        return "missing"
    if isinstance(exc, ForbiddenExtraKeysError):
        return "unknown key(s): " + ", ".join(sorted(exc.extra_fields))
    return cattrs.v.format_exception(exc, type_)


def _messages_for(exc: BaseException) -> list[str]:
    out = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_format_exception):
        desc, _, path = line.rpartition(" @ ")
        path = path.removeprefix("$").removeprefix(".")
        out.append(f"{path}: {desc}" if path else desc)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _loads(text: str) -> Any:
    """Strict JSON (no NaN / Infinity); raises MessageError, also for nesting too deep to parse."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise MessageError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise MessageError("payload is not valid JSON: nested too deeply") from None


def load_json_object(payload: Bytes) -> dict[str, Any]:
    """Decode ``payload`` (UTF-8 JSON bytes) into a dict.

    Raises MessageError for invalid UTF-8, invalid JSON (NaN / Infinity
    included), or JSON that is not an object.
    """
    try:
        text = bytes(payload).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageError(f"payload is not valid UTF-8 (byte {exc.start})") from None
    obj = _loads(text)
    if not isinstance(obj, dict):
        raise MessageError(f"payload must be a JSON object, got {_json_kind(obj)}")
    return obj


def _json_kind(v: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else kinds.get(type(v), type(v).__name__)


def structure(obj: Any, cls: type[T]) -> T:
    """Structure decoded JSON into ``cls``; raises MessageError naming the field(s)."""
    try:
        return converter.structure(obj, cls)
    except MessageError:
        raise
    except (ClassValidationError, IterableValidationError) as exc:
        raise MessageError(_messages_for(exc)) from None
    except (TypeError, ValueError, KeyError) as exc:
        raise MessageError(_format_exception(exc, None)) from None


def structure_json(payload: Bytes, cls: type[T]) -> T:
    """Parse a UTF-8 JSON object payload into ``cls`` with `converter`.

    Raises MessageError naming the offending field(s) for invalid UTF-8,
    invalid JSON, a non-object, missing fields, wrong types, unknown keys
    (for classes that forbid them) and failed field checks.
    """
    return structure(load_json_object(payload), cls)


# --------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------

_HOST_RE = re.compile(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.%A-Za-z_\-]+\]")


def parse_peer(peer: str, *, field: str = "peer") -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)`` (an IPv6 host in brackets,
    returned without them). Port must be decimal 1-65535. Raises
    MessageError naming ``field`` otherwise."""
    host, sep, port_s = peer.rpartition(":")
    if not sep or not host or not _HOST_RE.fullmatch(host):
        raise MessageError(f"{field}: expected 'host:port', got {peer!r}")
    if not (port_s.isascii() and port_s.isdigit()) or not 1 <= int(port_s) <= 65535:
        raise MessageError(f"{field}: port must be 1-65535, got {port_s!r}")
    if host.startswith("["):
        host = host[1:-1]
    return host, int(port_s)


def _peer_validator(_inst: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None:
        parse_peer(value, field=attr.name)


def _empty_to_none(v: str | None) -> str | None:
    return None if v == "" else v


# --------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------

ExpertMode: TypeAlias = Literal["solo", "combined"]


def _content_hook(v: Any, _t: Any) -> str | list[Any] | None:
    if v is None or isinstance(v, (str, list)):
        return v
    raise TypeMismatch(f"expected str, list or null, got {type_name(v)}")


@attrs.frozen
class ChatMessage:
    """One OpenAI chat message. ``content`` is a string, a list of content
    parts (passed through unchecked) or null. Other keys (``tool_calls``,
    ...) are allowed and dropped here; the request's ``raw`` keeps them."""

    role: str
    content: str | list[Any] | None = None
    name: str | None = None


register(ChatMessage, forbid_extra=False, content=override(struct_hook=_content_hook))


@attrs.frozen
class SetExpertModeRequest:
    """SET_EXPERT_MODE payload (hydra-protocol.md §3): ``mode`` is
    ``"solo"`` or ``"combined"``; ``peer`` is ``"host:port"`` or None (an
    empty string is read as None). Build it with `parse_set_expert_mode`.
    Raises MessageError on a bad peer."""

    mode: ExpertMode
    peer: str | None = attrs.field(
        default=None, converter=_empty_to_none, validator=_peer_validator
    )


register(SetExpertModeRequest, forbid_extra=True)


def parse_set_expert_mode(payload: Bytes) -> SetExpertModeRequest:
    """Parse a SET_EXPERT_MODE payload (hydra-protocol.md §3).

    Accepted forms: raw ``solo`` / ``combined`` (ASCII, any case, surrounding
    whitespace ignored); a JSON string of those; a JSON object
    ``{"mode": ..., "peer": "host:port"}`` (mode case-insensitive, other
    keys rejected). Raises MessageError for invalid UTF-8, bad JSON, an
    unknown mode or a bad peer: the server replies BAD_REQUEST (the C++
    engine silently fell back to solo, §3 **[fix]**).
    """
    try:
        text = bytes(payload).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise MessageError("mode: payload is not valid UTF-8") from None
    if not text:
        raise MessageError("mode: missing (empty payload)")
    if text[0] in '{["':
        obj = _loads(text)
        if isinstance(obj, str):
            text = obj.strip()
        elif isinstance(obj, dict):
            mode = obj.get("mode")
            if isinstance(mode, str):
                obj = {**obj, "mode": mode.strip().lower()}
            return structure(obj, SetExpertModeRequest)
        else:
            raise MessageError(f"payload must be a mode or a JSON object, got {_json_kind(obj)}")
    mode = text.lower()
    if mode not in ("solo", "combined"):
        raise MessageError(f"mode: expected 'solo' or 'combined', got {text[:40]!r}")
    return SetExpertModeRequest(mode)  # type: ignore[arg-type]


def _non_empty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise MessageError(f"{attr.name}: must not be empty")


@attrs.frozen
class PipelineAttachRequest:
    """PIPELINE_ATTACH payload (hydra-protocol.md §3): ``peer``
    ``"host:port"``, ``ot_split`` the tensor-override regex naming the
    tensors the peer owns (non-empty; not compiled here: llama.cpp uses
    std::regex). Unknown keys are rejected."""

    peer: str = attrs.field(validator=_peer_validator)
    ot_split: str = attrs.field(validator=_non_empty)


register(PipelineAttachRequest, forbid_extra=True)


@attrs.frozen
class DecodeRequest:
    """DECODE payload (hydra-protocol.md §3): ``{"n_predict": N, "messages":
    [...]}`` or a full OpenAI chat body. Unknown keys are allowed; the whole
    input object is kept in ``raw``. ``messages`` None means "continue from
    the slot's KV cache". ``stream`` false asks for the whole reply at once
    (with its final meta). See `frame_budget` for the token count."""

    n_predict: int | None = None
    max_tokens: int | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    stream: bool | None = None
    raw: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def frame_budget(self, default: int, cap: int) -> int:
        """Tokens (= 9-byte frames) to announce: ``n_predict``, else
        ``max_tokens``; a missing or negative value (llama-server's -1 =
        "until EOS") means ``default``; the result is at most ``cap``."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        if n is None or n < 0:
            n = default
        return min(n, cap)


register(DecodeRequest, forbid_extra=False, keep_raw=True)


@attrs.frozen
class PrefillRequest:
    """PREFILL payload (hydra-protocol.md §3): an OpenAI chat-completions
    body; ``messages`` is required and non-empty, ``model`` is an optional
    alias. Unknown keys are allowed; the whole input object is kept in
    ``raw``."""

    messages: list[ChatMessage] = attrs.field(validator=_non_empty)
    model: str | None = None
    raw: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)


register(PrefillRequest, forbid_extra=False, keep_raw=True)


# --------------------------------------------------------------------------
# CONFIGURE
# --------------------------------------------------------------------------

T1_KEYS: dict[str, Callable[[Any], Any]] = {
    "temperature": _as_float,
    "top_p": _as_float,
    "top_k": _as_int,
    "min_p": _as_float,
    "seed": _as_int,
    "n_predict": _as_int,
    "repeat_penalty": _as_float,
    "repeat_last_n": _as_int,
    "presence_penalty": _as_float,
    "frequency_penalty": _as_float,
    "state_chunk_size": _as_int,
}
"""CONFIGURE tier 1 (applied at once), key -> strict checker."""
T2_KEYS: dict[str, Callable[[Any], Any]] = {
    "n_ctx": _as_int,
    "cache_type_k": _as_str,
    "cache_type_v": _as_str,
    "n_parallel": _as_int,
}
"""CONFIGURE tier 2 (context rebuild), key -> strict checker."""
T3_KEYS: dict[str, Callable[[Any], Any]] = {
    "model": _as_str,
    "model_path": _as_str,
    "n_gpu_layers": _as_int,
    "tensor_overrides": _as_str_or_str_list,
    "override_tensor": _as_str_or_str_list,
}
"""CONFIGURE tier 3 (model reload), key -> strict checker."""

STATE_CHUNK_MIN = 64 * 1024
STATE_CHUNK_MAX = 64 * 1024 * 1024


@attrs.frozen
class ConfigureRequest:
    """CONFIGURE payload: a free JSON object of engine/sampling params
    (hydra-protocol.md §3). Split it with `classify_configure_keys`."""

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
    hydra-protocol.md §3; ``unrecognized`` keeps input order and becomes
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
    """Clamp a state chunk size (bytes) to 64 KiB..64 MiB (hydra-protocol.md §3)."""
    return max(STATE_CHUNK_MIN, min(STATE_CHUNK_MAX, n))
