"""Live, stateful fuzzing of a running hydra-trio server over real sockets (hypothesis).

:class:`LiveServerMachine` interleaves valid requests of all three protocols
with garbage, disconnects mid-request, slow senders, KV round trips and mode
switches.  After every step it checks the invariants of issue "fuzzing and
hardening": every request got a well-formed reply or its connection closed,
nothing hung past its timeout, ``/health`` is 200, no slot is processing
without a request, and INFO agrees with ``/slots``.

Point it at a server with :func:`configure` (``python -m fuzz`` does this and
starts the server itself).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from hydra_trio.http.settings import HttpSettings
from hydra_trio.protocol import ggml_rpc as _g
from hydra_trio.protocol.hydra import (
    Op,
    Status,
    encode_request,
)

from . import wire
from .findings import FINDINGS, timeouts_are_findings
from .hostile import HostileRules
from .strategies import (
    RPC_BUFFER_SIZE,
    GgmlRpcMutant,
    Mutant,
    Req,
    RpcStep,
    SizedCase,
    StatusRead,
    deep_grammars,
    deep_json_bodies,
    extreme_schemas,
    ggml_rpc_hellos,
    ggml_rpc_mutants,
    ggml_rpc_silent_openings,
    ggml_rpc_truncated,
    http_requests,
    long_prompts,
    long_request_lists,
    many_part_chat_bodies,
    nearly_valid_requests,
    random_first_bytes,
    status_reads,
    valid_requests,
    wide_and_deep_schemas,
)
from .wire import STATS, configure

STATUS_READ_LIMIT = 10.0
"""Seconds a status read may take while a slot evaluates a long prompt: it answers from the engine's
snapshot, so only a read that waits for the engine thread (a batch, or the whole prefill) gets near it."""

__all__ = ["FINDINGS", "STATS", "LiveServerMachine", "configure"]


class LiveServerMachine(HostileRules):
    """Stateful fuzzing of one live server (see the module docstring); :class:`fuzz.hostile.HostileRules` adds
    long requests, vanishing clients, hostile numbers and corrupt blobs."""

    def __init__(self) -> None:
        super().__init__()
        STATS["examples"] += 1
        self.http = httpx.Client(base_url=wire.base(), timeout=wire.TIMEOUT)

    def teardown(self) -> None:
        self.http.close()

    # -------------------------------------------------------------- HTTP
    @rule(
        content=st.text(min_size=1, max_size=40),
        max_tokens=st.integers(0, 8),
        stream=st.booleans(),
        slot=st.integers(-1, 3),
    )
    @timeouts_are_findings
    def http_chat(self, content: str, max_tokens: int, stream: bool, slot: int) -> None:
        STATS["http"] += 1
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": stream,
            "temperature": 0,
            "id_slot": slot,
        }
        r = self.http.post("/v1/chat/completions", json=body)
        # llama-server's rules: an id_slot past the last slot wraps around (id_slot % n_slots); a budget of 0
        # evaluates the prompt and still reports the one token sampled from it
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            reply = r.json()
            assert reply["usage"]["completion_tokens"] <= max(max_tokens, 1)
            assert reply["id_slot"] == slot % int(wire.TARGET["n_slots"]) if slot >= 0 else True  # type: ignore[call-overload]

    @rule(
        body=st.one_of(
            st.binary(max_size=300),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
                lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                max_leaves=20,
            ).map(lambda v: json.dumps(v).encode()),
        )
    )
    @timeouts_are_findings
    def http_bad_body(self, body: bytes) -> None:
        STATS["http"] += 1
        r = self.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error"

    @rule(schema=extreme_schemas())
    @timeouts_are_findings
    def http_extreme_schema(self, schema: dict) -> None:
        """A schema is converted, or refused with a 400 naming why (the schema's limit; for a schema nested past
        the body's depth limit, the body's); never a 500, never a hang."""
        STATS["http"] += 1
        r = _post_sized(
            self.http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "json_schema": schema},
        )
        if r is not None and r.status_code == 400:
            message = r.json()["error"]["message"]
            assert message.startswith("json_schema") or "nested deeper than" in message, r.text[:300]

    @rule(body=many_part_chat_bodies())
    @timeouts_are_findings
    def http_many_parts(self, body: dict) -> None:
        """Bodies of many small parts are answered (400 over a limit), in bounded time."""
        STATS["http"] += 1
        r = _post_sized(self.http, "/v1/chat/completions", {**body, "max_tokens": 1})
        if r is not None and r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error"

    @rule(case=st.one_of(wide_and_deep_schemas(), deep_json_bodies(), long_request_lists(), deep_grammars()))
    @timeouts_are_findings
    def http_sized_request(self, case: SizedCase) -> None:
        """A request whose size would drive recursion, time or memory: answered (200), or refused with a 400
        naming the limit; the node serves the next request."""
        STATS["http"] += 1
        r = self.http.post("/v1/chat/completions", content=case.body, headers={"Content-Type": "application/json"})
        text = r.json()["error"]["message"] if r.status_code == 400 else ""
        if case.limits:
            assert r.status_code == 400 and any(k in text for k in case.limits), (case.what, r.status_code, text[:300])
        else:
            assert r.status_code == 200 or "context holds" in text, (case.what, r.status_code, r.text[:300])

    @rule(raw=st.binary(min_size=1, max_size=200), method=st.sampled_from([b"GET ", b"POST ", b"PUT ", b"HEAD "]))
    @timeouts_are_findings
    def http_garbage_request(self, raw: bytes, method: bytes) -> None:
        STATS["garbage"] += 1
        with wire.connect() as s:
            s.sendall(method + raw + b"\r\n\r\n")
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data == b"" or data.startswith(b"HTTP/1.1 "), data[:80]

    @rule(raw=http_requests())
    @timeouts_are_findings
    def http_raw(self, raw: bytes) -> None:
        STATS["http"] += 1
        data = wire.exchange_until_close(raw)
        assert data == b"" or data.startswith(b"HTTP/1.1 "), data[:80]
        # _exchange_until_close half-closes after sending: the server takes that as the client
        # leaving (as llama-server does), so a request that was still running is cancelled (503)
        if data.startswith(b"HTTP/1.1 5") and b"the request was cancelled" not in data:
            raise AssertionError(f"server error: {data[:200]!r}")

    @rule(n=st.integers(2, 4), tokens=st.integers(1, 6))
    @timeouts_are_findings
    def http_concurrent_completions(self, n: int, tokens: int) -> None:
        import concurrent.futures

        STATS["http"] += n

        def one(i: int) -> int:
            r = httpx.post(
                wire.base() + "/v1/completions",
                timeout=wire.TIMEOUT,
                json={"prompt": f"Item {i}:", "max_tokens": tokens, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            assert all(k <= tokens for k in pool.map(one, range(n)))

    # ------------------------------------------------------------- Hydra
    @rule(req=valid_requests(max_payload=512))
    @timeouts_are_findings
    def hydra_valid_frame(self, req: Req) -> None:
        STATS["hydra"] += 1
        if req.op == Op.CONFIGURE:
            return  # random CONFIGURE bodies could legitimately retune the engine; covered below
        reply = wire.hydra_exchange([req.encode()])
        if req.flags:
            assert reply is not None and reply[0] == Status.BAD_REQUEST
        elif reply is not None and req.op not in set(Op):
            assert reply[0] == Status.NOT_IMPLEMENTED

    @rule(m=nearly_valid_requests())
    @timeouts_are_findings
    def hydra_nearly_valid(self, m: Mutant) -> None:
        STATS["hydra"] += 1
        if m.req.op == Op.CONFIGURE:
            return
        wire.hydra_exchange([m.data], half_close=True)

    @rule(slot=st.integers(0, 3))
    @timeouts_are_findings
    def hydra_info_and_meta(self, slot: int) -> None:
        STATS["hydra"] += 1
        status, meta, _ = wire.hydra_exchange([encode_request(Op.INFO, trace_id="fuzz")])  # type: ignore[misc]
        assert status == Status.OK and meta["engine"] == "hydra-trio"
        reply = wire.hydra_exchange([encode_request(Op.STATE_META, key=str(slot))])
        assert reply is not None
        assert reply[0] == (Status.OK if slot < int(wire.TARGET["n_slots"]) else Status.NOT_FOUND)  # type: ignore[call-overload]

    @rule(text=long_prompts(), slot=st.integers(0, 3), reads=status_reads(2))
    @timeouts_are_findings
    def status_reads_during_prefill(self, text: str, slot: int, reads: list[StatusRead]) -> None:
        """Status reads while one slot evaluates a long prompt answer at once (from the engine's
        snapshot) with consistent values: the other slots keep their ``n_past`` and stay idle, the busy
        slot's ``n_past`` only grows, and once the completion returns every read shows its final
        ``n_past``."""
        STATS["http"] += 1
        n_slots = int(wire.TARGET["n_slots"])  # type: ignore[call-overload]
        slot %= n_slots
        before = {s["id"]: s["n_past"] for s in self.http.get("/slots").json()}
        done, out = threading.Event(), {}

        def prefill() -> None:
            try:
                with httpx.Client(base_url=wire.base(), timeout=wire.TIMEOUT * 5) as c:
                    out["r"] = c.post(
                        "/completion",
                        json={"prompt": text, "n_predict": 1, "id_slot": slot, "cache_prompt": False, "temperature": 0},
                    )
            finally:
                done.set()

        worker = threading.Thread(target=prefill, daemon=True)
        worker.start()
        seen: list[int] = []

        def check(sid: int, n_past: int, processing: bool) -> None:
            if sid != slot:
                assert n_past == before[sid] and not processing, f"idle slot {sid} changed during a prefill"
            elif processing:
                assert not seen or n_past >= seen[-1], f"slot {slot}'s n_past went back: {seen} then {n_past}"
                seen.append(n_past)

        try:
            for read in reads:
                if done.is_set():
                    break
                t0 = time.monotonic()
                if read.kind == "http":
                    r = self.http.get(read.target)
                    assert r.status_code == 200, (read, r.status_code, r.text[:200])
                    body = r.json()
                    if read.target == "/slots":
                        for s in body:
                            check(s["id"], s["n_past"], s["is_processing"])
                    elif read.target.endswith("/state/meta"):
                        check(body["slot_id"], body["n_past"], body["is_processing"])
                    elif read.target == "/props":
                        assert body["total_slots"] == n_slots
                    else:
                        assert body["status"] == "ok"
                else:
                    STATS["hydra"] += 1
                    op = Op.INFO if read.target == "INFO" else Op.STATE_META
                    status, meta, _ = wire.hydra_exchange([encode_request(op, key=read.key)])  # type: ignore[misc]
                    assert status == Status.OK, (read, meta)
                    if op == Op.INFO:
                        assert meta["n_slots"] == n_slots and set(meta["slots_processing"]) <= {slot}, meta
                    else:
                        check(meta["slot_id"], meta["n_past"], meta["is_processing"])
                STATS["prefill_status_reads"] += 1
                took = time.monotonic() - t0
                assert took < STATUS_READ_LIMIT, f"{read} took {took:.1f} s during a prefill: it waited for the engine"
        finally:
            worker.join(wire.TIMEOUT * 5)
        r = out.get("r")
        assert r is not None and r.status_code == 200, r.text if r is not None else "no reply"
        final = r.json()["tokens_cached"]
        assert not seen or max(seen) <= final, (seen, final)
        s = self.http.get("/slots").json()[slot]
        assert s["n_past"] == final and not s["is_processing"], (s, final)
        status, meta, _ = wire.hydra_exchange([encode_request(Op.STATE_META, key=str(slot))])  # type: ignore[misc]
        assert status == Status.OK and meta["n_past"] == final and not meta["is_processing"], meta

    @rule(slot=st.integers(0, 1))
    @timeouts_are_findings
    def hydra_state_round_trip(self, slot: int) -> None:
        STATS["hydra"] += 1
        got = wire.hydra_exchange([encode_request(Op.STATE_GET, key=str(slot))])
        assert got is not None
        if got[0] == Status.BUSY:
            return
        assert got[0] == Status.OK, got[1]
        put = wire.hydra_exchange([encode_request(Op.STATE_PUT, key=str(slot), payload=got[2])])
        assert put is not None and put[0] in (Status.OK, Status.BUSY), put[1]
        if put[0] == Status.OK:
            assert put[1]["n_past"] == got[1]["n_past"]

    @rule(mode=st.sampled_from([b"solo", b"combined", b'{"mode":"solo"}', b"{bad", b"turbo"]))
    @timeouts_are_findings
    def hydra_mode_switch(self, mode: bytes) -> None:
        STATS["hydra"] += 1
        reply = wire.hydra_exchange([encode_request(Op.SET_EXPERT_MODE, payload=mode)])
        assert reply is not None
        if mode in (b"{bad", b"turbo"):
            assert reply[0] == Status.BAD_REQUEST
        else:
            assert reply[0] in (Status.OK, Status.BUSY) and reply[1]["mode"] == "solo"

    @rule(req=valid_requests(max_payload=2048), cut=st.floats(0.0, 0.99))
    @timeouts_are_findings
    def hydra_disconnect_mid_request(self, req: Req, cut: float) -> None:
        STATS["disconnects"] += 1
        data = req.encode()
        with wire.connect() as s:
            s.sendall(data[: int(len(data) * cut)])

    @rule(pause=st.floats(0.0, 0.05))
    @timeouts_are_findings
    def hydra_slow_sender(self, pause: float) -> None:
        STATS["hydra"] += 1
        data = encode_request(Op.INFO, trace_id="slow")
        reply = wire.hydra_exchange([data[:3], data[3:10], data[10:]], pause=pause)
        assert reply is not None and reply[0] == Status.OK

    # ----------------------------------------------------- other first bytes
    @rule(first=random_first_bytes())
    @timeouts_are_findings
    def random_first_byte(self, first: bytes) -> None:
        STATS["garbage"] += 1
        if first[:1] in (b"Y", b"\x0e") or first[:1].isupper():
            return  # real protocols: covered by their own rules
        with wire.connect() as s:
            s.sendall(first)
            try:
                assert s.recv(16) == b""
            except ConnectionResetError:
                pass  # closed with unread bytes pending: a reset is a close too

    @rule(hello=ggml_rpc_hellos())
    @timeouts_are_findings
    def ggml_rpc_hello(self, hello: bytes) -> None:
        STATS["ggml_rpc"] += 1
        reply = wire.exchange_until_close(hello)
        if hello == b"\x0e" + (24).to_bytes(8, "little") + bytes(24):
            assert len(reply) >= 36 and reply[8] == 7, reply  # the real backend answered
        else:
            assert len(reply) in (0, 36), reply  # a bad opening gets closed (or answered, if it happens to parse)

    @rule(opening=ggml_rpc_silent_openings())
    @timeouts_are_findings
    def ggml_rpc_silent_client(self, opening: bytes) -> None:
        """A client that goes quiet inside its HELLO must not block anyone's HELLO."""
        STATS["ggml_rpc"] += 1
        pid = wire.rpc_pid()
        with wire.connect() as silent:
            silent.sendall(opening)
            wire.ggml_backend_answers(pid)

    @rule(steps=ggml_rpc_truncated())
    @timeouts_are_findings
    def ggml_rpc_truncated_message(self, steps: list[RpcStep]) -> None:
        """A session that disconnects in the middle of a message (its buffer handles are made up, so
        the real server may refuse it earlier: any ending is fine but a crash or a hang)."""
        STATS["disconnects"] += 1
        pid = wire.rpc_pid()
        with wire.connect() as s:
            try:
                for step in steps:
                    s.sendall(step.request)
                    if step.reply is not None:
                        wire.ggml_reply(s)
            except (ConnectionError, OSError):
                pass  # refused on the way
        wire.ggml_backend_answers(pid)

    @rule(m=ggml_rpc_mutants())
    @timeouts_are_findings
    def ggml_rpc_malformed(self, m: GgmlRpcMutant) -> None:
        """Crashing GRAPH_COMPUTEs, bad tensors, bad framing: closed before the child sees them."""
        STATS["garbage"] += 1
        pid = wire.rpc_pid()
        with wire.connect() as s:
            s.sendall(_g.hello_request())
            wire.ggml_reply(s)
            buffer = base = 0
            if m.needs_buffer:
                s.sendall(_g.encode_request(_g.RpcCmd.ALLOC_BUFFER, struct.pack("<IQ", 0, RPC_BUFFER_SIZE)))
                buffer, size = struct.unpack("<QQ", wire.ggml_reply(s))
                assert buffer and size >= RPC_BUFFER_SIZE
                s.sendall(_g.encode_request(_g.RpcCmd.BUFFER_GET_BASE, struct.pack("<Q", buffer)))
                (base,) = struct.unpack("<Q", wire.ggml_reply(s))
            try:
                s.sendall(m.make(buffer, base))
            except OSError:
                pass  # closed while we were still sending: refused
            assert wire.closes(s), f"{m.kind}: the front door neither refused it nor closed"
        wire.ggml_backend_answers(pid)

    # ---------------------------------------------------------- invariants
    @invariant()
    def server_healthy_and_slots_idle(self) -> None:
        STATS["steps"] += 1
        assert self.http.get("/health").json() == {"status": "ok", "stage": "ready"}
        # A request whose client has just gone can still be on its way in (its
        # job is being built when the step ends) and then be cancelled at the
        # engine's next step: poll until /slots and INFO agree that all is idle.
        deadline = time.monotonic() + wire.TIMEOUT
        while True:
            slots = self.http.get("/slots").json()
            busy = [s["id"] for s in slots if s["is_processing"]]
            status, meta, _ = wire.hydra_exchange([encode_request(Op.INFO)])  # type: ignore[misc]
            assert status == Status.OK and meta["n_slots"] == len(slots)
            if (not busy and meta["slots_processing"] == []) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert busy == [] and meta["slots_processing"] == [], f"slots {busy} processing with no request in flight"

    @invariant()
    def connections_released(self) -> None:
        """Every connection a step opened is closed by the server soon after its client left.

        Open now: this machine's keep-alive client and the scrape itself.  A
        leaked connection (a handler that never ends) stays and fails this.
        """
        deadline = time.monotonic() + wire.TIMEOUT
        while True:
            open_now = _metric(self.http.get("/metrics").text, "hydra_trio:connections_open")
            if open_now <= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert open_now <= 2, f"{open_now:.0f} connections still open after the step"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def _post_sized(http: Any, path: str, body: dict) -> Any:
    """POST ``body``: a body over the node's limit must be a 413 naming the limit (then None is returned),
    any other an answer of 200 or 400 (returned)."""
    data = json.dumps(body).encode()
    r = http.post(path, content=data, headers={"Content-Type": "application/json"})
    if len(data) > HttpSettings().max_body:
        assert r.status_code == 413 and "the limit is" in r.text, r.text[:300]
        return None
    assert r.status_code in (200, 400), r.text[:300]
    return r
