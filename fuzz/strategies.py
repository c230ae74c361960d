"""Hypothesis strategies for hydra-trio's three protocols: the public entry point for fuzzing a node.

Importable by tests (``from fuzz.strategies import ...``, with the repository
root on ``sys.path``: pytest run from the root has it) and by long-running
fuzzers; ``examples/fuzz_my_node.py`` fuzzes a node of yours with them.

* Hydra: :func:`valid_requests` (:class:`Req`), :func:`nearly_valid_requests`
  (:class:`Mutant`: one field off), :func:`random_first_bytes`,
  :func:`chunk_cuts` / :func:`split_at` (a request in pieces).
* HTTP: :func:`http_requests` (raw requests, valid or broken in one way, each
  ending with ``Connection: close``).
* Text that is not Unicode: :func:`http_surrogate_bodies` and
  :func:`hydra_surrogate_payloads` (:class:`SurrogateCase`: a body of every
  endpoint / JSON op with a lone surrogate in one string, key or value).
* Status reads during a long prefill: :func:`long_prompts` (a long text for
  one slot), :func:`status_reads` (:class:`StatusRead`: ``/slots``,
  ``/slots/{id}/state/meta``, ``/health``, ``/props``, Hydra INFO and
  STATE_META, in any order and number).
* ggml-RPC: :func:`ggml_rpc_hellos`, :func:`ggml_rpc_sessions` (valid
  :class:`RpcStep` sessions), :func:`ggml_rpc_mutants` (:class:`GgmlRpcMutant`),
  :func:`ggml_rpc_silent_openings`, :func:`ggml_rpc_truncated`.

Decoders under test should use the limits below (`MAX_PAYLOAD`, `MAX_KEY`,
`MAX_TRACE`) so the "over the limit" mutants mean something.
"""

from __future__ import annotations

import itertools
import struct
from typing import Literal, get_args

import attrs
from hypothesis import strategies as st

from hydra_trio.protocol.hydra import (
    MAGIC,
    Op,
    RequestHeader,
    encode_request,
)

__all__ = [
    "MAX_KEY",
    "MAX_PAYLOAD",
    "MAX_TRACE",
    "GgmlRpcMutant",
    "Mutant",
    "Req",
    "RpcStep",
    "SizedCase",
    "StatusRead",
    "SurrogateCase",
    "chunk_cuts",
    "deep_grammars",
    "deep_json_bodies",
    "ggml_rpc_hellos",
    "ggml_rpc_mutants",
    "ggml_rpc_sessions",
    "ggml_rpc_silent_openings",
    "ggml_rpc_truncated",
    "http_requests",
    "http_surrogate_bodies",
    "hydra_surrogate_payloads",
    "lone_surrogates",
    "long_prompts",
    "long_request_lists",
    "nearly_valid_requests",
    "random_first_bytes",
    "split_at",
    "status_reads",
    "valid_requests",
    "wide_and_deep_schemas",
]

MAX_PAYLOAD = 4096
MAX_KEY = 256
MAX_TRACE = 256


@attrs.frozen
class Req:
    """One logical request: what a decoder should report for it."""

    op: int
    flags: int
    key: str
    trace_id: str
    payload: bytes

    def encode(self) -> bytes:
        return encode_request(self.op, self.key, self.payload, self.trace_id, self.flags)


_ops = st.one_of(st.sampled_from(list(Op)).map(int), st.integers(0, 255))
_text = st.text(max_size=16)  # at most 64 UTF-8 bytes, under MAX_KEY / MAX_TRACE


def valid_requests(max_payload: int = 1024) -> st.SearchStrategy[Req]:
    """Well-formed requests within the module limits: any op (engine ops
    favoured), any flags byte (flags are not a framing matter), any Unicode
    key / trace_id, payload of 0..max_payload bytes."""
    return st.builds(
        Req,
        op=_ops,
        flags=st.one_of(st.just(0), st.integers(0, 255)),
        key=st.one_of(st.integers(0, 63).map(str), _text),
        trace_id=_text,
        payload=st.binary(max_size=max_payload),
    )


MutantKind = Literal[
    "bad_magic",  # decoder must raise BadMagic
    "payload_too_large",  # FrameTooLarge, header attached
    "key_too_large",  # FrameTooLarge
    "trace_too_large",  # FrameTooLarge
    "truncated",  # declared lengths longer than the bytes: stays mid-request
    "unknown_flags",  # decodes fine; flags kept in the header
    "bad_key_utf8",  # decodes fine; RequestStarted.key_error set
]


@attrs.frozen
class Mutant:
    """A request with exactly one field off. ``req`` is the valid request it
    was derived from; ``data`` the mutated bytes."""

    kind: MutantKind
    data: bytes
    req: Req


def _header(req: Req, **changes: int) -> bytes:
    kb, tb = req.key.encode(), req.trace_id.encode()
    fields = dict(
        magic=MAGIC,
        op=req.op,
        flags=req.flags,
        key_len=len(kb),
        payload_len=len(req.payload),
        trace_len=len(tb),
    )
    fields.update(changes)
    return struct.pack(
        "<HBBHQH",
        fields["magic"],
        fields["op"],
        fields["flags"],
        fields["key_len"],
        fields["payload_len"],
        fields["trace_len"],
    )


@st.composite
def nearly_valid_requests(draw: st.DrawFn) -> Mutant:
    """A `Mutant`: a valid request with one field off (magic, a length,
    flags, or the key's encoding)."""
    req = draw(valid_requests(max_payload=256))
    kind: MutantKind = draw(st.sampled_from(get_args(MutantKind)))
    kb, tb = req.key.encode(), req.trace_id.encode()
    body = kb + tb + req.payload
    if kind == "bad_magic":
        magic = draw(st.integers(0, 0xFFFF).filter(lambda m: m != MAGIC))
        data = _header(req, magic=magic) + body
    elif kind == "payload_too_large":
        n = draw(st.integers(MAX_PAYLOAD + 1, 2**64 - 1))
        data = _header(req, payload_len=n) + body
    elif kind == "key_too_large":
        data = _header(req, key_len=draw(st.integers(MAX_KEY + 1, 0xFFFF))) + body
    elif kind == "trace_too_large":
        data = _header(req, trace_len=draw(st.integers(MAX_TRACE + 1, 0xFFFF))) + body
    elif kind == "truncated":
        full = req.encode()  # always >= REQUEST_HEADER_SIZE bytes
        data = full[: draw(st.integers(1, len(full) - 1))]
    elif kind == "unknown_flags":
        flags = draw(st.integers(2, 255))
        req = attrs.evolve(req, flags=flags)
        data = req.encode()
    else:  # bad_key_utf8
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x80b"]))
        kb = kb + bad
        data = _header(req, key_len=len(kb)) + kb + tb + req.payload
    return Mutant(kind, data, req)


