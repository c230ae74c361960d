"""TLS on the one port with real processes and certificates made here by ``trustme``.

What is covered: HTTPS (httpx, curl, the openai client) and plain HTTP on the
same port; Hydra INFO over TLS (HydraClient and the ``hydra-trio info --tls``
command); ggml-RPC over TLS (HELLO, then round trips through the pump's threads); an untrusted server
certificate refused by the clients; mutual TLS (no client certificate:
refused; with one: served, its subject logged); ``--tls-required`` (loopback
plain still served; a real plain connection from the machine's non-loopback
address refused, when it has one; the policy function for IPv4, IPv6 and
IPv4-mapped addresses); garbage after ``0x16`` and a truncated ClientHello
closed within the classify timeout while the node stays up.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio
import trustme

from hydra_trio.hydra.client import HydraClient, HydraConnectError, HydraError
from hydra_trio.transport.tls import client_context, plain_allowed

from .conftest import ROOT, ServerProcess

HELLO = b"\x0e" + (24).to_bytes(8, "little") + bytes(24)  # RPC_CMD_HELLO as peer_reachable sends it


class Certs:
    """A CA, a node certificate for 127.0.0.1/localhost, a client certificate, and a second (untrusted) CA."""

    def __init__(self, d: Path) -> None:
        self.ca = trustme.CA(organization_name="hydra test CA")
        self.ca_pem = d / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        node = self.ca.issue_cert("127.0.0.1", "localhost", common_name="node-a")
        self.cert, self.key = d / "node.pem", d / "node.key"
        node.private_key_pem.write_to_path(str(self.key))
        for i, blob in enumerate(node.cert_chain_pems):
            blob.write_to_path(str(self.cert), append=i > 0)
        client = self.ca.issue_cert("client-1@example", common_name="client-1")
        self.client_cert, self.client_key = d / "client.pem", d / "client.key"
        client.private_key_pem.write_to_path(str(self.client_key))
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        other = trustme.CA(organization_name="someone else")
        self.other_ca_pem = d / "other-ca.pem"
        other.cert_pem.write_to_path(str(self.other_ca_pem))

    def tls_flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory, certs: Certs):
    """A node with the default model, TLS on its port, classify timeout 1 s."""
    srv = ServerProcess(tmp_path_factory.mktemp("tls") / "server.log", "--classify-timeout", "1", *certs.tls_flags())
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def mtls_node(tmp_path_factory: pytest.TempPathFactory, certs: Certs):
    """A compute-only node that asks for client certificates and refuses plain from non-loopback peers."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("mtls") / "server.log",
        "--no-model",
        "--host",
        "0.0.0.0",
        "--classify-timeout",
        "2",
        *certs.tls_flags(),
        "--tls-client-ca",
        str(certs.ca_pem),
        "--tls-required",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def ca(path: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(path))


def https(node: ServerProcess) -> str:
    return f"https://127.0.0.1:{node.port}"


