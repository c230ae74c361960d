"""Hypothesis strategies for the Hydra codec (hydra_trio.protocol.hydra).

Importable by tests (``from fuzz.strategies import ...``) and by long-running
fuzzers. Decoders under test should use the limits below (`MAX_PAYLOAD`,
`MAX_KEY`, `MAX_TRACE`) so the "over the limit" mutants mean something.
"""

from __future__ import annotations

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
    "Mutant",
    "Req",
    "chunk_cuts",
    "nearly_valid_requests",
    "random_first_bytes",
    "split_at",
    "valid_requests",
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
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --------------------------------------------------------------------------
# HTTP and ggml-RPC byte streams (for live fuzzing of the shared port)
# --------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
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
    kind = draw(st.sampled_from(["json", "nested", "bad_utf8", "huge", "bad_line", "bad_header", "short_length",
                                 "long_length", "chunked", "bad_chunked"]))
    body = _json.dumps(draw(_json_values)).encode()
    if kind == "nested":
        body = b"[" * draw(st.integers(100, 50_000))
    elif kind == "bad_utf8":
        body = b'{"prompt": "\xff\xfe", "max_tokens": 1}'
    elif kind == "huge":
        body = _json.dumps({"prompt": "x" * draw(st.integers(1000, 200_000)), "max_tokens": 0}).encode()
    line = f"{method} {path} HTTP/1.1\r\n".encode()
    if kind == "bad_line":
        line = draw(st.sampled_from([b"POST\r\n", b"GET /health HTTP/9.9\r\n", b"POST /v1/completions HTTP/1.1 x\r\n",
                                     b"G\x00T / HTTP/1.1\r\n"]))
    headers = b"Host: fuzz\r\nConnection: close\r\nContent-Type: application/json\r\n"
    if kind == "bad_header":
        headers += draw(st.sampled_from([b"X: \x00\r\n", b"no colon here\r\n", b": empty\r\n", b"X-Long: " + b"a" * 70000 + b"\r\n"]))
    if kind in ("chunked", "bad_chunked"):
        size = len(body) + (draw(st.integers(1, 9)) if kind == "bad_chunked" else 0)
        framed = f"{size:x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        return line + headers + b"Transfer-Encoding: chunked\r\n\r\n" + framed
    length = len(body) + {"short_length": -1, "long_length": 5}.get(kind, 0)
    return line + headers + f"Content-Length: {max(length, 0)}\r\n\r\n".encode() + body


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
