"""The live event stream: the bus itself in-process, and ``GET /v1/events`` on real servers."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket_url

from hydra_trio.observability.events import CATEGORIES, EventBus, parse_types
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess, streaming


# ------------------------------------------------------------------ the bus, in-process
async def test_slow_subscriber_gets_a_dropped_count_and_never_blocks_the_publisher() -> None:
    bus = EventBus()
    with bus.subscribe(maxlen=2) as sub:
        # from another thread, as the engine thread publishes: returns at once however full the queue is
        await trio.to_thread.run_sync(lambda: [bus.publish("slot.assigned", f"t{i}", slot=i) for i in range(5)])
        await trio.testing.wait_all_tasks_blocked()
        first = await sub.get()
        assert first["type"] == "dropped" and first["count"] == 3
        assert [(await sub.get())["slot"] for _ in range(2)] == [0, 1]
        assert bus.dropped_total == 3 and bus.published == 5
        bus.publish("mode.changed", mode="combined")
        nxt = await sub.get()
        assert nxt["type"] == "mode.changed" and "trace_id" not in nxt
    assert bus.subscribers == 0


async def test_filter_by_category_and_recent() -> None:
    bus = EventBus()
    with bus.subscribe(["mode"]) as sub:
        bus.publish("slot.finished", "x", slot=0)
        bus.publish("mode.changed", mode="solo")
        got = await sub.get()
        assert got["type"] == "mode.changed" and not sub.queue
    assert [e["type"] for e in bus.recent(frozenset({"slot"}))] == ["slot.finished"]
    # the once-a-second stats samples never push the events out of the history: only the newest is kept
    small = EventBus(history=5)
    small.publish("slot.finished", "old", slot=1)
    for i in range(300):
        small.publish("stats", n=i)
    assert [(e["type"], e.get("n")) for e in small.recent(None, 50)] == [("slot.finished", None), ("stats", 299)]
    assert [e["type"] for e in small.recent(frozenset({"slot"}))] == ["slot.finished"]
    assert parse_types("slot, mode") == {"slot", "mode"} and parse_types("") is None
    with pytest.raises(ValueError, match="unknown event categories"):
        parse_types("slot,bogus")


async def test_closing_the_bus_ends_every_subscription() -> None:
    bus = EventBus()
    with bus.subscribe() as sub:
        bus.close()
        with pytest.raises(trio.EndOfChannel):
            await sub.get()
    with pytest.raises(RuntimeError), bus.subscribe():
        pass


# ------------------------------------------------------------------ live, over a WebSocket
class Reader:
    """Collects a subscriber's events in the background; :meth:`wait_for` polls them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._changed = trio.Event()

    async def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        with trio.fail_after(timeout):
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                self._changed = trio.Event()
                await self._changed.wait()

    def add(self, e: dict[str, Any]) -> None:
        self.events.append(e)
        self._changed.set()


@asynccontextmanager
async def subscribed(port: int, query: str = "") -> AsyncIterator[Reader]:
    reader = Reader()
    async with open_websocket_url(f"ws://127.0.0.1:{port}/v1/events{query}") as ws, trio.open_nursery() as nursery:

        async def pump() -> None:
            try:
                while True:
                    reader.add(json.loads(await ws.get_message()))
            except ConnectionClosed:
                pass

        nursery.start_soon(pump)
        yield reader
        nursery.cancel_scope.cancel()


