"""Strict JSON to attrs classes: one converter factory for every request body the node reads.

Sans-I/O.  Typing is strict, unlike cattrs' defaults: a str is never turned
into an int, a bool is not an int, a number is not a str, floats accept ints
but must be finite, ints must fit in 64 bits; JSON itself is strict (no NaN or
Infinity).  Every error is a :class:`MessageError` (an
:class:`~hydra_trio.errors.InvalidRequest`) whose message names the field,
e.g. ``"n_predict: expected int, got str"`` or ``"messages[0].role: missing"``.

Each module that reads bodies makes its own :class:`StrictConverter` (the
Hydra payloads in :mod:`hydra_trio.hydra.messages`, the OpenAI bodies in
:mod:`hydra_trio.openai.schemas`): importing one never changes another's hooks.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from types import GenericAlias
from typing import Any, Literal, TypeVar, get_args

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from ..errors import InvalidRequest
from ..protocol.decode_frames import Bytes

T = TypeVar("T")


class MessageError(InvalidRequest, ValueError):
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
# Strict primitives (shared by the converter and classify_configure_keys); each raises TypeMismatch
# --------------------------------------------------------------------------


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def as_int(v: Any) -> int:
    """A JSON integer within 64 bits (fields with tighter bounds check them later)."""
    if isinstance(v, int) and not isinstance(v, bool):
        if not INT64_MIN <= v <= INT64_MAX:
            raise TypeMismatch(f"expected a 64-bit integer, got one with {len(str(abs(v)))} digits")
        return int(v)
    raise TypeMismatch(f"expected int, got {type_name(v)}")


def as_bool(v: Any) -> bool:
    """A JSON boolean (not 0 / 1)."""
    if isinstance(v, bool):
        return v
    raise TypeMismatch(f"expected bool, got {type_name(v)}")


def as_float(v: Any) -> float:
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


def as_str(v: Any) -> str:
    """A JSON string."""
    if isinstance(v, str):
        return v
    raise TypeMismatch(f"expected str, got {type_name(v)}")


def as_str_or_str_list(v: Any) -> str | list[str]:
    """A JSON string, or an array of strings (a copy)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    raise TypeMismatch(f"expected str or list of str, got {type_name(v)}")


# --------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------


def _is_literal(t: Any) -> bool:
    return getattr(t, "__origin__", None) is Literal


def _literal_hook(v: Any, t: Any) -> Any:
    allowed = get_args(t)
    if v in allowed and type(v) in {type(a) for a in allowed}:
        return v
    want = " or ".join(repr(a) for a in allowed)
    raise TypeMismatch(f"expected {want}, got {v!r}")


def _is_list(t: Any) -> bool:
    return t is list or getattr(t, "__origin__", None) is list


def _is_var_tuple(t: Any) -> bool:
    args = get_args(t)
    return getattr(t, "__origin__", None) is tuple and len(args) == 2 and args[1] is Ellipsis


