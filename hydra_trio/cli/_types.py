"""argparse value types of ``hydra-trio run``: each checks its value when the command line is parsed and
raises :class:`argparse.ArgumentTypeError` with a message in llama-server's value syntax (exit 2, the
subcommand's usage on stderr).  Value syntaxes follow llama.cpp's ``common/arg.cpp``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.settings import N_PARALLEL_MAX

INT32_MAX = 2**31 - 1
GGML_MAX_N_THREADS = 512  # ggml's most threads (ggml.h)

# common_arg_utils::is_truthy / is_falsey / is_autoy (common/arg.cpp)
TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
AUTOY = ("auto", "-1")

# kv_cache_types (common/arg.cpp): the KV cache types llama-server accepts for -ctk / -ctv
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _named(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    parse.__name__ = name  # argparse names the type in its "invalid <type> value" fallback
    return parse


INT32_MIN = -(2**31)


def int_range(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """A decimal integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}{f' ({why})' if why else ''}, got {value}")
        return value

    return _named(parse, "integer")


def threads(text: str) -> int:
    """``-t/-tb N``: threads, at most :data:`GGML_MAX_N_THREADS`; 0 or less is every core, as llama-server
    (``common/arg.cpp``: ``hardware_concurrency()``).  Returns N, or 0 for every core."""
    return max(0, int_range(-INT32_MAX - 1, GGML_MAX_N_THREADS, "ggml's most threads")(text))


def _finite(text: str, what: str) -> float:
    """``text`` as a finite float; ArgumentTypeError naming ``what`` ("number", "number of seconds")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite {what}, got {text!r}")
    return value


def float_range(lo: float = -math.inf, hi: float = math.inf) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]``."""

    def parse(text: str) -> float:
        value = _finite(text, "number")
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo:g} and {hi:g}, got {text}")
        return value

    return _named(parse, "number")


def seconds(*, zero_ok: bool = False) -> Callable[[str], float]:
    """A finite number of seconds, > 0 (>= 0 with ``zero_ok``)."""

    def parse(text: str) -> float:
        value = _finite(text, "number of seconds")
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero_ok else '> 0'} seconds, got {text!r}")
        return value

    return _named(parse, "seconds")


def timeout_seconds(text: str) -> float:
    """``-to/--timeout N``: any finite number of seconds, as llama-server's (an integer there, read with
    ``std::stoi``): above 0 the limit; 0 no waiting; below 0 no limit (cpp-httplib's ``poll`` conventions)."""
    return _finite(text, "number of seconds")


port = int_range(0, 65535, "a TCP port; 0 = any free port")


def n_parallel(text: str) -> int:
    """``-np N``: slots, 1 to :data:`~hydra_trio.engine.settings.N_PARALLEL_MAX` (llama.cpp's most sequences, the
    bound CONFIGURE uses too), or below 0 for llama-server's auto (``tools/server/server.cpp``: any negative
    value), returned as -1."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        return -1
    if not 1 <= value <= N_PARALLEL_MAX:
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {N_PARALLEL_MAX} (llama.cpp's most sequences), or below 0 (auto), got {value}"
        )
    return value


def int_at_least(floor: int, hi: int = INT32_MAX) -> Callable[[str], int]:
    """A 32-bit integer up to ``hi``; one below ``floor`` is ``floor``, where llama-server gives every value
    below it the same meaning (``--cache-ram`` below 0: no limit; ``--ctx-checkpoints``, ``--cache-reuse`` 0
    or less: off)."""
    parse_int = int_range(INT32_MIN, hi)

    def parse(text: str) -> int:
        return max(floor, parse_int(text))

    return _named(parse, "integer")


def choice(*values: str) -> Callable[[str], str]:
    """One of ``values`` (llama-server's ``{a,b,c}`` syntax in the message)."""

    def parse(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"expected one of {{{','.join(values)}}}, got {text!r}")
        return text

    return _named(parse, "choice")


def on_off_auto(text: str) -> str:
    """``on|off|auto`` with llama-server's spellings (``enabled``, ``true``, ``1``; ``-1`` = auto): returns
    ``"on"``, ``"off"`` or ``"auto"``."""
    if text in TRUTHY:
        return "on"
    if text in FALSEY:
        return "off"
    if text in AUTOY:
        return "auto"
    raise argparse.ArgumentTypeError(f"expected [on|off|auto], got {text!r}")


def on_off(text: str) -> bool:
    """``on|off`` with llama-server's spellings (``enabled``/``disabled``, ``true``/``false``, ``1``/``0``)."""
    if text in TRUTHY:
        return True
    if text in FALSEY:
        return False
    raise argparse.ArgumentTypeError(f"expected [on|off], got {text!r}")


def gpu_layers(text: str) -> int | str:
    """``-ngl N|all|auto``: an integer >= 0, or ``"all"`` / ``"auto"``."""
    if text in ("all", "auto"):
        return text
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N, 'all' or 'auto', got {text!r}") from None
    if value < 0:  # llama.cpp: -1 auto, -2 all; anything else negative is nonsense
        return {-1: "auto", -2: "all"}.get(value) or _fail(f"expected N >= 0, 'all' or 'auto', got {text!r}")
    return value


def _fail(message: str) -> Any:
    raise argparse.ArgumentTypeError(message)


def cache_type(text: str) -> str:
    """``-ctk/-ctv TYPE``: one of llama-server's KV cache types (:data:`KV_CACHE_TYPES`)."""
    if text.lower() not in KV_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KV_CACHE_TYPES)}, got {text!r}")
    return text.lower()