async def test_a_completion_shows_as_slot_events_with_the_replys_timings(server: ServerProcess) -> None:
    async with subscribed(server.port, "?types=slot") as reader:
        hello = await reader.wait_for(lambda e: True)
        assert hello["type"] == "hello" and hello["model"] == "smollm2-135m" and hello["n_slots"] == 4
        reply = await trio.to_thread.run_sync(
            lambda: httpx.post(
                server.base + "/v1/completions",
                json={"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                timeout=120,
            ).json()
        )
        rid = reply["id"]
        done = await reader.wait_for(lambda e: e["type"] == "slot.finished" and e.get("trace_id") == rid)
        kinds = [e["type"] for e in reader.events if e.get("trace_id") == rid]
        assert kinds == ["slot.assigned", "slot.first_token", "slot.finished"]
        assert done["slot"] == reply["id_slot"] and done["finish_reason"] == "length"
        assert done["timings"]["predicted_n"] == reply["usage"]["completion_tokens"] == 6
        assert done["timings"]["prompt_n"] == reply["timings"]["prompt_n"]
        assert all(e["type"].startswith("slot.") or e["type"] in ("hello", "dropped") for e in reader.events)
        assert all(isinstance(e["ts"], float) for e in reader.events)


async def test_a_cancelled_stream_is_a_slot_cancelled_event(server: ServerProcess) -> None:
    async with subscribed(server.port, "?types=slot") as reader:

        def run() -> None:
            with streaming(server.base, {"prompt": "Count to one thousand:", "max_tokens": 4000, "ignore_eos": True}):
                pass

        await trio.to_thread.run_sync(run)
        cancelled = await reader.wait_for(lambda e: e["type"] == "slot.cancelled")
        assert cancelled["n_decoded"] >= 1 and cancelled["trace_id"].startswith("cmpl-")


async def test_stats_every_second_and_control_busy_and_state_events(server: ServerProcess) -> None:
    async with subscribed(server.port, "?types=stats,control,state") as reader:
        stats = await reader.wait_for(lambda e: e["type"] == "stats")
        assert stats["stage"] == "ready" and stats["mode"] == "solo" and len(stats["slots"]) == 4
        assert stats["connections"]["http"] >= 1 and stats["subscribers"] >= 1

        def processing_tick(e: dict) -> bool:
            return e["type"] == "stats" and any(s["state"] == "processing" and s["n_decoded"] >= 1 for s in e["slots"])

        def busy_switch() -> tuple[int, dict]:
            body = {"prompt": "Count to one thousand:", "max_tokens": 4000, "ignore_eos": True, "id_slot": 0}
            with streaming(server.base, body):
                with Wire(server.port) as w:
                    status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo", trace_id="evt-busy")
                # the stream runs until a stats tick has shown its slot at work
                trio.from_thread.run(reader.wait_for, processing_tick)
                return status, meta

        status, meta = await trio.to_thread.run_sync(busy_switch)
        assert status == Status.BUSY
        busy = await reader.wait_for(lambda e: e["type"] == "control.busy")
        assert busy["trace_id"] == "evt-busy" and busy["busy_slots"] == meta["busy_slots"] and busy["busy_slots"]
        busy_stats = [
            e for e in reader.events if e["type"] == "stats" and any(s["state"] == "processing" for s in e["slots"])
        ]
        assert busy_stats  # the stream ran across a tick (it was held until one came): its slot showed its tokens
        assert max(s["n_decoded"] for e in busy_stats for s in e["slots"]) >= 1
        assert [s["id"] for s in busy_stats[-1]["slots"] if s["state"] == "processing"] == [0]

        def round_trip() -> int:
            with Wire(server.port) as w:
                status, _meta, blob = w.call(Op.STATE_GET, key="3", trace_id="evt-get")
                assert status == Status.OK
                status, _meta, _ = w.call(Op.STATE_PUT, key="1", payload=blob, trace_id="evt-put")
                assert status == Status.OK
                status, _meta, _ = w.call(Op.STATE_PUT, key="1", payload=b"\0" * 64, trace_id="evt-bad")
                assert status != Status.OK
                return len(blob)

        size = await trio.to_thread.run_sync(round_trip)
        got = await reader.wait_for(lambda e: e["type"] == "state.get" and e.get("trace_id") == "evt-get")
        assert got["slot"] == 3 and got["bytes"] == size and got["result"] == "ok" and got["ms"] >= 0
        put = await reader.wait_for(lambda e: e["type"] == "state.put" and e.get("trace_id") == "evt-put")
        assert put["bytes"] == size and put["result"] == "ok"
        bad = await reader.wait_for(lambda e: e["type"] == "state.put" and e.get("trace_id") == "evt-bad")
        assert bad["result"] != "ok" and bad["bytes"] == 64


@pytest.mark.parametrize(
    "query, named",
    [
        ("types=slot,nope", "nope"),
        ("types=" + "%C3%A9" * 200, "unknown event categories"),
        ("queue=0", "queue"),
        ("queue=99999999999999", "queue"),
        ("recent=%EF%BC%91", "recent"),
        ("recent=-1", "recent"),
    ],
)
async def test_a_bad_query_is_refused_with_400_and_a_reason(server: ServerProcess, query: str, named: str) -> None:
    """The handshake is answered 400 with an OpenAI-style error body naming the parameter (a close before
    the handshake would reach the client as a bare 403 with no reason)."""
    with pytest.raises(ConnectionRejected) as info:
        async with open_websocket_url(f"ws://127.0.0.1:{server.port}/v1/events?{query}") as ws:
            await ws.get_message()
    assert info.value.status_code == 400
    error = json.loads(info.value.body)["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400


def _vanish(port: int) -> None:
    """Open the upgrade by hand and drop the TCP connection without a close frame."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"GET /v1/events HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    assert s.recv(12).startswith(b"HTTP/1.1 101")
    s.close()


async def test_many_subscribers_that_vanish_free_everything(server: ServerProcess) -> None:
    client = httpx.Client(base_url=server.base, timeout=30)  # one keep-alive connection: it counts once

    def open_now() -> int:
        text = client.get("/metrics").text
        return int(float(text.split("\nhydra_trio:connections_open ")[1].split()[0]))

    before = await trio.to_thread.run_sync(open_now)
    threads = [threading.Thread(target=_vanish, args=(server.port,)) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    async with trio.open_nursery() as nursery:  # and some that close properly
        for _ in range(10):

            async def polite() -> None:
                async with subscribed(server.port) as r:
                    await r.wait_for(lambda e: e["type"] == "hello")

            nursery.start_soon(polite)
    async with subscribed(server.port, "?types=stats") as reader:
        await reader.wait_for(lambda e: e["type"] == "stats" and e["subscribers"] == 1, timeout=120)
        text = await trio.to_thread.run_sync(lambda: client.get("/metrics").text)
        assert "\nhydra_trio:event_subscribers 1.0" in text
    # closed sockets linger until hypercorn's keep-alive timer (5 s) notices them: allow for it
    with trio.fail_after(120):
        while await trio.to_thread.run_sync(open_now) > before:
            await trio.sleep(0.5)
    await trio.to_thread.run_sync(client.close)


def _hold(port: int) -> socket.socket:
    """An event subscriber that never reads and never leaves (until closed)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(
        b"GET /v1/events HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    return s


def test_subscribers_cannot_take_every_connection_of_the_node(spawn) -> None:
    """Subscribers stay forever; past their cap (a quarter of --max-connections) a handshake gets 503, so
    they never hold every connection slot: HTTP and Hydra keep being answered."""
    srv = spawn("-np", "1", "-c", "512", "--max-connections", "8")
    srv.wait_ready()
    held = [_hold(srv.port) for _ in range(2)]
    try:
        for s in held:
            assert s.recv(12).startswith(b"HTTP/1.1 101")
        extra = [_hold(srv.port) for _ in range(8)]
        for s in extra:
            reply = s.recv(4096)
            while b"}}" not in reply and (more := s.recv(4096)):
                reply += more
            assert reply.startswith(b"HTTP/1.1 503"), reply
            assert b"event subscribers" in reply
            s.close()
        assert httpx.get(srv.base + "/health", timeout=60).status_code == 200
        with Wire(srv.port) as w:
            assert w.call(Op.INFO)[0] == Status.OK
        held.pop().close()
        for _ in range(600):  # the freed place is taken again
            s = _hold(srv.port)
            if s.recv(12).startswith(b"HTTP/1.1 101"):
                held.append(s)
                break
            s.close()
            threading.Event().wait(0.1)
        else:
            raise AssertionError("a freed subscriber place was never given again")
    finally:
        for s in held:
            s.close()


def test_the_events_address_without_an_upgrade_and_in_absolute_form(server: ServerProcess) -> None:
    """A plain GET is told to upgrade (426, RFC 9110 §15.5.22), not that the route does not exist; the
    absolute form of the target (RFC 9112 §3.2.2) reaches the stream as it does every other route; a
    handshake to an address that does not exist is a 404 with the usual error body."""
    r = httpx.get(server.base + "/v1/events", timeout=60)
    assert r.status_code == 426 and r.headers["upgrade"] == "websocket", (r.status_code, r.text)
    assert r.json()["error"]["code"] == 426 and "WebSocket" in r.json()["error"]["message"]
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(
        b"GET http://x/v1/events HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    try:
        assert s.recv(12).startswith(b"HTTP/1.1 101")
    finally:
        s.close()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(
        b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    reply = b""
    try:
        while b"}}" not in reply and (more := s.recv(4096)):
            reply += more
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 404") and b"no route for /v1/nowhere" in reply, reply  # not a bare 403


def test_categories_are_documented_in_the_operations_page() -> None:
    from hydra_trio.testing.spawn import ROOT

    page = (ROOT / "docs" / "operations.md").read_text()
    for c in CATEGORIES:
        assert f"`{c}" in page, c


async def test_a_killed_ggml_rpc_child_shows_as_died_then_restarted(spawn) -> None:
    node = spawn("--no-model")
    await trio.to_thread.run_sync(node.wait_ready)
    async with subscribed(node.port, "?types=rpc&recent=20") as reader:
        started = await reader.wait_for(lambda e: e["type"] == "rpc.child_started")
        os.kill(started["pid"], signal.SIGKILL)
        died = await reader.wait_for(lambda e: e["type"] == "rpc.child_died", timeout=120)
        assert died["pid"] == started["pid"] and died["code"] == -signal.SIGKILL and "SIGKILL" in died["how"]
        again = await reader.wait_for(lambda e: e["type"] == "rpc.child_restarted", timeout=120)
        assert again["pid"] != started["pid"] and again["restarts"] == 1


async def test_an_unreachable_peer_is_a_peer_fallback_event(spawn) -> None:
    server = spawn("-np", "1")  # its own node: the peer it is given stays in its INFO
    await trio.to_thread.run_sync(server.wait_ready)
    async with subscribed(server.port, "?types=peer,mode,control") as reader:

        def switch() -> dict:
            with Wire(server.port) as w:
                status, meta, _ = w.call(
                    Op.SET_EXPERT_MODE,
                    payload=json.dumps({"mode": "combined", "peer": "127.0.0.1:1"}).encode(),
                    trace_id="evt-peer",
                )
                assert status == Status.OK, meta
                return meta

        meta = await trio.to_thread.run_sync(switch)
        assert meta["success"] is False and meta["mode"] == "solo"
        fallback = await reader.wait_for(lambda e: e["type"] == "peer.fallback")
        assert fallback["peer"] == "127.0.0.1:1" and fallback["mode"] == "solo" and fallback["reason"]
        applied = await reader.wait_for(lambda e: e["type"] == "control.applied" and e.get("trace_id") == "evt-peer")
        assert applied["success"] is False
        assert not [e for e in reader.events if e["type"] == "mode.changed"]  # SOLO stayed SOLO
