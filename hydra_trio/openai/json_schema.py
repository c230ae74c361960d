"""JSON schema -> GBNF, with the work bounded before it is done.

The node's one converter, for ``json_schema``, ``response_format`` and tools'
``parameters`` (llama-cpp-python's ``json_schema_to_gbnf`` expands
``minItems: 100000000`` into a 100-million-item string before anything can
refuse it, recurses once per optional property, and ignores keywords it does
not enforce).  It enforces what
llama.cpp's converter enforces (``common/json-schema.cpp`` and
``common/json-schema-to-grammar.cpp`` of the llama.cpp we run):

* ``type`` (a name or a list of names), ``const``, ``enum``, ``anyOf`` /
  ``oneOf`` (as alternatives: like llama.cpp, ``oneOf`` does not check that
  only one matches), ``allOf`` of object schemas, local ``$ref`` (``#/...``);
* objects: ``properties``, ``required``, ``additionalProperties``;
* arrays: ``items`` (a schema, or a list: a tuple), ``prefixItems``,
  ``minItems``, ``maxItems``;
* strings: ``minLength``, ``maxLength``, ``pattern`` (anchored ``^...$``),
  ``format`` ``date``, ``time``, ``date-time``, ``uuid`` (``uuid1``..``uuid5``);
* integers: ``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum`` (64-bit; a fractional bound is rounded inwards), as
  digit-range rules.

Annotations (``title``, ``description``, ``default``, ``examples``, ``$defs``,
...) are accepted.  Any other keyword, or a keyword where the grammar would
not enforce it (``minimum`` on a ``number``, ``minLength`` beside
``pattern``, ``format: email``, ``multipleOf``, ``uniqueItems: true``, ...)
raises :class:`SchemaError` naming it and its place (``#/properties/x``).

Nothing recurses with the schema's width: an object's optional properties
become llama.cpp's rule set (``_build_object_rule``), built from the last
property back, linear in time and text.

Limits, checked while walking the schema, before any output is built:
:data:`MAX_SCHEMA_DEPTH`, :data:`MAX_SCHEMA_NODES`, :data:`MAX_REPETITION`
(every count and ``{m,n}``; llama.cpp's GBNF parser refuses a larger minimum
and turns a larger maximum into "unbounded"), :data:`MAX_PATTERN_CHARS`, and
the grammar's size (:data:`hydra_trio.engine.batching.sampling.MAX_GRAMMAR_BYTES`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, ClassVar

from ..engine import MAX_GRAMMAR_BYTES
from ..errors import InvalidRequest

MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of subschemas (a ``$ref`` followed counts as one level)."""
MAX_SCHEMA_NODES = 4096
"""Most subschemas visited in one schema (``$ref`` targets once each)."""
MAX_REPETITION = 2000
"""Largest ``minItems``, ``maxItems``, ``minLength``, ``maxLength`` and regex ``{m,n}`` count
(llama.cpp's ``MAX_REPETITION_THRESHOLD``)."""
MAX_PATTERN_CHARS = 4096
"""Longest ``pattern``."""
MAX_INTEGER_DIGITS = 16
"""Digits of an integer with no bound on that side (llama.cpp's ``integral-part`` rule)."""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "example",
        "$schema",
        "$id",
        "$comment",
        "$defs",
        "definitions",
        "readOnly",
        "writeOnly",
        "deprecated",
        "discriminator",
        "$anchor",
        "contentMediaType",
        "contentEncoding",
    }
)
"""Keywords that constrain nothing (accepted, and not enforced because there is nothing to enforce)."""

_APPLIES_TO = {
    "properties": "object",
    "required": "object",
    "additionalProperties": "object",
    "minProperties": "object",
    "maxProperties": "object",
    "patternProperties": "object",
    "propertyNames": "object",
    "dependentRequired": "object",
    "dependentSchemas": "object",
    "dependencies": "object",
    "unevaluatedProperties": "object",
    "items": "array",
    "prefixItems": "array",
    "minItems": "array",
    "maxItems": "array",
    "uniqueItems": "array",
    "contains": "array",
    "minContains": "array",
    "maxContains": "array",
    "additionalItems": "array",
    "unevaluatedItems": "array",
    "minLength": "string",
    "maxLength": "string",
    "pattern": "string",
    "format": "string",
    "minimum": "number",
    "maximum": "number",
    "exclusiveMinimum": "number",
    "exclusiveMaximum": "number",
    "multipleOf": "number",
}
"""The JSON type each type-specific keyword constrains (on values of another type it holds vacuously)."""

