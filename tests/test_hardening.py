"""Regression tests for faults found by breaking the server on purpose (each was a crash, hang or wrong state)."""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time

import httpx
import pytest

from hydra_trio.cli._types import n_parallel as cli_n_parallel
from hydra_trio.engine.kv.state import blob_checksum, parse_header
from hydra_trio.engine.settings import N_PARALLEL_MAX, EngineConfig, ParameterError
from hydra_trio.protocol.hydra import Op, Status, encode_request, encode_request_header, unpack_decode_frames
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ROOT, ServerProcess, streaming, wait_for

HI = [{"role": "user", "content": "Say hi."}]


def test_penalties_do_not_kill_the_node(http: httpx.Client) -> None:
    # was: llama_sampler_init_penalties called with 4 of its 5 arguments -> TypeError on the engine thread
    for extra in ({"repeat_penalty": 1.1}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}):
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200


def test_configure_rejects_out_of_range_values(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        # was: 1e999 parsed as inf, applied, and then INFO could not be encoded
        for params in (
            {"temperature": 1e999},
            {"temperature": -5},
            {"top_k": -5},
            {"n_ctx": 2**31},
            {"n_ctx": 2**32 + 512},
            {"n_parallel": 0},
            {"n_parallel": N_PARALLEL_MAX + 1},
        ):
            status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps(params).encode())
            assert status == Status.BAD_REQUEST, (params, meta)
            assert meta["error"]
        # CONFIGURE and the command line share one bound for the slot count, with the same words
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"n_parallel": N_PARALLEL_MAX + 1}).encode())
        assert meta["error"] == f"n_parallel: must be between 1 and {N_PARALLEL_MAX}, got {N_PARALLEL_MAX + 1}"
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be between 1 and {N_PARALLEL_MAX} "):
            cli_n_parallel(str(N_PARALLEL_MAX + 1))
        assert cli_n_parallel(str(N_PARALLEL_MAX)) == N_PARALLEL_MAX == 256  # llama.cpp's LLAMA_MAX_SEQ
        with pytest.raises(ParameterError, match=f"n_parallel: must be between 1 and {N_PARALLEL_MAX}, got 0"):
            EngineConfig(ROOT / "unused.gguf", "unused", n_parallel=0)
        status, meta, _ = w.call(Op.INFO)
        assert status == Status.OK and meta["sampling_defaults"]["temperature"] == 0.8


def test_deeply_nested_json_is_a_bad_request(server: ServerProcess) -> None:
    # was: RecursionError escaped the parser and the connection closed without a reply
    with Wire(server.port) as w:
        for op in (Op.CONFIGURE, Op.SET_EXPERT_MODE, Op.PREFILL, Op.DECODE):
            status, meta, _ = w.call(op, key="0", payload=b"[" * 100_000)
            assert status == Status.BAD_REQUEST and "nested" in meta["error"], (op, meta)
        assert w.call(Op.INFO)[0] == Status.OK


@pytest.mark.parametrize("key", [" 1", "1 ", "+1", "00", "01", "1_0", "\uff11", "\u0663", "0x1", ""])
def test_slot_keys_are_plain_decimals(server: ServerProcess, key: str) -> None:
    with Wire(server.port) as w:
        status, meta, _ = w.call(Op.STATE_META, key=key)
    assert status == Status.BAD_REQUEST, meta


def test_http_slot_ids_are_plain_decimals(http: httpx.Client) -> None:
    assert http.get("/slots/%EF%BC%91/state/meta").status_code == 400
    assert http.get("/slots/1_0/state/meta").status_code == 400
    assert http.get("/slots/1/state/meta").status_code == 200


def test_sequential_slot_requests_never_see_busy(server: ServerProcess, http: httpx.Client) -> None:
    # was: the slot was released after Finished reached the client, so the next request saw BUSY
    body = json.dumps({"messages": HI, "n_predict": 2, "temperature": 0}).encode()
    with Wire(server.port) as w:
        for _ in range(10):
            status, meta, payload = w.call(Op.DECODE, key="2", payload=body)
            assert status == Status.OK, meta
            assert len(payload) == 18
    for _ in range(5):
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "id_slot": 2})
        assert r.status_code == 200
        with Wire(server.port) as w:
            status, meta, _ = w.call(Op.PREFILL, key="2", payload=json.dumps({"messages": HI}).encode())
        assert status == Status.OK, meta
        assert http.get("/slots").json()[2]["is_processing"] is False


