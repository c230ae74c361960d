"""KV state through one buffer: the transfer pool, the bulk socket loops, the decoder's
skip, and real multi-MB blobs over Hydra (plain and TLS) and HTTP on a real node: the bytes, the
checksum, the restored slot's continuation."""

from __future__ import annotations

import mmap
import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme

from hydra_trio import EngineConfig, ServerConfig
from hydra_trio.engine.kv.blobbuf import TAIL_ROOM, TRANSFER_POOL, BlobBuffer, BlobPool
from hydra_trio.engine.kv.state import verify_checksum
from hydra_trio.hydra.client import HydraClient
from hydra_trio.hydra.session import HydraSettings
from hydra_trio.models.presets import resolve_model
from hydra_trio.protocol.hydra import (
    NEED_DATA,
    Op,
    RequestDecoder,
    RequestEnded,
    RequestStarted,
    ResponseDecoder,
    ResponseStarted,
    Status,
    encode_request_header,
)
from hydra_trio.transport.frontdoor import FrontDoorSettings
from hydra_trio.transport.net import BULK_WRITE, recv_into_view, send_view
from hydra_trio.transport.tls import TlsSettings, client_context, server_context

from .conftest import embedded_node, wait_for

# ------------------------------------------------------------------------------------------- no model


def test_pool_keeps_one_idle_mapping_and_reuses_it() -> None:
    pool = BlobPool(keep_s=60)
    a = pool.take(3 << 20)
    assert len(a) == 3 << 20 and a.capacity >= (3 << 20) + TAIL_ROOM and pool.created == 1
    a.view()[:4] = b"HYKV"
    a.release()
    assert pool.idle_bytes >= 3 << 20 and len(a) == 0
    with pytest.raises(ValueError, match="released"):
        a.view()
    a.release()  # twice is harmless
    b = pool.take(1 << 20)  # smaller: the idle mapping serves it
    assert pool.reused == 1 and pool.idle_bytes == 0 and len(b) == 1 << 20
    c = pool.take(8 << 20)  # none idle: a new one
    assert pool.created == 2
    b.release()
    c.release()  # the larger one is kept, the smaller unmapped
    assert pool.idle_bytes >= 8 << 20
    d = pool.take(16 << 20)  # the idle one is too small: replaced
    assert pool.created == 3 and pool.reused == 1 and pool.idle_bytes == 0
    d.release()
    pool.keep_s = 0
    pool.trim()
    assert pool.idle_bytes == 0


def test_unpooled_buffer_has_tail_room_and_shrinks() -> None:
    b = BlobBuffer(1000, populate=True)
    assert len(b.whole()) >= 1000 + TAIL_ROOM and bytes(b.view()) == bytes(1000)
    b.size = 10
    assert len(b.view()) == 10
    b.release()  # no pool: nothing to give back, the buffer is empty
    assert len(b) == 0
    with pytest.raises(ValueError, match="no room"):
        BlobBuffer(10, _map=mmap.mmap(-1, 100))  # no tail room after the blob


def test_decoder_skip_payload() -> None:
    dec = RequestDecoder(max_payload=1 << 20)
    events = dec.feed(encode_request_header(Op.STATE_PUT, "0", "t", 10) + b"abc")
    assert isinstance(events[0], RequestStarted) and dec.payload_remaining == 7
    with pytest.raises(ValueError):
        dec.skip_payload(8)
    dec.skip_payload(4)
    assert dec.payload_remaining == 3 and dec.next_event() is NEED_DATA
    dec.skip_payload(3)
    assert dec.in_frame and dec.next_event() == RequestEnded() and dec.idle  # the end comes as an event
    with pytest.raises(ValueError):
        dec.skip_payload(1)
    dec.receive_data(encode_request_header(Op.STATE_PUT, "0", "t", 10))
    assert isinstance(dec.next_event(), RequestStarted)
    dec.receive_data(b"abc")
    with pytest.raises(ValueError):  # received bytes come before skipped ones
        dec.skip_payload(1)


