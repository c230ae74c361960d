"""Sans-I/O codec for the Hydra binary protocol (docs/hydra-protocol.md §2, §3).

Bytes in, events out; no sockets, no trio, no asyncio, like h11 / h2.

Server side, pull-style as h11 (and the ggml-RPC codec)::

    dec = RequestDecoder(max_payload=64 * 1024 * 1024)
    dec.receive_data(await stream.receive_some())
    while (event := dec.next_event()) is not NEED_DATA:
        ...  # RequestStarted, PayloadChunk..., RequestEnded

Client side: `encode_request` / `encode_request_header` to send,
`ResponseDecoder` to read replies.

Every integer on the wire is little-endian. All sizes in this module are in
bytes.
"""

from __future__ import annotations

import enum
import json
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias

import attrs

from .decode_frames import Bytes
from .need_data import NEED_DATA, NeedData

__all__ = [
    "DECODE_FLAG_FINAL",
    "DECODE_FLAG_PAD",
    "DECODE_FRAME_SIZE",
    "DECODE_PAD_FRAME",
    "DECODE_PAD_TOKEN",
    "DECODE_STOP_FLAGS",
    "FLAG_COMPRESSED",
    "KNOWN_FLAGS",
    "MAGIC",
    "MAX_META_LEN",
    "NEED_DATA",
    "REQUEST_HEADER_SIZE",
    "RESPONSE_HEADER_SIZE",
    "BadMagic",
    "DecodeFramer",
    "DecoderState",
    "FrameTooLarge",
    "NeedData",
    "Op",
    "PayloadChunk",
    "ProtocolError",
    "RequestDecoder",
    "RequestEnded",
    "RequestEvent",
    "RequestHeader",
    "RequestStarted",
    "ResponseDecoder",
    "ResponseEnded",
    "ResponseEvent",
    "ResponseHeader",
    "ResponseStarted",
    "Status",
    "decode_pad_frames",
    "decode_stop_reason",
    "encode_request",
    "encode_request_header",
    "encode_response",
    "encode_response_header",
    "is_store_op",
    "pack_decode_frame",
    "unpack_decode_frames",
]

# --------------------------------------------------------------------------
# Constants and enums (docs/hydra-protocol.md §2)
# --------------------------------------------------------------------------

MAGIC = 0x4859
"""Request magic; on the wire (little-endian) the bytes ``59 48`` ("YH")."""
REQUEST_HEADER_SIZE = 16
RESPONSE_HEADER_SIZE = 12
FLAG_COMPRESSED = 0x01
"""Request flag: compressed payload. Defined by the protocol, not implemented by
hydra-trio: the server answers BAD_REQUEST (docs/hydra-protocol.md §2)."""
KNOWN_FLAGS = FLAG_COMPRESSED
"""Mask of every flag bit the protocol defines (not: that hydra-trio implements)."""
MAX_META_LEN = (1 << 24) - 1
"""Largest response meta JSON, in bytes (24-bit field)."""

_MAGIC_BYTES = struct.pack("<H", MAGIC)
_REQ = struct.Struct("<HBBHQH")  # magic, op, flags, key_len, payload_len, trace_len
_RESP = struct.Struct("<IQ")  # status | meta_len << 8, payload_len
assert _REQ.size == REQUEST_HEADER_SIZE and _RESP.size == RESPONSE_HEADER_SIZE

_U8 = 0xFF
_U16 = 0xFFFF
_U64 = (1 << 64) - 1


class Op(enum.IntEnum):
    """Engine opcodes (docs/hydra-protocol.md §3)."""

    STATE_GET = 0x30
    STATE_PUT = 0x31
    STATE_META = 0x32
    CONFIGURE = 0x40
    INFO = 0x41
    PREFILL = 0x42
    DECODE = 0x43
    SET_EXPERT_MODE = 0x44
    SWAP_QUANT = 0x45
    PIPELINE_ATTACH = 0x46


