"""Access rules: API keys on HTTP, allow-lists and the token for Hydra control ops,
the allow-list for ggml-RPC.  Live nodes with the real model, real sockets; the matching rules as units."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from hypothesis import HealthCheck, settings

from fuzz import access as access_fuzz
from hydra_trio.errors import InvalidRequest
from hydra_trio.http.auth import bearer_key
from hydra_trio.hydra.client import HydraBadRequest, HydraClient
from hydra_trio.hydra.gate import Gate
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire
from hydra_trio.transport.access import (
    AllowList,
    Peer,
    Secrets,
    new_refusals,
    normalize_address,
    parse_network,
    read_key_file,
)

from .conftest import ROOT, ServerProcess, wait_for
from .test_rpc_backend import LONG, RawRpc

KEY, FILE_KEY, TOKEN = "sk-test-one", "sk-from-file", "hydra-secret-token"
UNAUTHORIZED = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
CONTROL = [  # (op, key, payload) of every op that changes the node
    (Op.CONFIGURE, "", b'{"temperature": 0.5}'),
    (Op.SET_EXPERT_MODE, "", b"solo"),
    (Op.STATE_PUT, "1", b"\0" * 4096),
    (Op.SWAP_QUANT, "", b"\x07\x00default.*"),
    (Op.PIPELINE_ATTACH, "", b'{"peer": "127.0.0.1:1", "ot_split": "blk"}'),
]


def metric(base: str, name: str, headers: dict | None = None) -> float:
    """A sample of ``/metrics``, read with the key (llama-server's ``--api-key`` protects ``/metrics``)."""
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    text = httpx.get(base + "/metrics", headers=headers, timeout=LONG).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Keys (one on the command line, one from a file), control ops for 10/8 or the token, ggml-RPC for 10/8."""
    tmp = tmp_path_factory.mktemp("auth")
    keys = tmp / "keys.txt"
    keys.write_text(f"# the team's key\n\n  {FILE_KEY}\r\n")
    srv = ServerProcess(
        tmp / "node.log",
        "-np",
        "2",
        "--api-key",
        KEY,
        "--api-key-file",
        str(keys),
        "--control-allow",
        "10.0.0.0/8",
        "--hydra-token",
        TOKEN,
        "--rpc-allow",
        "10.0.0.0/8",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


# --------------------------------------------------------------------------- HTTP: API keys


@pytest.mark.parametrize("key", [KEY, FILE_KEY])
def test_openai_client_with_the_right_key(node: ServerProcess, key: str) -> None:
    client = openai.OpenAI(base_url=node.base + "/v1", api_key=key, timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    out = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content


def test_openai_client_with_a_wrong_key_is_401(node: ServerProcess) -> None:
    client = openai.OpenAI(base_url=node.base + "/v1", api_key="sk-wrong", timeout=120, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body in (UNAUTHORIZED, UNAUTHORIZED["error"])  # (openai versions differ)


def test_requests_without_a_key(node: ServerProcess) -> None:
    before = metric(node.base, 'hydra_trio:refused_total{protocol="http",reason="missing_api_key"}')
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/slots"),
        ("POST", "/slots/0?action=erase"),
        ("GET", "/nowhere"),
    ]:
        r = httpx.request(method, node.base + path, json={}, timeout=LONG)
        assert r.status_code == 401, (path, r.text)
        assert r.json() == UNAUTHORIZED
        assert r.headers["www-authenticate"] == 'Bearer realm="hydra-trio"'
        assert r.headers["content-type"].startswith("application/json")
    after = metric(node.base, 'hydra_trio:refused_total{protocol="http",reason="missing_api_key"}')
    assert after - before == 5


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": f"Basic {KEY}"},  # not the Bearer scheme: the whole value is the key, a wrong one
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": b"Bearer \xe9\xff"},  # not UTF-8: still just a wrong key
        {"Authorization": "Bearer"},
    ],
)
def test_wrong_keys_are_401_never_500(node: ServerProcess, headers: dict) -> None:
    r = httpx.get(node.base + "/v1/models", headers=headers, timeout=LONG)
    assert r.status_code == 401 and r.json() == UNAUTHORIZED
    assert r.headers["www-authenticate"].startswith("Bearer realm=")


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {KEY}"},
        {"Authorization": f"bearer   {FILE_KEY}"},
        {"Authorization": KEY},
        {"X-Api-Key": FILE_KEY},  # llama-server accepts the last two as well
        # llama-server (tools/server/server-http.cpp) reads X-Api-Key when Authorization is empty, and takes
        # "Bearer " off whichever header it read
        {"Authorization": "", "X-Api-Key": KEY},
        {"X-Api-Key": f"Bearer {FILE_KEY}"},
    ],
)
def test_key_forms_llama_server_accepts(node: ServerProcess, headers: dict) -> None:
    assert httpx.get(node.base + "/v1/models", headers=headers, timeout=LONG).status_code == 200


@pytest.mark.parametrize(
    "headers, key",
    [
        ([(b"authorization", b"Bearer k1"), (b"x-api-key", b"k2")], b"k1"),  # Authorization wins
        ([(b"authorization", b""), (b"x-api-key", b"k2")], b"k2"),
        ([(b"authorization", b"  "), (b"x-api-key", b"Bearer k2")], b"k2"),
        ([(b"x-api-key", b"bearer k2")], b"k2"),
        ([(b"authorization", b"Basic k1")], b"Basic k1"),  # another scheme: the whole value, a wrong key
        ([(b"authorization", b"")], None),
        ([], None),
    ],
)
def test_bearer_key_reads_headers_as_llama_server(headers: list, key: bytes | None) -> None:
    assert bearer_key(headers) == key


def test_open_set_is_llama_servers(node: ServerProcess) -> None:
    """Without a key: llama-server's public endpoints (/health, /v1/health; tools/server/server-http.cpp,
    ``get_public_endpoints``), the status page's files and CORS preflights.  /metrics needs the key, as in
    llama-server, and so does the status page's data (its event stream)."""
    for path in ("/health", "/v1/health"):
        r = httpx.get(node.base + path, timeout=LONG)
        assert r.status_code == 200 and r.json()["status"] == "ok", (path, r.text)
    for path in ("/", "/static/status.js", "/static/status.css"):
        assert httpx.get(node.base + path, timeout=LONG).status_code == 200, path
    before = metric(node.base, 'hydra_trio:refused_total{protocol="http",reason="missing_api_key"}')
    r = httpx.get(node.base + "/metrics", timeout=LONG)
    assert r.status_code == 401 and r.json() == UNAUTHORIZED and "llamacpp:" not in r.text
    assert httpx.get(node.base + "/metrics", headers={"X-Api-Key": KEY}, timeout=LONG).status_code == 200
    r = httpx.get(
        node.base + "/v1/events",
        headers={
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
        timeout=LONG,
    )
    assert r.status_code == 401 and r.json() == UNAUTHORIZED
    after = metric(node.base, 'hydra_trio:refused_total{protocol="http",reason="missing_api_key"}')
    assert after - before == 2
    # an OPTIONS that is not a preflight passes the key check but carries no node data
    r = httpx.options(node.base + "/slots", timeout=LONG)
    assert r.status_code != 200 and "n_ctx" not in r.text


def test_health_and_preflight_stay_open(node: ServerProcess) -> None:
    assert httpx.get(node.base + "/health", timeout=LONG).json()["status"] == "ok"
    r = httpx.options(
        node.base + "/v1/chat/completions",
        timeout=LONG,
        headers={
            "Origin": "http://example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")
    # a browser reading a 401 gets the CORS headers too
    r = httpx.get(node.base + "/v1/models", headers={"Origin": "http://example.com"}, timeout=LONG)
    assert r.status_code == 401 and "access-control-allow-origin" in r.headers


# --------------------------------------------------------------------------- Hydra: allow-list and token


def test_control_ops_refused_from_outside_the_allow_list(node: ServerProcess) -> None:
    httpx.post(
        node.base + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
        json={"prompt": "The capital of France is", "max_tokens": 4, "id_slot": 0},
    )
    before = metric(node.base, 'hydra_trio:refused_total{protocol="hydra",reason="not_allowed"}')
    with Wire(node.port) as w:
        s, meta1, _ = w.call(Op.STATE_META, key="1")
        assert s == Status.OK
        for op, key, payload in CONTROL:
            status, meta, body = w.call(op, key=key, payload=payload)
            assert status == Status.BAD_REQUEST, (op, meta)
            assert meta["refused"] == "not_allowed" and meta["op"] == Op(op).name and body == b""
            assert "--control-allow" in meta["error"] and "127.0.0.1" in meta["error"]
        # the same connection still serves what is open; nothing changed
        assert w.call(Op.INFO)[0] == Status.OK
        s, meta0, blob = w.call(Op.STATE_GET, key="0")
        assert s == Status.OK and meta0["n_past"] > 0 and len(blob) == meta0["state_size"]
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=blob)
        assert status == Status.BAD_REQUEST and meta["refused"] == "not_allowed"
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == meta1["n_past"]
    after = metric(node.base, 'hydra_trio:refused_total{protocol="hydra",reason="not_allowed"}')
    assert after - before == len(CONTROL) + 1
    assert (
        httpx.get(node.base + "/props", headers={"Authorization": f"Bearer {KEY}"}, timeout=LONG).json()[
            "default_generation_settings"
        ]["params"]["temperature"]
        != 0.5
    )


def test_the_token_makes_the_connection_trusted(node: ServerProcess) -> None:
    with Wire(node.port) as w:
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"auth": "nope"}).encode())
        assert status == Status.BAD_REQUEST and meta["refused"] == "invalid_token"
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"auth": "nope", "seed": 1}).encode())
        assert status == Status.BAD_REQUEST and meta["refused"] == "invalid_token"
        assert w.call(Op.SET_EXPERT_MODE, payload=b"solo")[1]["refused"] == "not_allowed"
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"auth": TOKEN}).encode())
        assert status == Status.OK and meta["trusted"] is True and meta["params_applied"] == {}
        status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo")
        assert status == Status.OK and meta["mode"] == "solo"
        status, meta, _ = w.call(Op.CONFIGURE, payload=b'{"seed": 7}')
        assert status == Status.OK and meta["params_applied"] == {"seed": 7}
        _s, meta0, blob = w.call(Op.STATE_GET, key="0")
        status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=blob)
        assert status == Status.OK and meta["n_past"] == meta0["n_past"]
    with Wire(node.port) as w:  # trust belongs to the connection, not to the address
        assert w.call(Op.SET_EXPERT_MODE, payload=b"solo")[1]["refused"] == "not_allowed"
        # the token and a setting in one CONFIGURE
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"auth": TOKEN, "seed": 8}).encode())
        assert status == Status.OK and meta["params_applied"] == {"seed": 8} and "auth" not in meta["unrecognized_keys"]