def wait_log(node: ServerProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in node.log():
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{node.log()[-3000:]}"
        time.sleep(0.05)


# ------------------------------------------------------------------ HTTP


def test_https_and_plain_http_on_one_port(tls_node: ServerProcess, certs: Certs) -> None:
    r = httpx.get(https(tls_node) + "/health", verify=ca(certs.ca_pem), timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.get(tls_node.base + "/health", timeout=30).status_code == 200  # plain, same port
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    over_tls = httpx.post(https(tls_node) + "/v1/completions", json=body, verify=ca(certs.ca_pem), timeout=120)
    plain = httpx.post(tls_node.base + "/v1/completions", json=body, timeout=120)
    assert over_tls.status_code == 200, over_tls.text
    assert over_tls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    wait_log(tls_node, "TLSv1.3")


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_over_https(tls_node: ServerProcess, certs: Certs) -> None:
    out = subprocess.run(
        ["curl", "-sS", "--cacert", str(certs.ca_pem), https(tls_node) + "/v1/models"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert '"object":"list"' in out.stdout.replace(" ", "")
    out = subprocess.run(
        ["curl", "-sS", "--cacert", str(certs.other_ca_pem), https(tls_node) + "/health"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 60, (out.returncode, out.stderr)  # CURLE_PEER_FAILED_VERIFICATION


def test_openai_client_over_https(tls_node: ServerProcess, certs: Certs) -> None:
    with httpx.Client(verify=ca(certs.ca_pem)) as http_client:
        client = openai.OpenAI(base_url=https(tls_node) + "/v1", api_key="unused", http_client=http_client)
        out = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert out.choices[0].message.content is not None


def test_untrusted_certificate_refused_by_clients(tls_node: ServerProcess, certs: Certs) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(https(tls_node) + "/health", verify=ca(certs.other_ca_pem), timeout=30)

    async def hydra() -> None:
        with pytest.raises(HydraConnectError, match="TLS handshake failed"):
            async with HydraClient("127.0.0.1", tls_node.port, ssl_context=client_context(certs.other_ca_pem)):
                pass

    trio.run(hydra)
    wait_log(tls_node, "TLS handshake failed")
    assert httpx.get(tls_node.base + "/health", timeout=30).status_code == 200


# ------------------------------------------------------------------ Hydra, ggml-RPC


def test_hydra_info_over_tls(tls_node: ServerProcess, certs: Certs) -> None:
    async def main() -> dict:
        async with HydraClient("127.0.0.1", tls_node.port, ssl_context=client_context(certs.ca_pem)) as c:
            first = await c.info()
            second = await c.info()  # the connection stays usable
            assert first["mode"] == second["mode"] == "solo"
            return first

    assert "rpc_backend" in trio.run(main)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_trio",
            "info",
            f"127.0.0.1:{tls_node.port}",
            "--tls",
            "--tls-ca",
            str(certs.ca_pem),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert '"mode": "solo"' in out.stdout


def tls_socket(port: int, ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLSocket:
    ctx = client_context(ca, cert, key)
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30), server_hostname="127.0.0.1")


def _recv_exactly(s: ssl.SSLSocket, n: int) -> bytes:
    reply = b""
    while len(reply) < n:
        chunk = s.recv(n - len(reply))
        assert chunk, f"closed after {len(reply)} of {n} reply bytes"
        reply += chunk
    return reply


def test_ggml_rpc_hello_over_tls(tls_node: ServerProcess, certs: Certs) -> None:
    """HELLO, then round trips through the pump: its threads carry the TLS that trio's handshake began."""
    with tls_socket(tls_node.port, certs.ca_pem) as s:
        s.sendall(HELLO)
        reply = _recv_exactly(s, 8 + 28)
        assert reply[8] == 7  # RPC_PROTO_MAJOR_VERSION of this llama.cpp
        for _ in range(20):
            s.sendall(bytes([15]) + bytes(8))  # RPC_CMD_DEVICE_COUNT
            assert _recv_exactly(s, 8 + 4) == (4).to_bytes(8, "little") + (1).to_bytes(4, "little")

    async def rpc_info() -> dict:
        async with HydraClient("127.0.0.1", tls_node.port) as c:
            return (await c.info())["rpc_backend"]

    r = trio.run(rpc_info)
    assert r["connections"] >= 1 and r["trio_pumped"] == 0  # pumped on threads, not in trio


# ------------------------------------------------------------------ mutual TLS, --tls-required


def test_mutual_tls(mtls_node: ServerProcess, certs: Certs) -> None:
    async def main() -> None:
        with pytest.raises((HydraError, OSError)):  # TLS 1.3: the refusal may arrive after the client's handshake
            async with HydraClient("127.0.0.1", mtls_node.port, ssl_context=client_context(certs.ca_pem)) as c:
                await c.info()
        ctx = client_context(certs.ca_pem, certs.client_cert, certs.client_key)
        async with HydraClient("127.0.0.1", mtls_node.port, ssl_context=ctx) as c:
            assert "rpc_backend" in await c.info()

    trio.run(main)
    # the CLI says why the node may have closed it (the node's log has the reason)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_trio",
            "info",
            f"127.0.0.1:{mtls_node.port}",
            "--tls",
            "--tls-ca",
            str(certs.ca_pem),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "client certificate" in out.stderr, out.stderr
    wait_log(mtls_node, "TLS handshake failed")
    wait_log(mtls_node, "client certificate subject 'O=trustme")
    wait_log(mtls_node, ",CN=client-1'")  # trustme's subject: O, OU, CN
    with pytest.raises(httpx.HTTPError):
        httpx.get(https(mtls_node) + "/health", verify=ca(certs.ca_pem), timeout=30)
    r = httpx.get(
        https(mtls_node) + "/health",
        timeout=30,
        verify=client_context(certs.ca_pem, certs.client_cert, certs.client_key),
    )
    assert r.status_code == 200


def _own_address() -> str | None:
    """This machine's address on its default route (not loopback), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent (UDP connect picks the route)
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_tls_required(mtls_node: ServerProcess, certs: Certs) -> None:
    # loopback may speak plain (127.0.0.1, and 127.0.0.2 which is loopback too)
    assert httpx.get(mtls_node.base + "/health", timeout=30).status_code == 200
    with socket.create_connection(("127.0.0.2", mtls_node.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    # the policy itself
    for host in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"):
        assert plain_allowed(host, required=True), host
    for host in ("10.0.0.1", "192.0.2.2", "::ffff:10.0.0.1", "2001:db8::1", "fe80::1%eth0", None, "bogus"):
        assert not plain_allowed(host, required=True), host
    assert plain_allowed("10.0.0.1", required=False)
    # a real plain connection from a non-loopback address of this machine is closed unanswered
    own = _own_address()
    if own is None:
        pytest.skip("no non-loopback address to connect from (the policy function was checked)")
    with socket.create_connection((own, mtls_node.port), timeout=30) as s:
        assert s.getsockname()[0] == own
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert s.recv(64) == b""  # closed unanswered
        except ConnectionResetError:
            pass  # or reset (closed with the request unread)
    wait_log(mtls_node, "--tls-required; closed")
    # TLS from that address is served
    ctx = client_context(certs.ca_pem, certs.client_cert, certs.client_key)
    with ctx.wrap_socket(socket.create_connection((own, mtls_node.port), timeout=30), server_hostname="127.0.0.1") as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200")


# ------------------------------------------------------------------ bad input


def _client_hello() -> bytes:
    """A real ClientHello, made with a memory BIO (nothing sent)."""
    ctx = ssl.create_default_context()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


@pytest.mark.parametrize("what", ["garbage", "truncated", "hello_then_silence"])
def test_bad_tls_closes_within_the_classify_timeout(tls_node: ServerProcess, what: str) -> None:
    hello = _client_hello()
    data = {
        "garbage": b"\x16" + bytes(range(200)),
        "truncated": hello[: len(hello) // 2],
        "hello_then_silence": b"\x16\x03\x01",
    }[what]
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", tls_node.port), timeout=120) as s:
        s.sendall(data)
        try:
            while s.recv(4096):  # an alert may come first; then the close
                pass
        except ConnectionResetError:
            pass
    assert time.monotonic() - t0 < 120  # classify timeout 1 s: closed, not held; a bound of minutes for a busy machine
    assert httpx.get(tls_node.base + "/health", timeout=30).status_code == 200


# ------------------------------------------------------------------ §4: COMBINED through the TLS tunnel


@pytest.mark.slow
def test_combined_through_the_tls_tunnel(tls_node: ServerProcess, certs: Certs, spawn) -> None:
    """Peer B (compute only) with TLS, mutual TLS and --tls-required; head A with the test MoE reaches it
    through its loopback tunnel (--rpc-tls).  COMBINED answers as SOLO, token for token; B's bytes came over TLS."""
    from .conftest import wait_for
    from .test_combined import complete, info, rpc_bytes, set_mode

    b = spawn("--no-model", *certs.tls_flags(), "--tls-client-ca", str(certs.ca_pem), "--tls-required")
    b.wait_ready()
    a = spawn(
        "-m",
        "smollm2-135m-moe",
        "-np",
        "1",
        "-c",
        "1024",
        "--no-rpc-backend",
        "--rpc-engine",
        f"127.0.0.1:{b.port}",
        "--rpc-tls",
        "--tls-ca",
        str(certs.ca_pem),
        *certs.tls_flags(),
    )
    a.wait_ready()
    wait_for(lambda: info(a.port)["mode"] == "combined", timeout=300)
    meta = info(a.port)
    assert meta["peer_reachable"] is True
    assert meta["peer_addr"] == f"127.0.0.1:{b.port}"  # the real peer, not the tunnel's loopback port
    assert rpc_bytes(b.port) > 150_000_000  # the expert tensors went up through the tunnel
    assert "client certificate subject" in b.log() and "ggml-RPC tunnel" in a.log()
    before = rpc_bytes(b.port)
    combined_text = complete(a.base)
    assert rpc_bytes(b.port) > before  # B computed
    status, _ = set_mode(a.port, b"solo")
    assert status == 0
    assert complete(a.base) == combined_text
    assert a.stop() == 0
    assert "stopped answering" not in a.log()  # the tunnel outlived the engine, which freed B's buffers through it


@pytest.mark.slow
def test_peer_named_later_goes_through_a_tls_tunnel(certs: Certs, spawn) -> None:
    """Head A has --rpc-tls and no --rpc-engine: a peer named by SET_EXPERT_MODE, then by PIPELINE_ATTACH, is
    dialled through a TLS tunnel started then (B would take plain from loopback, so the proof of TLS is B's log of
    A's client certificate subject).  INFO and the replies name B's real address; the texts equal SOLO's."""
    import json

    from hydra_trio.protocol.hydra import Op
    from hydra_trio.testing.hydra_wire import Wire

    from .conftest import wait_for
    from .test_combined import complete, info, rpc_bytes, set_mode

    b = spawn("--no-model", *certs.tls_flags(), "--tls-client-ca", str(certs.ca_pem), "--tls-required")
    # -fa off: PIPELINE_ATTACH puts whole layers on B, where llama.cpp turns flash attention off by itself; the
    # SOLO text is computed without it too, so the texts compare the same arithmetic on any CPU
    # (tests/test_pipeline.py says more)
    a = spawn(
        "-m",
        "smollm2-135m-moe",
        "-np",
        "1",
        "-c",
        "1024",
        "--no-rpc-backend",
        "-fa",
        "off",
        "--rpc-tls",
        "--tls-ca",
        str(certs.ca_pem),
        *certs.tls_flags(),
    )
    b.wait_ready()
    a.wait_ready()
    peer = f"127.0.0.1:{b.port}"
    solo_text = complete(a.base)
    assert "client certificate subject" not in b.log()
    status, meta = set_mode(a.port, json.dumps({"mode": "combined", "peer": peer}).encode())
    assert status == 0 and meta["success"] is True and meta["mode"] == "combined", meta
    assert meta["peer"] == peer
    state = info(a.port)
    assert state["mode"] == "combined" and state["peer_addr"] == peer and state["peer_attach"] == "attached"
    assert rpc_bytes(b.port) > 150_000_000  # the expert tensors went up
    assert "client certificate subject" in b.log()  # ... over TLS: B saw A's certificate
    assert "ggml-RPC tunnel 127.0.0.1:" in a.log() and f"-> {peer} over TLS" in a.log()
    before = rpc_bytes(b.port)
    assert complete(a.base) == solo_text
    assert rpc_bytes(b.port) > before  # B computed
    wait_for(lambda: info(a.port)["peer_reachable"] is True, timeout=30)  # the watchdog checks B itself
    assert info(a.port)["peer_addr"] == peer

    # PIPELINE_ATTACH to the same peer: the same tunnel carries it.  Detach first ({"peer": ""}): B's ggml-RPC
    # server takes one client at a time, so a switch with the COMBINED link still open could not probe it
    split = r"blk\.(1[0-9]|2[0-9])\."
    with Wire(a.port) as w:
        status, meta, _ = w.call(Op.PIPELINE_ATTACH, payload=b'{"peer": ""}')
        assert status == 0 and meta["success"] is True, meta
        status, meta, _ = w.call(Op.PIPELINE_ATTACH, payload=json.dumps({"peer": peer, "ot_split": split}).encode())
    assert status == 0 and meta["success"] is True and meta["mode"] == "pipeline" and meta["peer"] == peer, meta
    assert info(a.port)["peer_addr"] == peer
    assert complete(a.base) == solo_text
    assert a.log().count("ggml-RPC tunnel 127.0.0.1:") == 1  # one tunnel per real peer
    assert a.stop() == 0
    assert "stopped answering" not in a.log()


def test_allow_subject_lets_a_verified_certificate_pass_the_rpc_allow_list(certs: Certs, spawn, tmp_path: Path) -> None:
    from hydra_trio.transport.tls import subject_text

    subject = subject_text(ssl._ssl._test_decode_cert(str(certs.client_cert)))  # type: ignore[attr-defined]
    assert subject and subject.endswith("CN=client-1")
    other = certs.ca.issue_cert("client-2@example", common_name="client-2")
    other_cert, other_key = tmp_path / "c2.pem", tmp_path / "c2.key"
    other.cert_chain_pems[0].write_to_path(str(other_cert))
    other.private_key_pem.write_to_path(str(other_key))
    node = spawn(
        "--no-model",
        "--classify-timeout",
        "2",
        *certs.tls_flags(),
        "--tls-client-ca",
        str(certs.ca_pem),
        "--rpc-allow",
        "10.0.0.0/8",
        "--allow-subject",
        subject,
    )
    node.wait_ready()

    def hello(sock: socket.socket) -> bytes:
        sock.sendall(HELLO)
        reply = b""
        try:
            while len(reply) < 11:
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
        except (ConnectionResetError, ssl.SSLError):
            pass
        return reply

    with socket.create_connection(("127.0.0.1", node.port), timeout=30) as plain:  # 127.0.0.1 is not in 10/8
        assert hello(plain) == b""
    with tls_socket(node.port, certs.ca_pem, other_cert, other_key) as s:  # a valid certificate, another subject
        assert hello(s) == b""
    with tls_socket(node.port, certs.ca_pem, certs.client_cert, certs.client_key) as s:
        reply = hello(s)
    assert len(reply) >= 11 and reply[8] == 7
    text = httpx.get(f"http://127.0.0.1:{node.port}/metrics", timeout=30).text
    assert 'hydra_trio:refused_total{protocol="ggml_rpc",reason="not_allowed"} 2.0' in text, text