def random_first_bytes() -> st.SearchStrategy[bytes]:
    """Arbitrary byte strings biased towards the interesting prefixes: the
    magic's first byte, the full magic, a valid header followed by junk."""
    junk = st.binary(max_size=256)
    header = st.builds(
        lambda op, flags, k, p, t: RequestHeader(op, flags, k, p, t).pack(),
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 300),
        st.integers(0, 2 * MAX_PAYLOAD),
        st.integers(0, 300),
    )
    return st.one_of(
        junk,
        junk.map(lambda b: b"Y" + b),
        junk.map(lambda b: b"YH" + b),
        st.tuples(header, junk).map(lambda t: t[0] + t[1]),
    )


def chunk_cuts(n: int) -> st.SearchStrategy[list[int]]:
    """Sorted cut offsets in ``0..n`` (duplicates allowed: empty chunks)."""
    return st.lists(st.integers(0, n), max_size=40).map(sorted)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """Split ``data`` at the (sorted) offsets in ``cuts``."""
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# --------------------------------------------------------------------------
# HTTP and ggml-RPC byte streams (for live fuzzing of the shared port)
# --------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=16,
)
_valid_json_values = st.recursive(  # what JSON allows (no Infinity): a body whose only fault is the one put in
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=16,
)


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """Raw HTTP/1.1 requests to the API, valid or broken in one way: the
    request line, a header, Content-Length, chunked framing, deeply nested or
    invalid-UTF-8 JSON, huge JSON. Every one ends with ``Connection: close``
    so the server's answer is followed by EOF."""
    import json as _json

    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/health", "/slots", "/nope", "/slots/0"]))
    method = draw(st.sampled_from(["POST", "GET", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]))
    kind = draw(
        st.sampled_from(
            [
                "json",
                "nested",
                "bad_utf8",
                "huge",
                "bad_line",
                "bad_header",
                "short_length",
                "long_length",
                "chunked",
                "bad_chunked",
            ]
        )
    )
    body = _json.dumps(draw(_json_values)).encode()
    if kind == "nested":
        body = b"[" * draw(st.integers(100, 50_000))
    elif kind == "bad_utf8":
        body = b'{"prompt": "\xff\xfe", "max_tokens": 1}'
    elif kind == "huge":
        body = _json.dumps({"prompt": "x" * draw(st.integers(1000, 200_000)), "max_tokens": 0}).encode()
    line = f"{method} {path} HTTP/1.1\r\n".encode()
    if kind == "bad_line":
        line = draw(
            st.sampled_from(
                [
                    b"POST\r\n",
                    b"GET /health HTTP/9.9\r\n",
                    b"POST /v1/completions HTTP/1.1 x\r\n",
                    b"G\x00T / HTTP/1.1\r\n",
                ]
            )
        )
    headers = b"Host: fuzz\r\nConnection: close\r\nContent-Type: application/json\r\n"
    if kind == "bad_header":
        headers += draw(
            st.sampled_from(
                [b"X: \x00\r\n", b"no colon here\r\n", b": empty\r\n", b"X-Long: " + b"a" * 70000 + b"\r\n"]
            )
        )
    if kind in ("chunked", "bad_chunked"):
        size = len(body) + (draw(st.integers(1, 9)) if kind == "bad_chunked" else 0)
        framed = f"{size:x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        return line + headers + b"Transfer-Encoding: chunked\r\n\r\n" + framed
    length = len(body) + {"short_length": -1, "long_length": 5}.get(kind, 0)
    return line + headers + f"Content-Length: {max(length, 0)}\r\n\r\n".encode() + body


# --------------------------------------------------------------------------
# Text that is not Unicode: a lone surrogate in any string of a JSON body
# --------------------------------------------------------------------------

lone_surrogates = st.integers(0xD800, 0xDFFF).map(chr)
"""One UTF-16 surrogate code point alone: JSON can spell it (``"\\ud800"``), Unicode text cannot hold it."""

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                "required": ["city"],
            },
        },
    }
]

HTTP_TEXT_BODIES: list[tuple[str, dict]] = [
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ann"}],
            "max_tokens": 1,
            "stop": ["x"],
            "user": "u",
            "tools": _TOOLS,
            "tool_choice": "auto",
            "logit_bias": {"hello": 1},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 1,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"k": {"type": "string"}}}},
            },
        },
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": "x", "grammar": 'root ::= "a"'}),
    (
        "/completion",
        {
            "prompt": ["a", "b"],
            "n_predict": 1,
            "json_schema": {"type": "string", "pattern": "a+"},
            "samplers": ["top_k", "temperature"],
            "dry_sequence_breakers": ["\n"],
        },
    ),
    ("/tokenize", {"content": "hi there", "with_pieces": True}),
    ("/detokenize", {"tokens": [1, 2]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    ("/v1/embeddings", {"input": ["a", "b"], "model": "m", "encoding_format": "float"}),
    ("/slots/0?action=save", {"filename": "fuzz.bin"}),
    ("/slots/0?action=restore", {"filename": "fuzz.bin"}),
]
"""Bodies of every HTTP endpoint that reads JSON, each with several string fields (keys and values)."""

HYDRA_TEXT_BODIES: list[tuple[int, str, dict]] = [
    (Op.CONFIGURE, "", {"temperature": 0.7, "top_k": 40, "dry_sequence_breakers": ["\n", ":"], "cache_type_k": "f16"}),
    (
        Op.DECODE,
        "0",
        {"n_predict": 2, "messages": [{"role": "user", "content": "hi"}], "stop": ["x"], "grammar": 'root ::= "a"'},
    ),
    (Op.DECODE, "1", {"n_predict": 2, "messages": None, "stop": ["x"], "logit_bias": {"a": 1}}),
    (
        Op.PREFILL,
        "0",
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "t"}]},
            ],
            "tools": _TOOLS,
        },
    ),
    (Op.SET_EXPERT_MODE, "", {"mode": "solo", "peer": "127.0.0.1:1"}),
    (Op.PIPELINE_ATTACH, "", {"peer": "127.0.0.1:1", "ot_split": "blk\\.1\\."}),
]
"""JSON payloads of every Hydra op that reads JSON: (op, key, body)."""


@attrs.frozen
class SurrogateCase:
    """A body with a lone surrogate in one string: ``target`` (an HTTP path, or a Hydra op and key),
    ``body`` (JSON bytes, the surrogate as its ``\\uXXXX`` escape) and ``site`` (where it is)."""

    target: str | tuple[int, str]
    body: bytes
    site: str