def op_name(op: int) -> str:
    """The opcode's name (``Op.NAME``), or ``0x..`` for a byte that is no opcode (log lines, metrics)."""
    try:
        return Op(op).name
    except ValueError:
        return f"0x{op:02x}"


def is_store_op(op: int) -> bool:
    """True for Store-service opcodes (``0x01``-``0x15`` and ``0x33``).

    An engine answers them NOT_IMPLEMENTED (docs/hydra-protocol.md §2).
    """
    return 0x01 <= op <= 0x15 or op == 0x33


class Status(enum.IntEnum):
    """Response status codes (docs/hydra-protocol.md §2)."""

    OK = 0
    NOT_FOUND = 1
    ERROR = 2
    PARTIAL = 3
    BUSY = 4
    BAD_REQUEST = 5
    NOT_IMPLEMENTED = 6


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class ProtocolError(Exception):
    """The peer broke the framing rules; the byte stream cannot be trusted.

    Attributes:
        status: the status to reply with (when `reply` is true).
        close: whether the connection must be closed after handling this.
            Every error a decoder raises is fatal to the stream (the decoder
            goes to `DecoderState.CLOSED`), so decoders always raise with
            ``close=True``.
        reply: whether a reply frame should be sent before closing.
        header: the request/response header being decoded, when it was
            complete, else None (lets the server reply with the op's context).
        events: events the failing ``feed`` call completed before the error
            (earlier pipelined frames); handle them first. Empty otherwise
            (``next_event`` returned them one by one before it raised).
    """

    default_status: ClassVar[Status] = Status.BAD_REQUEST
    default_reply: ClassVar[bool] = True

    def __init__(
        self,
        message: str,
        *,
        status: Status | None = None,
        close: bool = True,
        reply: bool | None = None,
        header: RequestHeader | ResponseHeader | None = None,
    ) -> None:
        super().__init__(message)
        self.status: Status = self.default_status if status is None else status
        self.close: bool = close
        self.reply: bool = self.default_reply if reply is None else reply
        self.header: RequestHeader | ResponseHeader | None = header
        self.events: list[Any] = []


class BadMagic(ProtocolError):
    """The first two bytes of a request header are not ``59 48``.

    Close the connection without a reply (docs/hydra-protocol.md §2). Raised as
    soon as the first wrong byte arrives.
    """

    default_reply = False


class FrameTooLarge(ProtocolError):
    """A length field is over the configured limit.

    Reply BAD_REQUEST, then close instead of draining the payload
    (docs/hydra-protocol.md §2). ``header`` is the complete header; ``limit`` the
    limit (bytes) that was exceeded.
    """

    def __init__(
        self,
        message: str,
        *,
        header: RequestHeader | ResponseHeader,
        limit: int,
    ) -> None:
        super().__init__(message, header=header)
        self.limit: int = limit


# --------------------------------------------------------------------------
# Headers
# --------------------------------------------------------------------------


