"""ggml-RPC beyond HELLO over TLS, quickly (no MoE, no model upload): the tunnel (:mod:`hydra_trio.transport.tunnel`)
and the front door's TLS pump (:mod:`hydra_trio.rpc_backend.pump`, its trio path) carry real messages both
ways — buffers allocated, a 1 MiB tensor written and read back — to a real compute-only node with TLS.

The slow tests in tests/test_tls.py run COMBINED through the tunnel with the test MoE; these cover the
same parts in the normal suite: raw ggml-RPC (:class:`tests.test_rpc_backend.AsyncRpc`) through an
:class:`~hydra_trio.transport.tunnel.RpcTunnel` (plain loopback in, TLS out) or straight over TLS.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.protocol import ggml_rpc as g
from hydra_trio.protocol.ggml_rpc import RpcCmd, RpcTensor
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire
from hydra_trio.transport.blocking import LowWater
from hydra_trio.transport.tls import client_context
from hydra_trio.transport.tunnel import RpcTunnel, TunnelPool, _RequestBounds

from .conftest import ServerProcess, wait_for
from .test_rpc_backend import AsyncRpc, RawRpc, slow_read_of_a_big_reply
from .test_tls import Certs

N = 1 << 18  # f32 values: a 1 MiB tensor


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def tls_peer(certs: Certs, spawn) -> ServerProcess:
    """A compute-only node (ggml-RPC backend, no model) with TLS on its port."""
    node = spawn("--no-model", *certs.tls_flags())
    node.wait_ready()
    return node


def rpc_backend(port: int) -> dict:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK
    return meta["rpc_backend"]


async def round_trip(rpc: AsyncRpc) -> None:
    """HELLO, DEVICE_COUNT, a 1 MiB buffer, SET_TENSOR of N random f32 values, GET_TENSOR of them back
    (equal, byte for byte), FREE_BUFFER; then HELLO's neighbour GET_ALIGNMENT still answers (in sync)."""
    assert len(await rpc.call(RpcCmd.HELLO, bytes(24), g.HELLO_REPLY_SIZE)) == g.HELLO_REPLY_SIZE
    assert struct.unpack("<I", await rpc.call(RpcCmd.DEVICE_COUNT, b"", 4)) == (1,)
    ptr, size = struct.unpack("<QQ", await rpc.call(RpcCmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 4 * N), 16))
    assert ptr != 0 and size >= 4 * N
    (base,) = struct.unpack("<Q", await rpc.call(RpcCmd.BUFFER_GET_BASE, struct.pack("<Q", ptr), 8))
    t = RpcTensor(id=1, type=0, buffer=ptr, ne=(N, 1, 1, 1), nb=(4, 4 * N, 4 * N, 4 * N), data=base)
    data = os.urandom(4 * N)
    await rpc.stream.send_all(g.encode_set_tensor(t, 0, data))  # no reply
    back = await rpc.call(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, 4 * N), 4 * N)
    assert back == data
    part = await rpc.call(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 4096, 64), 64)
    assert part == data[4096:4160]
    await rpc.call(RpcCmd.FREE_BUFFER, struct.pack("<Q", ptr))  # no reply
    (alignment,) = struct.unpack("<Q", await rpc.call(RpcCmd.GET_ALIGNMENT, struct.pack("<I", 0), 8))
    assert alignment >= 1


async def test_ggml_rpc_through_the_tunnel_to_a_tls_node(tls_peer: ServerProcess, certs: Certs) -> None:
    before = await trio.to_thread.run_sync(rpc_backend, tls_peer.port)
    tunnel = RpcTunnel(f"127.0.0.1:{tls_peer.port}", client_context(certs.ca_pem))
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnel.run)
        host, port = tunnel.local.rsplit(":", 1)
        assert host == "127.0.0.1"
        rpc = await AsyncRpc.connect(int(port))
        async with rpc.stream:
            await round_trip(rpc)
        nursery.cancel_scope.cancel()
    assert (tunnel.connections, tunnel.failed) == (1, 0)
    after = await trio.to_thread.run_sync(rpc_backend, tls_peer.port)
    assert after["bytes_in"] - before["bytes_in"] >= 4 * N  # the tensor reached the node's backend
    assert after["connections"] == before["connections"] + 1