_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")

SPACE = '" "?'
_PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false") space', ()),
    "null": ('"null" space', ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integer": ('("-"? integral-part) space', ("integral-part",)),
    "number": (
        '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)? space',
        ("integral-part", "decimal-part"),
    ),
    "char": (r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": (r'"\"" char* "\"" space', ("char",)),
    "value": (
        "object | array | string | number | boolean | null",
        ("object", "array", "string", "number", "boolean", "null"),
    ),
    "object": (
        '"{" space ( string ":" space value ("," space string ":" space value)* )? "}" space',
        ("string", "value"),
    ),
    "array": ('"[" space ( value ("," space value)* )? "]" space', ("value",)),
    "uuid": (
        r'"\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
        r'[0-9a-fA-F]{12} "\"" space',
        (),
    ),
    "date": ('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )', ()),
    "time": (
        '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
        '( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
        (),
    ),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": (r'"\"" date "\"" space', ("date",)),
    "time-string": (r'"\"" time "\"" space', ("time",)),
    "date-time-string": (r'"\"" date-time "\"" space', ("date-time",)),
}
_FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string"}


class SchemaError(InvalidRequest, ValueError):
    """A JSON schema that cannot be turned into a grammar that enforces it, or that is over a limit;
    the message names the keyword or the limit and where (``#/properties/a``)."""


class Document:
    """A schema placed inside another (a tool's ``parameters`` inside the call object its grammar
    describes) that is a document of its own: its ``$ref``s resolve inside it (``#`` is this schema),
    the depth limit counts from its root, and errors name places in it after ``where``
    (``tools[0].function.parameters/properties/a``)."""

    __slots__ = ("schema", "where")

    def __init__(self, schema: Any, where: str = "#") -> None:
        self.schema = schema
        self.where = where


def schema_to_gbnf(schema: Any, *, wrap: Callable[[str], str] | None = None) -> str:
    """GBNF for JSON values that satisfy ``schema`` (which may hold :class:`Document` s).

    The root rule ``root`` is the schema's rule; with ``wrap``, it is ``wrap(name)``: GBNF text
    around ``name``, the schema's rule (a tool call between its format's markers).

    Raises:
        SchemaError: a keyword that cannot be enforced, an invalid schema, or a limit
            (this module's docstring) exceeded; nothing larger than the limits is built.
    """
    conv = _Converter(schema)
    if wrap is None:
        conv.visit(schema, "", "#", 0)
    else:
        conv.rules["root"] = ""  # held for the wrapper: no rule of the schema takes the name
        call = conv.visit(schema, "call", "#", 0)
        del conv.rules["root"]
        conv.add_rule("root", wrap(call))
    return conv.grammar()


def _json_literal(value: Any, path: str) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError, TypeError):
        raise SchemaError(f"{path}: a value that cannot be written as JSON (too deep, or not finite)") from None
    return _gbnf_literal(text)