def _sites(v: object, path: str = "") -> list[tuple[str, bool]]:
    """Every string of a JSON value: (path, is_key); paths as ``a.b[0]``."""
    out: list[tuple[str, bool]] = []
    if isinstance(v, str):
        out.append((path, False))
    elif isinstance(v, dict):
        for k, x in v.items():
            sub = f"{path}.{k}" if path else k
            out.append((sub, True))
            out += _sites(x, sub)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _sites(x, f"{path}[{i}]")
    return out


def _spoil(v: object, path: str, is_key: bool, bad: object, here: str = "") -> object:
    """``v`` with the string at ``path`` (a key when ``is_key``) replaced by ``bad(old)``."""
    if isinstance(v, str):
        return bad(v) if here == path and not is_key else v  # type: ignore[operator]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            sub = f"{here}.{k}" if here else k
            out[bad(k) if is_key and sub == path else k] = _spoil(x, path, is_key, bad, sub)  # type: ignore[operator]
        return out
    if isinstance(v, list):
        return [_spoil(x, path, is_key, bad, f"{here}[{i}]") for i, x in enumerate(v)]
    return v


@st.composite
def _with_surrogate(draw: st.DrawFn, body: dict) -> tuple[bytes, str]:
    """``body`` as JSON with a lone surrogate put into one of its strings, or into a key added at any depth."""
    import json as _json

    sites = _sites(body)
    surrogate = draw(lone_surrogates)
    how = draw(st.sampled_from(["insert", "replace", "then_ascii", "reversed_pair", "new_key"]))
    if how == "new_key":
        objects = [""] + [p for p, is_key in sites if is_key and isinstance(_get(body, p), dict)]
        where = draw(st.sampled_from(objects))
        key = draw(st.text(max_size=4)) + surrogate
        value = draw(_valid_json_values)
        out = _add_key(body, where, key, value)
        return _json.dumps(out).encode(), f"{where or '.'} new key"
    path, is_key = draw(st.sampled_from(sites))

    def bad(old: str) -> str:
        at = draw(st.integers(0, len(old)))
        piece = {
            "insert": surrogate,
            "replace": surrogate,
            "then_ascii": surrogate + "a",
            "reversed_pair": chr(0xDC00) + chr(0xD800),
        }[how]
        return piece if how == "replace" else old[:at] + piece + old[at:]

    out = _spoil(body, path, is_key, bad)
    return _json.dumps(out).encode(), f"{path} ({'key' if is_key else 'value'}, {how})"


def _get(v: object, path: str) -> object:
    """The value at ``path`` (see :func:`_sites`)."""
    for part in _split(path):
        v = v[part]  # type: ignore[index]
    return v


def _split(path: str) -> list[str | int]:
    import re

    out: list[str | int] = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        out.append(int(index) if index else name)
    return out


def _add_key(body: dict, where: str, key: str, value: object) -> dict:
    import copy

    out = copy.deepcopy(body)
    target: object = out
    for part in _split(where) if where else []:
        target = target[part]  # type: ignore[index]
    assert isinstance(target, dict)
    target[key] = value
    return out


@st.composite
def http_surrogate_bodies(draw: st.DrawFn) -> SurrogateCase:
    """A body of an HTTP endpoint that reads JSON (:data:`HTTP_TEXT_BODIES`) with a lone surrogate in one
    string: the node answers 400 naming the field ("not valid Unicode"; 501 where the endpoint is off) and
    changes nothing."""
    path, body = draw(st.sampled_from(HTTP_TEXT_BODIES))
    raw, site = draw(_with_surrogate(body))
    return SurrogateCase(path, raw, site)


@st.composite
def hydra_surrogate_payloads(draw: st.DrawFn) -> SurrogateCase:
    """A JSON payload of a Hydra op (:data:`HYDRA_TEXT_BODIES`) with a lone surrogate in one string: the node
    answers BAD_REQUEST naming the field and changes nothing."""
    op, key, body = draw(st.sampled_from(HYDRA_TEXT_BODIES))
    raw, site = draw(_with_surrogate(body))
    return SurrogateCase((int(op), key), raw, site)


def ggml_rpc_hellos() -> st.SearchStrategy[bytes]:
    """ggml-RPC openings: the valid HELLO of protocol 7 (24 bytes of transport
    caps), a HELLO of the wrong size (older / newer clients), truncated ones,
    and a first command that is not HELLO."""
    valid = b"\x0e" + (24).to_bytes(8, "little") + bytes(24)
    return st.one_of(
        st.just(valid),
        st.integers(0, 64).filter(lambda n: n != 24).map(lambda n: b"\x0e" + n.to_bytes(8, "little") + bytes(n)),
        st.integers(1, len(valid) - 1).map(lambda n: valid[:n]),
        st.binary(max_size=40).map(lambda b: b"\x0e" + b),
    )


# --------------------------------------------------------------------------
# ggml-RPC clients: valid sessions, silent and malformed clients
# (hydra_trio.protocol.ggml_rpc; layouts from ggml-rpc.cpp v7.0.0)
# --------------------------------------------------------------------------

from collections.abc import Callable  # noqa: E402

from hydra_trio.protocol import ggml_rpc as _g  # noqa: E402

RPC_BUFFER = 0x5A5A_0000_1000
"""The buffer handle fake sessions pretend ALLOC_BUFFER answered."""
RPC_BASE = 0x7F00_0000_0000
"""The base address fake sessions pretend BUFFER_GET_BASE answered."""
RPC_BUFFER_SIZE = 1 << 20
HELLO_REPLY = _g.encode_reply(bytes([_g.RPC_PROTO_MAJOR_VERSION, 0, 0, 0]) + bytes(_g.RPC_CONN_CAPS_SIZE))
_GGML_OP_ADD = 2


@attrs.frozen
class RpcStep:
    """One client message and the server's answer to it (None: the command is not answered)."""

    request: bytes
    reply: bytes | None


@attrs.frozen
class GgmlRpcMutant:
    """A ggml-RPC message with one thing wrong that the front door must refuse.

    ``make(buffer, base)`` builds the bytes; when ``needs_buffer`` the session must
    first have allocated a buffer of at least :data:`RPC_BUFFER_SIZE` bytes (the
    handle and base address its ALLOC_BUFFER / BUFFER_GET_BASE replies gave).
    ``check`` is the validator check expected to refuse it.
    """

    kind: str
    check: str
    needs_buffer: bool
    make: Callable[[int, int], bytes] = attrs.field(repr=False)


def rpc_buffer_steps(buffer: int = RPC_BUFFER, base: int = RPC_BASE, size: int = RPC_BUFFER_SIZE) -> list[RpcStep]:
    """ALLOC_BUFFER (device 0) and BUFFER_GET_BASE with the answers a server would give."""
    return [
        RpcStep(
            _g.encode_request(_g.RpcCmd.ALLOC_BUFFER, struct.pack("<IQ", 0, size)),
            _g.encode_reply(struct.pack("<QQ", buffer, size)),
        ),
        RpcStep(
            _g.encode_request(_g.RpcCmd.BUFFER_GET_BASE, struct.pack("<Q", buffer)),
            _g.encode_reply(struct.pack("<Q", base)),
        ),
    ]