def test_a_slow_tls_reader_is_served_and_no_child_killed(certs: Certs, spawn) -> None:
    """Over TLS (the front door's TlsPipe): a 1 MiB reply read at 128 KiB/s, longer than the stall
    timeout behind one blocked send, all arrives (the client's kernel acknowledging bytes is progress);
    the child is never killed (``backend_stall``)."""
    node = spawn("--no-model", "--rpc-stall-timeout", "1", *certs.tls_flags())
    node.wait_ready()
    pid = rpc_backend(node.port)["pid"]
    with RawRpc(node.port) as c:
        c.sock = client_context(certs.ca_pem).wrap_socket(c.sock, server_hostname="127.0.0.1")
        c.hello()
        assert slow_read_of_a_big_reply(c, 1 << 20) == 1 << 20
        assert c.device_count() == 1
    r = rpc_backend(node.port)
    assert (r["pid"], r["crashes"], r["trio_pumped"]) == (pid, 0, 0)
    assert {k: v for k, v in r["closed"].items() if v} == {}


async def test_ggml_rpc_straight_over_tls_beyond_hello(tls_peer: ServerProcess, certs: Certs) -> None:
    tcp = await trio.open_tcp_stream("127.0.0.1", tls_peer.port)
    tls = trio.SSLStream(tcp, client_context(certs.ca_pem), server_hostname="127.0.0.1")
    rpc = AsyncRpc(tls)  # type: ignore[arg-type]
    async with tls:
        await round_trip(rpc)
    # and a second connection after the first closed: the backend serves it too
    tcp = await trio.open_tcp_stream("127.0.0.1", tls_peer.port)
    tls = trio.SSLStream(tcp, client_context(certs.ca_pem), server_hostname="127.0.0.1")
    async with tls:
        await round_trip(AsyncRpc(tls))  # type: ignore[arg-type]


async def test_a_tunnel_to_a_peer_it_cannot_verify_closes_the_connection(tls_peer: ServerProcess, certs: Certs) -> None:
    tunnel = RpcTunnel(f"127.0.0.1:{tls_peer.port}", client_context(certs.other_ca_pem))
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnel.run)
        rpc = await AsyncRpc.connect(int(tunnel.local.rsplit(":", 1)[1]))
        async with rpc.stream:
            await rpc.stream.send_all(g.hello_request())
            with trio.fail_after(120):  # closed with no reply (a reset, our HELLO unread, is a close too)
                try:
                    got = await rpc.stream.receive_some(1)
                except trio.BrokenResourceError:
                    got = b""
            assert got == b""  # ggml's client sees an unreachable peer
        nursery.cancel_scope.cancel()
    assert (tunnel.connections, tunnel.failed) == (0, 1)