class StrictConverter:
    """A cattrs converter with strict primitives and field-naming errors.

    Unknown keys are rejected unless a class is registered with
    ``forbid_extra=False``; a ``list`` / ``tuple[X, ...]`` field reads only a
    JSON array (cattrs would iterate a string).
    """

    def __init__(self) -> None:
        c = self.cattrs = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
        c.register_structure_hook(int, lambda v, _t: as_int(v))
        c.register_structure_hook(float, lambda v, _t: as_float(v))
        c.register_structure_hook(str, lambda v, _t: as_str(v))
        c.register_structure_hook(bool, lambda v, _t: as_bool(v))
        c.register_structure_hook_func(_is_literal, _literal_hook)
        c.register_structure_hook_func(_is_list, self._list_hook)
        c.register_structure_hook_func(_is_var_tuple, self._var_tuple_hook)

    def _list_hook(self, v: Any, t: Any) -> list[Any]:
        if not isinstance(v, list):
            raise TypeMismatch(f"expected list, got {type_name(v)}")
        args = get_args(t)
        elem = args[0] if args else Any
        if elem is Any:
            return list(v)
        hook = self.cattrs.get_structure_hook(elem)
        out: list[Any] = []
        errors: list[Exception] = []
        for i, x in enumerate(v):
            try:
                out.append(hook(x, elem))
            except Exception as exc:  # collected into the group
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {t} @ index {i}", i, elem),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {t!r}", errors, t)
        return out

    def _var_tuple_hook(self, v: Any, t: Any) -> tuple[Any, ...]:
        return tuple(self._list_hook(v, GenericAlias(list, get_args(t)[0])))  # list[item type]

    def register(self, cls: type[Any], *, forbid_extra: bool, keep_raw: bool = False, **overrides: Any) -> None:
        """Read ``cls`` from a JSON object (anything else: "expected object"); ``overrides`` are
        cattrs field overrides; with ``keep_raw`` the input dict is kept in the ``raw`` field."""
        if keep_raw:
            overrides["raw"] = override(omit=True)
        base = make_dict_structure_fn(cls, self.cattrs, _cattrs_forbid_extra_keys=forbid_extra, **overrides)

        def hook(v: Any, t: Any) -> Any:
            if not isinstance(v, Mapping):
                raise TypeMismatch(f"expected object, got {type_name(v)}")
            obj = base(v, t)
            if keep_raw:
                obj = attrs.evolve(obj, raw=dict(v))
            return obj

        self.cattrs.register_structure_hook(cls, hook)

    def structure(self, obj: Any, cls: type[T]) -> T:
        """Structure decoded JSON into ``cls``; raises MessageError naming the field(s)."""
        try:
            return self.cattrs.structure(obj, cls)
        except MessageError:
            raise
        except (ClassValidationError, IterableValidationError) as exc:
            raise MessageError(_messages_for(exc)) from None
        except (TypeError, ValueError, KeyError) as exc:
            raise MessageError(_format_exception(exc, None)) from None

    def structure_json(self, payload: Bytes, cls: type[T]) -> T:
        """Parse a UTF-8 JSON object payload into ``cls``.

        Raises MessageError naming the offending field(s) for invalid UTF-8,
        invalid JSON, a non-object, missing fields, wrong types, unknown keys
        (for classes that forbid them) and failed field checks.
        """
        return self.structure(load_json_object(payload), cls)


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


class NotUnicode(MessageError):
    """A JSON string (a key or a value) that is not Unicode text: it holds a lone surrogate
    (``"\\ud800"``, a high surrogate without its low one, a low one alone).  The message names
    the field, e.g. ``"messages[0].content: not valid Unicode: ..."``."""


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")  # a \uD800..\uDFFF escape (or text that looks like one)


def _show(s: str) -> str:
    """``s`` quoted for an error message, lone surrogates (and other non-printables) escaped:
    the message itself must encode as UTF-8."""
    if len(s) > 40:
        s = s[:40] + "..."
    return json.dumps(s)


def _field_path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _SURROGATE.search(p) is None and p.isidentifier():
            out += f".{p}" if out else p
        else:
            out += f"[{_show(p)}]"
    return out