def _range(lo: int, hi: int) -> Callable[[Any, attrs.Attribute[int], int], None]:
    def check(_inst: Any, attr: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{attr.name} must be an int in [{lo}, {hi}], got {value!r}")

    return check


@attrs.frozen
class RequestHeader:
    """The 16-byte request header (docs/hydra-protocol.md §2): magic (implicit),
    op, flags, key_len, payload_len, trace_len. Lengths in bytes.

    Raises ValueError on construction when a field is out of its wire range.
    """

    op: int = attrs.field(validator=_range(0, _U8))
    flags: int = attrs.field(validator=_range(0, _U8))
    key_len: int = attrs.field(validator=_range(0, _U16))
    payload_len: int = attrs.field(validator=_range(0, _U64))
    trace_len: int = attrs.field(validator=_range(0, _U16))

    def pack(self) -> bytes:
        """The 16 header bytes."""
        return _REQ.pack(MAGIC, self.op, self.flags, self.key_len, self.payload_len, self.trace_len)

    @classmethod
    def unpack(cls, b: bytes | bytearray | memoryview) -> RequestHeader:
        """Parse exactly 16 bytes. Raises ValueError on another length,
        BadMagic on a wrong magic."""
        if len(b) != REQUEST_HEADER_SIZE:
            raise ValueError(f"request header is {REQUEST_HEADER_SIZE} bytes, got {len(b)}")
        magic, op, flags, key_len, payload_len, trace_len = _REQ.unpack(b)
        if magic != MAGIC:
            raise BadMagic(f"bad magic 0x{magic:04x}, expected 0x{MAGIC:04x}")
        return cls(op, flags, key_len, payload_len, trace_len)

    @property
    def body_len(self) -> int:
        """key_len + trace_len: bytes between the header and the payload."""
        return self.key_len + self.trace_len


@attrs.frozen
class ResponseHeader:
    """The 12-byte response header (docs/hydra-protocol.md §2): status (u8),
    meta_len (u24), payload_len (u64). Lengths in bytes. ``status`` is kept
    as a plain int so that codes newer than `Status` survive decoding.

    Raises ValueError on construction when a field is out of its wire range.
    """

    status: int = attrs.field(validator=_range(0, _U8))
    meta_len: int = attrs.field(validator=_range(0, MAX_META_LEN))
    payload_len: int = attrs.field(validator=_range(0, _U64))

    def pack(self) -> bytes:
        """The 12 header bytes."""
        return _RESP.pack(self.status | (self.meta_len << 8), self.payload_len)

    @classmethod
    def unpack(cls, b: bytes | bytearray | memoryview) -> ResponseHeader:
        """Parse exactly 12 bytes. Raises ValueError on another length."""
        if len(b) != RESPONSE_HEADER_SIZE:
            raise ValueError(f"response header is {RESPONSE_HEADER_SIZE} bytes, got {len(b)}")
        word, payload_len = _RESP.unpack(b)
        return cls(word & 0xFF, word >> 8, payload_len)


# --------------------------------------------------------------------------
# Encoders
# --------------------------------------------------------------------------


def _utf8(name: str, s: str, limit: int) -> bytes:
    b = s.encode("utf-8")
    if len(b) > limit:
        raise ValueError(f"{name} is {len(b)} bytes, at most {limit} fit")
    return b


def encode_request_header(op: int, key: str = "", trace_id: str = "", payload_len: int = 0, flags: int = 0) -> bytes:
    """Header + key + trace_id, for a request whose ``payload_len`` payload
    bytes the caller streams after it. Raises ValueError when a field does
    not fit its wire size (key/trace_id over 65535 UTF-8 bytes, ...)."""
    kb = _utf8("key", key, _U16)
    tb = _utf8("trace_id", trace_id, _U16)
    header = RequestHeader(op, flags, len(kb), payload_len, len(tb))
    return header.pack() + kb + tb


def encode_request(
    op: int,
    key: str = "",
    payload: bytes | bytearray | memoryview = b"",
    trace_id: str = "",
    flags: int = 0,
) -> bytes:
    """A complete request frame (docs/hydra-protocol.md §2). Raises ValueError as
    `encode_request_header` does."""
    return encode_request_header(op, key, trace_id, len(payload), flags) + bytes(payload)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _meta_bytes(meta: Mapping[str, Any]) -> bytes:
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        b = text.encode("utf-8")
    except UnicodeEncodeError:
        # a lone surrogate (requests refuse them: strict.check_unicode) must not make the reply
        # unsendable: it goes out as the text "\\udXXX" (a surrogate occurs only inside JSON strings)
        b = _LONE_SURROGATE.sub(lambda m: f"\\\\u{ord(m.group()):04x}", text).encode("utf-8")
    if len(b) > MAX_META_LEN:
        raise ValueError(f"meta JSON is {len(b)} bytes, at most {MAX_META_LEN} fit")
    return b


def encode_response_header(status: int, meta: Mapping[str, Any], payload_len: int) -> bytes:
    """Header + meta JSON (compact, UTF-8), for a reply whose ``payload_len``
    payload bytes the caller streams after it (STATE_GET, PREFILL, DECODE).

    Raises ValueError when the meta JSON is over 2**24 - 1 bytes, holds NaN /
    infinity, or a field is out of range; TypeError when meta is not a
    mapping or holds a value JSON cannot encode.
    """
    mb = _meta_bytes(meta)
    return ResponseHeader(int(status), len(mb), payload_len).pack() + mb


def encode_response(status: int, meta: Mapping[str, Any], payload: bytes | bytearray | memoryview = b"") -> bytes:
    """A complete reply frame; raises as `encode_response_header` does."""
    return encode_response_header(status, meta, len(payload)) + bytes(payload)


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


@attrs.frozen
class RequestStarted:
    """A request's header, key and trace_id have arrived; its payload follows
    as `PayloadChunk` events, then `RequestEnded`.

    ``key_error`` is None normally. When the key or the trace_id is not valid
    UTF-8 it says which (e.g. ``"key is not valid UTF-8"``) and the string is
    decoded with U+FFFD replacements: the framing is intact, so the server
    consumes the payload and replies BAD_REQUEST on a usable connection.
    """

    header: RequestHeader
    key: str
    trace_id: str
    key_error: str | None = None


@attrs.frozen
class PayloadChunk:
    """Some payload bytes (never empty). Chunk boundaries carry no meaning."""

    data: bytes


@attrs.frozen
class RequestEnded:
    """All payload_len payload bytes of the current request were delivered."""


@attrs.frozen
class ResponseStarted:
    """A reply's header and meta have arrived. ``meta`` is the parsed JSON
    object (``{}`` when meta_len is 0)."""

    header: ResponseHeader
    meta: dict[str, Any]


@attrs.frozen
class ResponseEnded:
    """All payload_len payload bytes of the current reply were delivered."""


RequestEvent: TypeAlias = RequestStarted | PayloadChunk | RequestEnded
ResponseEvent: TypeAlias = ResponseStarted | PayloadChunk | ResponseEnded


class DecoderState(enum.Enum):
    """Where a decoder is in the byte stream.

    IDLE: between frames, nothing buffered (the server's idle timeout
    applies). HEADER: part of a header arrived. BODY: header done, waiting
    for key+trace (requests) or meta (responses). PAYLOAD: streaming
    payload bytes. CLOSED: a ProtocolError was raised; the decoder is dead.
    """

    IDLE = "idle"
    HEADER = "header"
    BODY = "body"
    PAYLOAD = "payload"
    CLOSED = "closed"


class _Decoder:
    """Shared state machine: fixed header, bounded body, streamed payload; pull-style, as h11.

    ``receive_data(bytes)`` hands the decoder the next bytes of the stream; ``next_event()`` returns the
    next event they complete, or :data:`NEED_DATA` once they are all read out.  Only the header and body
    (key+trace or meta) are ever buffered; payload bytes go straight from the received data into
    `PayloadChunk` events, so `buffered` stays below header size + body limit whatever the payload size.
    """

    _header_size: ClassVar[int]

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = DecoderState.IDLE
        self._body_len = 0
        self._remaining = 0
        self._data: Bytes = b""  # the bytes received last, read from ``_pos`` on
        self._view = memoryview(b"")
        self._pos = 0

    @property
    def state(self) -> DecoderState:
        """The current `DecoderState`."""
        return self._state

    @property
    def unread(self) -> int:
        """Bytes received that ``next_event`` has not read yet."""
        return len(self._view) - self._pos

    @property
    def idle(self) -> bool:
        """True between frames with nothing buffered or unread (idle-timeout territory)."""
        return self._state is DecoderState.IDLE and not self.unread

    @property
    def in_frame(self) -> bool:
        """True mid-frame: some bytes of a frame arrived, not all of them (or its end event is not read yet)."""
        return self._state in (DecoderState.HEADER, DecoderState.BODY, DecoderState.PAYLOAD)

    @property
    def needs_data(self) -> bool:
        """True unless the decoder is CLOSED."""
        return self._state is not DecoderState.CLOSED

    @property
    def payload_remaining(self) -> int:
        """Payload bytes still expected for the current frame (0 outside PAYLOAD)."""
        return self._remaining if self._state is DecoderState.PAYLOAD else 0

    @property
    def buffered(self) -> int:
        """Bytes held internally (partial header / body); never payload."""
        return len(self._buf)

    def _fail(self, exc: ProtocolError) -> ProtocolError:
        self._state = DecoderState.CLOSED
        self._buf = bytearray()
        self._data, self._view, self._pos = b"", memoryview(b""), 0
        return exc

    # Hooks for subclasses ------------------------------------------------
    def _check_prefix(self) -> None:
        """Called while a header is partial; may raise early."""

    def _on_header(self, raw: bytearray) -> int:
        """Parse a full header, check limits; return the body length."""
        raise NotImplementedError

    def _on_body(self, raw: bytes) -> tuple[Any, int]:
        """Parse header+body; return (started event, payload_len)."""
        raise NotImplementedError

    _ended: ClassVar[Any]

    def receive_data(self, data: Bytes) -> None:
        """The next bytes of the stream (any chunking; empty bytes are nothing); read the events they make
        with :meth:`next_event`.  Bytes received before and not read yet are kept in front of them.

        Raises ProtocolError when the decoder is CLOSED (after a protocol error).
        """
        if self._state is DecoderState.CLOSED:
            raise ProtocolError("decoder is closed after a protocol error")
        if not len(data):
            return
        if self.unread:
            data = bytes(self._view[self._pos :]) + bytes(data)
        self._data = data
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def next_event(self) -> Any:
        """The next event of the bytes received so far, or :data:`NEED_DATA` when they make no more.

        Raises ProtocolError (and goes CLOSED) at the first byte that breaks the framing; the events of
        the frames before it were handed out by the calls before.
        """
        if self._state is DecoderState.CLOSED:
            raise ProtocolError("decoder is closed after a protocol error")
        try:
            return self._next()
        except ProtocolError as exc:
            raise self._fail(exc) from None

    def _next(self) -> Any:
        mv = self._view
        n = len(mv)
        hs = self._header_size
        while True:
            st = self._state
            pos = self._pos
            if st is DecoderState.IDLE or st is DecoderState.HEADER:
                take = min(hs - len(self._buf), n - pos)
                self._buf += mv[pos : pos + take]
                self._pos = pos + take
                if self._buf:
                    self._check_prefix()
                if len(self._buf) < hs:
                    self._state = DecoderState.HEADER if self._buf else DecoderState.IDLE
                    return NEED_DATA
                self._body_len = self._on_header(self._buf)
                self._buf.clear()
                self._state = DecoderState.BODY
                continue
            if st is DecoderState.BODY:
                take = min(self._body_len - len(self._buf), n - pos)
                self._buf += mv[pos : pos + take]
                self._pos = pos + take
                if len(self._buf) < self._body_len:
                    return NEED_DATA
                started, self._remaining = self._on_body(bytes(self._buf))
                self._buf.clear()
                self._state = DecoderState.PAYLOAD
                return started
            # PAYLOAD
            if self._remaining:
                take = min(self._remaining, n - pos)
                if not take:
                    return NEED_DATA
                data = self._data
                chunk = data if pos == 0 and take == n and isinstance(data, bytes) else bytes(mv[pos : pos + take])
                self._pos = pos + take
                self._remaining -= take
                return PayloadChunk(chunk)
            self._state = DecoderState.IDLE
            return self._ended

    def skip_payload(self, n: int) -> None:
        """The caller took the next ``n`` payload bytes off the stream itself (``recv_into`` a buffer of
        its own: no `PayloadChunk` is made for them); once the payload is whole, :meth:`next_event`
        returns the frame's end event.

        Raises ValueError outside a payload, for more bytes than the payload has left, or while bytes
        received are still unread (they come first).
        """
        if self._state is not DecoderState.PAYLOAD or not 0 <= n <= self._remaining or self.unread:
            raise ValueError(
                f"skip_payload({n}): {self._remaining} payload bytes left in state {self._state.value}, "
                f"{self.unread} received bytes unread"
            )
        self._remaining -= n

    def feed(self, data: Bytes) -> list[Any]:
        """:meth:`receive_data` then every event :meth:`next_event` makes (for tests and tools).  A
        ProtocolError carries the events of the frames before it on ``exc.events``."""
        self.receive_data(data)
        events: list[Any] = []
        try:
            while (ev := self.next_event()) is not NEED_DATA:
                events.append(ev)
        except ProtocolError as exc:
            exc.events = events
            raise
        return events


class RequestDecoder(_Decoder):
    """Incremental SERVER-side request decoder (docs/hydra-protocol.md §2).

    ``receive_data(data)`` takes any chunking of the byte stream (one byte at a time,
    empty bytes, several pipelined requests in one chunk); ``next_event()`` returns the
    events it completes, in order, then `NEED_DATA`:
    ``RequestStarted`` (once header, key and trace_id are in),
    ``PayloadChunk`` * n (whatever payload bytes each call brings; the
    payload is never buffered, so memory stays bounded by
    16 + max_key + max_trace bytes), ``RequestEnded``.

    Limits (bytes), checked as soon as the 16-byte header is complete:
    ``payload_len`` over ``max_payload_for(op)`` (when given) or else over
    ``max_payload``, ``key_len`` over ``max_key`` or ``trace_len`` over
    ``max_trace`` raise `FrameTooLarge` carrying ``.header`` (the
    RequestStarted for that request is NOT emitted; reply BAD_REQUEST with
    the header's op, then close).

    Errors: `BadMagic` as soon as the first or second byte of a header is
    wrong (close, no reply). After any ProtocolError the decoder is CLOSED
    and further calls raise ProtocolError. The events of the requests before
    the bad bytes were returned by the calls before the failing one.

    Not decoder errors (the framing is intact, the server consumes the
    payload and replies BAD_REQUEST / NOT_IMPLEMENTED on a usable
    connection): unknown flags (kept in ``header.flags``), unknown opcodes,
    a key or trace_id that is not valid UTF-8 (reported in
    ``RequestStarted.key_error``).
    """

    _header_size = REQUEST_HEADER_SIZE
    _ended = RequestEnded()

    def __init__(
        self,
        max_payload: int,
        max_key: int = 4096,
        max_trace: int = 4096,
        max_payload_for: Callable[[int], int] | None = None,
    ) -> None:
        super().__init__()
        self.max_payload = max_payload
        self.max_key = max_key
        self.max_trace = max_trace
        self.max_payload_for = max_payload_for
        self._header: RequestHeader | None = None

    @property
    def header(self) -> RequestHeader | None:
        """Header of the request in progress (BODY/PAYLOAD states), else None."""
        if self._state in (DecoderState.BODY, DecoderState.PAYLOAD):
            return self._header
        return None

    def next_event(self) -> RequestEvent | NeedData:
        """The next event of the bytes received, or `NEED_DATA`. Raises `BadMagic`, `FrameTooLarge` or
        `ProtocolError` (all with close=True)."""
        return super().next_event()

    def feed(self, data: Bytes) -> list[RequestEvent]:
        """`receive_data` then every event `next_event` makes; raises as it does."""
        return super().feed(data)

    def _check_prefix(self) -> None:
        buf = self._buf
        if buf[0] != _MAGIC_BYTES[0] or (len(buf) > 1 and buf[1] != _MAGIC_BYTES[1]):
            raise BadMagic(f"bad magic bytes {bytes(buf[:2]).hex()}, expected {_MAGIC_BYTES.hex()}")

    def _on_header(self, raw: bytearray) -> int:
        h = RequestHeader.unpack(raw)
        limit = self.max_payload if self.max_payload_for is None else self.max_payload_for(h.op)
        if h.payload_len > limit:
            raise FrameTooLarge(
                f"payload_len {h.payload_len} over the limit {limit} for op 0x{h.op:02x}",
                header=h,
                limit=limit,
            )
        if h.key_len > self.max_key:
            raise FrameTooLarge(f"key_len {h.key_len} over the limit {self.max_key}", header=h, limit=self.max_key)
        if h.trace_len > self.max_trace:
            raise FrameTooLarge(
                f"trace_len {h.trace_len} over the limit {self.max_trace}",
                header=h,
                limit=self.max_trace,
            )
        self._header = h
        return h.body_len

    def _on_body(self, raw: bytes) -> tuple[RequestStarted, int]:
        h = self._header
        assert h is not None
        errors = []
        try:
            key = raw[: h.key_len].decode("utf-8")
        except UnicodeDecodeError:
            key = raw[: h.key_len].decode("utf-8", "replace")
            errors.append("key is not valid UTF-8")
        try:
            trace = raw[h.key_len :].decode("utf-8")
        except UnicodeDecodeError:
            trace = raw[h.key_len :].decode("utf-8", "replace")
            errors.append("trace_id is not valid UTF-8")
        return RequestStarted(h, key, trace, "; ".join(errors) or None), h.payload_len


class ResponseDecoder(_Decoder):
    """Incremental CLIENT-side reply decoder (docs/hydra-protocol.md §2).

    Same contract as `RequestDecoder`: any chunking; events
    ``ResponseStarted`` (header + parsed meta), ``PayloadChunk`` * n,
    ``ResponseEnded``; payload never buffered.

    Raises (and goes CLOSED) `FrameTooLarge` when meta_len is over
    ``max_meta`` or payload_len over ``max_payload`` (None: no limit;
    bytes), `ProtocolError` when the meta is not valid UTF-8, not valid
    JSON, or not a JSON object. An empty meta (meta_len 0) is read as ``{}``.
    Status codes outside `Status` are passed through, not rejected.
    """

    _header_size = RESPONSE_HEADER_SIZE
    _ended = ResponseEnded()

    def __init__(self, max_payload: int | None = None, max_meta: int = MAX_META_LEN) -> None:
        super().__init__()
        self.max_payload = max_payload
        self.max_meta = max_meta
        self._header: ResponseHeader | None = None

    def next_event(self) -> ResponseEvent | NeedData:
        """The next event of the bytes received, or `NEED_DATA`. Raises `FrameTooLarge` or
        `ProtocolError` (close=True)."""
        return super().next_event()

    def feed(self, data: Bytes) -> list[ResponseEvent]:
        """`receive_data` then every event `next_event` makes; raises as it does."""
        return super().feed(data)

    def _on_header(self, raw: bytearray) -> int:
        h = ResponseHeader.unpack(raw)
        if h.meta_len > self.max_meta:
            raise FrameTooLarge(
                f"meta_len {h.meta_len} over the limit {self.max_meta}",
                header=h,
                limit=self.max_meta,
            )
        if self.max_payload is not None and h.payload_len > self.max_payload:
            raise FrameTooLarge(
                f"payload_len {h.payload_len} over the limit {self.max_payload}",
                header=h,
                limit=self.max_payload,
            )
        self._header = h
        return h.meta_len

    def _on_body(self, raw: bytes) -> tuple[ResponseStarted, int]:
        h = self._header
        assert h is not None
        if not raw:
            return ResponseStarted(h, {}), h.payload_len
        try:
            meta = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"meta is not valid UTF-8: {exc}", header=h) from None
        except ValueError as exc:
            raise ProtocolError(f"meta is not valid JSON: {exc}", header=h) from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"meta must be a JSON object, got {type(meta).__name__}", header=h)
        return ResponseStarted(h, meta), h.payload_len


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# DECODE frames live in their own module; re-exported here (their historical home)
from .decode_frames import (  # noqa: E402
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_FRAME_SIZE,
    DECODE_PAD_FRAME,
    DECODE_PAD_TOKEN,
    DECODE_STOP_FLAGS,
    DecodeFramer,
    decode_pad_frames,
    decode_stop_reason,
    pack_decode_frame,
    unpack_decode_frames,
)
