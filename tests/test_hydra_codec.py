"""Sans-I/O tests of the Hydra codec and payload messages (no sockets)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.strategies import (
    MAX_KEY,
    MAX_PAYLOAD,
    MAX_TRACE,
    Mutant,
    Req,
    chunk_cuts,
    nearly_valid_requests,
    random_first_bytes,
    split_at,
    valid_requests,
)
from hydra_trio.hydra.messages import (
    MessageError,
    PipelineAttachRequest,
    SetExpertModeRequest,
    clamp_state_chunk_size,
    classify_configure_keys,
    parse_configure,
    parse_decode,
    parse_peer,
    parse_prefill,
    parse_set_expert_mode,
    structure_json,
)
from hydra_trio.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from hydra_trio.protocol.hydra import (
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_FRAME_SIZE,
    DECODE_PAD_TOKEN,
    MAGIC,
    MAX_META_LEN,
    NEED_DATA,
    REQUEST_HEADER_SIZE,
    RESPONSE_HEADER_SIZE,
    BadMagic,
    DecoderState,
    FrameTooLarge,
    Op,
    PayloadChunk,
    ProtocolError,
    RequestDecoder,
    RequestEnded,
    RequestHeader,
    RequestStarted,
    ResponseDecoder,
    ResponseEnded,
    ResponseHeader,
    ResponseStarted,
    Status,
    decode_pad_frames,
    encode_request,
    encode_request_header,
    encode_response,
    encode_response_header,
    is_store_op,
    pack_decode_frame,
    unpack_decode_frames,
)


def new_decoder() -> RequestDecoder:
    return RequestDecoder(MAX_PAYLOAD, max_key=MAX_KEY, max_trace=MAX_TRACE)


def logical(events: list[Any]) -> tuple[list[Req], Req | None]:
    """Fold events into complete requests plus the one in progress."""
    done: list[Req] = []
    cur: Req | None = None
    parts: list[bytes] = []
    for ev in events:
        if isinstance(ev, RequestStarted):
            assert cur is None
            h = ev.header
            cur = Req(h.op, h.flags, ev.key, ev.trace_id, b"")
            parts = []
        elif isinstance(ev, PayloadChunk):
            assert cur is not None and ev.data
            parts.append(ev.data)
        else:
            assert isinstance(ev, RequestEnded) and cur is not None
            done.append(Req(cur.op, cur.flags, cur.key, cur.trace_id, b"".join(parts)))
            cur = None
    if cur is not None:
        cur = Req(cur.op, cur.flags, cur.key, cur.trace_id, b"".join(parts))
    return done, cur


def feed_all(dec: RequestDecoder, chunks: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for c in chunks:
        out.extend(dec.feed(c))
    return out


# --------------------------------------------------------------------------
# Headers and frames
# --------------------------------------------------------------------------


@given(
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 0xFFFF),
    st.integers(0, 2**64 - 1),
    st.integers(0, 0xFFFF),
)
def test_request_header_round_trip(op: int, flags: int, k: int, p: int, t: int) -> None:
    h = RequestHeader(op, flags, k, p, t)
    b = h.pack()
    assert len(b) == REQUEST_HEADER_SIZE and b[:2] == b"YH"
    assert struct.unpack("<HBBHQH", b) == (MAGIC, op, flags, k, p, t)
    assert RequestHeader.unpack(b) == h


@given(st.integers(0, 255), st.integers(0, MAX_META_LEN), st.integers(0, 2**64 - 1))
def test_response_header_round_trip(status: int, meta_len: int, p: int) -> None:
    h = ResponseHeader(status, meta_len, p)
    b = h.pack()
    assert len(b) == RESPONSE_HEADER_SIZE
    assert b[0] == status and int.from_bytes(b[1:4], "little") == meta_len
    assert int.from_bytes(b[4:], "little") == p
    assert ResponseHeader.unpack(b) == h


def test_header_validation() -> None:
    with pytest.raises(ValueError):
        RequestHeader(256, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        RequestHeader(0, 0, 0, -1, 0)
    with pytest.raises(ValueError):
        ResponseHeader(0, MAX_META_LEN + 1, 0)
    with pytest.raises(ValueError):
        RequestHeader.unpack(b"YH")
    with pytest.raises(BadMagic):
        RequestHeader.unpack(b"\0" * 16)


def test_encode_request_layout() -> None:
    b = encode_request(Op.DECODE, "3", b"{}", "tr-1", flags=0)
    assert b[:16] == RequestHeader(0x43, 0, 1, 2, 4).pack()
    assert b[16:] == b"3tr-1{}"
    assert encode_request_header(Op.STATE_PUT, "0", "", 10) == RequestHeader(0x31, 0, 1, 10, 0).pack() + b"0"
    with pytest.raises(ValueError):
        encode_request(Op.INFO, "k" * 70000)


def test_encode_response_layout_and_limits() -> None:
    b = encode_response(Status.BUSY, {"error": "busy", "busy_slots": [0]}, b"xy")
    meta = b'{"error":"busy","busy_slots":[0]}'
    assert b == ResponseHeader(4, len(meta), 2).pack() + meta + b"xy"
    assert encode_response_header(Status.OK, {"a": "é"}, 99) == (
        ResponseHeader(0, len('{"a":"é"}'.encode()), 99).pack() + '{"a":"é"}'.encode()
    )
    with pytest.raises(ValueError):
        encode_response(Status.OK, {"x": "a" * MAX_META_LEN})
    with pytest.raises(ValueError):
        encode_response(Status.OK, {"x": math.nan})
    with pytest.raises(TypeError):
        encode_response(Status.OK, [1, 2])  # type: ignore[arg-type]


def test_enums_and_store_ops() -> None:
    assert int(Op.PIPELINE_ATTACH) == 0x46 and int(Status.NOT_IMPLEMENTED) == 6
    assert all(is_store_op(o) for o in [*range(0x01, 0x16), 0x33])
    assert not any(is_store_op(o) for o in [0x00, 0x16, 0x30, 0x32, 0x34, *map(int, Op)])


# --------------------------------------------------------------------------
# RequestDecoder
# --------------------------------------------------------------------------


def test_full_request_round_trip() -> None:
    dec = new_decoder()
    assert dec.state is DecoderState.IDLE and dec.idle and dec.needs_data
    ev = dec.feed(encode_request(Op.PREFILL, "1", b"payload", "t"))
    assert ev == [
        RequestStarted(RequestHeader(0x42, 0, 1, 7, 1), "1", "t"),
        PayloadChunk(b"payload"),
        RequestEnded(),
    ]
    assert dec.idle and dec.buffered == 0 and dec.header is None


def test_pipelined_and_empty_payloads_in_one_feed() -> None:
    dec = new_decoder()
    data = encode_request(Op.INFO) + encode_request(Op.STATE_META, "0") + encode_request(Op.INFO)
    done, cur = logical(dec.feed(data))
    assert [r.op for r in done] == [0x41, 0x32, 0x41] and cur is None
    assert dec.feed(b"") == [] and dec.idle


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(valid_requests(), min_size=1, max_size=5), st.data())
def test_any_chunking_same_requests(reqs: list[Req], data: st.DataObject) -> None:
    stream = b"".join(r.encode() for r in reqs)
    whole, _ = logical(new_decoder().feed(stream))
    cuts = data.draw(chunk_cuts(len(stream)))
    chunked, cur = logical(feed_all(new_decoder(), split_at(stream, cuts)))
    assert whole == chunked == reqs and cur is None


@settings(deadline=None, max_examples=30)
@given(st.lists(valid_requests(max_payload=64), min_size=1, max_size=3))
def test_one_byte_at_a_time_with_empty_feeds(reqs: list[Req]) -> None:
    stream = b"".join(r.encode() for r in reqs)
    dec = new_decoder()
    events: list[Any] = []
    for i in range(len(stream)):
        events += dec.feed(b"")
        events += dec.feed(stream[i : i + 1])
        assert dec.buffered <= REQUEST_HEADER_SIZE + MAX_KEY + MAX_TRACE
    assert logical(events) == (reqs, None)
    assert dec.idle


@given(st.lists(valid_requests(), min_size=1, max_size=4), st.data())
def test_truncated_stream_stays_mid_request(reqs: list[Req], data: st.DataObject) -> None:
    frames = [r.encode() for r in reqs]
    stream = b"".join(frames)
    cut = data.draw(st.integers(0, len(stream) - 1))
    dec = new_decoder()
    first = dec.feed(stream[:cut])
    done, cur = logical(first)
    ends = [sum(len(f) for f in frames[: i + 1]) for i in range(len(frames))]
    complete = sum(1 for e in ends if e <= cut)
    assert done == reqs[:complete]
    at_boundary = cut == 0 or cut in ends
    assert dec.idle == at_boundary and dec.in_frame == (not at_boundary)
    if cur is not None:  # the partial request's payload is a prefix of the real one
        nxt = reqs[complete]
        assert (cur.op, cur.key, cur.trace_id) == (nxt.op, nxt.key, nxt.trace_id)
        assert nxt.payload.startswith(cur.payload)
        assert dec.payload_remaining == len(nxt.payload) - len(cur.payload)
        assert dec.header is not None and dec.header.op == nxt.op
    # the rest of the stream completes it
    assert logical(first + dec.feed(stream[cut:])) == (reqs, None)


def test_oversize_payload_raises_frame_too_large_with_header() -> None:
    dec = new_decoder()
    data = RequestHeader(Op.STATE_PUT, 0, 1, MAX_PAYLOAD + 1, 0).pack()
    assert dec.feed(data[:15]) == []
    with pytest.raises(FrameTooLarge) as ei:
        dec.feed(data[15:] + b"0")
    e = ei.value
    assert e.close and e.reply and e.status == Status.BAD_REQUEST and e.limit == MAX_PAYLOAD
    assert isinstance(e.header, RequestHeader) and e.header.op == Op.STATE_PUT
    assert dec.state is DecoderState.CLOSED and not dec.needs_data
    with pytest.raises(ProtocolError):
        dec.feed(b"")


def test_per_op_payload_limit() -> None:
    limits = {int(Op.STATE_PUT): 10_000}
    dec = RequestDecoder(100, max_payload_for=lambda op: limits.get(op, 100))
    done, _ = logical(dec.feed(encode_request(Op.STATE_PUT, "0", b"x" * 5000)))
    assert len(done[0].payload) == 5000
    with pytest.raises(FrameTooLarge):
        dec.feed(encode_request(Op.PREFILL, "0", b"x" * 101))


def test_key_and_trace_limits() -> None:
    with pytest.raises(FrameTooLarge):
        new_decoder().feed(encode_request(Op.INFO, "k" * (MAX_KEY + 1)))
    with pytest.raises(FrameTooLarge):
        new_decoder().feed(encode_request(Op.INFO, trace_id="t" * (MAX_TRACE + 1)))


@pytest.mark.parametrize("data", [b"X", b"\x0e", b"GET /", b"Y\x00", b"HY" + b"\0" * 14])
def test_bad_magic(data: bytes) -> None:
    dec = new_decoder()
    with pytest.raises(BadMagic) as ei:
        dec.feed(data)
    assert ei.value.close and not ei.value.reply
    assert dec.state is DecoderState.CLOSED


def test_error_keeps_events_completed_before_it() -> None:
    dec = new_decoder()
    with pytest.raises(BadMagic) as ei:
        dec.feed(encode_request(Op.INFO, "a") + b"ZZ")
    assert logical(ei.value.events) == ([Req(0x41, 0, "a", "", b"")], None)


def test_unknown_flags_and_bad_utf8_key_keep_stream_in_sync() -> None:
    dec = new_decoder()
    bad_key = RequestHeader(Op.STATE_META, 0, 2, 3, 1).pack() + b"\xff0" + b"\xc3" + b"abc"
    ev = dec.feed(encode_request(Op.INFO, flags=0x80) + bad_key + encode_request(Op.INFO))
    started = [e for e in ev if isinstance(e, RequestStarted)]
    assert [s.header.flags for s in started] == [0x80, 0, 0]
    assert [s.key_error for s in started] == [
        None,
        "key is not valid UTF-8; trace_id is not valid UTF-8",
        None,
    ]
    assert started[1].key == "\ufffd0"
    assert logical(ev)[0][1].payload == b"abc" and dec.idle


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(random_first_bytes(), st.data())
def test_random_bytes_raise_only_protocol_errors(blob: bytes, data: st.DataObject) -> None:
    dec = new_decoder()
    try:
        for chunk in split_at(blob, data.draw(chunk_cuts(len(blob)))):
            dec.feed(chunk)
    except ProtocolError as exc:
        assert exc.close and dec.state is DecoderState.CLOSED


@given(nearly_valid_requests(), st.data())
def test_nearly_valid_requests(m: Mutant, data: st.DataObject) -> None:
    dec = new_decoder()
    chunks = split_at(m.data, data.draw(chunk_cuts(len(m.data))))
    if m.kind == "bad_magic":
        with pytest.raises(BadMagic):
            feed_all(dec, chunks)
    elif m.kind in ("payload_too_large", "key_too_large", "trace_too_large"):
        with pytest.raises(FrameTooLarge) as ei:
            feed_all(dec, chunks)
        assert isinstance(ei.value.header, RequestHeader) and ei.value.header.op == m.req.op
    elif m.kind == "truncated":
        done, _ = logical(feed_all(dec, chunks))
        assert done == [] and dec.in_frame
    elif m.kind == "unknown_flags":
        assert logical(feed_all(dec, chunks)) == ([m.req], None)
    else:
        ev = feed_all(dec, chunks)
        (started,) = [e for e in ev if isinstance(e, RequestStarted)]
        assert started.key_error is not None and "key" in started.key_error
        done, cur = logical(ev)
        assert done[0].payload == m.req.payload and cur is None and dec.idle


def test_memory_bound_50mb_payload() -> None:
    size, chunk = 50 * 1024 * 1024, b"\xab" * 65536
    dec = RequestDecoder(max_payload=size)
    events = dec.feed(encode_request_header(Op.STATE_PUT, "0", "trace", size))
    assert [type(e) for e in events] == [RequestStarted]
    total = 0
    for _ in range(size // len(chunk)):
        for ev in dec.feed(chunk):
            if isinstance(ev, PayloadChunk):
                total += len(ev.data)
                assert ev.data is chunk  # whole-feed payload is passed through, not copied
            else:
                assert isinstance(ev, RequestEnded)
        assert dec.buffered < 65536 + REQUEST_HEADER_SIZE
    assert total == size and dec.idle


# --------------------------------------------------------------------------
# ResponseDecoder
# --------------------------------------------------------------------------

_json_meta = st.dictionaries(
    st.text(max_size=8),
    st.one_of(st.integers(-(2**53), 2**53), st.text(max_size=8), st.booleans(), st.none()),
    max_size=4,
)


@settings(deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(list(Status)), _json_meta, st.binary(max_size=512)),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_response_any_chunking(frames: list[tuple[Status, dict[str, Any], bytes]], data: st.DataObject) -> None:
    stream = b"".join(encode_response(s, m, p) for s, m, p in frames)
    dec = ResponseDecoder()
    out: list[tuple[int, dict[str, Any], bytes]] = []
    parts: list[bytes] = []
    started: ResponseStarted | None = None
    for chunk in split_at(stream, data.draw(chunk_cuts(len(stream)))):
        for ev in dec.feed(chunk):
            if isinstance(ev, ResponseStarted):
                started, parts = ev, []
            elif isinstance(ev, PayloadChunk):
                parts.append(ev.data)
            else:
                assert isinstance(ev, ResponseEnded) and started is not None
                out.append((started.header.status, started.meta, b"".join(parts)))
    assert out == [(int(s), m, p) for s, m, p in frames] and dec.idle


def test_response_meta_edge_cases() -> None:
    assert ResponseDecoder().feed(ResponseHeader(0, 0, 0).pack()) == [
        ResponseStarted(ResponseHeader(0, 0, 0), {}),
        ResponseEnded(),
    ]
    for meta in [b"{bad", b"[1]", b"\xff\xfe", b'{"a":NaN}']:
        dec = ResponseDecoder()
        with pytest.raises(ProtocolError):
            dec.feed(ResponseHeader(2, len(meta), 0).pack() + meta)
        assert dec.state is DecoderState.CLOSED
    with pytest.raises(FrameTooLarge):
        ResponseDecoder(max_payload=10).feed(ResponseHeader(0, 0, 11).pack())
    # statuses newer than the enum pass through
    (ev, _) = ResponseDecoder().feed(encode_response(0x7F, {}))
    assert isinstance(ev, ResponseStarted) and ev.header.status == 0x7F


# --------------------------------------------------------------------------
# The pull-style interface: receive_data, then next_event until NEED_DATA (as h11)
# --------------------------------------------------------------------------


def pull(dec: RequestDecoder | ResponseDecoder) -> list[Any]:
    """Every event the bytes received so far make, read one ``next_event()`` at a time."""
    out = []
    while (ev := dec.next_event()) is not NEED_DATA:
        out.append(ev)
    return out


def test_a_frame_one_byte_at_a_time_gives_the_events_of_the_whole_frame() -> None:
    cases: list[tuple[Callable[[], RequestDecoder | ResponseDecoder], bytes, int]] = [
        (new_decoder, encode_request(Op.STATE_PUT, "3", b"blob", "trace"), 3),
        (ResponseDecoder, encode_response(Status.BUSY, {"error": "busy", "busy_slots": [0]}), 2),
        (ResponseDecoder, encode_response(Status.OK, {"n": 1}, b"payload"), 3),
    ]
    for make, frame, n_events in cases:
        dec_whole, dec_bytes = make(), make()
        dec_whole.receive_data(frame)
        whole = pull(dec_whole)
        assert len(whole) == n_events and dec_whole.idle
        one_by_one = []
        for i in range(len(frame)):
            dec_bytes.receive_data(frame[i : i + 1])
            one_by_one += pull(dec_bytes)
            assert dec_bytes.in_frame == (i < len(frame) - 1)
        # the same started event, the same payload bytes (chunk boundaries carry no meaning), one end
        assert logical_any(one_by_one) == logical_any(whole)
        assert type(one_by_one[-1]) is type(whole[-1]) and dec_bytes.idle


def logical_any(events: list[Any]) -> list[tuple[Any, bytes]]:
    """(started event, payload) per frame: chunk boundaries carry no meaning."""
    out: list[tuple[Any, bytes]] = []
    for ev in events:
        if isinstance(ev, (RequestStarted, ResponseStarted)):
            out.append((ev, b""))
        elif isinstance(ev, PayloadChunk):
            out[-1] = (out[-1][0], out[-1][1] + ev.data)
    return out


def test_two_frames_in_one_chunk_give_two_frames_of_events() -> None:
    dec = new_decoder()
    dec.receive_data(encode_request(Op.INFO, "", b"", "a") + encode_request(Op.PREFILL, "1", b"{}", "b"))
    first = [dec.next_event(), dec.next_event()]
    assert first == [RequestStarted(RequestHeader(Op.INFO, 0, 0, 0, 1), "", "a"), RequestEnded()]
    assert dec.unread == REQUEST_HEADER_SIZE + 2 + 2  # the second frame waits, unread, until asked for
    rest = pull(dec)
    assert rest == [
        RequestStarted(RequestHeader(Op.PREFILL, 0, 1, 2, 1), "1", "b"),
        PayloadChunk(b"{}"),
        RequestEnded(),
    ]
    assert dec.next_event() is NEED_DATA and dec.idle
    resp = ResponseDecoder()
    resp.receive_data(encode_response(Status.OK, {"a": 1}) + encode_response(Status.NOT_FOUND, {"error": "x"}))
    assert [type(e).__name__ for e in pull(resp)] == ["ResponseStarted", "ResponseEnded"] * 2


def test_bad_bytes_after_a_frame_raise_once_its_events_are_read() -> None:
    """The events of the frames before bad bytes come first; the error comes at the call that reaches
    them, and the decoder is closed after it."""
    dec = new_decoder()
    dec.receive_data(encode_request(Op.INFO, "a") + b"ZZ")
    assert isinstance(dec.next_event(), RequestStarted) and dec.next_event() == RequestEnded()
    with pytest.raises(BadMagic):
        dec.next_event()
    assert dec.state is DecoderState.CLOSED
    with pytest.raises(ProtocolError):
        dec.next_event()
    with pytest.raises(ProtocolError):
        dec.receive_data(b"x")


def test_bytes_received_twice_before_reading_are_read_in_order() -> None:
    frame = encode_request(Op.STATE_PUT, "0", b"abcdef", "t")
    dec = new_decoder()
    dec.receive_data(frame[:20])
    dec.receive_data(frame[20:])
    assert logical(pull(dec)) == ([Req(Op.STATE_PUT, 0, "0", "t", b"abcdef")], None)


# --------------------------------------------------------------------------
# DECODE frames
# --------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.floats(width=32, allow_nan=False), st.integers(0, 255)),
        max_size=20,
    )
)
def test_decode_frames_round_trip(frames: list[tuple[int, float, int]]) -> None:
    b = b"".join(pack_decode_frame(*f) for f in frames)
    assert len(b) == DECODE_FRAME_SIZE * len(frames)
    assert unpack_decode_frames(b) == frames


def test_decode_padding_rule() -> None:
    budget = 5
    payload = pack_decode_frame(7, -0.5, 0) + pack_decode_frame(8, -1.25, DECODE_FLAG_FINAL)
    payload += decode_pad_frames(budget - 2)
    assert len(payload) == DECODE_FRAME_SIZE * budget
    frames = unpack_decode_frames(payload)
    assert frames[1] == (8, -1.25, DECODE_FLAG_FINAL)
    assert frames[2:] == [(DECODE_PAD_TOKEN, 0.0, DECODE_FLAG_PAD)] * 3
    assert decode_pad_frames(0) == b""
    with pytest.raises(ValueError):
        unpack_decode_frames(payload[:-1])
    with pytest.raises(ValueError):
        decode_pad_frames(-1)


# --------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "mode", "peer"),
    [
        (b"solo", "solo", None),
        (b"  COMBINED\r\n", "combined", None),
        (b'"Solo"', "solo", None),
        (b'{"mode": "combined", "peer": "10.0.0.2:50052"}', "combined", "10.0.0.2:50052"),
        (b'{"mode": "SOLO"}', "solo", None),
        (b'{"mode": "combined", "peer": ""}', "combined", None),
        (b'{"mode": "combined", "peer": "[fe80::1]:9"}', "combined", "[fe80::1]:9"),
    ],
)
def test_set_expert_mode_forms(payload: bytes, mode: str, peer: str | None) -> None:
    assert parse_set_expert_mode(payload) == SetExpertModeRequest(mode, peer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"", "mode"),
        (b"turbo", "mode"),
        (b"s\xffolo", "UTF-8"),
        (b'{"mode": "solo"', "JSON"),
        (b"[1]", "payload"),
        (b'{"mode": 1}', "mode"),
        (b'{"peer": "a:1"}', "mode: missing"),
        (b'{"mode": "combined", "peer": "nohost"}', "peer"),
        (b'{"mode": "combined", "peer": "h:70000"}', "peer"),
        (b'{"mode": "combined", "peer": "h:0"}', "peer"),
        (b'{"mode": "combined", "peer": ":80"}', "peer"),
        (b'{"mode": "combined", "peer": 5}', "peer: expected str"),
        (b'{"mode": "combined", "peers": "h:1"}', "peers"),
    ],
)
def test_set_expert_mode_errors(payload: bytes, needle: str) -> None:
    with pytest.raises(MessageError) as ei:
        parse_set_expert_mode(payload)
    assert needle in str(ei.value)


def test_parse_peer() -> None:
    assert parse_peer("node-2.lan:50052") == ("node-2.lan", 50052)
    assert parse_peer("[::1]:1") == ("::1", 1)
    for bad in ["h:", "h:+1", "h:١٢", "a b:1", "::1:5"]:
        with pytest.raises(MessageError):
            parse_peer(bad)


def _pipeline(payload: bytes) -> PipelineAttachRequest:
    return structure_json(payload, PipelineAttachRequest)


@pytest.mark.parametrize(
    ("payload", "parse", "needle"),
    [
        (b'{"n_predict": "5"}', parse_decode, "n_predict: expected int, got str"),
        (b'{"n_predict": true}', parse_decode, "n_predict: expected int, got bool"),
        (b'{"n_predict": 1.5}', parse_decode, "n_predict: expected int, got float"),
        (b'{"messages": [{"content": "x"}]}', parse_decode, "messages[0].role: missing"),
        (b'{"messages": "hi"}', parse_decode, "messages: expected list, got str"),
        (b'{"messages": []}', parse_decode, "messages: empty"),
        (b'{"messages": [{"role": "user", "content": 3}]}', parse_prefill, "messages[0].content"),
        (b'{"messages": ["hi"]}', parse_prefill, "messages[0]: expected object"),
        (b'{"messages": []}', parse_prefill, "messages: at least one message"),
        (b'{"model": "m"}', parse_prefill, "messages: at least one message"),
        (b'{"messages": [{"role": "user"}], "model": 1}', parse_prefill, "model: expected str"),
        (b'{"messages": [{"role": "user"}], "repeat_last_n": -2}', parse_prefill, "repeat_last_n: must be between"),
        (b'{"peer": "h:1"}', _pipeline, "ot_split: missing"),
        (b'{"peer": "h", "ot_split": "x"}', _pipeline, "peer"),
        (b"\xff", parse_decode, "UTF-8"),
        (b"{", parse_decode, "JSON"),
        (b'{"n_predict": NaN}', parse_decode, "JSON"),
        (b"7", parse_decode, "JSON object, got number"),
    ],
)
def test_structure_errors_name_the_field(payload: bytes, parse: object, needle: str) -> None:
    with pytest.raises(MessageError) as ei:
        parse(payload)  # type: ignore[operator]
    assert needle in str(ei.value)


def test_prefill_and_decode_bodies_are_parsed_whole() -> None:
    body = {
        "model": "smol",
        "stream": False,
        "temperature": 0.2,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"},
        ],
    }
    p = parse_prefill(json.dumps(body).encode())
    assert isinstance(p, ChatCompletionRequest) and p.model == "smol" and p.temperature == 0.2
    assert p.messages[1] == ChatMessage("user", "hi", "u")  # text parts joined
    d = parse_decode(json.dumps({**body, "max_tokens": 12}).encode())
    assert isinstance(d.body, ChatCompletionRequest) and not d.continues_slot
    assert d.n_predict is None and d.frame_budget(default=64, cap=1000) == 12
    assert parse_decode(b'{"n_predict": -1}').frame_budget(64, 1000) == 64
    assert parse_decode(b'{"n_predict": 5000}').frame_budget(64, 1000) == 1000
    cont = parse_decode(b'{"messages": null, "temperature": 0, "stream": false}')
    assert cont.continues_slot and isinstance(cont.body, CompletionRequest) and cont.body.temperature == 0
    assert cont.stream is False and parse_decode(b"{}").continues_slot
    assert structure_json(b'{"peer": "h:1", "ot_split": "ffn_.*_exps"}', PipelineAttachRequest) == (
        PipelineAttachRequest("h:1", "ffn_.*_exps")
    )


def test_configure_classification() -> None:
    params = parse_configure(
        json.dumps(
            {
                "temperature": 1,
                "top_k": 40,
                "state_chunk_size": 1,
                "n_ctx": 4096,
                "cache_type_k": "q8_0",
                "n_gpu_layers": -1,
                "override_tensor": ["a=CPU"],
                "batch": 512,
                "ctx": 2048,
            }
        ).encode()
    ).params
    t1, t2, t3, unknown = classify_configure_keys(params)
    assert t1 == {"temperature": 1.0, "top_k": 40, "state_chunk_size": 1}
    assert isinstance(t1["temperature"], float)
    assert t2 == {"n_ctx": 4096, "cache_type_k": "q8_0"}
    assert t3 == {"n_gpu_layers": -1, "override_tensor": ["a=CPU"]}
    assert unknown == ["batch", "ctx"]
    assert parse_configure(b"").params == {}
    with pytest.raises(MessageError):
        parse_configure(b"[]")


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"top_k": True}, "top_k: expected int, got bool"),
        ({"temperature": "hot"}, "temperature: expected float, got str"),
        ({"seed": 1.0}, "seed: expected int, got float"),
        ({"n_ctx": "4096"}, "n_ctx"),
        ({"model_path": 3}, "model_path"),
        ({"mirostat": 1.0}, "mirostat: expected int, got float"),
        ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers: expected a list of str, got string"),
        ({"dry_sequence_breakers": ["a", 1]}, "dry_sequence_breakers: expected a list of str"),
    ],
)
def test_configure_type_errors_name_the_key(params: dict[str, Any], needle: str) -> None:
    with pytest.raises(MessageError) as ei:
        classify_configure_keys(params)
    assert needle in str(ei.value)


def test_configure_tier1_has_every_sampler_field() -> None:
    """CONFIGURE sets the node's default for every sampler field, under its llama-server name."""
    from hydra_trio.engine.settings import SamplingParams

    fields = SamplingParams().to_json()
    t1, t2, t3, unknown = classify_configure_keys(fields)
    assert t1 == fields and not t2 and not t3 and unknown == []


def test_clamp_state_chunk_size() -> None:
    assert clamp_state_chunk_size(1) == 64 * 1024
    assert clamp_state_chunk_size(1 << 20) == 1 << 20
    assert clamp_state_chunk_size(1 << 40) == 64 * 1024 * 1024