def test_bulk_loops_over_a_real_socket() -> None:
    """send_view / recv_into_view move 24 MB intact in both directions; a stall and a close are reported."""
    data = bytes(range(256)) * (24 * 4096)

    async def main() -> None:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            accepted: list[trio.SocketStream] = []

            async def accept() -> None:
                accepted.append(await listener.accept())

            nursery.start_soon(accept)
            client = await trio.open_tcp_stream("127.0.0.1", port)
        server = accepted[0]
        head = b"frame header"
        into = memoryview(bytearray(len(head) + len(data)))
        counted: list[int] = []
        pieces: list[bytes] = []  # what the received callback was handed, in order

        async def send() -> None:
            await send_view(client, memoryview(data), 256 * 1024, counted.append, head=head)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            got, closed = await recv_into_view(server, into, 10.0, lambda p: pieces.append(bytes(p)))
        assert (got, closed) == (len(into), False) and into == head + data
        assert sum(counted) == len(data)  # the count is the view's bytes (the head rode in the first write)
        assert max(counted) <= BULK_WRITE  # several 256 KiB pieces per system call
        # the callback saw every byte once, in order (batched: fewer calls than reads of 64 KiB would make)
        assert b"".join(pieces) == head + data and len(pieces) > 1
        into = memoryview(bytearray(len(data)))
        # nothing more comes: a stall is reported after the progress timeout, with what did arrive (and told)
        await client.send_all(b"xyz")
        pieces.clear()
        got, closed = await recv_into_view(server, into, 0.3, lambda p: pieces.append(bytes(p)))
        assert (got, closed) == (3, False) and into[:3] == b"xyz" and pieces == [b"xyz"]
        await client.aclose()
        got, closed = await recv_into_view(server, into, 5.0)
        assert (got, closed) == (0, True)
        await server.aclose()
        await listener.aclose()

    trio.run(main)


# ------------------------------------------------------------------------------------------- a real node


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("kvcerts")
    ca = trustme.CA()
    ca_pem, cert, key = d / "ca.pem", d / "node.pem", d / "node.key"
    ca.cert_pem.write_to_path(str(ca_pem))
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.private_key_pem.write_to_path(str(key))
    for i, pem in enumerate(leaf.cert_chain_pems):
        pem.write_to_path(str(cert), append=i > 0)
    return ca_pem, cert, key


REQUEST_TIMEOUT = 10.0  # the node's seconds without progress inside a request (and, in a reply, a send)


@pytest.fixture(scope="module")
def node(certs: tuple[Path, Path, Path]) -> Iterator[Any]:
    """The default model, 2 slots, TLS on its port (plain served too), in a thread of this process."""
    _, cert, key = certs
    path, _ = resolve_model("smollm2-135m")
    config = ServerConfig(
        port=0,
        rpc_backend=None,
        hydra=HydraSettings(request_timeout=REQUEST_TIMEOUT),
        frontdoor=FrontDoorSettings(tls=server_context(TlsSettings(cert, key))),
        engine=EngineConfig(model_path=path, model_alias="kv", n_parallel=2, n_ctx=4096),
    )
    with embedded_node(config) as server:
        yield server


N_TOKENS = 400  # about 9 MB of KV state (f16) on the default model


@pytest.fixture(scope="module")
def prompt(node: Any) -> list[int]:
    """Slot 0 holds these tokens."""
    base = f"http://127.0.0.1:{node.port}"
    text = (Path(__file__).resolve().parent.parent / "docs" / "http-api.md").read_text()[:20000]
    tokens = httpx.post(base + "/tokenize", json={"content": text}, timeout=60).json()["tokens"][:N_TOKENS]
    assert len(tokens) == N_TOKENS
    r = httpx.post(base + "/completion", json={"prompt": tokens, "n_predict": 0, "id_slot": 0}, timeout=600)
    assert r.status_code == 200, r.text
    return tokens