def _contiguous_nb(t: int, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    blck, size = _g.TYPE_TRAITS[t]
    nb0 = size
    nb1 = size * (ne[0] // blck)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


_ids = st.integers(1, 2**64 - 1)
_names = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20).map(str.encode)


@st.composite
def rpc_tensors(
    draw: st.DrawFn,
    buffer: int = RPC_BUFFER,
    base: int = RPC_BASE,
    size: int = RPC_BUFFER_SIZE,
    types: list[int] | None = None,
) -> _g.RpcTensor:
    """A valid, contiguous ``rpc_tensor`` whose data lies inside the given buffer (buffer 0: no buffer)."""
    t = draw(st.sampled_from(types or sorted(_g.TYPE_TRAITS)))
    blck, _ = _g.TYPE_TRAITS[t]
    ne = (blck * draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    nb = _contiguous_nb(t, ne)
    nbytes = nb[3] * ne[3]
    data = base + draw(st.integers(0, size - nbytes)) if buffer else 0
    return _g.RpcTensor(id=draw(_ids), type=t, buffer=buffer, ne=ne, nb=nb, data=data, name=draw(_names))


@st.composite
def _graph(draw: st.DrawFn, buffer: int = RPC_BUFFER, base: int = RPC_BASE) -> tuple[list[int], list[_g.RpcTensor]]:
    """A valid GRAPH_COMPUTE body: f32 leaves and ADD nodes over them, all in the buffer."""
    n_leaves = draw(st.integers(1, 3))
    n_nodes = draw(st.integers(1, 3))
    ids = draw(st.lists(_ids, min_size=n_leaves + n_nodes, max_size=n_leaves + n_nodes, unique=True))
    ne = (draw(st.integers(1, 64)), draw(st.integers(1, 4)), 1, 1)
    nb = _contiguous_nb(0, ne)
    nbytes = nb[3]
    tensors = []
    for i in range(n_leaves + n_nodes):
        data = base + i * nbytes
        if i < n_leaves:
            tensors.append(_g.RpcTensor(id=ids[i], type=0, buffer=buffer, ne=ne, nb=nb, data=data))
        else:
            a, b = draw(st.sampled_from(ids[:i])), draw(st.sampled_from(ids[:i]))
            src = (a, b) + (0,) * (_g.GGML_MAX_SRC - 2)
            tensors.append(
                _g.RpcTensor(id=ids[i], type=0, buffer=buffer, ne=ne, nb=nb, op=_GGML_OP_ADD, src=src, data=data)
            )
    return ids[n_leaves:], tensors


@st.composite
def ggml_rpc_steps(draw: st.DrawFn) -> RpcStep:
    """One valid message after HELLO, ALLOC_BUFFER and BUFFER_GET_BASE (see :func:`ggml_rpc_sessions`)."""
    C = _g.RpcCmd
    kind = draw(
        st.sampled_from(
            [
                "device_count",
                "alignment",
                "max_size",
                "device_memory",
                "set_tensor",
                "get_tensor",
                "set_tensor_hash",
                "copy_tensor",
                "memset_tensor",
                "init_tensor",
                "alloc_size",
                "buffer_clear",
                "graph",
                "recompute",
            ]
        )
    )
    if kind == "device_count":
        return RpcStep(_g.encode_request(C.DEVICE_COUNT), _g.encode_reply(struct.pack("<I", 1)))
    if kind in ("alignment", "max_size"):
        cmd = C.GET_ALIGNMENT if kind == "alignment" else C.GET_MAX_SIZE
        return RpcStep(_g.encode_request(cmd, struct.pack("<I", 0)), _g.encode_reply(struct.pack("<Q", 32)))
    if kind == "device_memory":
        return RpcStep(_g.encode_request(C.GET_DEVICE_MEMORY, struct.pack("<I", 0)), _g.encode_reply(bytes(16)))
    if kind == "buffer_clear":
        return RpcStep(
            _g.encode_request(C.BUFFER_CLEAR, struct.pack("<QB", RPC_BUFFER, draw(st.integers(0, 255)))), None
        )
    if kind == "recompute":
        return RpcStep(_g.encode_request(C.GRAPH_RECOMPUTE, struct.pack("<I", 0)), None)
    if kind == "graph":
        nodes, tensors = draw(_graph())
        return RpcStep(_g.encode_graph_compute(0, nodes, tensors), None)
    t = draw(rpc_tensors())
    nbytes = _g.tensor_nbytes(t)
    offset = draw(st.integers(0, nbytes))
    length = draw(st.integers(0, min(nbytes - offset, 4096)))
    if kind == "set_tensor":
        return RpcStep(_g.encode_set_tensor(t, offset, draw(st.binary(min_size=length, max_size=length))), None)
    if kind == "get_tensor":
        return RpcStep(
            _g.encode_request(C.GET_TENSOR, t.pack() + struct.pack("<QQ", offset, length)),
            _g.encode_reply(draw(st.binary(min_size=length, max_size=length))),
        )
    if kind == "set_tensor_hash":
        return RpcStep(
            _g.encode_request(C.SET_TENSOR_HASH, t.pack() + struct.pack("<QQ", offset, draw(_ids))),
            _g.encode_reply(b"\x00"),
        )
    if kind == "copy_tensor":
        other = draw(rpc_tensors())
        return RpcStep(_g.encode_request(C.COPY_TENSOR, t.pack() + other.pack()), _g.encode_reply(b"\x01"))
    if kind == "memset_tensor":
        return RpcStep(_g.encode_request(C.MEMSET_TENSOR, t.pack() + struct.pack("<QQB", offset, length, 0)), None)
    if kind == "init_tensor":
        return RpcStep(_g.encode_request(C.INIT_TENSOR, t.pack()), None)
    # alloc_size: the tensor and up to two sources, the rest zero
    srcs = draw(st.lists(rpc_tensors(), max_size=2))
    body = struct.pack("<I", 0) + t.pack() + b"".join(s.pack() for s in srcs)
    body += bytes(_g.RPC_TENSOR_SIZE * (_g.GGML_MAX_SRC - len(srcs)))
    return RpcStep(_g.encode_request(C.GET_ALLOC_SIZE, body), _g.encode_reply(bytes(8)))


def ggml_rpc_sessions(max_steps: int = 8) -> st.SearchStrategy[list[RpcStep]]:
    """A whole valid session: HELLO, a 1 MiB buffer, then up to ``max_steps`` valid messages."""
    return st.lists(ggml_rpc_steps(), max_size=max_steps).map(
        lambda steps: [RpcStep(_g.hello_request(), HELLO_REPLY), *rpc_buffer_steps(), *steps]
    )


def ggml_rpc_silent_openings() -> st.SearchStrategy[bytes]:
    """What a silent client sends before going quiet: ``0x0E`` alone or any strict prefix of HELLO."""
    hello = _g.hello_request()
    return st.integers(1, len(hello) - 1).map(lambda n: hello[:n])


@st.composite
def ggml_rpc_truncated(draw: st.DrawFn) -> list[RpcStep]:
    """A valid session whose last message is cut short (its step has no reply): send the requests in
    order, reading each reply, and the last one stays incomplete."""
    steps = draw(ggml_rpc_sessions(max_steps=3))
    n = draw(st.integers(1, len(steps) - 1))
    last = steps[n].request
    return [*steps[:n], RpcStep(last[: draw(st.integers(1, len(last) - 1))], None)]


def _mutant(kind: str, check: str, make: Callable[[int, int], bytes], needs_buffer: bool = True) -> GgmlRpcMutant:
    return GgmlRpcMutant(kind, check, needs_buffer, make)


@st.composite
def ggml_rpc_crashing_graphs(draw: st.DrawFn) -> GgmlRpcMutant:
    """The GRAPH_COMPUTE family that crashes an unguarded ggml-RPC server, or would: node ids that are 0 or
    absent, dangling sources, ops past GGML_OP_COUNT, computed nodes without memory, bad counts, tensors
    with bad types or shapes. Random node counts and ids."""
    kind = draw(
        st.sampled_from(
            [
                "zero_node_bare",
                "zero_node",
                "missing_node",
                "missing_src",
                "missing_view_src",
                "bad_op",
                "unbacked_node",
                "no_nodes",
                "bad_count",
                "bad_type",
                "bad_shape",
            ]
        )
    )
    if kind == "zero_node_bare":  # crashes an unguarded server: command 10, size 20, zeros but n_nodes = 1
        n = draw(st.integers(1, 4))
        data = _g.encode_request(_g.RpcCmd.GRAPH_COMPUTE, struct.pack(f"<II{n}QI", 0, n, *([0] * n), 0))
        return _mutant(kind, "graph", lambda b, a: data, needs_buffer=False)
    nodes, tensors = draw(_graph(buffer=0, base=0))  # placed below, once the buffer is known
    extra = draw(_ids.filter(lambda i: i not in {t.id for t in tensors}))
    pick = draw(st.integers(0, len(tensors) - 1))
    node_pick = draw(st.integers(0, len(nodes) - 1))
    bad_type = draw(st.one_of(st.integers(_g.GGML_TYPE_COUNT, 2**32 - 1), st.sampled_from(sorted(_g.REMOVED_TYPES))))
    check = {"bad_count": "size", "bad_type": "tensor_type", "bad_shape": "tensor_shape"}.get(kind, "graph")

    def make(buffer: int, base: int) -> bytes:
        ts = [attrs.evolve(t, buffer=buffer, data=base + i * t.nb[3]) for i, t in enumerate(tensors)]
        ns = list(nodes)
        if kind == "zero_node":
            ns[node_pick] = 0
        elif kind == "missing_node":
            ns[node_pick] = extra
        elif kind == "missing_src":
            ts[pick] = attrs.evolve(ts[pick], src=(extra,) + ts[pick].src[1:])
        elif kind == "missing_view_src":
            ts[pick] = attrs.evolve(ts[pick], view_src=extra)
        elif kind == "bad_op":
            ts[pick] = attrs.evolve(ts[pick], op=_g.GGML_OP_COUNT + pick)
        elif kind == "unbacked_node":
            i = next(i for i, t in enumerate(ts) if t.id == ns[node_pick])
            ts[i] = attrs.evolve(ts[i], buffer=0, data=0)
        elif kind == "no_nodes":
            ns = []
        elif kind == "bad_type":
            ts[pick] = attrs.evolve(ts[pick], type=bad_type)
        elif kind == "bad_shape":  # Q4_0 rows of one element
            ts[pick] = attrs.evolve(ts[pick], type=2, ne=(1, 1, 1, 1), nb=(18, 18, 18, 18))
        data = _g.encode_graph_compute(0, ns, ts)
        if kind == "bad_count":  # n_tensors one more than present
            head = 4 + 4 + 8 * len(ns)
            body = bytearray(data[_g.HEADER_SIZE :])
            struct.pack_into("<I", body, head, len(ts) + 1)
            data = _g.encode_request(_g.RpcCmd.GRAPH_COMPUTE, bytes(body))
        return data

    return _mutant(kind, check, make)


@st.composite
def ggml_rpc_bad_tensor_messages(draw: st.DrawFn) -> GgmlRpcMutant:
    """A tensor-carrying message (SET_TENSOR, GET_TENSOR, MEMSET_TENSOR, INIT_TENSOR, COPY_TENSOR,
    GET_ALLOC_SIZE) whose tensor has a bad type, shape, strides or place; includes a Q4_0 tensor
    with ne0 = 1 in SET_TENSOR (it crashes an unguarded server)."""
    C = _g.RpcCmd
    kind = draw(
        st.sampled_from(
            [
                "type_out_of_range",
                "removed_type",
                "q4_0_ne0_1",
                "ne0_not_blocks",
                "zero_ne",
                "ne_overflow",
                "zero_stride",
                "nb0_not_block",
                "outside_buffer",
                "region_outside",
            ]
        )
    )
    cmd = draw(
        st.sampled_from([C.SET_TENSOR, C.GET_TENSOR, C.MEMSET_TENSOR, C.INIT_TENSOR, C.COPY_TENSOR, C.GET_ALLOC_SIZE])
    )
    if kind in ("zero_ne", "region_outside"):  # only wrong where data moves
        cmd = draw(st.sampled_from([C.SET_TENSOR, C.GET_TENSOR, C.MEMSET_TENSOR]))
    if kind == "q4_0_ne0_1":
        cmd = C.SET_TENSOR
    base_t = draw(rpc_tensors(buffer=1, base=0))  # buffer/data fixed up in make()
    quant = draw(st.sampled_from(sorted(t for t, (b, _) in _g.TYPE_TRAITS.items() if b > 1)))
    blck, qsize = _g.TYPE_TRAITS[quant]
    bad_type = (
        draw(st.integers(_g.GGML_TYPE_COUNT, 2**32 - 1))
        if kind == "type_out_of_range"
        else draw(st.sampled_from(sorted(_g.REMOVED_TYPES)))
    )
    odd = draw(st.integers(1, blck - 1))
    check = {
        "type_out_of_range": "tensor_type",
        "removed_type": "tensor_type",
        "q4_0_ne0_1": "tensor_shape",
        "ne0_not_blocks": "tensor_shape",
        "zero_ne": "tensor_shape",
        "ne_overflow": "tensor_shape",
        "zero_stride": "tensor_strides",
        "nb0_not_block": "tensor_strides",
        "outside_buffer": "tensor_bounds",
        "region_outside": "tensor_region",
    }[kind]

    def make(buffer: int, base: int) -> bytes:
        t = attrs.evolve(base_t, buffer=buffer, data=base + (base_t.data or 0))
        nbytes = _g.tensor_nbytes(t)
        if kind in ("type_out_of_range", "removed_type"):
            t = attrs.evolve(t, type=bad_type)
        elif kind == "q4_0_ne0_1":
            t = attrs.evolve(t, type=2, ne=(1, 1, 1, 1), nb=(18, 18, 18, 18), data=base)
        elif kind == "ne0_not_blocks":
            t = attrs.evolve(t, type=quant, ne=(odd, 1, 1, 1), nb=(qsize,) * 4, data=base)
        elif kind == "zero_ne":
            t = attrs.evolve(t, ne=(t.ne[0], 0, t.ne[2], t.ne[3]))
        elif kind == "ne_overflow":
            t = attrs.evolve(t, type=0, ne=(2**32 - 1,) * 4, nb=(4, 4, 4, 4))
        elif kind == "zero_stride":
            t = attrs.evolve(t, type=0, ne=(4, 2, 1, 1), nb=(4, 0, 8, 8), data=base)
        elif kind == "nb0_not_block":
            t = attrs.evolve(
                t, type=quant, ne=(blck, 1, 1, 1), nb=(qsize + 1, qsize + 1, qsize + 1, qsize + 1), data=base
            )
        elif kind == "outside_buffer":
            t = attrs.evolve(t, data=base + RPC_BUFFER_SIZE - nbytes + 1)
        offset, length = (nbytes, 1) if kind == "region_outside" else (0, 0)
        if cmd == C.SET_TENSOR:
            return _g.encode_set_tensor(t, offset, b"\x00" * (length or (18 if kind == "q4_0_ne0_1" else 1)))
        if cmd == C.GET_TENSOR:
            return _g.encode_request(cmd, t.pack() + struct.pack("<QQ", offset, length or 1))
        if cmd == C.MEMSET_TENSOR:
            return _g.encode_request(cmd, t.pack() + struct.pack("<QQB", offset, length or 1, 0))
        if cmd == C.INIT_TENSOR:
            return _g.encode_request(cmd, t.pack())
        if cmd == C.COPY_TENSOR:
            return _g.encode_request(cmd, t.pack() + attrs.evolve(base_t, buffer=buffer, data=base).pack())
        return _g.encode_request(cmd, struct.pack("<I", 0) + t.pack() + bytes(_g.RPC_TENSOR_SIZE * _g.GGML_MAX_SRC))

    return _mutant(f"{cmd.name.lower()}:{kind}", check, make)


def ggml_rpc_framing_mutants() -> st.SearchStrategy[GgmlRpcMutant]:
    """Framing errors after HELLO: unknown commands, wrong fixed sizes, a second HELLO, a huge SET_TENSOR."""
    C = _g.RpcCmd
    unknown = st.integers(int(C.NONE), 255).map(
        lambda c: _mutant("unknown_command", "unknown_command", lambda b, a: _g.encode_request(c), False)
    )
    wrong = (
        st.tuples(st.sampled_from(sorted(_g.REQUEST_SIZES)), st.integers(0, 4000))
        .filter(lambda cs: cs[0] != C.HELLO and cs[1] != _g.REQUEST_SIZES[cs[0]])
        .map(lambda cs: _mutant("wrong_size", "size", lambda b, a: _g.encode_request(cs[0], bytes(cs[1])), False))
    )
    again = st.just(_mutant("hello_again", "hello_repeated", lambda b, a: _g.hello_request(), False))
    huge = st.integers(17 << 30, 2**64 - 1).map(
        lambda n: _mutant(
            "too_large", "too_large", lambda b, a: struct.pack("<BQ", C.SET_TENSOR, n) + bytes(400), False
        )
    )
    return st.one_of(unknown, wrong, again, huge)


def ggml_rpc_mutants() -> st.SearchStrategy[GgmlRpcMutant]:
    """Every kind of refused ggml-RPC message above."""
    return st.one_of(ggml_rpc_crashing_graphs(), ggml_rpc_bad_tensor_messages(), ggml_rpc_framing_mutants())


# --------------------------------------------------------------------------- costs bounded before the work

_HUGE = st.one_of(st.integers(2001, 10**12), st.sampled_from([2**31, 2**63, 10**18, 100_000_000]))
_COUNT = st.one_of(st.integers(0, 2000), _HUGE)


@st.composite
def extreme_schemas(draw: st.DrawFn, depth: int = 0) -> dict:
    """JSON schemas with extreme counts and bounds (minItems / maxLength / {m,n} up to 10^18, deep
    nesting, wide objects, integer ranges near 64 bits), and keywords the grammar cannot enforce."""
    kind = draw(st.sampled_from(["array", "string", "pattern", "integer", "object", "deep", "unenforceable", "enum"]))
    if kind == "array":
        s: dict = {"type": "array", "items": draw(extreme_schemas(depth + 1)) if depth < 2 else {"type": "integer"}}
        for k in draw(st.sets(st.sampled_from(["minItems", "maxItems"]))):
            s[k] = draw(_COUNT)
        return s
    if kind == "string":
        return {
            "type": "string",
            **{k: draw(_COUNT) for k in draw(st.sets(st.sampled_from(["minLength", "maxLength"])))},
        }
    if kind == "pattern":
        lo, hi = draw(_COUNT), draw(st.one_of(st.none(), _COUNT))
        item = draw(st.sampled_from(["a", "[a-z]", "(ab|c)", "\\d", "."]))
        return {"type": "string", "pattern": f"^{item}{{{lo},{'' if hi is None else hi}}}$"}
    if kind == "integer":
        big = st.integers(-(2**64), 2**64)
        return {
            "type": "integer",
            **{
                k: draw(big)
                for k in draw(st.sets(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])))
            },
        }
    if kind == "object":
        n = draw(st.sampled_from([1, 10, 5000, 20000]))
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    if kind == "deep":
        s = {"type": "null"}
        for _ in range(draw(st.sampled_from([10, 65, 300]))):
            s = {"type": "array", "items": s}
        return s
    if kind == "enum":
        # up to 3 MB: past the grammar-size limit; a body past the HTTP body limit is a 413 (checked too)
        return {"enum": ["x" * draw(st.sampled_from([1, 1000, 10_000]))] * draw(st.sampled_from([1, 100, 300]))}
    return draw(
        st.sampled_from(
            [
                {"type": "number", "minimum": 1},
                {"type": "integer", "multipleOf": 2},
                {"type": "string", "format": "email"},
                {"not": {}},
                {"uniqueItems": True, "type": "array"},
                {"type": "object", "minProperties": 2},
            ]
        )
    )


