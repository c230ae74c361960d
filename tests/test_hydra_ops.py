"""The Hydra operations (:mod:`hydra_trio.hydra.ops`) against a node embedded in this trio run (the library
API), over real loopback sockets, on the real engine (the packaged default model):

* BUSY on a busy slot for PREFILL, DECODE and STATE_PUT: a streamed DECODE holds the slot (its header
  is out, so its slot is assigned; its budget of 2000 tokens, EOS ignored, keeps it processing);
* a streamed DECODE that fails after its header went out: the rest of the budget is padding and the
  frame that ends it carries the error stop reason (docs/protocol-notes.md "DECODE frames and padding");
  the failure is the engine's own path for a failed step (``Scheduler.fail_all`` with an
  ``EngineFailure``), run on the engine thread between two steps through ``Engine.call``;
* CONFIGURE tier 3 (a model reload, docs/hydra-protocol.md §3): to another model and back, refused BUSY
  while a slot works, refused for a file llama.cpp cannot load; nothing changes when refused.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import attrs
import trio

from hydra_trio import EngineConfig, ServerConfig, resolve_model, serve
from hydra_trio.engine.engine import Engine
from hydra_trio.engine.tasks import EngineTask
from hydra_trio.errors import EngineFailure
from hydra_trio.protocol.decode_frames import (
    DECODE_FLAG_FINAL,
    DECODE_FLAG_PAD,
    DECODE_PAD_FRAME,
    decode_stop_reason,
)
from hydra_trio.protocol.hydra import (
    Op,
    PayloadChunk,
    ResponseDecoder,
    ResponseEnded,
    ResponseStarted,
    Status,
    encode_request,
)

HI = [{"role": "user", "content": "Count from one to one thousand, in words."}]
HOLD = {"messages": HI, "n_predict": 2000, "ignore_eos": True, "temperature": 0}  # keeps a slot processing


class AsyncWire:
    """One Hydra connection: raw frames over a real socket, parsed with the real codec."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.dec = ResponseDecoder()
        self.events: list[Any] = []

    @classmethod
    @asynccontextmanager
    async def open(cls, port: int) -> AsyncIterator[AsyncWire]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            yield cls(stream)

    async def send(self, op: int, key: str = "", payload: bytes = b"", trace_id: str = "test") -> None:
        await self.stream.send_all(encode_request(op, key=key, payload=payload, trace_id=trace_id))

    async def next_event(self) -> Any:
        while not self.events:
            data = await self.stream.receive_some(1 << 20)
            assert data, "the server closed the connection"
            self.events.extend(self.dec.feed(data))
        return self.events.pop(0)

    async def started(self) -> ResponseStarted:
        ev = await self.next_event()
        assert isinstance(ev, ResponseStarted), ev
        return ev

    async def payload(self, at_least: int | None = None) -> bytes:
        """Payload bytes until the reply ends, or (``at_least``) until that many have come."""
        out = bytearray()
        while at_least is None or len(out) < at_least:
            ev = await self.next_event()
            if isinstance(ev, ResponseEnded):
                break
            assert isinstance(ev, PayloadChunk), ev
            out += ev.data
        return bytes(out)

    async def call(self, op: int, key: str = "", payload: bytes = b"") -> tuple[int, dict[str, Any], bytes]:
        await self.send(op, key, payload)
        started = await self.started()
        return started.header.status, started.meta, await self.payload()


def body(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def frames(payload: bytes) -> list[tuple[int, float, int]]:
    assert len(payload) % 9 == 0
    return [struct.unpack_from("<IfB", payload, i) for i in range(0, len(payload), 9)]


@asynccontextmanager
async def node(n_ctx: int = 4096) -> AsyncIterator[Any]:
    """A node in this trio run: 2 slots of ``n_ctx / 2`` tokens, no ggml-RPC backend."""
    path, alias = resolve_model("smollm2-135m")
    config = ServerConfig(port=0, rpc_backend=None, engine=EngineConfig(path, alias, n_parallel=2, n_ctx=n_ctx))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, config)
        with trio.fail_after(300):
            await server.engine.wait_ready()
        yield server
        nursery.cancel_scope.cancel()