async def test_the_pool_starts_one_tunnel_per_peer(tls_peer: ServerProcess, certs: Certs) -> None:
    pool = TunnelPool(client_context(certs.ca_pem), limit=2)
    peer = f"127.0.0.1:{tls_peer.port}"
    with pytest.raises(OSError, match="not running"):
        await pool.local_for(peer)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        local = await pool.local_for(peer)
        assert await pool.local_for(peer) == local  # the same tunnel for the same peer
        # the engine thread's way in: dial from a worker thread
        assert await trio.to_thread.run_sync(pool.dial, peer) == local
        with pytest.raises(OSError, match="no TLS tunnel to not a peer"):
            await trio.to_thread.run_sync(pool.dial, "not a peer")
        other = await pool.local_for("127.0.0.1:1")  # a second peer: its own tunnel (it connects lazily)
        assert other != local
        with pytest.raises(OSError, match="2 TLS tunnels"):
            await pool.local_for("127.0.0.1:2")  # past the limit: no new peer
        rpc = await AsyncRpc.connect(int(local.rsplit(":", 1)[1]))
        async with rpc.stream:
            await round_trip(rpc)
        assert pool.stats() == {
            peer: {"local": local, "connections": 1, "failed": 0},
            "127.0.0.1:1": {"local": other, "connections": 0, "failed": 0},
        }
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["reset", "fin"])
async def test_a_tls_client_gone_mid_message_leaves_the_backend_to_the_next(
    tls_peer: ServerProcess, certs: Certs, how: str
) -> None:
    """A TLS ggml-RPC client that goes away inside a SET_TENSOR (its payload announced, a part sent; then a
    TCP reset, or a FIN with no close_notify): the pump ends that connection and the backend serves the
    next client whole."""
    import socket

    tcp = await trio.open_tcp_stream("127.0.0.1", tls_peer.port)
    tls = trio.SSLStream(tcp, client_context(certs.ca_pem), server_hostname="127.0.0.1")
    rpc = AsyncRpc(tls)  # type: ignore[arg-type]
    assert len(await rpc.call(RpcCmd.HELLO, bytes(24), g.HELLO_REPLY_SIZE)) == g.HELLO_REPLY_SIZE
    ptr, _ = struct.unpack("<QQ", await rpc.call(RpcCmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 4 * N), 16))
    (base,) = struct.unpack("<Q", await rpc.call(RpcCmd.BUFFER_GET_BASE, struct.pack("<Q", ptr), 8))
    t = RpcTensor(id=1, type=0, buffer=ptr, ne=(N, 1, 1, 1), nb=(4, 4 * N, 4 * N, 4 * N), data=base)
    whole = g.encode_set_tensor(t, 0, bytes(4 * N))
    await tls.send_all(whole[: len(whole) // 3])  # the message announced whole, a third of it sent
    if how == "reset":
        tcp.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await tcp.aclose()  # the TCP socket only: no close_notify
    tcp = await trio.open_tcp_stream("127.0.0.1", tls_peer.port)
    tls = trio.SSLStream(tcp, client_context(certs.ca_pem), server_hostname="127.0.0.1")
    with trio.fail_after(120):
        async with tls:
            await round_trip(AsyncRpc(tls))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 17), st.binary(max_size=600)), min_size=1, max_size=6), st.data())
def test_the_tunnels_low_water_mark_never_outruns_the_request_under_way(
    requests: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    """The tunnel waits for at most the rest of the request a client is sending (a 9-byte header
    between requests), whatever the pieces the bytes arrive in: it can never wait for bytes
    ggml's client holds back until it has an answer."""
    stream = b"".join(g.encode_request(cmd, payload) for cmd, payload in requests)
    ends = set(itertools.accumulate(len(g.encode_request(c, p)) for c, p in requests))
    bounds = _RequestBounds()
    at = 0
    for cut in sorted(set(data.draw(st.lists(st.integers(1, len(stream)), max_size=8)))) + [len(stream)]:
        if cut <= at:
            continue
        bounds.feed(memoryview(stream[at:cut]))
        at = cut
        rest = 9 if at in ends else min(e for e in ends if e > at) - at  # of the request under way
        assert 1 <= bounds.low_water(1 << 18) <= rest, at
    assert bounds.low_water(1 << 18) == 9 and bounds.low_water(4) == 4  # between requests: a header


def test_a_low_water_receive_returns_once_the_mark_is_there_counting_bytes_already_queued() -> None:
    """LowWater (the pump's and the tunnel's receives): one byte queued before the receive, eight after:
    it returns the nine (a blocking recv under SO_RCVLOWAT would copy the one, then wait for nine more)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server, _ = listener.accept()
    with listener, client, server:
        low = LowWater(server)
        client.sendall(b"\x0f")
        # the byte is queued before the receive starts (loopback delivery may lag the send on a busy
        # machine: waited for, not slept for)
        wait_for(lambda: low.queued() == 1, timeout=60, what="the first byte queued")
        low.set(9)
        got: list[int] = []
        buf = bytearray(64)
        reader = threading.Thread(target=lambda: got.append(low.recv_into(buf)), daemon=True)
        reader.start()
        time.sleep(0.2)
        assert got == []  # one byte is below the mark: no wake-up
        client.sendall(bytes(8))
        reader.join(10)
        assert got == [9] and buf[:9] == b"\x0f" + bytes(8)
        assert low.queued() == 0
        client.sendall(b"\x01\x02")
        wait_for(lambda: low.queued() == 2, timeout=60, what="the two bytes queued")
        low.set(1)
        assert low.recv_into(buf) == 2
        client.close()
        low.set(9)
        assert low.recv_into(buf) == 0  # the end wakes it below the mark