@st.composite
def many_part_chat_bodies(draw: st.DrawFn) -> dict:
    """Chat bodies made of many small parts: thousands of one-word messages, many content parts,
    one huge message, special-token texts, many stop strings."""
    kind = draw(st.sampled_from(["messages", "parts", "huge", "special", "stop"]))
    if kind == "messages":
        n = draw(st.sampled_from([1, 100, 5000, 10001, 40000]))
        return {"messages": [{"role": "user", "content": "hi"}] * n}
    if kind == "parts":
        n = draw(st.sampled_from([2, 1024, 1025, 50000]))
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * n}]}
    if kind == "huge":
        return {"messages": [{"role": "user", "content": "word " * draw(st.sampled_from([10, 10**5, 10**6]))}]}
    if kind == "special":
        return {"messages": [{"role": "user", "content": "<|im_end|>" * draw(st.sampled_from([1, 1000, 100_000]))}]}
    return {"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * draw(st.sampled_from([1, 17, 10_000]))}


# --------------------------------------------------------------------------- requests whose size would drive the work


@attrs.frozen
class SizedCase:
    """A chat body (JSON text, written without recursion: it may nest 100,000 deep) and what the node
    answers: 200 when ``limits`` is empty (a 400 saying the prompt does not fit a slot's context is
    allowed too), else a 400 whose message names one of ``limits``."""

    what: str
    body: bytes = attrs.field(repr=False)
    limits: tuple[str, ...] = ()


def _nest(inner: str, n: int, open_: str, close: str) -> str:
    return open_ * n + inner + close * n


def _chat_body(**fields: str) -> bytes:
    """A chat body with ``fields`` given as JSON texts (one user message, max_tokens 0)."""
    parts = ['"messages": [{"role": "user", "content": "x"}]', '"max_tokens": 0'] + [
        f'"{k}": {v}' for k, v in fields.items() if k != "messages"
    ]
    if "messages" in fields:
        parts[0] = f'"messages": {fields["messages"]}'
    return ("{" + ", ".join(parts) + "}").encode()


_RESERVED = ["root", "string", "space", "value", "char", "integer", "object"]


@st.composite
def wide_and_deep_schemas(draw: st.DrawFn) -> SizedCase:
    """``json_schema`` bodies wide or deep in every way a schema can be: many optional properties
    (llama.cpp's rule set, linear), nested objects, arrays and ``anyOf`` around the depth limits, ``$ref``
    and ``allOf``-``$ref`` chains, big enums, many pattern alternatives and nested groups, property
    names that are rule names of the grammar."""
    kind = draw(
        st.sampled_from(
            [
                "optional",
                "objects",
                "arrays",
                "anyof",
                "refs",
                "allof-refs",
                "enum",
                "alternatives",
                "groups",
                "reserved",
            ]
        )
    )
    if kind == "optional":
        n = draw(st.sampled_from([10, 1000, 2000, 3000, 5000]))
        required = draw(st.sets(st.integers(0, n - 1), max_size=3))
        props = ", ".join(f'"p{i}": {{"type": "string"}}' for i in range(n))
        required_names = json_list(f"p{i}" for i in sorted(required))
        schema = f'{{"type": "object", "properties": {{{props}}}, "required": {required_names}}}'
        return SizedCase(
            f"{n} properties",
            _chat_body(json_schema=schema),
            () if n <= 2000 else ("MAX_GRAMMAR_BYTES", "MAX_SCHEMA_NODES"),
        )
    if kind in ("objects", "arrays", "anyof"):
        d = draw(st.sampled_from([10, 64, 65, 100, 130, 5000]))
        if kind == "objects":
            schema = _nest('{"type": "string"}', d, '{"type": "object", "properties": {"a": ', "}}")
        elif kind == "arrays":
            schema = _nest('{"type": "string"}', d, '{"type": "array", "items": ', "}")
        else:
            schema = _nest('{"type": "string"}', d, '{"anyOf": [{"type": "null"}, ', "]}")
        json_depth = 1 + d * (1 if kind == "arrays" else 2) + 1
        limits = ("MAX_JSON_DEPTH",) if json_depth > 256 else ("MAX_SCHEMA_DEPTH",) if d > 64 else ()
        return SizedCase(f"{kind} {d} deep", _chat_body(json_schema=schema), limits)
    if kind in ("refs", "allof-refs"):
        n = draw(st.sampled_from([10, 3000]))
        step = '{{"$ref": "#/$defs/d{}"}}' if kind == "refs" else '{{"allOf": [{{"$ref": "#/$defs/d{}"}}]}}'
        defs = ", ".join(f'"d{i}": ' + step.format(i + 1) for i in range(n))
        last = '{"type": "object", "properties": {"x": {"type": "integer"}}}'
        schema = f'{{"$defs": {{{defs}, "d{n}": {last}}}, "$ref": "#/$defs/d0"}}'
        # a short chain of allOf links is refused too: the converter combines object schemas only, not an allOf in one
        short: tuple[str, ...] = () if kind == "refs" else ("allOf: only object schemas",)
        return SizedCase(
            f"{kind} chain of {n}", _chat_body(json_schema=schema), short if n == 10 else ("MAX_SCHEMA_DEPTH",)
        )
    if kind == "enum":
        n = draw(st.sampled_from([100, 100_000]))
        return SizedCase(
            f"enum of {n}",
            _chat_body(json_schema=f'{{"enum": {json_list(range(n))}}}'),
            () if n == 100 else ("MAX_GRAMMAR_BYTES",),
        )
    if kind == "alternatives":
        n = draw(st.sampled_from([10, 600, 2000]))  # 2000: past the pattern's 4096 characters
        pattern = "^(" + "|".join(f"a{i}" for i in range(n)) + ")$"
        return SizedCase(
            f"pattern of {n} alternatives",
            _chat_body(json_schema=f'{{"type": "string", "pattern": "{pattern}"}}'),
            () if n < 2000 else ("MAX_PATTERN_CHARS",),
        )
    if kind == "groups":
        d = draw(st.sampled_from([10, 64, 65, 1000]))
        pattern = "^" + "(a" * d + ")" * d + "$"
        return SizedCase(
            f"pattern of {d} nested groups",
            _chat_body(json_schema=f'{{"type": "string", "pattern": "{pattern}"}}'),
            () if d <= 64 else ("MAX_SCHEMA_DEPTH",),
        )
    names = draw(st.lists(st.sampled_from(_RESERVED), min_size=1, max_size=4, unique=True))
    props = ", ".join(f'"{n}": {{"type": "integer"}}' for n in names)
    return SizedCase(
        f"properties named {names}", _chat_body(json_schema=f'{{"type": "object", "properties": {{{props}}}}}')
    )


def json_list(items: object) -> str:
    """A JSON array of ``items`` (strings or integers), written without ``json.dumps``."""
    return "[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in items) + "]"  # type: ignore[attr-defined]


