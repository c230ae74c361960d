"""HydraClient framing against an in-test trio TCP server that uses the REAL
codec (`RequestDecoder` to parse, `encode_response*` to reply): checks the
client's side of docs/hydra-protocol.md §2/§3, not the engine. No model needed."""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio
import trio.lowlevel

from hydra_trio.hydra.client import (
    CHUNK_SIZE,
    HydraBadRequest,
    HydraBusy,
    HydraClient,
    HydraConnectError,
    HydraConnectionClosed,
    HydraNotFound,
    HydraNotImplemented,
    HydraProtocolError,
    HydraServerError,
    HydraTimeout,
)
from hydra_trio.protocol.hydra import (
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_PAD_TOKEN,
    DECODE_STOP_FLAGS,
    PayloadChunk,
    RequestDecoder,
    RequestEnded,
    RequestStarted,
    Status,
    decode_pad_frames,
    encode_response,
    encode_response_header,
    pack_decode_frame,
)

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


@attrs.define
class Req:
    op: int
    key: str
    trace_id: str
    payload: bytes


Handler = Callable[[Req, trio.SocketStream], Awaitable[None]]


class FakeEngine:
    """Parses requests with the real RequestDecoder; ``handler`` replies."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Req] = []
        self.connections = 0
        self.port = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        dec = RequestDecoder(max_payload=1 << 34)
        started: RequestStarted | None = None
        buf = bytearray()
        try:
            while data := await stream.receive_some(65536):
                for ev in dec.feed(data):
                    if isinstance(ev, RequestStarted):
                        started, buf = ev, bytearray()
                    elif isinstance(ev, PayloadChunk):
                        buf += ev.data
                    else:
                        assert isinstance(ev, RequestEnded) and started is not None
                        req = Req(started.header.op, started.key, started.trace_id, bytes(buf))
                        self.requests.append(req)
                        await self.handler(req, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@pytest.fixture
async def start_engine(nursery: trio.Nursery) -> Callable[[Handler], Awaitable[FakeEngine]]:
    async def start(handler: Handler) -> FakeEngine:
        eng = FakeEngine(handler)
        listeners = await nursery.start(partial(trio.serve_tcp, eng.serve, 0, host="127.0.0.1"))
        eng.port = listeners[0].socket.getsockname()[1]
        return eng

    return start


INFO_META = {"engine": "hydra-trio", "version": "0.1.0", "mode": "solo", "capabilities": ["kv"]}


async def reply_info(req: Req, stream: trio.SocketStream) -> None:
    await stream.send_all(encode_response(Status.OK, {**INFO_META, "trace": req.trace_id}))


async def test_info_round_trip(start_engine) -> None:
    eng = await start_engine(reply_info)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        meta = await c.info()
        assert meta == {**INFO_META, "trace": eng.requests[0].trace_id}
        assert await c.info(trace_id="abc-123") == {**INFO_META, "trace": "abc-123"}
    r = eng.requests[0]
    assert (r.op, r.key, r.payload) == (0x41, "", b"")
    assert len(r.trace_id) == 8 and int(r.trace_id, 16) >= 0
    assert eng.connections == 1


async def test_from_address(start_engine) -> None:
    eng = await start_engine(reply_info)
    async with HydraClient.from_address(f"127.0.0.1:{eng.port}", timeout=5) as c:
        assert (await c.info())["engine"] == "hydra-trio"
    with pytest.raises(ValueError):
        HydraClient.from_address("no-port")


async def test_state_get_streamed_to_file(start_engine, tmp_path: Path) -> None:
    blob = os.urandom(3 * MiB + 17)

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        assert req.op == 0x30 and req.key == "3"
        meta = {"n_past": 42, "state_size": len(blob)}
        await stream.send_all(encode_response_header(Status.OK, meta, len(blob)))
        for i in range(0, len(blob), 100_000):  # odd chunking on purpose
            await stream.send_all(blob[i : i + 100_000])
            await trio.lowlevel.checkpoint()

    eng = await start_engine(handler)
    target = tmp_path / "slot3.kv"
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        meta = await c.state_get_to_file(3, target)
        assert meta == {"n_past": 42, "state_size": len(blob)}
        assert target.read_bytes() == blob
        assert sorted(p.name for p in tmp_path.iterdir()) == ["slot3.kv"]  # no temp left  # noqa: ASYNC240  (a listing of a small local directory)
        # the streaming form and the in-memory form on the same connection
        async with c.state_get(3) as r:
            assert r.payload_len == len(blob)
            n = 0
            async for chunk in r:
                assert len(chunk) <= CHUNK_SIZE
                n += len(chunk)
        assert n == len(blob)
        meta2, data = await c.state_get_bytes(3)
        assert data == blob and meta2["n_past"] == 42
    assert eng.connections == 1


async def test_state_get_to_file_cut_mid_stream(start_engine, tmp_path: Path) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        await stream.send_all(encode_response_header(Status.OK, {"n_past": 1}, 1 * MiB))
        await stream.send_all(b"x" * 1000)
        await stream.aclose()

    eng = await start_engine(handler)
    target = tmp_path / "out.kv"
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        with pytest.raises(HydraConnectionClosed):
            await c.state_get_to_file(0, target)
        assert list(tmp_path.iterdir()) == []  # neither target nor temp file  # noqa: ASYNC240  (a listing of a small local directory)
        with pytest.raises(HydraConnectionClosed):  # no silent reconnect
            await c.info()


async def test_state_put_from_file(start_engine, tmp_path: Path) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        assert req.op == 0x31
        meta = {"restored": True, "bytes": len(req.payload), "key": req.key}
        await stream.send_all(encode_response(Status.OK, meta))

    eng = await start_engine(handler)
    data = os.urandom(3 * MiB + 123)
    src = tmp_path / "in.kv"
    src.write_bytes(data)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        meta = await c.state_put_from_file(2, src)
        assert meta == {"restored": True, "bytes": len(data), "key": "2"}
        assert eng.requests[-1].payload == data and eng.requests[-1].key == "2"
        # in-memory form, and an empty file
        assert (await c.state_put(5, b"abc"))["bytes"] == 3
        assert eng.requests[-1].payload == b"abc"
        (tmp_path / "empty").write_bytes(b"")
        assert (await c.state_put_from_file(0, tmp_path / "empty"))["bytes"] == 0
        # a missing file fails before anything is sent; connection still fine
        with pytest.raises(FileNotFoundError):
            await c.state_put_from_file(0, tmp_path / "missing")
        assert (await c.state_put(1, b""))["bytes"] == 0
    assert eng.connections == 1


async def test_busy_raises_hydra_busy(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            return await reply_info(req, stream)
        assert req.op == 0x44
        meta = {"success": False, "error": "2 slots are processing", "busy_slots": [0, 2]}
        await stream.send_all(encode_response(Status.BUSY, meta))

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        with pytest.raises(HydraBusy) as ei:
            await c.set_expert_mode("combined", peer="10.0.0.2:50052", trace_id="t1")
        assert ei.value.meta["busy_slots"] == [0, 2]
        assert ei.value.status is Status.BUSY and ei.value.status_name == "BUSY"
        assert str(ei.value) == "2 slots are processing" and ei.value.trace_id == "t1"
        assert json.loads(eng.requests[-1].payload) == {"mode": "combined", "peer": "10.0.0.2:50052"}
        with pytest.raises(HydraBusy):
            await c.set_expert_mode("solo")
        assert eng.requests[-1].payload == b"solo"
        assert (await c.info())["engine"] == "hydra-trio"


async def test_error_reply_with_payload_keeps_connection(start_engine) -> None:
    junk = os.urandom(700_000)

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            return await reply_info(req, stream)
        if req.op == 0x42:
            meta = {"error": "prefill failed", "n_past": 0}
            await stream.send_all(encode_response_header(Status.ERROR, meta, len(junk)))
            await stream.send_all(junk[:1000])
            await trio.sleep(0.05)
            await stream.send_all(junk[1000:])
        elif req.op == 0x32:
            await stream.send_all(encode_response(Status.NOT_FOUND, {"error": "no slot 9"}))
        else:  # an empty meta and a payload
            await stream.send_all(encode_response_header(Status.BAD_REQUEST, {}, 5) + b"12345")

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        with pytest.raises(HydraServerError) as ei:
            await c.prefill(0, {"messages": [{"role": "user", "content": "hi"}]})
        assert ei.value.message == "prefill failed" and ei.value.status is Status.ERROR
        assert json.loads(eng.requests[-1].payload)["messages"][0]["content"] == "hi"
        assert (await c.info())["engine"] == "hydra-trio"
        with pytest.raises(HydraNotFound, match="no slot 9"):
            await c.state_meta(9)
        with pytest.raises(HydraBadRequest, match="BAD_REQUEST"):
            await c.configure({"temperature": 0.5})
        reply = await c.exchange(0x45, payload=b"x")
        assert (reply.status, reply.meta, reply.payload) == (Status.BAD_REQUEST, {}, b"12345")
        assert (await c.info())["engine"] == "hydra-trio"
    assert eng.connections == 1


def frames(*toks: tuple[int, float, int]) -> bytes:
    return b"".join(pack_decode_frame(*t) for t in toks)


async def test_decode_stream_stops_at_final_and_consumes_padding(start_engine) -> None:
    budget = 10
    real = [(101, -0.5, 0), (102, -1.0, 0), (103, -0.25, DECODE_FLAG_FINAL)]

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            return await reply_info(req, stream)
        assert req.op == 0x43 and json.loads(req.payload)["n_predict"] == budget
        await stream.send_all(encode_response_header(Status.OK, {"n_past": 7}, 9 * budget))
        # frames split across TCP writes at odd offsets
        data = frames(*real)
        await stream.send_all(data[:5])
        await trio.sleep(0.02)
        await stream.send_all(data[5:13])
        await trio.sleep(0.02)
        await stream.send_all(data[13:])
        await trio.sleep(0.05)
        await stream.send_all(decode_pad_frames(budget - len(real)))

    eng = await start_engine(handler)
    body = {"n_predict": budget, "messages": [{"role": "user", "content": "x"}]}
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        got = []
        async with c.decode_stream(1, body) as s:
            async for frame in s:
                got.append(frame)
            assert s.budget == budget and s.meta == {"n_past": 7}
        assert got == real
        assert (await c.info())["engine"] == "hydra-trio"  # padding was consumed

        assert await c.decode(1, body) == real  # list form
        assert (await c.info())["engine"] == "hydra-trio"

        got = [f async for f in c.decode_stream(1, body)]  # bare async-for form
        assert got == real
        assert (await c.info())["engine"] == "hydra-trio"

        async with c.decode_stream(1, body) as s:  # leaving early drains the rest
            async for frame in s:
                assert frame == real[0]
                break
        assert (await c.info())["engine"] == "hydra-trio"
    assert eng.connections == 1


async def test_decode_all_padding_and_not_implemented(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x43:  # generation failed before any token: all padding
            await stream.send_all(encode_response(Status.OK, {"error_detail": "x"}, decode_pad_frames(4)))
        elif req.op == 0x45:
            (n,) = struct.unpack_from("<H", req.payload)
            qk, pattern = req.payload[2 : 2 + n].decode(), req.payload[2 + n :].decode()
            await stream.send_all(encode_response(Status.OK, {"swapped": [qk, pattern]}))
        else:
            await stream.send_all(encode_response(Status.NOT_IMPLEMENTED, {"error": "no pipeline"}))

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        assert await c.decode(0, {"n_predict": 4}) == []
        assert (await c.swap_quant("q4_k", r"blk\.\d+\.ffn_.*_exps"))["swapped"] == [
            "q4_k",
            r"blk\.\d+\.ffn_.*_exps",
        ]
        with pytest.raises(HydraNotImplemented):
            await c.pipeline_attach("10.0.0.3:50052", "ffn_.*_exps")
        assert json.loads(eng.requests[-1].payload) == {"peer": "10.0.0.3:50052", "ot_split": "ffn_.*_exps"}
        assert await c.decode(0, {"n_predict": 4}) == []


async def test_decode_stop_reason(start_engine) -> None:
    """The stop reason rides on the frame that ends a DECODE (docs/protocol-notes.md
    "DECODE frames and padding"): FINAL, else the first PAD; a non-streamed
    reply without tokens has it in its meta."""
    eos, length, error = (DECODE_STOP_FLAGS[k] for k in ("eos", "length", "error"))
    real = [(7, -0.5, 0), (8, -0.75, DECODE_FLAG_FINAL | eos)]
    gate = trio.Event()

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        kind = json.loads(req.payload)["kind"]
        if kind == "eos":  # the FINAL frame says eos, padding follows
            await stream.send_all(encode_response_header(Status.OK, {}, 9 * 5) + frames(real[0]))
            await gate.wait()
            await stream.send_all(frames(real[1]) + decode_pad_frames(3))
        elif kind == "length":  # the budget used up: FINAL is the last frame
            await stream.send_all(encode_response(Status.OK, {}, frames((9, -1.0, DECODE_FLAG_FINAL | length))))
        elif kind == "error":  # no token: the first PAD frame carries the reason
            pad = frames((DECODE_PAD_TOKEN, 0.0, DECODE_FLAG_PAD | error))
            await stream.send_all(encode_response(Status.OK, {}, pad + decode_pad_frames(3)))
        elif kind == "unmarked":  # a server that sets no reason bit
            await stream.send_all(encode_response(Status.OK, {}, frames((5, -1.0, DECODE_FLAG_FINAL))))
        else:  # "stream": false and no token: an empty payload, the reason in the meta
            await stream.send_all(encode_response(Status.OK, {"stop_reason": "eos", "tokens_generated": 0}))

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        async with c.decode_stream(0, {"kind": "eos"}) as s:
            assert s.stop_reason is None
            got = [await s.__anext__()]
            assert got == real[:1] and s.stop_reason is None  # not ended yet
            gate.set()
            got += [f async for f in s]
            assert got == real and s.stop_reason == "eos"
        bare = c.decode_stream(0, {"kind": "length"})
        assert [f async for f in bare] == [(9, -1.0, DECODE_FLAG_FINAL | length)]
        assert bare.stop_reason == "length"
        async with c.decode_stream(0, {"kind": "error"}) as s:
            assert [f async for f in s] == [] and s.stop_reason == "error"
        async with c.decode_stream(0, {"kind": "unmarked"}) as s:
            assert len([f async for f in s]) == 1 and s.stop_reason is None
        async with c.decode_stream(0, {"kind": "meta"}) as s:
            assert [f async for f in s] == [] and s.stop_reason == "eos"
        assert len(eng.requests) == 5
    assert eng.connections == 1


async def test_response_stream_bare_async_for(start_engine) -> None:
    """ResponseStream shares DecodeStream's life cycle: a bare ``async for``
    sends the request, and releases the client at the end of the payload."""

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            return await reply_info(req, stream)
        await stream.send_all(encode_response(Status.OK, {"n_past": 1}, b"z" * 300_000))

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        got = b"".join([chunk async for chunk in c.state_get(0)])
        assert got == b"z" * 300_000
        assert (await c.info())["engine"] == "hydra-trio"
        s = c.state_get(0)
        async with s:
            pass  # leaving drains
        assert s.done and [chunk async for chunk in s] == []  # closed: nothing more
        assert (await c.info())["engine"] == "hydra-trio"
    assert eng.connections == 1


async def test_timeout_when_server_never_answers(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=0.5) as c:
        t0 = trio.current_time()
        with trio.fail_after(120):  # a backstop: the timeout must fire, and not before its 0.5 s
            with pytest.raises(HydraTimeout) as ei:
                await c.info(trace_id="slow")
        elapsed = trio.current_time() - t0
        assert 0.45 <= elapsed < 120
        assert ei.value.trace_id == "slow" and ei.value.status is None
        assert not c.connected
        with pytest.raises(HydraConnectionClosed):
            await c.info()


async def test_reconnect_option(start_engine) -> None:
    calls = 0

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await stream.aclose()  # drop the first request
            return
        await reply_info(req, stream)

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5, reconnect=True) as c:
        with pytest.raises(HydraConnectionClosed):
            await c.info()
        assert (await c.info())["engine"] == "hydra-trio"
    assert eng.connections == 2


async def test_concurrent_callers_are_serialized(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        await trio.sleep(0.01)
        await stream.send_all(encode_response(Status.OK, {"key": req.key}))

    eng = await start_engine(handler)
    results: dict[int, dict] = {}
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:

        async def one(i: int) -> None:
            results[i] = await c.state_meta(i)

        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(one, i)
    assert results == {i: {"key": str(i)} for i in range(8)}
    assert eng.connections == 1


async def test_connect_refused() -> None:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(HydraConnectError) as ei:
            async with HydraClient("127.0.0.1", port, timeout=5):
                pass
    assert isinstance(ei.value, OSError) and "refused" in str(ei.value).lower()


# --------------------------------------------------------------------------
# CLI (subprocess, against the same fake engine)
# --------------------------------------------------------------------------


async def run_cli(*argv: str) -> trio.CompletedProcess:
    return await trio.run_process(
        [sys.executable, "-m", "hydra_trio.hydra.commands", *argv],
        cwd=ROOT,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


async def test_cli(start_engine, tmp_path: Path) -> None:
    blob = os.urandom(300_000)

    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            await reply_info(req, stream)
        elif req.op == 0x30:
            await stream.send_all(encode_response(Status.OK, {"n_past": 3}, blob))
        elif req.op == 0x31:
            await stream.send_all(encode_response(Status.OK, {"restored": True, "bytes": len(req.payload)}))
        else:
            meta = {"success": False, "error": "slots busy", "busy_slots": [1]}
            await stream.send_all(encode_response(Status.BUSY, meta))

    eng = await start_engine(handler)
    addr = f"127.0.0.1:{eng.port}"

    r = await run_cli("info", addr, "--trace-id", "cli1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["trace"] == "cli1"

    out = tmp_path / "s.kv"
    r = await run_cli("state", "get", addr, "0", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"n_past": 3} and out.read_bytes() == blob
    assert f"wrote {len(blob)} bytes" in r.stderr.decode()

    r = await run_cli("state", "put", addr, "1", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] == len(blob)
    assert eng.requests[-1].payload == blob

    r = await run_cli("mode", addr, "combined", "--peer", "10.0.0.2:50052")
    assert r.returncode == 1
    err = r.stderr.decode()
    assert err.startswith("error: BUSY: slots busy")
    assert json.loads(err.split("\n", 1)[1])["busy_slots"] == [1]

    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        r = await run_cli("info", f"127.0.0.1:{s.getsockname()[1]}")
    assert r.returncode == 2 and b"refused" in r.stderr.lower()


# --------------------------------------------------------------------------
# Desync handling
# --------------------------------------------------------------------------


async def test_early_reply_while_put_is_sent(nursery: trio.Nursery) -> None:
    """A server that rejects a big payload after its header (BAD_REQUEST,
    then close without draining, docs/hydra-protocol.md §2) surfaces as
    HydraBadRequest even though the client is still sending."""

    async def serve(stream: trio.SocketStream) -> None:
        dec = RequestDecoder(max_payload=1 * MiB)
        try:
            while data := await stream.receive_some(65536):
                dec.feed(data)
        except Exception as exc:  # FrameTooLarge
            assert exc.header.op == 0x31
            await stream.send_all(encode_response(Status.BAD_REQUEST, {"error": "payload too large"}))
            await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with HydraClient("127.0.0.1", port, timeout=5) as c:
        with pytest.raises(HydraBadRequest, match="payload too large"):
            await c.state_put(0, b"\0" * (64 * MiB))
        assert not c.connected  # the server closed it: no reuse


async def test_cancel_mid_reply_closes_connection(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        await stream.send_all(encode_response_header(Status.OK, {}, 1000) + b"x" * 10)
        await trio.sleep_forever()

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        with trio.move_on_after(0.2) as cs:
            await c.state_get_bytes(0)
        assert cs.cancelled_caught
        assert not c.connected
        with pytest.raises(HydraConnectionClosed):
            await c.info()


async def test_bad_replies(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            return await reply_info(req, stream)
        if req.op == 0x43:  # 10 bytes: not whole 9-byte frames
            return await stream.send_all(encode_response(Status.OK, {}, b"\0" * 10))
        meta = b"not json"  # broken meta: the stream cannot be trusted
        await stream.send_all(struct.pack("<IQ", len(meta) << 8, 0) + meta)

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        with pytest.raises(HydraProtocolError, match="multiple of 9"):
            await c.decode(0, {"n_predict": 1})
        assert (await c.info())["engine"] == "hydra-trio"  # outer framing was intact
        with pytest.raises(HydraProtocolError, match="not valid JSON"):
            await c.configure({})
        assert not c.connected


async def test_nested_request_in_same_task_is_refused(start_engine) -> None:
    async def handler(req: Req, stream: trio.SocketStream) -> None:
        if req.op == 0x41:
            return await reply_info(req, stream)
        await stream.send_all(encode_response(Status.OK, {}, b"y" * 100))

    eng = await start_engine(handler)
    async with HydraClient("127.0.0.1", eng.port, timeout=5) as c:
        async with c.state_get(0) as r:
            with pytest.raises(RuntimeError, match="streamed reply open"):
                await c.info()
            assert await r.read_all() == b"y" * 100
        assert (await c.info())["engine"] == "hydra-trio"