def continuation(base: str, id_slot: int, tokens: list[int]) -> dict[str, Any]:
    r = httpx.post(
        base + "/completion", json={"prompt": tokens, "n_predict": 8, "temperature": 0, "id_slot": id_slot}, timeout=300
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("transport", ["plain", "tls"])
def test_large_blob_round_trip(node: Any, prompt: list[int], certs: tuple[Path, Path, Path], transport: str) -> None:
    """STATE_GET into one buffer (the socket writes into it on plain TCP), the same bytes as the chunked
    read; STATE_PUT of it into the empty slot 1 (received into a pooled buffer); slot 1 then continues
    exactly as slot 0 does, from the cache."""
    base = f"http://127.0.0.1:{node.port}"
    assert httpx.post(base + "/slots/1?action=erase", timeout=60).status_code == 200
    ctx = client_context(certs[0]) if transport == "tls" else None
    reused = TRANSFER_POOL.reused

    async def main() -> tuple[dict[str, Any], bytes]:
        async with HydraClient("127.0.0.1", node.port, timeout=120, ssl_context=ctx) as c:
            meta, view = await c.state_get_into(0)
            blob = bytes(view)
            assert len(blob) == meta["state_size"] > 5_000_000 and meta["n_past"] == N_TOKENS
            header = verify_checksum(blob)  # whole and intact
            assert header.n_tokens == N_TOKENS
            assert struct.unpack_from(f"<{N_TOKENS}I", blob, header.tokens_at) == tuple(prompt)
            _, chunked = await c.state_get_bytes(0)  # the chunk-by-chunk read: the same bytes
            assert chunked == blob
            own = bytearray(len(blob) + 100)  # a caller's buffer, larger than the blob
            _, view2 = await c.state_get_into(0, own)
            assert view2 == blob and view2.obj is own
            with pytest.raises(ValueError, match="hold"):
                await c.state_get_into(0, bytearray(10))
            assert (await c.info())["engine"] == "hydra-trio"  # the connection is still in sync
            put = await c.state_put(1, blob)
            return put, blob

    put, blob = trio.run(main)
    assert put["restored"] is True and put["bytes"] == len(blob) and put["n_past"] == N_TOKENS
    assert TRANSFER_POOL.reused > reused  # later transfers took the kept buffer
    more = prompt + [prompt[5], prompt[6]]
    there, here = continuation(base, 1, more), continuation(base, 0, more)
    assert there["content"] == here["content"] and there["tokens_predicted"] == 8
    assert there["timings"]["cache_n"] == N_TOKENS  # slot 1 evaluated only the 2 new tokens
    assert (
        httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 0, "id_slot": 0}, timeout=300).status_code
        == 200
    )  # slot 0 back to exactly the prompt