def test_the_gate_reads_configure_as_strictly_as_the_op(node: ServerProcess) -> None:
    # was: the gate's own json.loads let a RecursionError close the connection without a reply
    with Wire(node.port) as w:
        assert w.call(Op.CONFIGURE, payload=json.dumps({"auth": TOKEN}).encode())[0] == Status.OK
        for bad, why in ((b"[" * 100_000, "nested"), (b'{"auth": NaN}', "NaN"), (b"\xff", "UTF-8"), (b"[1]", "object")):
            status, meta, _ = w.call(Op.CONFIGURE, payload=bad)
            assert status == Status.BAD_REQUEST and why in meta["error"], (bad[:10], meta)
        assert w.call(Op.INFO)[0] == Status.OK


def test_hydra_client_and_cli_send_the_token(node: ServerProcess) -> None:
    async def main() -> None:
        async with HydraClient("127.0.0.1", node.port, token=TOKEN) as c:
            assert c.trusted is True
            assert (await c.set_expert_mode("solo"))["mode"] == "solo"
        async with HydraClient("127.0.0.1", node.port) as c:
            with pytest.raises(HydraBadRequest) as info:
                await c.set_expert_mode("solo")
            assert info.value.meta["refused"] == "not_allowed"
            assert (await c.info())["engine"] == "hydra-trio"
        c = HydraClient("127.0.0.1", node.port, token="wrong")
        with pytest.raises(HydraBadRequest) as info:
            await c.connect()
        assert info.value.meta["refused"] == "invalid_token" and not c.connected

    trio.run(main)
    cmd = [sys.executable, "-m", "hydra_trio", "mode", f"127.0.0.1:{node.port}", "solo"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_TRIO_TOKEN"}
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LONG, env=env)
    assert refused.returncode == 1 and "not_allowed" in refused.stderr
    ok = subprocess.run([*cmd, "--token", TOKEN], cwd=ROOT, capture_output=True, text=True, timeout=LONG, env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["mode"] == "solo"
    via_env = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=LONG, env={**env, "HYDRA_TRIO_TOKEN": TOKEN}
    )
    assert via_env.returncode == 0, via_env.stderr


