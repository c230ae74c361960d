"""The per-connection Hydra protocol object (:class:`hydra_trio.hydra.connection.ServerConnection`) under the
connection loop (:func:`hydra_trio.hydra.session.serve_connection`), in-process on trio's memory streams.

The node is compute-only (no engine: the ops these tests use need none): INFO answers from the node's
settings, a control op a trusted connection may run fails later for want of a model (NOT_IMPLEMENTED, as
HTTP answers it 501: :class:`hydra_trio.errors.NoModel`), so a
refusal by the connection's trust (BAD_REQUEST with ``refused``) is told apart from a pass.  Requests
and replies go through the real codec (``encode_request`` / ``ResponseDecoder``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from hydra_trio.engine.kv.blobbuf import BlobBuffer
from hydra_trio.hydra.connection import ServerConnection
from hydra_trio.hydra.server import HydraHandler
from hydra_trio.hydra.session import Drain, HydraRequest, HydraSettings, serve_connection
from hydra_trio.protocol.hydra import (
    Op,
    PayloadChunk,
    RequestHeader,
    ResponseDecoder,
    ResponseEnded,
    ResponseStarted,
    Status,
    encode_request,
    encode_request_header,
)
from hydra_trio.transport.access import AccessSettings, AllowList, Peer

TOKEN = "t0ken"
LOCAL = Peer(ipaddress.ip_address("127.0.0.1"))  # not in the allow-list below
ALLOWED = Peer(ipaddress.ip_address("10.1.2.3"))
SETTINGS = HydraSettings(max_json_payload=1024, max_state_payload=8192)


def guarded_handler(settings: HydraSettings = SETTINGS) -> HydraHandler:
    """A compute-only node with ``--control-allow 10.0.0.0/8`` and ``--hydra-token t0ken``."""
    access = AccessSettings(control_allow=AllowList.parse(["10.0.0.0/8"], "--control-allow"), hydra_token=TOKEN)
    return HydraHandler(None, settings, access=access)


class Recording(ServerConnection):
    """The real protocol object, which also keeps each request it was handed (op, trace id, payload kept)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[tuple[int, str, bytes]] = []
        self.kinds: list[type] = []  # what each kept payload was received into

    async def handle(self, req: HydraRequest) -> None:
        if isinstance(req.payload, BlobBuffer):
            assert req.filled == req.payload_len and req.checksum is not None
            kept = bytes(req.payload.view()[: req.filled])
        else:
            kept = bytes(req.payload)
        self.seen.append((req.op, req.trace_id, kept))
        self.kinds.append(type(req.payload))
        await super().handle(req)