@st.composite
def deep_json_bodies(draw: st.DrawFn) -> SizedCase:
    """Chat bodies with arrays nested around the depth limit (256) or far past it, in a field the node
    does not know, in ``chat_template_kwargs``, in a tool's ``parameters``, or in a tool call's
    ``arguments`` text (its own JSON: its depth counts from 1)."""
    where = draw(st.sampled_from(["extra", "kwargs", "parameters", "arguments"]))
    d = draw(st.sampled_from([10, 250, 255, 256, 257, 1000, 100_000]))
    deep = _nest("1", d, "[", "]")
    if where == "extra":
        body, depth = _chat_body(x=deep), d + 1
    elif where == "kwargs":
        body, depth = _chat_body(chat_template_kwargs=f'{{"x": {deep}}}'), d + 2
    elif where == "parameters":
        parameters = f'{{"type": "object", "default": {deep}}}'
        tools = f'[{{"type": "function", "function": {{"name": "f", "parameters": {parameters}}}}}]'
        body, depth = _chat_body(tools=tools), d + 5
    else:
        call = f'{{"id": "c1", "type": "function", "function": {{"name": "f", "arguments": "{deep}"}}}}'
        body, depth = (
            _chat_body(
                messages=f'[{{"role": "user", "content": "x"}}, {{"role": "assistant", "tool_calls": [{call}]}}]'
            ),
            d,
        )
    return SizedCase(f"{d} deep in {where}", body, ("MAX_JSON_DEPTH",) if depth > 256 else ())