def test_fuzz_access_rules_short_budget(node: ServerProcess) -> None:
    """fuzz/access.py: wrong keys and tokens, refused control ops with random payloads; nothing changes."""
    access_fuzz.configure(node.port, KEY, TOKEN, n_slots=2)
    test = access_fuzz.AccessMachine.TestCase
    test.settings = settings(
        max_examples=3, stateful_step_count=10, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    test("runTest").runTest()
    assert node.proc.poll() is None


# --------------------------------------------------------------------------- ggml-RPC: allow-list


def test_rpc_from_outside_the_allow_list_is_closed_before_any_reply(node: ServerProcess) -> None:
    name = 'hydra_rpc_clients_closed_total{reason="not_allowed"}'
    before = metric(node.base, name)
    served = metric(node.base, "hydra_rpc_clients_served_total")
    with RawRpc(node.port) as rpc:
        try:
            rpc.send(bytes([14]) + (24).to_bytes(8, "little") + bytes(24))  # HELLO
        except OSError:
            pass  # already closed: fine
        rpc.sock.settimeout(LONG)
        try:
            got = rpc.sock.recv(64)
        except ConnectionResetError:
            got = b""
        assert got == b"", "the refused client got a reply"
    wait_for(lambda: metric(node.base, name) == before + 1, timeout=LONG, what="the refusal is counted")
    assert metric(node.base, 'hydra_trio:refused_total{protocol="ggml_rpc",reason="not_allowed"}') >= 1
    assert metric(node.base, "hydra_rpc_clients_served_total") == served
    assert "ggml-RPC is open to every peer" not in node.log()


def test_open_rpc_on_a_public_address_warns_once_and_metrics_auth(tmp_path: Path) -> None:
    # --metrics-auth, once needed to protect /metrics, is the default now and still accepted
    srv = ServerProcess(tmp_path / "public.log", "--no-model", "--host", "0.0.0.0", "--api-key", KEY, "--metrics-auth")
    try:
        srv.wait_ready()
        assert srv.log().count("ggml-RPC is open to every peer") == 1
        r = httpx.get(srv.base + "/metrics", timeout=LONG)
        assert r.status_code == 401 and r.json() == UNAUTHORIZED
        assert (
            metric(
                srv.base,
                'hydra_trio:refused_total{protocol="http",reason="missing_api_key"}',
                headers={"Authorization": f"Bearer {KEY}"},
            )
            == 1
        )
        assert httpx.get(srv.base + "/health", timeout=LONG).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()


def test_no_metrics_auth_opens_metrics_only(tmp_path: Path) -> None:
    """The opt-in for a Prometheus without credentials: /metrics open, the rest as llama-server's --api-key."""
    srv = ServerProcess(tmp_path / "open-metrics.log", "--no-model", "--api-key", KEY, "--no-metrics-auth")
    try:
        srv.wait_ready()
        r = httpx.get(srv.base + "/metrics", timeout=LONG)
        assert r.status_code == 200 and "hydra_trio:refused_total" in r.text
        for path in ("/v1/models", "/slots", "/props"):
            r = httpx.get(srv.base + path, timeout=LONG)
            assert r.status_code == 401 and r.json() == UNAUTHORIZED, path
        assert metric(srv.base, 'hydra_trio:refused_total{protocol="http",reason="missing_api_key"}', {}) == 3
    finally:
        assert srv.stop() == 0, srv.log()


# --------------------------------------------------------------------------- units: the matching rules


@pytest.mark.parametrize(
    "address, cidr, expected",
    [
        ("127.0.0.1", "127.0.0.0/8", True),
        ("::ffff:127.0.0.1", "127.0.0.0/8", True),  # IPv4-mapped IPv6, as a dual-stack listener reports it
        ("::ffff:7f00:1", "127.0.0.0/8", True),
        ("::ffff:10.1.2.3", "10.0.0.0/8", True),
        ("::ffff:11.1.2.3", "10.0.0.0/8", False),
        ("10.1.2.3", "::ffff:10.0.0.0/104", True),  # an IPv4-mapped network is its IPv4 network
        ("::1", "127.0.0.0/8", False),  # IPv6 loopback is not 127/8
        ("::1", "::1", True),
        ("::1", "::/0", True),
        ("127.0.0.1", "::/0", False),  # an IPv6 network never matches an IPv4 peer
        ("fd00::5", "fd00::/8", True),
        ("fe80::1%eth0", "fe80::/10", True),  # a zone id does not stop the match
        ("fe80::1", "fd00::/8", False),
        ("192.168.1.7", "192.168.1.7", True),  # a bare address is a /32
        ("192.168.1.8", "192.168.1.7", False),
        ("8.8.8.8", "0.0.0.0/0", True),
        ("not-an-ip", "0.0.0.0/0", False),
        (None, "0.0.0.0/0", False),
    ],
)
def test_allow_list_matching(address: str | None, cidr: str, expected: bool) -> None:
    assert AllowList.parse([cidr]).allows(address) is expected


@pytest.mark.parametrize("bad", ["10.0.0.1/8", "10.0.0.0/33", "banana", "", "10.0.0.0/8/8", "::ffff:zz"])
def test_bad_cidrs_are_refused_with_a_message(bad: str) -> None:
    with pytest.raises(ValueError, match="not a CIDR"):
        parse_network(bad)


def test_cli_refuses_bad_access_flags(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n")
    for args, says in [
        (["--control-allow", "10.0.0.1/8"], "has host bits set"),
        (["--rpc-allow", "x"], "not a CIDR"),
        (["--api-key", " "], "non-empty"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "hydra_trio", "run", *args], cwd=ROOT, capture_output=True, text=True, timeout=LONG
        )
        assert r.returncode == 2 and says in r.stderr, r.stderr
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(empty)
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(tmp_path / "missing.txt")


def test_identity_hook_and_normalization() -> None:
    allow = AllowList(networks=(parse_network("10.0.0.0/8"),), identities=frozenset({"CN=head-1"}))
    assert allow.allows("192.0.2.1", "CN=head-1") and not allow.allows("192.0.2.1", "CN=other")
    assert allow.allows_peer(Peer(ipaddress.ip_address("10.9.9.9")))
    assert normalize_address("::ffff:10.0.0.1") == ipaddress.IPv4Address("10.0.0.1")


def test_secrets_and_bearer_parsing() -> None:
    s = Secrets(["alpha", "bêta"])
    assert s.matches("alpha") and s.matches("bêta".encode()) and s.matches(b"b\xc3\xaata")
    assert not s.matches("alph") and not s.matches("alphaa") and not s.matches(None) and not s.matches(b"\xff")
    assert not Secrets([]).matches("") and "alpha" not in repr(s)
    assert bearer_key([(b"authorization", b"Bearer  k1 ")]) == b"k1"
    assert bearer_key([(b"x-api-key", b"k2")]) == b"k2"
    assert bearer_key([(b"authorization", b"Bearer a"), (b"x-api-key", b"b")]) == b"a"
    assert bearer_key([]) is None


def test_gate_policy_without_a_network() -> None:
    """--hydra-token alone: only connections that sent it may change the node; no flag: everyone may."""
    refused = new_refusals()
    local = Peer(ipaddress.ip_address("127.0.0.1"))
    trust = Gate(None, "t0ken", refused).connection(local)
    with pytest.raises(InvalidRequest) as info:
        trust.check(Op.SWAP_QUANT, bytearray(b"x"))
    assert info.value.hydra_status == Status.BAD_REQUEST and info.value.reply_meta()["refused"] == "not_allowed"
    assert trust.check(Op.INFO, bytearray())[1] is None and trust.check(Op.DECODE, bytearray(b"{}"))[1] is None
    assert not trust.keeps_payload(Op.STATE_PUT) and trust.keeps_payload(Op.CONFIGURE)
    _payload, answer = trust.check(Op.CONFIGURE, bytearray(b'{"auth": "t0ken"}'))
    assert answer is not None and answer["trusted"] is True and trust.keeps_payload(Op.STATE_PUT)
    assert refused["hydra", "not_allowed"] == 1 and refused["hydra", "invalid_token"] == 0
    open_trust = Gate(None, None, refused).connection(local)
    assert open_trust.trusted and open_trust.check(Op.CONFIGURE, bytearray(b'{"auth": "x"}'))[1]["trusted"]


def test_a_key_in_the_query_is_not_written_to_the_log(node: ServerProcess) -> None:
    httpx.get(node.base + f"/v1/models?api_key={KEY}&x=1", timeout=LONG)
    httpx.get(node.base + f"/health?x=1&api_key={KEY}", timeout=LONG)
    deadline = time.monotonic() + 60
    while "/v1/models?api_key=***&x=1" not in node.log():
        assert time.monotonic() < deadline, node.log()[-2000:]
        time.sleep(0.1)
    assert KEY not in node.log()


def test_the_hydra_token_can_come_from_a_file(tmp_path: Path, spawn) -> None:
    path = tmp_path / "token"
    path.write_text("# the node's token\n\nfile-token-1\n")
    r = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "run", "--hydra-token", "x", "--hydra-token-file", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LONG,
    )
    assert r.returncode == 2 and "give one" in r.stderr, r.stderr
    node = spawn("-np", "1", "--control-allow", "10.0.0.0/8", "--hydra-token-file", str(path))
    node.wait_ready()
    with Wire(node.port) as w:
        status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo")
        assert status == Status.BAD_REQUEST and "--token or $HYDRA_TRIO_TOKEN" in meta["error"]
        assert w.call(Op.CONFIGURE, payload=b'{"auth": "file-token-1"}')[1]["trusted"] is True
        assert w.call(Op.SET_EXPERT_MODE, payload=b"solo")[0] == Status.OK
    assert "file-token-1" not in node.log()
    assert f"status page http://127.0.0.1:{node.port}/" in node.log()


def test_a_key_in_any_spelling_of_the_query_is_not_written_to_the_log(node: ServerProcess) -> None:
    """The WebSocket reads ``api_key`` percent-decoded (``api%5Fkey`` is the same parameter), and a key
    sent under another case or a ``token``-like name is a secret too: none reaches the log."""
    secrets = [f"{KEY}-pct", f"{KEY}-upper", f"{KEY}-token", f"{KEY}-plus"]
    query = f"api%5Fkey={secrets[0]}&API_KEY={secrets[1]}&x=1&access_token={secrets[2]}&%61pi_key={secrets[3]}&y=2"
    httpx.get(node.base + "/v1/models?" + query, timeout=LONG)
    marker = "/v1/models?api%5Fkey=***&API_KEY=***&x=1&access_token=***&%61pi_key=***&y=2"
    deadline = time.monotonic() + 60
    while marker not in node.log():
        assert time.monotonic() < deadline, node.log()[-2000:]
        time.sleep(0.1)
    assert not any(s in node.log() for s in secrets)