async def slot_idle(engine: Engine, id_slot: int) -> None:
    """Wait (at most minutes) until the slot no longer processes (a closed stream's request is cancelled)."""
    with trio.fail_after(120):
        while engine.slots[id_slot].is_processing:
            await trio.sleep(0.05)


async def test_busy_slot_refuses_prefill_decode_and_state_put_with_busy() -> None:
    async with node() as server, AsyncWire.open(server.port) as w:
        status, meta, blob = await w.call(Op.PREFILL, "0", body({"messages": HI}))
        assert status == Status.OK and len(blob) == meta["state_size"] > 0, meta
        n_past = meta["n_past"]
        async with AsyncWire.open(server.port) as holder:
            await holder.send(Op.DECODE, "0", body(HOLD))
            head = await holder.started()  # sent once slot 0 is assigned: it processes from here on
            assert head.header.status == Status.OK and head.header.payload_len == 9 * 2000
            assert server.engine.slots[0].is_processing

            status, meta, payload = await w.call(Op.PREFILL, "0", body({"messages": HI}))
            assert (status, meta["busy_slots"], payload) == (Status.BUSY, [0], b""), meta
            assert "processing" in meta["error"]
            # DECODE: BUSY is the status, not a header followed by padding
            status, meta, payload = await w.call(Op.DECODE, "0", body({"messages": HI, "n_predict": 4}))
            assert (status, meta["busy_slots"], payload) == (Status.BUSY, [0], b""), meta
            status, meta, payload = await w.call(Op.STATE_PUT, "0", blob)
            assert (status, meta["busy_slots"], payload) == (Status.BUSY, [0], b""), meta
            # the other slot serves meanwhile: BUSY is the slot's, not the node's
            status, meta, _ = await w.call(Op.PREFILL, "1", body({"messages": HI}))
            assert status == Status.OK, meta
            assert server.engine.slots[0].is_processing  # the holder was still running throughout
        await slot_idle(server.engine, 0)  # the holder's connection closed: its request is cancelled
        status, meta, _ = await w.call(Op.STATE_PUT, "0", blob)
        assert status == Status.OK and meta["restored"] is True and meta["n_past"] == n_past > 0, meta


@attrs.frozen
class FailRunning(EngineTask):
    """Engine thread, between two steps: what the engine does when a step raises (``EngineLoop._serve``) —
    every running request fails with an EngineFailure and its slot's half-decoded KV is dropped.
    Returns the slots that were running."""

    kind: ClassVar[str] = "test_fail_running"

    def run(self, engine: Engine) -> list[int]:
        return fail_running(engine)


def fail_running(engine: Engine) -> list[int]:
    assert engine.scheduler is not None
    running = [s.id for s in engine.slots if s.is_processing]
    engine.scheduler.fail_all(EngineFailure("engine error: injected by the test"))
    return running


async def test_a_decode_that_fails_after_its_header_pads_the_budget_with_the_error_stop_reason() -> None:
    async with node() as server, AsyncWire.open(server.port) as w:
        await w.send(Op.DECODE, "1", body(HOLD))
        head = await w.started()
        assert head.header.status == Status.OK and head.header.payload_len == 9 * 2000
        assert head.meta["stream"] is True and head.meta["n_predict"] == 2000
        first = await w.payload(at_least=9)  # tokens are coming: the header is long gone
        assert await server.engine.run_task(FailRunning()) == [1]
        rest = await w.payload()  # up to ResponseEnded: exactly payload_len bytes in all
        got = frames(first + rest)
        assert len(got) == 2000
        end = next(i for i, (_, _, flags) in enumerate(got) if flags & (DECODE_FLAG_FINAL | DECODE_FLAG_PAD))
        assert 0 < end < 2000 - 1, end  # it failed part-way: some tokens, then the end
        assert decode_stop_reason(got[end][2]) == "error", got[end]
        assert all(flags == 0 and token != 0xFFFFFFFF for token, _, flags in got[:end])
        # after the frame that ends it, plain PAD frames up to the budget
        assert (first + rest)[9 * (end + 1) :] == DECODE_PAD_FRAME * (2000 - end - 1)
        # the connection is in sync: the next reply on it parses
        status, meta, _ = await w.call(Op.INFO)
        assert status == Status.OK and meta["engine"]
        # the failed request's KV was dropped; the slot serves the next DECODE
        await slot_idle(server.engine, 1)
        status, meta, _ = await w.call(Op.STATE_META, "1")
        assert status == Status.OK and meta["n_past"] == 0, meta
        status, meta, payload = await w.call(Op.DECODE, "1", body({"messages": HI, "n_predict": 3, "ignore_eos": True}))
        assert status == Status.OK and len(payload) == 27
        assert decode_stop_reason(frames(payload)[-1][2]) == "length"