@st.composite
def long_request_lists(draw: st.DrawFn) -> SizedCase:
    """Lists and maps whose length would drive the work: ``logit_bias`` (past any vocabulary), ``stop``,
    ``response_fields``, many tools."""
    kind = draw(st.sampled_from(["logit_bias", "logit_bias_texts", "stop", "response_fields", "tools"]))
    if kind == "logit_bias":
        n = draw(st.sampled_from([10, 1_000_000]))
        return SizedCase(
            f"logit_bias of {n}",
            _chat_body(logit_bias="[" + ", ".join(["[1, -1]"] * n) + "]"),
            () if n == 10 else ("n_vocab",),
        )
    if kind == "logit_bias_texts":
        n = draw(st.sampled_from([10, 300_000]))
        keys = ", ".join(f'"w{i}": 1' for i in range(n))
        return SizedCase(
            f"logit_bias of {n} texts", _chat_body(logit_bias="{" + keys + "}"), () if n == 10 else ("n_vocab",)
        )
    if kind == "stop":
        n = draw(st.sampled_from([16, 17, 100_000]))
        return SizedCase(f"{n} stop strings", _chat_body(stop=json_list(["x"] * n)), () if n <= 16 else ("stop",))
    if kind == "response_fields":
        n = draw(st.sampled_from([10, 256, 257, 1_000_000]))
        return SizedCase(
            f"{n} response_fields",
            _chat_body(response_fields=json_list(["content"] * n)),
            () if n <= 256 else ("MAX_RESPONSE_FIELDS",),
        )
    n = draw(st.sampled_from([3, 1366, 200_000]))
    tools = "[" + ", ".join(f'{{"type": "function", "function": {{"name": "f{i}"}}}}' for i in range(n)) + "]"
    return SizedCase(f"{n} tools", _chat_body(tools=tools), () if n == 3 else ("MAX_SCHEMA_NODES",))