class Wire:
    """The client end of one memory-stream connection, replies parsed with the real codec."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.dec = ResponseDecoder()
        self.events: list[Any] = []

    async def send(self, op: int, payload: bytes = b"", *, trace_id: str = "t", key: str = "", flags: int = 0) -> None:
        await self.stream.send_all(encode_request(op, key=key, payload=payload, trace_id=trace_id, flags=flags))

    async def _next(self) -> Any:
        while not self.events:
            data = await self.stream.receive_some(1 << 16)
            assert data, "the server closed the connection"
            self.events.extend(self.dec.feed(data))
        return self.events.pop(0)

    async def reply(self) -> tuple[int, dict[str, Any], bytes]:
        started = await self._next()
        assert isinstance(started, ResponseStarted), started
        payload = bytearray()
        while not isinstance(ev := await self._next(), ResponseEnded):
            assert isinstance(ev, PayloadChunk), ev
            payload += ev.data
        return started.header.status, started.meta, bytes(payload)

    async def call(self, op: int, payload: bytes = b"", **kw: Any) -> tuple[int, dict[str, Any], bytes]:
        await self.send(op, payload, **kw)
        return await self.reply()

    async def closed(self) -> bool:
        """True once the server closed its end with nothing more sent (False if a byte arrives first)."""
        with trio.fail_after(30):  # a hang guard only
            return not self.events and await self.stream.receive_some(1 << 16) == b""


@asynccontextmanager
async def connection(
    handler: HydraHandler, peer: Peer = LOCAL, drain: Drain | None = None
) -> AsyncIterator[tuple[Wire, Recording, trio.Event]]:
    """One connection served by the node's protocol object under the connection loop; yields the client end,
    the protocol object and an event set when the loop has returned (its end of the stream then closed)."""
    client, server = trio.testing.memory_stream_pair()
    conn = Recording(handler.target, server, handler.gate.connection(peer), handler.metrics)
    done = trio.Event()

    async def serve() -> None:
        try:
            await serve_connection(server, handler.settings, conn, drain if drain is not None else Drain())
        finally:
            await server.aclose()
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        yield Wire(client), conn, done
        nursery.cancel_scope.cancel()


def configure(params: dict[str, Any]) -> bytes:
    return json.dumps(params).encode()


async def test_the_handler_makes_one_protocol_object_per_connection_with_its_own_trust() -> None:
    h = guarded_handler()
    a = h.connection(trio.testing.memory_stream_pair()[1], LOCAL)
    b = h.connection(trio.testing.memory_stream_pair()[1], ALLOWED)
    assert isinstance(a, ServerConnection) and a is not b
    assert (a.trust.trusted, b.trust.trusted) == (False, True)
    assert a.target is b.target is h.target and a.metrics is h.metrics


async def test_a_request_refused_by_trust_gets_bad_request_and_the_connection_goes_on() -> None:
    h = guarded_handler()
    async with connection(h) as (wire, conn, done):
        status, meta, _ = await wire.call(Op.CONFIGURE, configure({"n_parallel": 2}))
        assert status == Status.BAD_REQUEST
        assert meta["refused"] == "not_allowed" and meta["op"] == "CONFIGURE"
        assert "127.0.0.1" in meta["error"] and "--control-allow" in meta["error"]
        # a refused STATE_PUT: its payload is read and dropped, never kept, and the reply is the refusal
        status, meta, _ = await wire.call(Op.STATE_PUT, b"\x01" * 4000, key="0")
        assert status == Status.BAD_REQUEST and meta["refused"] == "not_allowed" and meta["op"] == "STATE_PUT"
        assert conn.seen[-1] == (Op.STATE_PUT, "t", b"")
        # the same connection still answers
        status, meta, _ = await wire.call(Op.INFO)
        assert status == Status.OK and meta["model"] is None
        assert not done.is_set()
    assert h.gate.refused["hydra", "not_allowed"] == 2
    assert h.metrics.hydra_requests["CONFIGURE", "BAD_REQUEST"] == 1
    assert h.metrics.hydra_requests["STATE_PUT", "BAD_REQUEST"] == 1
    assert h.metrics.hydra_requests["INFO", "OK"] == 1
    assert h.requests == 3


async def test_the_token_trusts_this_connection_only() -> None:
    h = guarded_handler()
    async with connection(h) as (wire, conn, _):
        assert conn.keeps_payload(Op.STATE_PUT) is False and conn.keeps_payload(Op.CONFIGURE) is True
        status, meta, _ = await wire.call(Op.CONFIGURE, configure({"auth": "wrong"}))
        assert status == Status.BAD_REQUEST and meta["refused"] == "invalid_token"
        assert conn.trust.trusted is False
        status, meta, _ = await wire.call(Op.CONFIGURE, configure({"auth": TOKEN}))
        assert status == Status.OK and meta["trusted"] is True and meta["params_applied"] == {}
        assert conn.trust.trusted is True and conn.keeps_payload(Op.STATE_PUT) is True
        # now the STATE_PUT passes the trust check, its payload is kept, and it fails for want of a model
        status, meta, _ = await wire.call(Op.STATE_PUT, b"\x02" * 100, key="0")
        assert status == Status.NOT_IMPLEMENTED and "refused" not in meta and "no model" in meta["error"]
        assert conn.seen[-1] == (Op.STATE_PUT, "t", b"\x02" * 100)
    async with connection(h) as (wire, conn, _):  # a new connection from the same peer starts untrusted
        status, meta, _ = await wire.call(Op.STATE_PUT, b"\x02" * 100, key="0")
        assert status == Status.BAD_REQUEST and meta["refused"] == "not_allowed"
    assert h.gate.refused["hydra", "invalid_token"] == 1 and h.gate.refused["hydra", "not_allowed"] == 1


async def test_a_payload_over_its_ops_cap_is_refused_at_the_header_and_the_connection_closes() -> None:
    h = guarded_handler()
    async with connection(h, ALLOWED) as (wire, conn, done):
        assert (conn.max_payload(Op.INFO), conn.max_payload(Op.CONFIGURE)) == (1024, 1024)
        assert conn.max_payload(Op.STATE_PUT) == 8192
        # STATE_PUT's cap is the state one: 4000 bytes pass (then NOT_IMPLEMENTED: no model) where JSON's 1024
        # would not
        status, _, _ = await wire.call(Op.STATE_PUT, b"\x03" * 4000, key="0")
        assert status == Status.NOT_IMPLEMENTED
        # only the header of an INFO announcing 1025 bytes goes out: the refusal comes before any payload byte
        await wire.stream.send_all(encode_request_header(Op.INFO, trace_id="big", payload_len=1025))
        status, meta, _ = await wire.reply()
        assert status == Status.BAD_REQUEST and meta["op"] == Op.INFO and "1025" in meta["error"]
        assert await wire.closed()
        await done.wait()
        assert [op for op, _, _ in conn.seen] == [Op.STATE_PUT]  # the refused request never reached dispatch


async def test_a_state_put_over_the_state_cap_is_refused_and_closes() -> None:
    h = guarded_handler()
    async with connection(h, ALLOWED) as (wire, conn, _done):
        await wire.stream.send_all(encode_request_header(Op.STATE_PUT, key="0", payload_len=8193))
        status, meta, _ = await wire.reply()
        assert status == Status.BAD_REQUEST and meta["op"] == Op.STATE_PUT and "8192" in meta["error"]
        assert await wire.closed()
        assert conn.seen == []


async def test_a_large_state_put_is_received_into_a_pool_buffer_a_small_one_into_a_bytearray() -> None:
    h = guarded_handler(HydraSettings(max_json_payload=1024, max_state_payload=1 << 20))
    async with connection(h, ALLOWED) as (wire, conn, _):
        assert conn.payload_buffer(Op.STATE_PUT, 100) is None
        assert conn.payload_buffer(Op.CONFIGURE, 1 << 17) is None
        blob = bytes(range(256)) * 512  # 128 KiB: over the size that goes into a pool buffer
        status, meta, _ = await wire.call(Op.STATE_PUT, blob, key="0")
        assert status == Status.NOT_IMPLEMENTED and "no model" in meta["error"]
        assert conn.seen[-1] == (Op.STATE_PUT, "t", blob) and conn.kinds[-1] is BlobBuffer
        status, _, _ = await wire.call(Op.STATE_PUT, b"\x05" * 100, key="0")
        assert status == Status.NOT_IMPLEMENTED
        assert conn.seen[-1] == (Op.STATE_PUT, "t", b"\x05" * 100) and conn.kinds[-1] is bytearray


@pytest.mark.parametrize("bytewise", [False, True], ids=["one-chunk", "byte-by-byte"])
async def test_pipelined_requests_are_dispatched_and_answered_in_order(bytewise: bool) -> None:
    h = guarded_handler()
    frames = [
        encode_request(Op.INFO, trace_id="r0"),
        encode_request(0x7F, payload=b"dropped", trace_id="r1"),  # unknown opcode
        encode_request(0x01, trace_id="r2"),  # a Store opcode
        encode_request(Op.INFO, trace_id="r3", flags=1),  # flags are not implemented
        encode_request(Op.CONFIGURE, payload=configure({"n_parallel": 2}), trace_id="r4"),  # refused by trust
        RequestHeader(Op.INFO, 0, 1, 0, 2).pack() + b"\xff" + b"r5",  # a key that is not UTF-8
        encode_request(Op.INFO, trace_id="r6"),
    ]
    data = b"".join(frames)
    async with connection(h) as (wire, conn, done):
        if bytewise:
            for i in range(len(data)):
                await wire.stream.send_all(data[i : i + 1])
        else:
            await wire.stream.send_all(data)
        replies = [await wire.reply() for _ in frames]
        assert not done.is_set()
    assert [trace for _, trace, _ in conn.seen] == [f"r{i}" for i in range(len(frames))]
    assert [op for op, _, _ in conn.seen] == [Op.INFO, 0x7F, 0x01, Op.INFO, Op.CONFIGURE, Op.INFO, Op.INFO]
    assert conn.seen[1][2] == b""  # an unknown op's payload is consumed, not kept
    statuses = [s for s, _, _ in replies]
    assert statuses == [
        Status.OK,
        Status.NOT_IMPLEMENTED,
        Status.NOT_IMPLEMENTED,
        Status.BAD_REQUEST,
        Status.BAD_REQUEST,
        Status.BAD_REQUEST,
        Status.OK,
    ]
    assert "unknown opcode" in replies[1][1]["error"] and "Store service" in replies[2][1]["error"]
    assert "flags 0x01" in replies[3][1]["error"] and replies[4][1]["refused"] == "not_allowed"
    assert "not valid UTF-8" in replies[5][1]["error"]
    assert replies[0][1] == replies[6][1]


async def test_drain_closes_an_idle_connection_now_and_a_busy_one_after_its_reply() -> None:
    h = guarded_handler()
    drain = Drain()
    async with (
        connection(h, drain=drain) as (idle, _, idle_done),
        connection(h, drain=drain) as (busy, busy_conn, busy_done),
    ):
        assert (await idle.call(Op.INFO))[0] == Status.OK
        # the busy connection is inside a request: its header and half its payload are in
        body = configure({"n_parallel": 2})
        await busy.stream.send_all(
            encode_request_header(Op.CONFIGURE, trace_id="mid", payload_len=len(body)) + body[:5]
        )
        await trio.testing.wait_all_tasks_blocked()
        drain.start()
        assert drain.draining
        assert await idle.closed()  # between requests: closed at once, with no reply
        await idle_done.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert not busy_done.is_set()  # the request in flight is not cut off
        await busy.stream.send_all(body[5:])
        status, meta, _ = await busy.reply()
        assert status == Status.BAD_REQUEST and meta["refused"] == "not_allowed"
        assert await busy.closed()  # and it closes after that reply, before reading another request
        await busy_done.wait()
        assert [trace for _, trace, _ in busy_conn.seen] == ["mid"]
    async with connection(h, drain=drain) as (late, late_conn, _late_done):  # a connection after the drain
        with contextlib.suppress(trio.BrokenResourceError):  # the loop may have closed its end already
            await late.send(Op.INFO)
        assert await late.closed()  # closed with no reply
        assert late_conn.seen == []


async def test_the_handler_drain_reaches_connections_it_serves() -> None:
    h = guarded_handler()
    client, server = trio.testing.memory_stream_pair()
    wire = Wire(client)
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            await h.serve(server, ALLOWED)
            await server.aclose()

        nursery.start_soon(serve)
        assert (await wire.call(Op.INFO))[0] == Status.OK
        await trio.testing.wait_all_tasks_blocked()
        assert not h.draining
        h.drain()
        assert h.draining
        assert await wire.closed()
