"""ggml-RPC on the same port: compute-only nodes, a stock llama.cpp client, crash recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hydra_trio.models.presets import resolve_model
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ROOT, wait_for


def probe(where: str, prompt: str = "The capital of France is", n: int = 16) -> dict:
    """The stock client's reply (tests/rpc_client_probe.py), on SmolLM2; it ran no hydra-trio code."""
    out = subprocess.run(
        [sys.executable, "tests/rpc_client_probe.py", where, str(resolve_model("smollm2-135m")[0]), prompt, str(n)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply["hydra_trio_modules"] == [], reply["hydra_trio_modules"]
    return reply


def info(port: int) -> dict:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK
    return meta


def test_compute_only_node_serves_a_stock_llama_cpp_client(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    assert httpx.get(node.base + "/slots").json() == []
    assert httpx.get(node.base + "/version").json()["engine"] == "hydra-trio"
    before = info(node.port)
    assert before["rpc_backend_active"] is True and before["solo_active"] is False
    assert "ggml_rpc" in before["protocols"]
    # ops that need a model answer a clear error, the same on both front ends: not implemented here (NoModel)
    with Wire(node.port) as w:
        status, meta, _ = w.call(Op.STATE_META, key="0")
        assert status == Status.NOT_IMPLEMENTED and "no model" in meta["error"]
    r = httpx.post(node.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 501 and "compute-only" in r.json()["error"]["message"]
    r = httpx.get(node.base + "/slots/0/state/meta")  # a slot of a node without slots: no model, as on Hydra
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    remote = probe(f"127.0.0.1:{node.port}")
    local = probe("local")
    assert remote["devices"] == ["RPC0"] and local["devices"] == ["CPU"]
    assert remote["text"].startswith(" Paris.") and local["text"].startswith(" Paris.")
    after = info(node.port)["rpc_backend"]
    assert after["bytes_in"] - before["rpc_backend"]["bytes_in"] > 50_000_000  # the weights went over
    assert after["connections"] > before["rpc_backend"]["connections"]


def test_backend_crash_restarts_and_http_stays_up(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    first = info(node.port)["rpc_backend"]
    os.kill(first["pid"], signal.SIGKILL)

    def restarted() -> dict | None:  # HTTP answers all the while the child is down
        assert httpx.get(node.base + "/health").status_code in (200, 503)
        now = info(node.port)
        return now if now["rpc_backend"]["restarts"] >= 1 and now["rpc_backend_active"] else None

    # a fresh child process on a busy machine may take far longer than its restart delay
    now = wait_for(restarted, timeout=LONG, what="the ggml-RPC child restarted")
    assert now["rpc_backend"]["restarts"] == 1 and now["rpc_backend_active"] is True
    assert now["rpc_backend"]["pid"] != first["pid"]
    assert probe(f"127.0.0.1:{node.port}", n=4)["text"].startswith(" Paris")
    assert "restarting in" in node.log()


def test_a_child_sigtermed_alone_is_a_crash_and_restarts(spawn) -> None:
    """SIGTERM to the child alone (the node is not stopping) is a crash as before: counted and restarted; only a
    child that ends with its node's stop is not (tests/test_lifecycle.py, the process-group SIGTERM)."""
    node = spawn("--no-model")
    node.wait_ready()
    first = info(node.port)["rpc_backend"]
    os.kill(first["pid"], signal.SIGTERM)
    now = wait_for(
        lambda: (r := info(node.port))["rpc_backend"]["restarts"] >= 1 and r["rpc_backend_active"] and r,
        timeout=LONG,
        what="the ggml-RPC child restarted",
    )
    assert (now["rpc_backend"]["restarts"], now["rpc_backend"]["crashes"]) == (1, 1)
    assert now["rpc_backend"]["pid"] != first["pid"]
    assert "crashed: SIGTERM" in node.log()


# ----------------------------------------------------------------------------
# The front door's ggml-RPC queue, deadlines and validation (real child, real sockets)
# ----------------------------------------------------------------------------

import re  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

import trio  # noqa: E402

from hydra_trio.protocol import ggml_rpc as g  # noqa: E402
from hydra_trio.protocol.ggml_rpc import RpcCmd, RpcTensor  # noqa: E402
from hydra_trio.rpc_backend.backend import RpcBackend, RpcBackendSettings  # noqa: E402

LONG = 60.0  # seconds: generous bound for anything that should happen "soon" on a busy machine
GRAPH_NODE_ZERO = (
    bytes([10]) + (20).to_bytes(8, "little") + struct.pack("<IIQI", 0, 1, 0, 0)
)  # crashed an unguarded ggml-RPC server


class RawRpc:
    """A blocking ggml-RPC client over one real socket: raw messages, exact replies."""

    def __init__(self, port: int, timeout: float = LONG) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def __enter__(self) -> RawRpc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    def reply(self, size: int) -> bytes:
        (got,) = struct.unpack("<Q", self.recv_exact(8))
        assert got == size, (got, size)
        return self.recv_exact(size)

    def call(self, cmd: int, payload: bytes = b"", reply_size: int | None = None) -> bytes:
        self.send(g.encode_request(cmd, payload))
        return self.reply(reply_size) if reply_size is not None else b""

    def hello(self) -> bytes:
        return self.call(RpcCmd.HELLO, bytes(24), 28)

    def device_count(self) -> int:
        return struct.unpack("<I", self.call(RpcCmd.DEVICE_COUNT, b"", 4))[0]

    def alloc(self, size: int = 1 << 20) -> tuple[int, int]:
        ptr, _ = struct.unpack("<QQ", self.call(RpcCmd.ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))
        (base,) = struct.unpack("<Q", self.call(RpcCmd.BUFFER_GET_BASE, struct.pack("<Q", ptr), 8))
        return ptr, base

    def closed_within(self, timeout: float = LONG) -> bool:
        """True when the peer closes within ``timeout`` (bytes that arrive first are read and dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not self.sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False
        return False

    def is_open(self) -> bool:
        """Nothing to read and not closed, right now."""
        self.sock.setblocking(False)
        try:
            return self.sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        finally:
            self.sock.settimeout(LONG)


def rpc_info(port: int) -> dict:
    return info(port)["rpc_backend"]


def child_port(log: str) -> int:
    return int(re.findall(r"ggml-RPC backend serving on 127\.0\.0\.1:(\d+)", log)[-1])


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=LONG).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


def test_silent_client_does_not_block_another_clients_hello(spawn) -> None:
    node = spawn("--no-model", "--rpc-handshake-timeout", "8")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    with RawRpc(node.port) as silent:
        silent.send(b"\x0e")  # and nothing more
        wait_for(
            lambda: rpc_info(node.port)["handshaking"] == 1, timeout=LONG, what="the silent client is in its handshake"
        )
        with RawRpc(node.port) as other:
            assert other.hello()[0] == 7  # answered while the silent one is still connected
            assert other.device_count() == 1
            assert silent.is_open()
        assert silent.closed_within()  # by its handshake deadline
    now = wait_for(
        lambda: (r := rpc_info(node.port))["closed"]["handshake_timeout"] == 1 and r, timeout=LONG, what="counted"
    )
    assert now["pid"] == pid and now["crashes"] == 0 and now["handshaking"] == 0
    assert "handshake_timeout" in node.log()
    assert metric(node.base, 'hydra_rpc_clients_closed_total{reason="handshake_timeout"}') == 1


def test_crashing_messages_are_refused_and_the_backend_lives(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    with RawRpc(node.port) as c:  # GRAPH_COMPUTE naming node 0: SIGSEGV in an unguarded child
        c.hello()
        c.send(GRAPH_NODE_ZERO)
        assert c.closed_within()
    with RawRpc(node.port) as c:  # a Q4_0 tensor with ne0 = 1: GGML_ASSERT abort in an unguarded child
        c.hello()
        ptr, base = c.alloc()
        t = RpcTensor(id=1, type=2, buffer=ptr, ne=(1, 1, 1, 1), nb=(18, 18, 18, 18), data=base)
        c.send(g.encode_set_tensor(t, 0, bytes(18)))
        assert c.closed_within()
    with RawRpc(node.port) as c:  # the next client is served by the same child
        c.hello()
        assert c.device_count() == 1
    after = rpc_info(node.port)
    assert after["pid"] == pid and after["crashes"] == 0 and after["restarts"] == 0
    assert after["invalid_messages"]["graph"] == 1 and after["invalid_messages"]["tensor_shape"] == 1
    assert after["closed"]["invalid_request"] == 2
    assert metric(node.base, 'hydra_rpc_invalid_messages_total{check="graph"}') == 1
    assert "node 0 has id 0" in node.log() and "not a multiple of the block size 32" in node.log()
    # control: the same bytes straight to the child (past the front door) do crash it
    with RawRpc(child_port(node.log())) as direct:
        direct.hello()
        direct.send(GRAPH_NODE_ZERO)
        assert direct.closed_within()
    now = wait_for(
        lambda: (r := rpc_info(node.port))["crashes"] == 1 and r["pid"] != pid and r, timeout=LONG, what="crash counted"
    )
    assert now["restarts"] == 1
    assert metric(node.base, "hydra_rpc_backend_crashes_total") == 1


def test_client_connecting_during_a_restart_is_served(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    first = rpc_info(node.port)
    os.kill(first["pid"], signal.SIGKILL)
    with RawRpc(node.port) as c:  # right after the kill: held until the child is back, then served
        assert c.hello()[0] == 7
        assert c.device_count() == 1
    now = wait_for(lambda: (r := rpc_info(node.port))["crashes"] == 1 and r, timeout=LONG, what="crash counted")
    assert now["pid"] != first["pid"] and now["restarts"] == 1
    assert now["closed"]["backend_unavailable"] == 0 and now["closed"]["backend_exit"] == 0
    assert metric(node.base, "hydra_rpc_backend_crashes_total") == 1
    assert "crashed: SIGKILL" in node.log()


def test_queue_is_fifo_bounded_and_timed(spawn) -> None:
    node = spawn("--no-model", "--rpc-max-waiting", "2", "--rpc-wait-timeout", "10")
    node.wait_ready()
    a, b, c, d = (RawRpc(node.port) for _ in range(4))
    try:
        a.hello()  # served: holds the child
        b.send(g.hello_request())
        wait_for(lambda: rpc_info(node.port)["waiting"] == 1, timeout=LONG, what="b waits")
        c.send(g.hello_request())
        wait_for(lambda: rpc_info(node.port)["waiting"] == 2, timeout=LONG, what="c waits")
        d.send(g.hello_request())
        assert d.closed_within()  # beyond the bound: closed at once
        assert rpc_info(node.port)["closed"]["queue_full"] == 1
        a.sock.close()
        assert b.reply(28)[0] == 7  # first come, first served
        assert b.device_count() == 1
        assert c.is_open() and rpc_info(node.port)["waiting"] == 1
        assert c.closed_within()  # after its wait timeout, never answered
        r = wait_for(
            lambda: (r := rpc_info(node.port))["closed"]["wait_timeout"] == 1 and r,
            timeout=LONG,
            what="timeout counted",
        )
        assert r["waiting"] == 0 and r["serving"] == 1
        assert b.device_count() == 1  # the one served is undisturbed
        assert metric(node.base, "hydra_rpc_clients_serving") == 1
    finally:
        for s in (a, b, c, d):
            s.sock.close()


def test_a_waiting_client_that_hangs_up_leaves_the_queue(spawn) -> None:
    node = spawn("--no-model", "--rpc-max-waiting", "1")
    node.wait_ready()
    with RawRpc(node.port) as a:
        a.hello()
        with RawRpc(node.port) as b:
            b.send(g.hello_request())
            wait_for(lambda: rpc_info(node.port)["waiting"] == 1, timeout=LONG, what="b waits")
        wait_for(lambda: rpc_info(node.port)["waiting"] == 0, timeout=LONG, what="b left the queue")
        with RawRpc(node.port) as c:  # the place b held is free again
            c.send(g.hello_request())
            wait_for(lambda: rpc_info(node.port)["waiting"] == 1, timeout=LONG, what="c waits")
        assert rpc_info(node.port)["closed"]["queue_full"] == 0


def test_idle_between_messages_is_fine_a_stalled_message_is_not(spawn) -> None:
    node = spawn("--no-model", "--rpc-stall-timeout", "2")
    node.wait_ready()
    with RawRpc(node.port) as c:
        c.hello()
        time.sleep(3)  # longer than the stall timeout, between messages: allowed
        assert c.device_count() == 1
        c.send(g.encode_request(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", 0))[:11])  # a begun message
        assert c.closed_within()
    r = wait_for(
        lambda: (r := rpc_info(node.port))["closed"]["stall_timeout"] == 1 and r, timeout=LONG, what="stall counted"
    )
    assert r["crashes"] == 0


def test_a_message_that_keeps_arriving_slowly_is_not_a_stall(spawn) -> None:
    """The pump waits for a request's head in one receive (a low-water mark), so the bytes of a slow
    client sit in the kernel meanwhile: they still count as arriving (a byte every 0.5 s of a 13-byte
    request: its 4-byte head takes 2 s against a 1 s stall timeout), and a request split into single
    bytes is answered as a whole one is."""
    node = spawn("--no-model", "--rpc-stall-timeout", "1")
    node.wait_ready()
    with RawRpc(node.port) as c:
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one segment per byte
        c.hello()
        for byte in g.encode_request(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", 0)):
            c.send(bytes([byte]))
            time.sleep(0.5)
        free, total = struct.unpack("<QQ", c.reply(16))
        assert 0 < free <= total
        assert c.device_count() == 1
    assert rpc_info(node.port)["closed"]["stall_timeout"] == 0


def test_idle_after_each_kind_of_reply_is_not_a_backend_stall(spawn) -> None:
    """A COMBINED head keeps its connection idle between messages for as long as it likes: after every
    kind of reply (small, zero-length, streamed, and after a message that gets none) a pause longer than
    the stall timeout neither closes the connection nor kills the child (the reply tracker is between
    replies then, and nothing sits below the child socket's low-water mark)."""
    node = spawn("--no-model", "--rpc-stall-timeout", "1")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    pause = 1.5  # > the stall timeout plus the watchdog's period (a quarter of it)
    with RawRpc(node.port) as c:
        c.hello()
        time.sleep(pause)
        assert c.device_count() == 1
        time.sleep(pause)
        ptr, base = c.alloc(1 << 16)  # ALLOC_BUFFER, BUFFER_GET_BASE
        time.sleep(pause)
        t = RpcTensor(id=1, type=0, buffer=ptr, ne=(1024, 1, 1, 1), nb=(4, 4096, 4096, 4096), data=base)
        u = RpcTensor(id=2, type=0, buffer=ptr, ne=(1024, 1, 1, 1), nb=(4, 4096, 4096, 4096), data=base + 4096)
        data = bytes(range(256)) * 16
        c.call(RpcCmd.SET_TENSOR, t.pack() + struct.pack("<BQ", 0, 0) + data)  # cache flag, offset; no reply
        time.sleep(pause)
        for size in (0, 64, 65, 4096):  # empty, the largest whole one, streamed ones
            assert c.call(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, size), size) == data[:size]
            time.sleep(pause)
        assert c.call(RpcCmd.COPY_TENSOR, t.pack() + u.pack(), 1) == b"\x01"
        time.sleep(pause)
        assert c.call(RpcCmd.GET_TENSOR, u.pack() + struct.pack("<QQ", 0, 4096), 4096) == data
    r = rpc_info(node.port)
    assert (r["pid"], r["crashes"], r["restarts"]) == (pid, 0, 0)
    assert {k: v for k, v in r["closed"].items() if v} == {}


def ask_for_a_big_reply(c: RawRpc, size: int) -> None:
    """Send a GET_TENSOR of ``size`` bytes, the whole of a fresh buffer's one f32 vector."""
    ptr, base = c.alloc(size)
    t = RpcTensor(id=1, type=0, buffer=ptr, ne=(size // 4, 1, 1, 1), nb=(4, size, size, size), data=base)
    c.send(g.encode_request(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, size)))


def slow_read_of_a_big_reply(c: RawRpc, size: int) -> int:
    """GET_TENSOR of ``size`` bytes (a fresh buffer) read 64 KiB every 0.5 s; the bytes read before
    the end (``size`` when all came)."""
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # the kernel holds little of it
    ask_for_a_big_reply(c, size)
    got = 0
    try:
        assert struct.unpack("<Q", c.recv_exact(8))[0] == size
        while got < size:
            got += len(c.recv_exact(min(1 << 16, size - got)))
            time.sleep(0.5)
    except OSError:  # closed mid-reply
        pass
    return got


def test_a_slow_reader_is_served_and_one_that_reads_nothing_closed_and_no_child_killed(spawn) -> None:
    """A client reading a 1 MiB reply at 128 KiB/s keeps reading longer than the stall timeout behind
    one blocked send: it is reading, so it gets it all (before, ``stall_timeout`` after ~160 KiB: the
    watchdog saw no new send start); a client that reads nothing is closed (``stall_timeout``).  Neither
    is the child's fault: it is never killed (``backend_stall``: the pump was sending, not waiting on it)."""
    node = spawn("--no-model", "--rpc-stall-timeout", "1")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    with RawRpc(node.port) as c:
        c.hello()
        assert slow_read_of_a_big_reply(c, 1 << 20) == 1 << 20
        assert c.device_count() == 1
    assert rpc_info(node.port)["closed"]["stall_timeout"] == 0
    with RawRpc(node.port) as c:
        c.hello()
        ask_for_a_big_reply(c, 64 << 20)  # more than the sockets hold
        time.sleep(3)  # reads nothing
        assert c.closed_within()
    r = wait_for(
        lambda: (r := rpc_info(node.port))["closed"]["stall_timeout"] == 1 and r, timeout=LONG, what="stall counted"
    )
    assert (r["pid"], r["crashes"], r["restarts"], r["closed"]["backend_stall"]) == (pid, 0, 0, 0)


def mul_mat_compute(c: RawRpc, k: int, m: int, n: int) -> bytes:
    """A GRAPH_COMPUTE of one MUL_MAT, f32: a ``[k, m]`` by b ``[k, n]`` into ``[m, n]``, all three in a
    fresh buffer of ``c``'s (the request, to send as often as wanted)."""
    ptr, base = c.alloc(4 * (k * m + k * n + m * n))
    ta = RpcTensor(id=1, type=0, buffer=ptr, ne=(k, m, 1, 1), nb=(4, 4 * k, 4 * k * m, 4 * k * m), data=base)
    tb = RpcTensor(
        id=2, type=0, buffer=ptr, ne=(k, n, 1, 1), nb=(4, 4 * k, 4 * k * n, 4 * k * n), data=base + 4 * k * m
    )
    tc = RpcTensor(
        id=3,
        type=0,
        buffer=ptr,
        ne=(m, n, 1, 1),
        nb=(4, 4 * m, 4 * m * n, 4 * m * n),
        data=base + 4 * (k * m + k * n),
        op=29,
        flags=16,
        src=(1, 2) + (0,) * 8,
    )
    return g.encode_graph_compute(0, [3], [ta, tb, tc])


def test_a_child_busy_with_a_reset_clients_compute_is_not_killed_at_the_next_hello(spawn) -> None:
    """A client resets while computes it sent still run: the child, single-threaded, answers the next
    client's HELLO only once they are done, later than the handshake timeout.  It is busy, not hung:
    that HELLO waits and is answered, the child is not killed (before: closed ``handshake_timeout``
    and the healthy child killed as unresponsive)."""
    node = spawn("--no-model", "--rpc-handshake-timeout", "1")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    with RawRpc(node.port) as a:
        a.hello()
        compute = mul_mat_compute(a, 8192, 1024, 1024)
        t0 = time.monotonic()
        a.send(compute)
        assert a.device_count() == 1  # answered after the compute
        one = time.monotonic() - t0
        a.send(compute * max(1, int(4 / one) + 1))  # work for about 4 s: past the 1 s handshake timeout
        time.sleep(0.2)
        a.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    with RawRpc(node.port) as b:
        b.hello()
        assert b.device_count() == 1
    r = rpc_info(node.port)
    assert (r["pid"], r["crashes"], r["restarts"], r["closed"]["handshake_timeout"]) == (pid, 0, 0, 0)


def test_a_child_silent_through_its_busy_grace_is_killed_at_its_end(spawn) -> None:
    """A client resets with a compute in flight, and the child hangs in it (SIGSTOP): the next HELLO
    gets the busy child's grace (``--rpc-wait-timeout``), and when that ends unanswered the child is
    killed then and restarted, so the client after is served.  Before, the grace's end only closed
    that client, and the hung child was killed at the following HELLO (one more client closed)."""
    node = spawn("--no-model", "--rpc-handshake-timeout", "1", "--rpc-wait-timeout", "2")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    try:
        with RawRpc(node.port) as a:
            a.hello()
            compute = mul_mat_compute(a, 1, 1, 1)
            base_url = f"http://127.0.0.1:{node.port}"
            before = metric(base_url, 'hydra_trio:rpc_bytes_total{direction="in"}')
            os.kill(pid, signal.SIGSTOP)  # hung from here on, with the compute below unread
            a.send(compute)
            wait_for(
                lambda: metric(base_url, 'hydra_trio:rpc_bytes_total{direction="in"}') >= before + len(compute),
                timeout=LONG,
                what="the compute passed on to the child",
            )
            a.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        with RawRpc(node.port) as b:
            b.send(g.encode_request(RpcCmd.HELLO, bytes(24)))
            assert b.closed_within()  # at the grace's end (2 s), unanswered
        r = _restarted_after(node.port, pid, "handshake_timeout")
        assert (r["crashes"], r["closed"]["handshake_timeout"]) == (1, 1)
        with RawRpc(node.port) as c:
            c.hello()
            assert c.device_count() == 1
    finally:
        _resume_and_kill(pid)


def _restarted_after(port: int, old_pid: int, reason: str) -> dict:
    """The backend's stats once the client's close (``reason``) is counted and a new child (not
    ``old_pid``, which was killed: one crash) accepts connections."""

    def ready() -> dict | None:
        meta = info(port)
        r = meta["rpc_backend"]
        done = (
            r["closed"][reason] == 1
            and r["crashes"] == 1
            and r["pid"] not in (None, old_pid)
            and meta["rpc_backend_active"]
        )
        return r if done else None

    return wait_for(ready, timeout=LONG, what=f"{reason} counted and the child restarted")


def _resume_and_kill(pid: int) -> None:
    """Leave no stopped child behind a failed test (the node's teardown cannot reach a stopped one)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def test_a_child_hung_mid_reply_is_killed_and_the_next_client_served(spawn) -> None:
    """The child stops (SIGSTOP) after it has begun a big GET_TENSOR reply: the client, still reading,
    gets what was under way and then the connection's end after the stall timeout (``backend_stall``);
    the hung child is killed and a fresh one serves the next client.  Before, the client waited for
    good and so did every later one, behind the same hung child."""
    node = spawn("--no-model", "--rpc-stall-timeout", "2")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    size = 512 << 20  # far more than the sockets between child and client hold: the child is mid-reply
    try:
        with RawRpc(node.port) as c:
            c.hello()
            ptr, base = c.alloc(size)
            t = RpcTensor(id=1, type=0, buffer=ptr, ne=(size // 4, 1, 1, 1), nb=(4, size, size, size), data=base)
            c.send(g.encode_request(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, size)))
            (announced,) = struct.unpack("<Q", c.recv_exact(8))  # the reply has begun
            assert announced == size
            os.kill(pid, signal.SIGSTOP)  # the client read nothing since: flow control holds the child
            got = 0
            while chunk := c.sock.recv(1 << 20):  # read on: what was under way, then the end
                got += len(chunk)
            assert got < size, got
        r = _restarted_after(node.port, pid, "backend_stall")
        assert r["closed"]["stall_timeout"] == 0
        with RawRpc(node.port) as d:
            d.hello()
            assert d.device_count() == 1
        assert "is unresponsive" in node.log()
    finally:
        _resume_and_kill(pid)


def test_a_child_hung_before_hello_is_killed_and_the_next_client_served(spawn) -> None:
    """A child that does not answer HELLO within the handshake timeout is hung for every client: the
    client is closed (``handshake_timeout``) and the child killed, so the next client is served.  Before,
    each later client waited the timeout out and was closed too."""
    node = spawn("--no-model", "--rpc-handshake-timeout", "2")
    node.wait_ready()
    pid = rpc_info(node.port)["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # its kernel still accepts the pump's connection
        with RawRpc(node.port) as c:
            c.send(g.hello_request())
            assert c.closed_within()
        _restarted_after(node.port, pid, "handshake_timeout")
        with RawRpc(node.port) as d:
            d.hello()
            assert d.device_count() == 1
    finally:
        _resume_and_kill(pid)


# ----------------------------------------------------------------------------
# drain(): in-process, with a real child and a real compute in flight
# ----------------------------------------------------------------------------


class AsyncRpc:
    """The async twin of RawRpc, for tests that share a trio loop with the backend."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def connect(cls, port: int) -> AsyncRpc:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def recv_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.stream.receive_some(1 << 20)
            if not chunk:
                raise ConnectionError(f"closed after {len(self.buf)} of {n} bytes")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    async def reply(self, size: int) -> bytes:
        (got,) = struct.unpack("<Q", await self.recv_exact(8))
        assert got == size, (got, size)
        return await self.recv_exact(size)

    async def call(self, cmd: int, payload: bytes = b"", reply_size: int | None = None) -> bytes:
        await self.stream.send_all(g.encode_request(cmd, payload))
        return await self.reply(reply_size) if reply_size is not None else b""

    async def at_eof(self) -> bool:
        return not self.buf and await self.stream.receive_some(1) == b""


async def test_drain_lets_a_compute_in_flight_finish_and_closes_the_rest(nursery: trio.Nursery) -> None:
    K, M, N = 1024, 1024, 512  # MUL_MAT of a [K, M] by b [K, N], f32: c [M, N] = K everywhere
    backend = RpcBackend(RpcBackendSettings(cache_dir=None, threads=2, drain_idle=0.2, handshake_timeout=30))
    with trio.fail_after(LONG):
        await nursery.start(backend.run)
        await backend.wait_active()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await backend(stream)

    nursery.start_soon(trio.serve_listeners, handler, listeners)
    with trio.fail_after(LONG * 2):
        a = await AsyncRpc.connect(port)
        assert (await a.call(RpcCmd.HELLO, bytes(24), 28))[0] == 7
        size = 4 * (K * M + K * N + M * N)
        ptr, _ = struct.unpack("<QQ", await a.call(RpcCmd.ALLOC_BUFFER, struct.pack("<IQ", 0, size + 4096), 16))
        (base,) = struct.unpack("<Q", await a.call(RpcCmd.BUFFER_GET_BASE, struct.pack("<Q", ptr), 8))
        ta = RpcTensor(id=1, type=0, buffer=ptr, ne=(K, M, 1, 1), nb=(4, 4 * K, 4 * K * M, 4 * K * M), data=base)
        tb = RpcTensor(
            id=2, type=0, buffer=ptr, ne=(K, N, 1, 1), nb=(4, 4 * K, 4 * K * N, 4 * K * N), data=base + 4 * K * M
        )
        tc = RpcTensor(
            id=3,
            type=0,
            buffer=ptr,
            ne=(M, N, 1, 1),
            nb=(4, 4 * M, 4 * M * N, 4 * M * N),
            data=base + 4 * (K * M + K * N),
            op=29,
            flags=16,  # GGML_OP_MUL_MAT, FLAG_COMPUTE
            src=(1, 2) + (0,) * 8,
        )
        one = struct.pack("<f", 1.0)
        await a.stream.send_all(g.encode_set_tensor(ta, 0, one * (K * M)) + g.encode_set_tensor(tb, 0, one * (K * N)))
        b = await AsyncRpc.connect(port)  # waits for its turn behind a
        await b.stream.send_all(g.hello_request())
        while backend.waiting != 1:
            await trio.sleep(0.02)
        # a COMBINED-style step: the compute, then read its result back; drain starts while it runs
        get = g.encode_request(RpcCmd.GET_TENSOR, tc.pack() + struct.pack("<QQ", 0, 4 * M * N))
        await a.stream.send_all(g.encode_graph_compute(0, [3], [ta, tb, tc]) + get)
        drained = trio.Event()

        async def drain() -> None:
            await backend.drain()
            drained.set()

        nursery.start_soon(drain)
        assert await b.at_eof()  # the queued client is closed at once
        out = await a.reply(4 * M * N)  # the step in flight gets its whole answer...
        assert set(struct.unpack(f"<{M * N}f", out)) == {float(K)}
        assert await a.at_eof()  # ...then the connection is closed at that boundary
        await drained.wait()
        c = await AsyncRpc.connect(port)  # nothing new is admitted
        await c.stream.send_all(g.hello_request())
        assert await c.at_eof()
    assert backend.closed["draining"] == 3 and backend.crashes == 0
    assert backend.serving == 0 and backend.waiting == 0


def test_the_child_waits_passively_unless_the_operator_says_otherwise(tmp_path) -> None:
    """The ggml-RPC child gets OMP_WAIT_POLICY=PASSIVE (its threads must not spin between a peer's
    graphs on cores others need); an OMP_WAIT_POLICY in the node's own environment wins."""
    from hydra_trio.testing.spawn import free_port, wait_healthy

    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if given:
            env["OMP_WAIT_POLICY"] = given
        port = free_port()
        with open(tmp_path / f"node-{given}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hydra_trio", "run", "--no-model", "--port", str(port)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_healthy(port, proc)
            pid = wait_for(lambda: rpc_info(port).get("pid"), timeout=LONG, what="the child's pid")  # noqa: B023  (called and finished within this iteration)
            environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
            assert environ.get("OMP_WAIT_POLICY") == expected
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