def check_unicode(obj: Any) -> None:
    """Every string of decoded JSON ``obj``, keys and values at any depth, must be Unicode text
    (encodable as UTF-8): the node's one policy for text that comes in (docs/operations.md, Security).

    Raises:
        NotUnicode: the first string holding a lone surrogate, naming its field
            (``messages[0].content``, ``tools[0].function.parameters["\\ud800"]`` for a key).
    """
    stack: list[tuple[Any, list[str | int]]] = [(obj, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            bad = _SURROGATE.search(v)
            if bad is not None:
                where = _field_path(path) or "the payload"
                raise NotUnicode(
                    f"{where}: not valid Unicode (UTF-8 cannot encode it): "
                    f"a lone surrogate U+{ord(bad.group()):04X} at "
                    f"character {bad.start()} (JSON text must be Unicode; a \\uD83D\\uDE00 "
                    "pair is fine, a surrogate alone is not)"
                )
        elif isinstance(v, dict):
            items = list(v.items())
            for k, _ in items:
                bad = _SURROGATE.search(k)
                if bad is not None:
                    where = _field_path(path)
                    raise NotUnicode(
                        f"{where + ': ' if where else ''}key {_show(k)}: "
                        "not valid Unicode (UTF-8 cannot encode it): a lone "
                        f"surrogate U+{ord(bad.group()):04X} (JSON text must be Unicode)"
                    )
            stack.extend((x, [*path, k]) for k, x in reversed(items))
        elif isinstance(v, list):
            stack.extend((x, [*path, i]) for i, x in reversed(list(enumerate(v))))


MAX_JSON_DEPTH = 256
"""Deepest nesting of arrays and objects in JSON a request carries (its body, a tool call's ``arguments``
text).  llama-server's JSON parser has no such limit; here every walk over a request (the schema
converter, templates, re-encoding) may recurse once per level, so the depth stays well inside Python's
recursion limit (1000).  A JSON schema at the converter's own depth limit (64 subschemas, two JSON levels
each) fits with room for the body around it."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class TooDeep(MessageError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH`; the message names the limit."""

    def __init__(self, where: str = "") -> None:
        super().__init__(
            f"{where + ': ' if where else ''}nested deeper than {MAX_JSON_DEPTH} levels of arrays and "
            "objects (MAX_JSON_DEPTH)"
        )


def json_depth(data: str | Bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text ``data`` (valid JSON: strings are skipped
    whole).  Linear, and no recursion: one regular-expression pass drops the strings, the brackets left
    are summed."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    steps = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS).translate(_BRACKET_STEP)
    return max(itertools.accumulate(memoryview(steps).cast("b")), default=0)


def loads(text: str | Bytes, where: str = "") -> Any:
    """Strict JSON (no NaN / Infinity, Unicode text only, at most :data:`MAX_JSON_DEPTH` levels deep);
    raises MessageError, also for invalid UTF-8 (bytes are read as UTF-8, a leading BOM skipped),
    :class:`TooDeep` naming the limit (``where``: the field, for its message) and :class:`NotUnicode`
    naming the field for a string with a lone surrogate (:func:`check_unicode`)."""
    if not isinstance(text, str):
        try:
            text = bytes(text).decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as exc:
            raise MessageError(f"payload is not valid UTF-8 ({exc})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise MessageError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than Python's parser goes (about 1000 levels)
        raise TooDeep(where) from None
    # no text with fewer brackets than the limit can nest deeper than it: most skip the scan
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise TooDeep(where)
    # the walk only when the text may hold a surrogate: escaped, or raw (a str argument)
    if _SURROGATE_ESCAPE.search(text) is not None or _SURROGATE.search(text) is not None:
        check_unicode(obj)
    return obj


class TooLong(MessageError):
    """Text that would pass the caller's limit on characters (:func:`dumps_within`)."""


def dumps_within(value: Any, max_chars: int | None, **options: Any) -> str:
    """``json.dumps(value, **options)``, refused with :class:`TooLong` as soon as the text passes
    ``max_chars`` characters (None: no limit).  Pretty-printed JSON (``indent``) repeats each level's
    indentation on each of its lines, so its text can be the value's length times its depth: it is
    written piece by piece and stops at the limit, so nothing much larger than the limit is built."""
    if options.get("indent") is None:  # compact: at most a few times the value's own text
        text = json.dumps(value, **options)
    else:
        pieces, n = [], 0
        for piece in json.JSONEncoder(**options).iterencode(value):
            n += len(piece)
            if max_chars is not None and n > max_chars:
                raise TooLong(f"the text would be longer than {max_chars} characters")
            pieces.append(piece)
        text = "".join(pieces)
    if max_chars is not None and len(text) > max_chars:
        raise TooLong(f"the text would be longer than {max_chars} characters")
    return text


def load_json_object(payload: Bytes) -> dict[str, Any]:
    """Decode ``payload`` (UTF-8 JSON bytes) into a dict.

    Raises MessageError for invalid UTF-8, invalid JSON (NaN / Infinity
    included), or JSON that is not an object.
    """
    try:
        text = bytes(payload).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageError(f"payload is not valid UTF-8 (byte {exc.start})") from None
    obj = loads(text)
    if not isinstance(obj, dict):
        raise MessageError(f"payload must be a JSON object, got {json_kind(obj)}")
    return obj


def json_kind(v: Any) -> str:
    """JSON's name for the kind of a decoded value: ``"array"``, ``"string"``, ``"boolean"``, ``"number"``,
    ``"null"`` (a Python type's name otherwise)."""
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else kinds.get(type(v), type(v).__name__)