def _gbnf_literal(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _count(schema: dict, key: str, path: str, default: int | None) -> int | None:
    if key not in schema:
        return default
    v = schema[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        if isinstance(v, float) and v.is_integer() and v >= 0:
            v = int(v)
        else:
            raise SchemaError(f"{path}: {key} must be a non-negative integer")
    if v > MAX_REPETITION:
        raise SchemaError(f"{path}: {key} is {v}; the limit is {MAX_REPETITION} (MAX_REPETITION)")
    return v


def _repeat(item: str, lo: int, hi: int | None, sep: str = "") -> str:
    """``item`` lo..hi times (hi None: unbounded), separated by ``sep``: GBNF ``{m,n}`` that
    llama.cpp's parser expands (counts are at most :data:`MAX_REPETITION` here)."""
    if hi == 0:
        return ""
    if not sep:
        if (lo, hi) == (0, 1):
            return f"{item}?"
        if hi is None:
            return f"{item}*" if lo == 0 else f"{item}+" if lo == 1 else f"{item}{{{lo},}}"
        return f"{item}{{{lo}}}" if lo == hi else f"{item}{{{lo},{hi}}}"
    rest = _repeat(f"({sep} {item})", max(lo - 1, 0), None if hi is None else hi - 1)
    body = f"{item} {rest}".strip()
    return f"({body})?" if lo == 0 else body


# --------------------------------------------------------------------------- integer ranges


def _same_length(lo: str, hi: str) -> str:
    """GBNF for the decimal strings of one length between ``lo`` and ``hi`` (digit strings, lo <= hi)."""
    i = 0
    while i < len(lo) and lo[i] == hi[i]:
        i += 1
    prefix = f'"{lo[:i]}" ' if i else ""
    if i == len(lo):
        return prefix.strip()
    rest = len(lo) - i - 1
    a, b = int(lo[i]), int(hi[i])
    if rest == 0:
        return f"{prefix}[{a}-{b}]"
    alts = []
    low_full = lo[i + 1 :] == "0" * rest
    high_full = hi[i + 1 :] == "9" * rest
    first = a if low_full else a + 1
    last = b if high_full else b - 1
    if not low_full:
        alts.append(f'"{a}" ({_same_length(lo[i + 1 :], "9" * rest)})')
    if first <= last:
        digits = f"[{first}]" if first == last else f"[{first}-{last}]"
        alts.append(f"{digits} [0-9]{{{rest}}}" if rest > 1 else f"{digits} [0-9]")
    if not high_full:
        alts.append(f'"{b}" ({_same_length("0" * rest, hi[i + 1 :])})')
    return f"{prefix}({' | '.join(alts)})"


def _nonneg_range(lo: int, hi: int | None) -> str:
    """GBNF for the non-negative integers lo..hi (hi None: up to :data:`MAX_INTEGER_DIGITS` digits)."""
    alts = []
    top_digits = len(str(hi)) if hi is not None else max(MAX_INTEGER_DIGITS, len(str(lo)))
    for d in range(len(str(lo)), top_digits + 1):
        a = max(lo, 10 ** (d - 1) if d > 1 else 0)
        if hi is None and a == 10 ** (d - 1) and d > 1:  # every number of d.. digits: one rule
            alts.append(f"[1-9] [0-9]{{{d - 1},{top_digits - 1}}}")
            break
        b = min(hi, 10**d - 1) if hi is not None else 10**d - 1
        if a <= b:
            alts.append(_same_length(str(a), str(b)))
    return " | ".join(f"({x})" for x in alts)


def integer_range_gbnf(lo: int | None, hi: int | None) -> str:
    """GBNF (no trailing space) for the decimal integers in ``[lo, hi]`` (None: unbounded on that side,
    then at most :data:`MAX_INTEGER_DIGITS` digits), without leading zeros or ``-0``."""
    alts = []
    if lo is None or lo < 0:  # the negative part: "-" then the magnitudes
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        mag_hi = None if lo is None else -lo
        if mag_hi is None or mag_lo <= mag_hi:
            alts.append(f'"-" ({_nonneg_range(mag_lo, mag_hi)})')
    if hi is None or hi >= 0:
        alts.append(_nonneg_range(max(lo or 0, 0), hi))
    return " | ".join(f"({a})" for a in alts)


# --------------------------------------------------------------------------- patterns


class _Pattern:
    """An anchored regular expression (``^...$``) -> GBNF, JSON-string-safe, bounded."""

    _CLASS_ESCAPES: ClassVar[dict[str, str]] = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r"}

    def __init__(self, pattern: str, path: str) -> None:
        self.p = pattern
        self.path = path
        self.i = 0

    def fail(self, why: str) -> SchemaError:
        return SchemaError(f"{self.path}: pattern {self.p[:80]!r} cannot be enforced: {why}")

    def convert(self) -> str:
        if len(self.p) > MAX_PATTERN_CHARS:
            raise SchemaError(
                f"{self.path}: pattern is {len(self.p)} characters; the limit is "
                f"{MAX_PATTERN_CHARS} (MAX_PATTERN_CHARS)"
            )
        if len(self.p) < 2 or self.p[0] != "^" or self.p[-1] != "$" or self.p.endswith("\\$"):
            raise self.fail("it must be anchored with ^ and $")
        self.p = self.p[1:-1]
        out = self.alternation(0)
        if self.i != len(self.p):
            raise self.fail("unbalanced parentheses")
        return out

    def alternation(self, depth: int) -> str:
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"{self.path}: pattern nests groups deeper than {MAX_SCHEMA_DEPTH} (MAX_SCHEMA_DEPTH)")
        alts = [self.sequence(depth)]
        while self.i < len(self.p) and self.p[self.i] == "|":
            self.i += 1
            alts.append(self.sequence(depth))
        return " | ".join(a or '""' for a in alts)

    def sequence(self, depth: int) -> str:
        items: list[str] = []
        quantified = False
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            c = self.p[self.i]
            if c in "*+?{":
                if not items or quantified:
                    raise self.fail("nothing to repeat" if not items else "a quantifier after a quantifier")
                items[-1] = self.quantifier(items[-1])
                quantified = True
                continue
            quantified = False
            if c == "(":
                self.i += 1
                if self.p.startswith("?:", self.i):
                    self.i += 2
                elif self.p.startswith("?", self.i):
                    raise self.fail("lookarounds and named groups are not supported")
                inner = self.alternation(depth + 1)
                if self.i >= len(self.p) or self.p[self.i] != ")":
                    raise self.fail("unbalanced parentheses")
                self.i += 1
                items.append(f"({inner})")
            elif c == "[":
                items.append(self.char_class())
            elif c == ".":
                self.i += 1
                items.append(r'[^"\\\x00-\x1F\x7F]')
            elif c in "^$":
                raise self.fail("an anchor inside the pattern")
            elif c == "\\":
                items.append(self.escape())
            else:
                self.i += 1
                items.append(_gbnf_literal(c if c not in '"\\' else "\\" + c))
        return " ".join(items)

    def escape(self) -> str:
        if self.i + 1 >= len(self.p):
            raise self.fail("a trailing backslash")
        c = self.p[self.i + 1]
        self.i += 2
        if c in self._CLASS_ESCAPES:
            return f"[{self._CLASS_ESCAPES[c]}]"
        if c in "DWS":
            return f'[^{self._CLASS_ESCAPES[c.lower()]}"\\\\\\x00-\\x1F\\x7F]'
        if c in "ntr":
            return _gbnf_literal({"n": "\\n", "t": "\\t", "r": "\\r"}[c])  # JSON escapes, as text
        if c in '"\\':
            return _gbnf_literal("\\" + c)
        if c in ".^$|?*+()[]{}/-":
            return _gbnf_literal(c)
        raise self.fail(f"the escape \\{c} is not supported")

    def char_class(self) -> str:
        j = self.i + 1
        negated = j < len(self.p) and self.p[j] == "^"
        j += negated
        body = []
        first = True
        while j < len(self.p) and (self.p[j] != "]" or first):
            first = False
            c = self.p[j]
            if c == "\\":
                if j + 1 >= len(self.p):
                    raise self.fail("a trailing backslash")
                e = self.p[j + 1]
                if e in self._CLASS_ESCAPES:
                    body.append(self._CLASS_ESCAPES[e])
                elif e in "ntr":
                    body.append("\\" + e)
                elif e in "]-^[.|?*+(){}/":
                    body.append("\\" + e if e in "]-^[" else e)
                else:
                    raise self.fail(f"the escape \\{e} in a character class is not supported")
                j += 2
                continue
            if c in '"\\':
                raise self.fail('a character class holding " or \\ is not supported')
            if ord(c) < 0x20:
                body.append(f"\\x{ord(c):02X}")
            else:
                body.append(c)
            j += 1
        if j >= len(self.p):
            raise self.fail("an unterminated character class")
        self.i = j + 1
        text = "".join(body)
        if negated:  # never a quote, a backslash or a control character inside a JSON string
            return f'[^{text}"\\\\\\x00-\\x1F\\x7F]'
        return f"[{text}]"

    def quantifier(self, item: str) -> str:
        c = self.p[self.i]
        self.i += 1
        if c in "*+?":
            out = item + c
        else:
            end = self.p.find("}", self.i)
            if end < 0:
                raise self.fail("an unterminated {m,n}")
            spec = self.p[self.i : end]
            self.i = end + 1
            parts = spec.split(",")
            hi: int | None
            try:
                if len(parts) == 1:
                    lo = hi = int(parts[0])
                elif len(parts) == 2:
                    lo = int(parts[0]) if parts[0].strip() else 0
                    hi = int(parts[1]) if parts[1].strip() else None
                else:
                    raise ValueError
            except ValueError:
                raise self.fail(f"{{{spec[:20]}}} is not a repetition count") from None
            for v in (lo, hi):
                if v is not None and v > MAX_REPETITION:
                    raise SchemaError(
                        f"{self.path}: pattern repetition {{{spec[:40]}}}: {v} is over the limit of "
                        f"{MAX_REPETITION} (MAX_REPETITION)"
                    )
            if hi is not None and hi < lo:
                raise self.fail(f"{{{spec}}}: the maximum is below the minimum")
            out = f"({item}){{{lo}}}" if lo == hi else f"({item}){{{lo},{'' if hi is None else hi}}}"
        if self.i < len(self.p) and self.p[self.i] in "?+":
            raise self.fail("lazy and possessive quantifiers are not supported")
        return out


# --------------------------------------------------------------------------- the converter


class _Converter:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.rules: dict[str, str] = {"space": SPACE}
        self.size = len(SPACE) + 10
        self.nodes = 0
        self.refs: dict[str, str] = {}

    def grammar(self) -> str:
        return "".join(f"{k} ::= {v}\n" for k, v in self.rules.items())

    def add_rule(self, name: str, rule: str) -> str:
        name = "".join(c if c.isascii() and (c.isalnum() or c == "-") else "-" for c in name) or "root"
        key, i = name, 0
        while key in self.rules and self.rules[key] != rule:
            i += 1
            key = f"{name}{i}"
        if key not in self.rules:
            self.size += len(key) + len(rule.encode("utf-8")) + 6
            if self.size > MAX_GRAMMAR_BYTES:
                raise SchemaError(
                    f"the grammar for this schema would exceed {MAX_GRAMMAR_BYTES} bytes (MAX_GRAMMAR_BYTES)"
                )
        self.rules[key] = rule
        return key

    def primitive(self, name: str, out_name: str | None = None) -> str:
        rule, deps = _PRIMITIVES[name]
        key = self.add_rule(out_name or name, rule)  # first: value -> object -> value is a cycle
        for d in deps:
            if d not in self.rules:
                self.primitive(d)
        return key

    def visit(self, schema: Any, name: str, path: str, depth: int) -> str:
        """The rule name for ``schema`` (named after ``name``; ``""`` is the root)."""
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"{path}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (MAX_SCHEMA_DEPTH)")
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise SchemaError(f"the schema has more than {MAX_SCHEMA_NODES} subschemas (MAX_SCHEMA_NODES)")
        if isinstance(schema, Document):
            return self.document(schema, name)
        rule_name = name + "-" if name in _PRIMITIVES or name in ("space", "root") else name or "root"
        sub = name + "-" if name else ""
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: a schema must be an object, got {type(schema).__name__}")
        keys = set(schema) - ANNOTATIONS

        def only(*allowed: str) -> None:
            for k in sorted(keys - set(allowed)):
                raise SchemaError(
                    f"{path}: {k} beside {allowed[0]} is not enforced (the grammar follows {allowed[0]} alone)"
                )

        if "$ref" in schema:
            only("$ref")
            return self.add_rule(rule_name, self.ref(schema["$ref"], path, depth))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                only(key)
                alts = self.alternatives(schema[key], f"{path}/{key}")
                return self.add_rule(
                    rule_name,
                    " | ".join(
                        self.visit(a, f"{sub}{key}-{i}" if name else f"alternative-{i}", f"{path}/{key}/{i}", depth + 1)
                        for i, a in enumerate(alts)
                    ),
                )
        t = schema.get("type")
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                raise SchemaError(f"{path}: type must be a string or a non-empty list of strings")
            if len(t) == 1:
                return self.visit({**schema, "type": t[0]}, name, path, depth)
            return self.add_rule(
                rule_name,
                " | ".join(
                    self.visit({**schema, "type": x}, f"{sub}{x}", f"{path}/type/{i}", depth + 1)
                    for i, x in enumerate(t)
                ),
            )
        if t is not None and t not in _TYPES:
            raise SchemaError(f"{path}: type {t!r} is not a JSON schema type")
        if "const" in schema:
            only("const", "type")
            return self.add_rule(rule_name, _json_literal(schema["const"], f"{path}/const"))
        if "enum" in schema:
            only("enum", "type")
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}: enum must be a non-empty array")
            lits = []
            for i, v in enumerate(values):
                lits.append(_json_literal(v, f"{path}/enum/{i}"))
                self.size += len(lits[-1])
                if self.size > MAX_GRAMMAR_BYTES:
                    raise SchemaError(
                        f"the grammar for this schema would exceed {MAX_GRAMMAR_BYTES} bytes (MAX_GRAMMAR_BYTES)"
                    )
            return self.add_rule(rule_name, "(" + " | ".join(lits) + ")")
        if t is None:  # no type: the structural keywords decide, as in llama.cpp
            if (
                "properties" in schema
                or ("additionalProperties" in schema and schema["additionalProperties"] is not True)
                or "allOf" in schema
            ):
                t = "object"
            elif "items" in schema or "prefixItems" in schema:
                t = "array"
            elif keys & {"pattern", "minLength", "maxLength", "format"}:
                t = "string"
        used: set[str] = {"type"}
        if t is None:
            self.check_keys(keys, used, None, path)
            body = self.primitive("value")
        else:
            self.check_keys(keys, used | _consumed(t, schema), t, path)
            if t == "object":
                body = self.object(schema, name, sub, path, depth)
            elif t == "array":
                body = self.array(schema, name, sub, path, depth)
            elif t == "string":
                body = self.string(schema, rule_name, path)
            elif t == "integer":
                body = self.integer(schema, path)
            else:
                body = self.primitive(t)
        # a plain primitive is referred to by its own name (llama.cpp's converter does the same), not by a rule
        # that only names it: a thousand string properties are a thousand rules fewer
        return body if name and body in _PRIMITIVES else self.add_rule(rule_name, body)

    def document(self, doc: Document, name: str) -> str:
        saved = self.root, self.refs
        self.root, self.refs = doc.schema, {}
        try:
            return self.visit(doc.schema, name, doc.where, 0)
        finally:
            self.root, self.refs = saved

    def check_keys(self, keys: set[str], used: set[str], t: str | None, path: str) -> None:
        for k in sorted(keys - used):
            applies = _APPLIES_TO.get(k)
            if t is not None and applies is not None and applies != t and not (applies == "number" and t == "integer"):
                continue  # holds vacuously on values of the type the grammar produces
            where = f" on a {t}" if t else (" on a schema without a type" if applies else "")
            raise SchemaError(f"{path}: the keyword {k}{where} cannot be enforced by the grammar")

    def alternatives(self, alts: Any, path: str) -> list:
        if not isinstance(alts, list) or not alts:
            raise SchemaError(f"{path}: must be a non-empty array of schemas")
        return alts

    def ref(self, ref: Any, path: str, depth: int) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(
                f"{path}: $ref {str(ref)[:80]!r}: only references into the same document (#/...) are supported"
            )
        if ref in self.refs:
            return self.refs[ref]
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"{path}: $ref {ref[:80]!r} cannot be resolved")
        name = "ref-" + (ref.rsplit("/", 1)[-1] if ref != "#" else "root")
        self.refs[ref] = key = self.add_rule(name, "space")  # placeholder: a cycle back here stops at the name
        real = self.visit(target, key, ref, depth + 1)
        if real != key:
            self.rules[key] = real
        return key

    def object(self, schema: dict, name: str, sub: str, path: str, depth: int) -> str:
        if "allOf" in schema:
            return self.all_of(schema, name, sub, path, depth)
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{path}: properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}: required must be an array of strings")
        for r in required:
            if r not in props:
                raise SchemaError(
                    f"{path}: required property {r[:80]!r} has no schema in properties (it could not be enforced)"
                )
        additional = schema.get("additionalProperties", "properties" not in schema)
        if not isinstance(additional, (bool, dict)):
            raise SchemaError(f"{path}: additionalProperties must be a boolean or a schema")
        if not props and additional is True:
            return self.primitive("object")
        return self.object_rule(list(props.items()), set(required), additional, name, sub, path, depth)

    def all_of(self, schema: dict, name: str, sub: str, path: str, depth: int) -> str:
        comps = self.alternatives(schema["allOf"], f"{path}/allOf")
        props: list[tuple[str, Any]] = []
        required: set[str] = set()

        def add(comp: Any, cpath: str, is_required: bool, level: int) -> None:
            if level > MAX_SCHEMA_DEPTH:
                raise SchemaError(f"{cpath}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (MAX_SCHEMA_DEPTH)")
            if isinstance(comp, dict) and "$ref" in comp and set(comp) - ANNOTATIONS == {"$ref"}:
                target = self.resolve(comp["$ref"], cpath, level)
                return add(target, comp["$ref"], is_required, level + 1)
            if isinstance(comp, dict) and "anyOf" in comp and set(comp) - ANNOTATIONS == {"anyOf"}:
                for i, c in enumerate(self.alternatives(comp["anyOf"], f"{cpath}/anyOf")):
                    add(c, f"{cpath}/anyOf/{i}", False, level + 1)
                return
            if (
                not isinstance(comp, dict)
                or not set(comp) - ANNOTATIONS <= {"type", "properties", "required"}
                or comp.get("type", "object") != "object"
            ):
                raise SchemaError(
                    f"{cpath}: allOf: only object schemas (type, properties, required) and $refs to "
                    "them can be combined"
                )
            cprops = comp.get("properties", {})
            if not isinstance(cprops, dict):
                raise SchemaError(f"{cpath}: properties must be an object")
            props.extend(cprops.items())
            if is_required:
                required.update(r for r in comp.get("required", []) if isinstance(r, str))

        for i, c in enumerate(comps):
            add(c, f"{path}/allOf/{i}", True, depth + 1)
        if set(schema) - ANNOTATIONS - {"allOf", "type"}:
            raise SchemaError(f"{path}: allOf with other keywords beside it is not enforced")
        return self.object_rule(props, required & {k for k, _ in props}, False, name, sub, path, depth)

    def resolve(self, ref: Any, path: str, depth: int) -> Any:
        self.ref(ref, path, depth)
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            target = target[int(part)] if isinstance(target, list) else target[part]
        return target

    def object_rule(
        self,
        props: list[tuple[str, Any]],
        required: set[str],
        additional: Any,
        name: str,
        sub: str,
        path: str,
        depth: int,
    ) -> str:
        kv: dict[str, str] = {}
        for pname, pschema in props:
            if not isinstance(pname, str):
                raise SchemaError(f"{path}: property names must be strings")
            value = self.visit(pschema, f"{sub}{pname}", f"{path}/properties/{pname}", depth + 1)
            kv[pname] = self.add_rule(f"{sub}{pname}-kv", f'{_json_literal(pname, path)} space ":" space {value}')
        req = [p for p, _ in props if p in required]
        opt = [p for p, _ in props if p not in required]
        if additional is not False:
            value = self.visit(
                {} if additional is True else additional,
                f"{sub}additional-value",
                f"{path}/additionalProperties",
                depth + 1,
            )
            kv["*"] = self.add_rule(f"{sub}additional-kv", f'{self.primitive("string")} ":" space {value}')
            opt.append("*")
        rule = '"{" space ' + ' "," space '.join(kv[p] for p in req)
        if opt:
            # llama.cpp's rule set (``_build_object_rule``): one alternative per optional property that may
            # come first, each followed by a ``<name>-rest`` rule for the properties after it (each optional);
            # built from the last property back, so the work and the text are linear in the properties
            rests = [""] * len(opt)  # rests[i]: the rule for what may follow opt[i] ("" after the last)
            for i in range(len(opt) - 2, -1, -1):
                k = opt[i + 1]
                body = f'( "," space {kv[k]} )' + ("*" if k == "*" else "?")
                rests[i] = self.add_rule(f"{sub}{opt[i]}-rest", body + (f" {rests[i + 1]}" if rests[i + 1] else ""))
            alts = " | ".join(
                kv[k] + (f' ( "," space {kv[k]} )*' if k == "*" else "") + (f" {rests[i]}" if rests[i] else "")
                for i, k in enumerate(opt)
            )
            rule += f' ( "," space ( {alts} ) )?' if req else f" ( {alts} )?"
        return rule + ' "}" space'

    def array(self, schema: dict, name: str, sub: str, path: str, depth: int) -> str:
        key = "items" if "items" in schema else "prefixItems" if "prefixItems" in schema else None
        lo = _count(schema, "minItems", path, 0)
        hi = _count(schema, "maxItems", path, None)
        assert lo is not None
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}: maxItems {hi} is below minItems {lo}: no array satisfies the schema")
        if schema.get("uniqueItems", False) is not False:
            raise SchemaError(f"{path}: the keyword uniqueItems cannot be enforced by the grammar")
        if key == "items" and "prefixItems" in schema:
            raise SchemaError(f"{path}: prefixItems beside items is not enforced (the grammar follows items alone)")
        items = schema.get(key) if key else None
        if isinstance(items, list):
            if len(items) > MAX_SCHEMA_NODES:
                raise SchemaError(f"the schema has more than {MAX_SCHEMA_NODES} subschemas (MAX_SCHEMA_NODES)")
            if lo > len(items) or (hi is not None and hi < len(items)):
                raise SchemaError(
                    f"{path}: minItems / maxItems beside a list of {len(items)} {key} is not enforced "
                    "(the grammar makes exactly that many)"
                )
            parts = [self.visit(it, f"{sub}tuple-{i}", f"{path}/{key}/{i}", depth + 1) for i, it in enumerate(items)]
            return '"[" space ' + ' "," space '.join(parts) + ' "]" space'
        if items is None and lo == 0 and hi is None:
            return self.primitive("array")
        item = self.visit({} if items is None else items, f"{sub}item", f"{path}/{key or 'items'}", depth + 1)
        return '"[" space ' + _repeat(item, lo, hi, '"," space') + ' "]" space'

    def string(self, schema: dict, rule_name: str, path: str) -> str:
        lo = _count(schema, "minLength", path, 0)
        hi = _count(schema, "maxLength", path, None)
        assert lo is not None
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}: maxLength {hi} is below minLength {lo}: no string satisfies the schema")
        lengths = "minLength" in schema or "maxLength" in schema
        if "pattern" in schema:
            if lengths or "format" in schema:
                raise SchemaError(
                    f"{path}: minLength, maxLength or format beside pattern is not enforced "
                    "(the grammar follows the pattern alone)"
                )
            if not isinstance(schema["pattern"], str):
                raise SchemaError(f"{path}: pattern must be a string")
            body = _Pattern(schema["pattern"], path).convert()
            return r'"\"" (' + body + r') "\"" space'
        if "format" in schema:
            fmt = schema["format"]
            if lengths:
                raise SchemaError(f"{path}: minLength or maxLength beside format is not enforced")
            if fmt in _FORMATS:
                return self.primitive(_FORMATS[fmt])
            if isinstance(fmt, str) and (fmt == "uuid" or (len(fmt) == 5 and fmt[:4] == "uuid" and fmt[4] in "12345")):
                return self.primitive("uuid")
            raise SchemaError(
                f"{path}: format {str(fmt)[:40]!r} cannot be enforced by the grammar (date, time, "
                "date-time and uuid can)"
            )
        if lengths:
            return r'"\"" ' + _repeat(self.primitive("char"), lo, hi) + r' "\"" space'
        return self.primitive("string")

    def integer(self, schema: dict, path: str) -> str:
        lo = hi = None
        for key, is_min, exclusive in (
            ("minimum", True, False),
            ("exclusiveMinimum", True, True),
            ("maximum", False, False),
            ("exclusiveMaximum", False, True),
        ):
            if key not in schema:
                continue
            v = schema[key]
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (isinstance(v, float) and not math.isfinite(v))
            ):
                raise SchemaError(f"{path}: {key} must be a finite number")
            if is_min:
                b = (math.floor(v) + 1) if exclusive else math.ceil(v)
                lo = b if lo is None else max(lo, b)
            else:
                b = (math.ceil(v) - 1) if exclusive else math.floor(v)
                hi = b if hi is None else min(hi, b)
            if not INT64_MIN <= b <= INT64_MAX:
                raise SchemaError(f"{path}: {key} {v} is outside the 64-bit integers llama.cpp's converter handles")
        if lo is None and hi is None:
            return self.primitive("integer")
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"{path}: no integer lies between the minimum {lo} and the maximum {hi}")
        return f"({integer_range_gbnf(lo, hi)}) space"


def _consumed(t: str, schema: dict) -> set[str]:
    """The keywords the rule for type ``t`` enforces."""
    if t == "object":
        return {"properties", "required", "additionalProperties", "allOf"}
    if t == "array":
        return {"items", "prefixItems", "minItems", "maxItems"} | (
            {"uniqueItems"} if schema.get("uniqueItems") is False else set()
        )
    if t == "string":
        return {"pattern", "minLength", "maxLength", "format"}
    if t == "integer":
        return {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
    return set()