def test_http_slot_state_through_one_buffer(node: Any, prompt: list[int]) -> None:
    """GET /slots/0/state streams the blob with its Content-Length; a PUT of it (over 1 MiB: read into a
    pooled buffer) restores slot 1, which then continues from the cache."""
    base = f"http://127.0.0.1:{node.port}"
    with httpx.Client(base_url=base, timeout=300) as c:
        assert c.post("/slots/1?action=erase").status_code == 200
        r = c.get("/slots/0/state")
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content) > 5_000_000
        assert r.headers["x-n-past"] == str(N_TOKENS) and verify_checksum(r.content).n_tokens == N_TOKENS
        put = c.put("/slots/1/state", content=r.content)
        assert put.status_code == 200 and put.json()["n_past"] == N_TOKENS and put.json()["bytes"] == len(r.content)
        damaged = bytearray(r.content)
        damaged[len(damaged) // 2] ^= 1
        bad = c.put("/slots/1/state", content=bytes(damaged))
        assert bad.status_code == 400 and "corrupt" in bad.json()["error"]["message"], bad.text
        assert c.get("/slots/1/state/meta").json()["n_past"] == N_TOKENS  # unchanged
    more = prompt + [prompt[7]]
    assert continuation(base, 1, more)["timings"]["cache_n"] == N_TOKENS


def test_state_put_cut_off_mid_payload_changes_nothing(node: Any, prompt: list[int]) -> None:
    """A STATE_PUT announcing 4 MB whose sender stops after 1 MB and closes: the node applies nothing
    and serves on (the payload went straight into a buffer, past the decoder)."""
    base = f"http://127.0.0.1:{node.port}"
    assert httpx.get(base + "/slots/0/state/meta", timeout=60).json()["n_past"] == N_TOKENS
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(encode_request_header(Op.STATE_PUT, "0", "cut", 4_000_000) + bytes(1_000_000))
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""  # the node closes without a reply: nothing was applied

    async def info() -> dict[str, Any]:
        async with HydraClient("127.0.0.1", node.port, timeout=60) as c:
            return await c.info()

    assert trio.run(info)["engine"] == "hydra-trio"
    assert httpx.get(base + "/slots/0/state/meta", timeout=60).json()["n_past"] == N_TOKENS


@pytest.mark.parametrize("size", [4_000_000, 1000], ids=["pooled", "small"])
def test_http_state_put_whose_client_leaves_mid_body_is_no_server_error(
    node: Any, prompt: list[int], caplog: pytest.LogCaptureFixture, size: int
) -> None:
    """A PUT /slots/0/state whose client closes inside its body (a pooled buffer's read, or a small body's):
    the node logs it as a 400 request (starlette's ClientDisconnect is the client's end, not a 500 with a
    traceback at ERROR), applies nothing and serves on."""
    import logging

    caplog.set_level(logging.INFO)
    base = f"http://127.0.0.1:{node.port}"
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        port = s.getsockname()[1]
        s.sendall(
            f"PUT /slots/0/state HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode() + bytes(size // 4)
        )
    lines = wait_for(
        lambda: [
            r
            for r in caplog.records
            if r.name == "hydra_trio.http.access"
            and "PUT /slots/0/state" in r.getMessage()
            and f":{port} " in r.getMessage()
        ],
        what="the cut PUT's access line",
    )
    assert '" 400 ' in lines[0].getMessage(), lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert httpx.get(base + "/slots/0/state/meta", timeout=60).json()["n_past"] == N_TOKENS


def _tls_socket(node: Any, certs: tuple[Path, Path, Path], rcvbuf: int = 0) -> Any:
    """A blocking TLS client socket (the ssl module, not trio) to the node; ``rcvbuf``: its receive buffer
    (bytes, set before it connects: a small one keeps the node's send waiting on it)."""
    raw = socket.socket()
    raw.settimeout(120)
    if rcvbuf:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.connect(("127.0.0.1", node.port))
    return client_context(certs[0]).wrap_socket(raw, server_hostname="127.0.0.1")


def _replies(sock: Any, n: int) -> list[tuple[int, dict[str, Any]]]:
    """The next ``n`` replies on ``sock``: (status, meta) each (payloads dropped)."""
    dec, out = ResponseDecoder(), []
    while len(out) < n:
        data = sock.recv(1 << 16)
        assert data, f"the node closed after {len(out)} of {n} replies"
        out += [(ev.header.status, ev.meta) for ev in dec.feed(data) if isinstance(ev, ResponseStarted)]
    return out


def test_tls_state_put_received_on_a_thread_then_trio_goes_on(
    node: Any, prompt: list[int], certs: tuple[Path, Path, Path]
) -> None:
    """Over TLS a large STATE_PUT payload is decrypted into its buffer on a worker thread with the
    connection's own TLS state; sent as the first request on a fresh connection (TLS 1.3 session tickets
    still held back by trio) in one write with an INFO, a corrupt STATE_PUT and another INFO behind it, the
    ciphertext the thread read past each payload is served by trio afterwards: four replies in order, the
    corrupt blob refused by the checksum taken as it arrived, slot 1 restored once."""
    base = f"http://127.0.0.1:{node.port}"
    blob = httpx.get(base + "/slots/0/state", timeout=120).content
    assert len(blob) > 5_000_000
    bad = bytearray(blob)
    bad[len(bad) * 2 // 3] ^= 0x10
    assert httpx.post(base + "/slots/1?action=erase", timeout=60).status_code == 200
    frames = (
        encode_request_header(Op.STATE_PUT, "1", "tls-put", len(blob))
        + blob
        + encode_request_header(Op.INFO, "", "tls-info")
        + encode_request_header(Op.STATE_PUT, "1", "tls-bad", len(bad))
        + bytes(bad)
        + encode_request_header(Op.INFO, "", "tls-info2")
    )
    with _tls_socket(node, certs) as s:
        assert s.version() == "TLSv1.3"
        s.sendall(frames)
        (st1, put), (st2, info), (st3, refused), (st4, info2) = _replies(s, 4)
    assert st1 == Status.OK and put["restored"] is True and put["n_past"] == N_TOKENS and put["bytes"] == len(blob)
    assert st2 == st4 == Status.OK and info["engine"] == info2["engine"] == "hydra-trio"
    assert st3 == Status.ERROR and "corrupt" in refused["error"], refused
    assert httpx.get(base + "/slots/1/state/meta", timeout=60).json()["n_past"] == N_TOKENS
    assert continuation(base, 1, prompt + [prompt[9]])["timings"]["cache_n"] == N_TOKENS


def test_tls_state_put_cut_off_mid_payload_changes_nothing(
    node: Any, prompt: list[int], certs: tuple[Path, Path, Path]
) -> None:
    """Over TLS, a STATE_PUT announcing 4 MB whose sender closes after 1 MB: the worker thread sees the end,
    the node applies nothing, closes and serves on."""
    base = f"http://127.0.0.1:{node.port}"
    assert httpx.post(base + "/slots/1?action=erase", timeout=60).status_code == 200
    with _tls_socket(node, certs) as s:
        s.sendall(encode_request_header(Op.STATE_PUT, "1", "tls-cut", 4_000_000) + bytes(1_000_000))
        socket.socket.shutdown(s, socket.SHUT_WR)  # the TCP end mid-payload, without a TLS close_notify
        assert s.recv(1) == b""  # the node closes without a reply (its session tickets are read by ssl)

    async def info() -> dict[str, Any]:
        async with HydraClient("127.0.0.1", node.port, timeout=60, ssl_context=client_context(certs[0])) as c:
            return await c.info()

    assert trio.run(info)["engine"] == "hydra-trio"
    assert httpx.get(base + "/slots/1/state/meta", timeout=60).json()["n_past"] == 0


def test_tls_state_get_whose_client_leaves_mid_payload(
    node: Any, prompt: list[int], certs: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Over TLS a STATE_GET's payload is sent from a worker thread; a client that reads the first MB and
    closes ends that send (the node logs no error and serves on), and the blob's buffer goes back to the pool."""
    import logging

    caplog.set_level(logging.INFO)
    base = f"http://127.0.0.1:{node.port}"
    size = httpx.get(base + "/slots/0/state/meta", timeout=60).json()["state_size"]
    assert size > 5_000_000
    TRANSFER_POOL.clear()  # no idle mapping: the STATE_GET makes one, and gives it back when its send ends
    with _tls_socket(node, certs, rcvbuf=64 * 1024) as s:  # the kernel cannot take the rest of the blob
        s.sendall(encode_request_header(Op.STATE_GET, "0", "tls-leave"))
        got = 0
        while got < 1_000_000:
            got += len(s.recv(1 << 16))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    assert wait_for(lambda: TRANSFER_POOL.idle_bytes >= size, what="the blob's buffer back in the pool")

    async def get() -> tuple[dict[str, Any], bytes]:
        async with HydraClient("127.0.0.1", node.port, timeout=60, ssl_context=client_context(certs[0])) as c:
            meta, view = await c.state_get_into(0)
            return meta, bytes(view)

    meta, blob = trio.run(get)  # a new TLS connection gets the whole blob
    assert meta["n_past"] == N_TOKENS and verify_checksum(blob).n_tokens == N_TOKENS
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


@pytest.mark.parametrize("transport", ["plain", "tls"])
def test_state_get_whose_client_stops_reading_is_closed(
    node: Any, prompt: list[int], certs: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture, transport: str
) -> None:
    """A client that sends STATE_GET and then reads nothing, its connection kept open: after
    ``request_timeout`` seconds in which the kernel took no byte of the reply the node ends the send (over
    TLS its worker thread ends), the blob's buffer goes back to the pool, the connection is closed before
    the whole blob went out, nothing is logged as an error, and the node serves on."""
    import logging
    import threading

    caplog.set_level(logging.INFO)
    base = f"http://127.0.0.1:{node.port}"
    size = httpx.get(base + "/slots/0/state/meta", timeout=60).json()["state_size"]
    assert size > 5_000_000
    TRANSFER_POOL.clear()  # no idle mapping: the STATE_GET makes one, and gives it back when its send ends
    if transport == "tls":
        s = _tls_socket(node, certs, rcvbuf=64 * 1024)
    else:
        s = socket.socket()
        s.settimeout(120)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.connect(("127.0.0.1", node.port))
    with s:
        s.sendall(encode_request_header(Op.STATE_GET, "0", "no-reader"))
        assert s.recv(1)  # the reply has begun; from here on the client reads nothing
        wait_for(
            lambda: TRANSFER_POOL.idle_bytes >= size,
            timeout=REQUEST_TIMEOUT + 120,
            what="the stalled send given up (the blob's buffer back in the pool)",
        )
        wait_for(
            lambda: not [t for t in threading.enumerate() if t.name == "tls-bulk-send"],
            timeout=120,
            what="no TLS send thread left",
        )
        got = 1
        try:
            while data := s.recv(1 << 16):
                got += len(data)
        except (ConnectionResetError, ssl.SSLError):
            pass
        assert got < size  # closed mid-reply
    assert trio.run(_info, node.port)["engine"] == "hydra-trio"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


async def _info(port: int) -> dict[str, Any]:
    async with HydraClient("127.0.0.1", port, timeout=60) as c:
        return await c.info()


@pytest.mark.parametrize("transport", ["plain", "tls"])
async def test_a_state_put_the_node_refuses_mid_send_surfaces_its_refusal(
    certs: tuple[Path, Path, Path], transport: str
) -> None:
    """A STATE_PUT over the node's cap is refused at its header (BAD_REQUEST, then the node closes without
    reading the rest): the client, still sending its 8 MB payload (over TLS from a worker thread), gets a
    failed send and then reads the node's refusal, which it raises as HydraBadRequest, on TLS as on plain
    TCP (the send's failure leaves the TLS stream able to receive what the node sent before it closed)."""
    from hydra_trio.hydra.errors import HydraBadRequest
    from hydra_trio.node.server import serve

    ca_pem, cert, key = certs
    config = ServerConfig(
        port=0,
        rpc_backend=None,
        hydra=HydraSettings(max_state_payload=1 << 20),
        frontdoor=FrontDoorSettings(tls=server_context(TlsSettings(cert, key))),
    )
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, config)  # compute-only: the refusal comes before any op
        ctx = client_context(ca_pem) if transport == "tls" else None
        async with HydraClient("127.0.0.1", server.port, timeout=120, ssl_context=ctx) as c:
            with pytest.raises(HydraBadRequest, match="over the limit 1048576"):
                await c.state_put(0, bytes(8 << 20))
        async with HydraClient("127.0.0.1", server.port, timeout=120, ssl_context=ctx) as c:
            assert (await c.info())["engine"] == "hydra-trio"  # and it serves on
        nursery.cancel_scope.cancel()