async def test_a_non_streamed_decode_that_fails_is_an_error_reply() -> None:
    async with node() as server, AsyncWire.open(server.port) as w:
        await w.send(Op.DECODE, "0", body({**HOLD, "stream": False}))
        with trio.fail_after(120):  # the slot is assigned and decoding
            while not (server.engine.slots[0].is_processing and server.engine.slots[0].n_decoded > 0):
                await trio.sleep(0.02)
        assert await server.engine.run_task(FailRunning()) == [0]
        head = await w.started()
        assert head.header.status == Status.ERROR and head.header.payload_len == 0
        assert "injected by the test" in head.meta["error"]
        assert await w.payload() == b""
        assert (await w.call(Op.INFO))[0] == Status.OK


async def test_configure_tier3_reloads_the_model_and_refusals_change_nothing(
    hybrid_model: Path, tmp_path: Path
) -> None:
    async with node() as server, AsyncWire.open(server.port) as w:
        info0 = (await w.call(Op.INFO))[1]
        status, meta, blob = await w.call(Op.PREFILL, "0", body({"messages": HI}))
        assert status == Status.OK

        # to another model (the generated hybrid): applied through the control channel
        status, meta, _ = await w.call(Op.CONFIGURE, payload=body({"model_path": str(hybrid_model)}))
        assert status == Status.OK, meta
        assert meta["success"] is True and meta["tier"] == 3 and meta["deferred_keys"] == []
        assert meta["params_applied"]["model_path"] == str(hybrid_model)
        info1 = (await w.call(Op.INFO))[1]
        assert info1["model_path"] == str(hybrid_model) and info1["model_hash"] != info0["model_hash"]
        # the old model's state blob is refused now (another model's), with both hashes
        status, meta, _ = await w.call(Op.STATE_PUT, "0", blob)
        assert status == Status.ERROR and meta["expected_hash"] == info1["model_hash"], meta
        assert meta["got_hash"] == info0["model_hash"]
        status, meta, payload = await w.call(Op.DECODE, "1", body({"messages": HI, "n_predict": 2, "ignore_eos": True}))
        assert status == Status.OK and len(payload) == 18 and meta["model_hash"] == info1["model_hash"]

        # refused while a slot works: BUSY, nothing applied, the model unchanged
        async with AsyncWire.open(server.port) as holder:
            await holder.send(Op.DECODE, "1", body(HOLD))
            assert (await holder.started()).header.status == Status.OK
            status, meta, _ = await w.call(Op.CONFIGURE, payload=body({"model": "smollm2-135m"}))
            assert status == Status.BUSY and meta["busy_slots"] == [1], meta
            assert meta["success"] is False and meta["params_applied"] == {} and meta["tier"] == 3
            assert (await w.call(Op.INFO))[1]["model_hash"] == info1["model_hash"]
        await slot_idle(server.engine, 1)

        # a file llama.cpp cannot load: BAD_REQUEST, the loaded model still serves
        junk = tmp_path / "not-a-model.gguf"
        junk.write_bytes(b"GGUF" + b"\0" * 64)
        status, meta, _ = await w.call(Op.CONFIGURE, payload=body({"model_path": str(junk)}))
        assert status == Status.BAD_REQUEST and meta["success"] is False and meta["params_applied"] == {}, meta
        assert (await w.call(Op.INFO))[1]["model_hash"] == info1["model_hash"]

        # back to the default model by its preset name: the first blob restores again
        status, meta, _ = await w.call(Op.CONFIGURE, payload=body({"model": "smollm2-135m"}))
        assert status == Status.OK and meta["success"] is True and meta["tier"] == 3, meta
        assert (await w.call(Op.INFO))[1]["model_hash"] == info0["model_hash"]
        status, meta, _ = await w.call(Op.STATE_PUT, "0", blob)
        assert status == Status.OK and meta["restored"] is True and meta["model_hash_match"] is True, meta