def _blob_tokens(blob: bytes) -> list[int]:
    """The token ids a state blob carries (after its header)."""
    header = parse_header(blob)
    return list(struct.unpack_from(f"<{header.n_tokens}I", blob, header.tokens_at))


def test_concurrent_prefills_on_one_slot(server: ServerProcess, http: httpx.Client) -> None:
    # was: both got OK and one reply carried the other request's KV
    chats = [[{"role": "user", "content": f"Topic {i}: " + "words " * 40}] for i in range(2)]
    bodies = [json.dumps({"messages": c}).encode() for c in chats]
    own = []  # each prompt's own tokenization: the template's text, tokenized as the chat endpoint does
    for c in chats:
        prompt = http.post("/apply-template", json={"messages": c}).json()["prompt"]
        own.append(http.post("/tokenize", json={"content": prompt, "parse_special": True}).json()["tokens"])
    assert own[0] != own[1]
    # BUSY, made to happen: the slot is processing a streamed request when the PREFILL arrives
    with (
        streaming(server.base, {"prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "id_slot": 3}),
        Wire(server.port) as w,
    ):
        status, meta, blob = w.call(Op.PREFILL, key="3", payload=bodies[0])
        assert status == Status.BUSY and meta["busy_slots"] == [3] and blob == b"", meta
    # the closed stream's slot frees only once the node has seen its client go and the engine's next step has
    # dropped it: until then both racing PREFILLs would get BUSY (a reply pair that proves nothing)
    wait_for(
        lambda: not http.get("/slots").json()[3]["is_processing"],
        timeout=120,
        what="slot 3 free after the closed stream",
    )
    # two PREFILLs racing for the slot: each reply that is OK carries the KV of its own prompt, never the other's
    for _ in range(3):
        replies: list[tuple[int, dict, bytes]] = []
        with Wire(server.port) as a, Wire(server.port) as b:
            a.send(encode_request(Op.PREFILL, key="3", payload=bodies[0]))
            b.send(encode_request(Op.PREFILL, key="3", payload=bodies[1]))
            replies = [a.read_reply(), b.read_reply()]
        statuses = sorted(r[0] for r in replies)
        assert statuses in ([Status.OK, Status.OK], [Status.OK, Status.BUSY]), replies
        for i, (status, meta, blob) in enumerate(replies):
            if status == Status.OK:
                assert meta["n_past"] == meta["tokens_processed"] + meta["cache_n"]
                assert len(blob) == meta["state_size"]
                assert _blob_tokens(blob) == own[i], i  # swapped blobs would hold the other prompt's tokens
                assert meta["n_past"] == len(own[i])
            else:
                assert meta["busy_slots"] == [3]


def test_decode_rejects_negative_budget(server: ServerProcess) -> None:
    with Wire(server.port) as w:
        status, meta, _ = w.call(Op.DECODE, key="0", payload=json.dumps({"messages": HI, "n_predict": -5}).encode())
        assert status == Status.BAD_REQUEST and "n_predict" in meta["error"]
        status, meta, payload = w.call(
            Op.DECODE, key="0", payload=json.dumps({"messages": HI, "n_predict": -1}).encode()
        )
        assert status == Status.OK and len(payload) == 9 * meta["n_predict"]
        assert unpack_decode_frames(payload)


def test_pipelined_request_before_bad_bytes_gets_its_reply(server: ServerProcess) -> None:
    # was: the decoder's completed events were dropped when the next frame was bad
    with Wire(server.port) as w:
        w.send(encode_request(Op.INFO) + b"XX" + bytes(14))
        status, meta, _ = w.read_reply()
        assert status == Status.OK and meta["engine"] == "hydra-trio"
        assert w.closed_by_server()
    with Wire(server.port) as w:
        w.send(encode_request(Op.INFO) + encode_request_header(Op.CONFIGURE, payload_len=1 << 40))
        assert w.read_reply()[0] == Status.OK
        status, meta, _ = w.read_reply()
        assert status == Status.BAD_REQUEST
        assert w.closed_by_server()


def test_small_context_long_prompt_is_a_clear_error(spawn) -> None:
    # was: llama.cpp capped n_batch at n_ctx, the engine kept 512, and GGML_ASSERT aborted the process
    srv = spawn("-c", "128", "-np", "1", "--no-rpc-backend")
    srv.wait_ready()
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello " * 100, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 or (r.status_code == 400 and "context" in r.json()["error"]["message"]), r.text
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello " * 300, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert srv.proc.poll() is None


def test_model_load_errors_exit_cleanly(spawn, tmp_path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    srv = spawn("-m", str(fake), "--no-rpc-backend")
    assert srv.proc.wait(60) == 1
    assert "fatal: llama.cpp could not load" in srv.log()
    big = spawn("-c", str(10**9), "--no-rpc-backend")
    assert big.proc.wait(60) == 1
    assert "n_ctx" in big.log()


def test_port_in_use_exits(server: ServerProcess) -> None:
    # was: the signal task kept the nursery open and the process hung after the error
    out = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "run", "--port", str(server.port)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Address already in use" in out.stderr


def test_slow_sender_cannot_hold_a_hydra_connection() -> None:
    """One byte now and then does not keep a Hydra connection open past the request timeout."""
    import trio

    from hydra_trio import EngineConfig, ServerConfig, serve
    from hydra_trio.hydra.server import HydraSettings
    from hydra_trio.models.presets import resolve_model

    path, alias = resolve_model("smollm2-135m")

    async def main() -> tuple[float, int]:
        config = ServerConfig(
            port=0,
            engine=EngineConfig(path, alias, n_parallel=1, n_ctx=512),
            rpc_backend=None,
            hydra=HydraSettings(request_timeout=1.0),
        )
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            frame = encode_request(Op.INFO, key="k" * 40)
            t0 = trio.current_time()
            closed_after, sent = -1.0, 0
            for i in range(len(frame)):
                try:
                    await stream.send_all(frame[i : i + 1])
                    sent += 1
                except trio.BrokenResourceError:
                    closed_after = trio.current_time() - t0
                    break
                with trio.move_on_after(0.3):
                    if await stream.receive_some(100) == b"":
                        closed_after = trio.current_time() - t0
                        break
            await stream.aclose()
            nursery.cancel_scope.cancel()
            return closed_after, sent

    closed_after, sent = trio.run(main)
    # closed while the frame was still trickling in (all of it takes 0.3 s a byte), and not before the
    # request timeout; the upper bound is only a backstop for a busy machine
    assert sent < len(encode_request(Op.INFO, key="k" * 40)), (sent, closed_after)
    assert 0.9 <= closed_after < 120, closed_after


def test_many_idle_connections_do_not_block_others(server: ServerProcess, http: httpx.Client) -> None:
    socks = []
    try:
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", server.port)))
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200
        assert time.monotonic() - t0 < 120  # blocked would be never: a bound of minutes, not a speed check
    finally:
        for s in socks:
            s.close()


def reseal(blob: bytearray) -> None:
    """Write a tampered blob's checksum again (what a buggy or hostile peer that knows the format could send)."""
    blob[52:60] = blob_checksum(blob).to_bytes(8, "little")


def test_state_put_rejected_by_llama_leaves_slot_as_it_was(server: ServerProcess, http: httpx.Client) -> None:
    """A blob whose header checks pass but whose KV bytes llama.cpp refuses: the old state is put back."""
    msgs = [{"role": "user", "content": "Name a large city."}]
    ref = http.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0, "id_slot": 0}
    ).json()
    with Wire(server.port) as w:
        before = w.call(Op.STATE_META, key="0")[1]
        status, meta, blob = w.call(Op.STATE_GET, key="0")
        assert status == Status.OK
        bad = bytearray(blob)
        kv_at = parse_header(blob).tokens_at + 4 * meta["n_past"]
        bad[kv_at : kv_at + 4] = (0xFFFFFFFF).to_bytes(4, "little")  # the stream's cell count: impossible
        reseal(bad)  # a valid checksum: the bytes reach llama.cpp, which must refuse them
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=bytes(bad))
        assert status == Status.ERROR and "rejected" in meta["error"]
        assert w.call(Op.STATE_META, key="0")[1]["n_past"] == before["n_past"]
        # into an empty slot (no backup needed): it stays empty
        assert http.post("/slots/1?action=erase").status_code == 200
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=bytes(bad))
        assert status == Status.ERROR
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == 0
        # the real blob still restores
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=blob)
        assert status == Status.OK and meta["n_past"] == before["n_past"] and meta["bytes"] == len(blob)
    again = http.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0, "id_slot": 0}
    ).json()
    assert again["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert again["timings"]["cache_n"] > 0