@st.composite
def deep_grammars(draw: st.DrawFn) -> SizedCase:
    """``grammar`` texts that llama.cpp's parser and grammar engine would work on in proportion to a
        power of their size: chains of references that stack up (``r0 ::= r1 "x"``), groups nested
        around the depth limit, long chains of references that do not stack (llama.cpp follows them with one
    C call per link), text past the size limit."""
    kind = draw(st.sampled_from(["stacking", "groups", "tail-chain", "size"]))
    if kind == "stacking":
        n = draw(st.sampled_from([100, 1024, 1025, 10_000]))
        g = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(n)) + f'r{n} ::= "a"\n'
        limits: tuple[str, ...] = () if n <= 1024 else ("MAX_GRAMMAR_STACK_DEPTH",)
    elif kind == "groups":
        n = draw(st.sampled_from([10, 128, 129, 10_000]))
        g, limits = "root ::= " + '("a" ' * n + ")" * n, () if n <= 128 else ("MAX_GRAMMAR_DEPTH",)
    elif kind == "tail-chain":
        n = draw(st.sampled_from([5000, 8191, 12_000]))
        g = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
        limits = () if n < 8192 else ("MAX_GRAMMAR_REF_CHAIN",)
    else:
        g, limits = 'root ::= "' + "a" * 300_000 + '"', ("MAX_GRAMMAR_BYTES",)
    escaped = g.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return SizedCase(f"grammar {kind}", _chat_body(grammar=f'"{escaped}"'), limits)


# ---------------------------------------------------------------------------
# Status reads during a long prefill

_PROMPT_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "bright jovial nymphs near misty harbours and old lanterns glow"
).split()


@attrs.frozen
class StatusRead:
    """One status read: ``kind`` is ``"http"`` (``target`` a path) or ``"hydra"`` (``target`` an op
    name, ``key`` its slot key)."""

    kind: Literal["http", "hydra"]
    target: str
    key: str = ""


def long_prompts(min_words: int = 200, max_words: int = 1200) -> st.SearchStrategy[str]:
    """A plain-words text of ``min_words`` to ``max_words`` words (about as many tokens with SmolLM2),
    each word drawn from a fixed list, starting anywhere in it."""
    return st.tuples(st.integers(min_words, max_words), st.integers(0, len(_PROMPT_WORDS) - 1)).map(
        lambda t: " ".join(_PROMPT_WORDS[(t[1] + i) % len(_PROMPT_WORDS)] for i in range(t[0]))
    )


def status_reads(n_slots: int, max_size: int = 40) -> st.SearchStrategy[list[StatusRead]]:
    """1..``max_size`` status reads of a node with ``n_slots`` slots (slot ids in range)."""
    slot = st.integers(0, n_slots - 1)
    one = st.one_of(
        st.just(StatusRead("http", "/slots")),
        slot.map(lambda i: StatusRead("http", f"/slots/{i}/state/meta")),
        st.just(StatusRead("http", "/health")),
        st.just(StatusRead("http", "/props")),
        st.just(StatusRead("hydra", "INFO")),
        slot.map(lambda i: StatusRead("hydra", "STATE_META", str(i))),
    )
    return st.lists(one, min_size=1, max_size=max_size)