def tensor_split(text: str) -> tuple[float, ...]:
    """``-ts N0,N1,...``: proportions separated by ``,`` or ``/`` (as llama-server), each a finite number >= 0."""
    parts = [p for p in re.split(r"[,/]+", text) if p != ""]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected N0,N1,..., got {text!r}")
    values = tuple(float_range(0.0)(p) for p in parts)
    return values


def tensor_overrides(text: str) -> tuple[tuple[str, str], ...]:
    """``-ot PATTERN=BUFT[,...]``: ``(regex, buffer type name)`` pairs; each regex must compile.  Whether
    the buffer type exists is checked when the node starts (it depends on the devices found)."""
    pairs = []
    for item in text.split(","):
        pattern, sep, buft = item.partition("=")
        if not sep or not pattern or not buft:
            raise argparse.ArgumentTypeError(f"expected <tensor name pattern>=<buffer type>,..., got {item!r}")
        pairs.append((regex(pattern), buft))
    return tuple(pairs)


def regex(text: str) -> str:
    """A regular expression that compiles (returned unchanged)."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {exc}") from None
    return text


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (``--chat-template-kwargs '{"enable_thinking": true}'``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def csv(text: str) -> tuple[str, ...]:
    """A comma-separated list; empty items are dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def existing_file(text: str) -> str:
    """A readable regular file."""
    path = os.path.expanduser(text)
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def directory(text: str) -> Path:
    """A directory (created when the node starts if missing); never empty."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got ''")
    return Path(os.path.expanduser(text))


def existing_directory(text: str) -> Path:
    """An existing directory (llama-server's ``--media-path``: ``not a directory: PATH``)."""
    path = Path(os.path.expanduser(text))
    if not text or not path.is_dir():
        raise argparse.ArgumentTypeError(f"not a directory: {text}")
    return path


def mmproj_device(text: str) -> str:
    """``-mmdev DEVICE``: ``none`` (not offloaded) or one device name (llama-server: ``only one device may be
    specified for mmproj``); whether this machine has it is checked when the node starts."""
    if text == "none":
        return text
    names = csv(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError("only one device may be specified for mmproj")
    return names[0]


def secret(text: str) -> str:
    """A non-empty key or token without surrounding whitespace."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError("must be non-empty, without leading or trailing whitespace")
    return text


def key_list(text: str) -> tuple[str, ...]:
    """``--api-key KEY[,KEY...]`` (llama-server: a comma-separated list; empty items dropped); each key
    non-empty, without leading or trailing whitespace (:func:`secret`)."""
    keys = [k for k in text.split(",") if k != ""]
    return tuple(secret(k) for k in keys) if keys else (secret(""),)


def cidr(text: str) -> str:
    """A CIDR network or a single IP address (checked, returned unchanged)."""
    from ..transport.access import parse_network

    try:
        parse_network(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cpu_mask(text: str) -> int:
    """``-C M``: an arbitrarily long hex CPU mask (``0x`` optional), as llama-server's ``parse_cpu_mask``."""
    digits = text[2:] if text.lower().startswith("0x") else text
    try:
        value = int(digits, 16)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a hex CPU mask, got {text!r}") from None
    return value


def cpu_range(text: str) -> int:
    """``-Cr lo-hi``: a CPU range as a mask (``lo`` or ``hi`` may be omitted, as llama-server)."""
    lo, sep, hi = text.partition("-")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected lo-hi, got {text!r}")
    try:
        start = int(lo) if lo else 0
        end = int(hi) if hi else (os.cpu_count() or 1) - 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lo-hi, got {text!r}") from None
    if start < 0 or end < start:
        raise argparse.ArgumentTypeError(f"expected 0 <= lo <= hi, got {text!r}")
    return sum(1 << i for i in range(start, end + 1))


def chat_template_value(text: str) -> tuple[str, str]:
    """``--chat-template NAME|FILE|JINJA`` (llama-server's flag): a built-in template name, a Jinja file, or
    Jinja text.  Returns ``(name or Jinja text, what it is for the log)``."""
    from ..engine import builtin_chat_templates

    if text in builtin_chat_templates():
        return text, f"built-in {text!r}"
    if os.path.isfile(os.path.expanduser(text)):
        return chat_template_file(text)
    try:
        return text, _check_template(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def chat_template_file(path: str) -> tuple[str, str]:
    """``--chat-template-file FILE`` (llama-server's flag): a Jinja template file, checked to compile."""
    try:
        text = Path(os.path.expanduser(path)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None
    try:
        _check_template(text, jinja=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    return text, f"Jinja file {path}"


def _check_template(text: str, jinja: bool = False) -> str:
    from ..engine import check_chat_template

    return check_chat_template(text, jinja=jinja)


def quant_value(text: str) -> tuple[str, str]:
    """``--quant KEY=PATH|ALIAS``: the key and the model (resolved when the node starts)."""
    key, sep, model = text.partition("=")
    if not sep or not key.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=PATH|ALIAS, got {text!r}")
    return key.strip(), model.strip()


def combined_ot(text: str) -> tuple[str, str | None]:
    """``--combined-ot-pattern REGEX[=BUFT]`` of the cluster's llama-server fork: the COMBINED expert pattern is
    everything before the last ``=`` (the fork reads the value in ``--override-tensor`` syntax and ignores the buffer
    type); a value without ``=`` is the regex whole.  Returns ``(regex, buffer type or None)``.

    Never refuses, as the fork starts with any value: a regex that is empty or does not compile leaves
    COMBINED off, which the node says at start-up (:func:`hydra_trio.cli.run.combined_target`).
    """
    regex, sep, buft = text.rpartition("=")
    return (regex, buft) if sep else (text, None)


def c_atoi(text: str) -> int:
    """An integer read as C's ``atoi``: leading blanks, an optional sign, the digits that follow; 0 when
    there are none (the cluster's llama-server fork reads ``--ggml-rpc-port`` so, and starts with any value)."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return int(m.group(1)) if m else 0


def engine_port(text: str) -> int:
    """A port flag of the cluster's llama-server fork (``--rpc-port``): a decimal integer; 0 or less opens no
    port, as in the fork (which starts its server only for a port above 0); one above 65535 is reported at
    start-up and opens nothing (the fork's bind fails and it serves on)."""
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def sampler_names(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--samplers NAMES``: sampler names separated by ``;``, any case, in llama-server's spellings
    (``common_sampler_types_from_names``).  Returns ``(canonical names, the names it does not know)``: as
    llama-server, an unknown name is left out (the start-up log names it)."""
    from ..engine.settings import SAMPLER_NAMES

    names = [(n, SAMPLER_NAMES.get(n.lower())) for n in text.split(";")]
    return tuple(c for _, c in names if c), tuple(n for n, c in names if not c)


def sampler_chars(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--sampler-seq CHARS``: one letter per sampler (``common_sampler_types_from_chars``), as
    :func:`sampler_names` returns them."""
    from ..engine.settings import SAMPLER_CHARS

    return tuple(SAMPLER_CHARS[c] for c in text if c in SAMPLER_CHARS), tuple(c for c in text if c not in SAMPLER_CHARS)


def logit_bias(text: str) -> tuple[int, float]:
    """``-l TOKEN_ID(+/-)BIAS``, as llama-server reads it: a token id, ``+`` or ``-``, then the bias
    (``15043+1``, ``15043-inf`` bans the token).  Returns ``(token id, signed bias)``."""
    m = re.fullmatch(r"\s*([+-]?[0-9]+)([+-])(.+)", text)
    try:
        if m is None:
            raise ValueError(text)
        token, bias = int(m.group(1)), float(m.group(3))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS, got {text!r}") from None
    if not -(2**31) <= token < 2**31 or math.isnan(bias):
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS, got {text!r}")
    return token, -bias if m.group(2) == "-" else bias


def grammar_file(path: str) -> str:
    """``--grammar-file FNAME``: the file's GBNF text (read now, as llama-server reads it)."""
    try:
        return Path(os.path.expanduser(path)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def json_schema_grammar(text: str) -> str:
    """``-j SCHEMA``: a JSON schema, as the GBNF that enforces it (converted now, as llama-server converts
    it: a schema that cannot be turned into a grammar exits 2).  ``{"type": "object"}`` is any JSON object."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON schema, got {text[:80]!r}: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise argparse.ArgumentTypeError(f"expected a JSON schema (an object), got {type(schema).__name__}")
    from ..openai.json_schema import SchemaError, schema_to_gbnf

    try:
        return schema_to_gbnf(schema)
    except SchemaError as exc:
        raise argparse.ArgumentTypeError(f"this schema cannot be enforced: {exc}"[:600]) from None


def json_schema_file(path: str) -> str:
    """``-jf FILE``: :func:`json_schema_grammar` of the file's text."""
    return json_schema_grammar(grammar_file(path))


def escapes(text: str) -> str:
    """llama-server's ``string_process_escapes`` (``common/common.cpp``), which ``-e/--escape`` (on by
    default) applies to ``-r`` and ``--dry-sequence-breaker``: ``\\n``, ``\\r``, ``\\t``, ``\\'``, ``\\"``,
    ``\\\\`` and ``\\xNN``; any other backslash stays as it is.  Works on the UTF-8 bytes; bytes that are
    not valid UTF-8 afterwards (a lone ``\\xNN`` above 0x7f) become U+FFFD."""
    raw, out, i = text.encode("utf-8"), bytearray(), 0
    simple = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("'"): 39, ord('"'): 34, ord("\\"): 92}
    while i < len(raw):
        c = raw[i]
        if c == 92 and i + 1 < len(raw):
            nxt = raw[i + 1]
            if nxt in simple:
                out.append(simple[nxt])
                i += 2
                continue
            hexdigits = raw[i + 2 : i + 4]
            if nxt == ord("x") and len(hexdigits) == 2 and re.fullmatch(rb"[0-9a-fA-F]{2}", hexdigits):
                out.append(int(hexdigits, 16))
                i += 4
                continue
            out += raw[i : i + 2]
            i += 2
            continue
        out.append(c)
        i += 1
    return out.decode("utf-8", "replace")


def kv_overrides(text: str) -> tuple[tuple[str, str, Any], ...]:
    """``--override-kv KEY=TYPE:VALUE,...`` as llama-server reads it (``string_parse_kv_override``,
    ``common/common.cpp``): a key of at most 127 bytes; ``int:`` read as C's ``atol``, ``float:`` as ``atof``,
    ``bool:true|false``, ``str:`` at most 127 bytes.  Items are comma-separated (a quoted item may hold
    commas).  Returns ``(key, type, value)`` triples."""
    import csv as _csv

    out: list[tuple[str, str, int | float | bool | str]] = []
    for item in next(_csv.reader([text], skipinitialspace=False), []):
        key, sep, typed = item.partition("=")
        kind, colon, value = typed.partition(":")
        if not sep or len(key.encode()) >= 128 or not colon or kind not in ("int", "float", "bool", "str"):
            raise argparse.ArgumentTypeError(f"expected KEY=TYPE:VALUE (TYPE: int, float, bool, str), got {item!r}")
        if kind == "int":
            out.append((key, kind, c_atoi(value)))
        elif kind == "float":
            m = re.match(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", value)
            out.append((key, kind, float(m.group(0)) if m else 0.0))
        elif kind == "bool":
            if value not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"{item!r}: a bool is true or false")
            out.append((key, kind, value == "true"))
        else:
            if len(value.encode()) > 127:
                raise argparse.ArgumentTypeError(f"{item!r}: a str value is at most 127 bytes")
            out.append((key, kind, value))
    return tuple(out)
