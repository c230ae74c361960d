"""Fuzzing TLS on the one port of a live node that also has the access rules of :mod:`fuzz.access`.

The node (:func:`server_flags`) has ``--tls-cert/--tls-key`` made at start by
``trustme`` (:func:`make_certs`), ``--tls-required``, ``--api-key``,
``--control-allow`` a network without 127.0.0.1, ``--hydra-token`` and
``--rpc-allow 127.0.0.0/8``.  :class:`TlsMachine` sends, each a rule:

* ``0x16`` then garbage, a real ClientHello cut short, a ClientHello with
  bytes flipped, a handshake with a client certificate from another CA:
  the node must close within the classify timeout (plus :data:`SLACK`);
* garbage *inside* a finished handshake, then EOF: the node must close
  (within the step timeout; what is inside is classified as on plain TCP);
* plain bytes from a non-loopback address of this machine (``--tls-required``):
  closed unanswered within the classify timeout (skipped, and counted as
  skipped, when the machine has no such address or the node listens on loopback);
* HTTPS with a wrong API key: 401 with llama-server's body; Hydra control
  ops over TLS from an untrusted address: BAD_REQUEST ``refused``.

After every step, as :class:`fuzz.access.AccessMachine`: ``/health`` is 200
and the sampling defaults, the mode and every slot's ``n_past`` are as they were.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hydra_trio.protocol.hydra import (
    NEED_DATA,
    Op,
    PayloadChunk,
    ResponseDecoder,
    ResponseEnded,
    ResponseStarted,
    Status,
    encode_request,
)

from . import access, wire
from .findings import StepTimeout, timeouts_are_findings

CLASSIFY_TIMEOUT = 2.0  # the node's --classify-timeout (it covers the TLS handshake)
SLACK = 10.0  # seconds over the classify timeout a close may take on a busy 2-core machine
TLS: dict[str, object] = {"ca": None, "other_cert": None, "other_key": None, "own": None}


def make_certs(d: Path) -> dict[str, Path]:
    """A CA and a node certificate for 127.0.0.1/localhost, plus a client certificate of an unrelated CA,
    written into ``d`` with ``trustme`` (a test extra); returns their paths by name."""
    import trustme

    ca, other = trustme.CA(organization_name="hydra fuzz CA"), trustme.CA(organization_name="not the node's CA")
    paths = {name: d / f"{name}.pem" for name in ("ca", "cert", "key", "other_cert", "other_key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    node = ca.issue_cert("127.0.0.1", "localhost")
    node.private_key_pem.write_to_path(str(paths["key"]))
    for i, blob in enumerate(node.cert_chain_pems):
        blob.write_to_path(str(paths["cert"]), append=i > 0)
    stranger = other.issue_cert("stranger@example")
    stranger.private_key_pem.write_to_path(str(paths["other_key"]))
    stranger.cert_chain_pems[0].write_to_path(str(paths["other_cert"]))
    return paths


def server_flags(certs: dict[str, Path], key: str, token: str) -> list[str]:
    """The access node's flags (see the module docstring); ``--host`` is the caller's choice."""
    return [
        "--tls-cert",
        str(certs["cert"]),
        "--tls-key",
        str(certs["key"]),
        "--tls-required",
        "--api-key",
        key,
        "--control-allow",
        "10.0.0.0/8",
        "--hydra-token",
        token,
        "--rpc-allow",
        "127.0.0.0/8",
        "--classify-timeout",
        str(CLASSIFY_TIMEOUT),
    ]


def own_address() -> str | None:
    """This machine's address on its default route (not loopback), or None (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def configure(port: int, key: str, token: str, n_slots: int, certs: dict[str, Path], own: str | None) -> None:
    """Point the machine at the access node on ``port``; ``own``: a non-loopback address of this machine the
    node listens on (for the plaintext rule), or None."""
    access.configure(port, key, token, n_slots)
    TLS.update(ca=certs["ca"], other_cert=certs["other_cert"], other_key=certs["other_key"], own=own)


def _client_hello() -> bytes:
    """A real ClientHello (TLS 1.2/1.3), made with a memory BIO: nothing is sent."""
    obj = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="127.0.0.1")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


HELLO = _client_hello()


def _count(kind: str) -> None:
    """One more TLS request of ``kind`` in the fuzzer's summary (``fuzz.wire.STATS``), and one more ``tls``."""
    wire.STATS["tls"] = wire.STATS.get("tls", 0) + 1
    wire.STATS[kind] = wire.STATS.get(kind, 0) + 1


def _port() -> int:
    return int(access.TARGET["port"])  # type: ignore[call-overload]


def _context(cert: object = None, key: object = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(TLS["ca"]))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _tls(ctx: ssl.SSLContext | None = None) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", _port()), timeout=wire.TIMEOUT)
    return (ctx or _context()).wrap_socket(raw, server_hostname="127.0.0.1")


def _seconds_to_close(s: socket.socket, limit: float) -> float:
    """Read (raw bytes, an alert maybe) until the node closes; the seconds it took.  AssertionError past ``limit``."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        while s.recv(65536):
            assert time.monotonic() - t0 < limit, "still sending past the limit"
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        raise StepTimeout(f"not closed within {limit:.0f} s") from None
    return time.monotonic() - t0


def _send_and_wait_close(data: bytes) -> float:
    """Send ``data`` on a fresh TCP connection and wait for the close, bounded by the classify timeout + SLACK."""
    with socket.create_connection(("127.0.0.1", _port()), timeout=wire.TIMEOUT) as s:
        try:
            s.sendall(data)
        except OSError:
            return 0.0  # closed before all of it went: a close is an answer
        took = _seconds_to_close(s, CLASSIFY_TIMEOUT + SLACK)
        wire.STATS["tls_slowest_close_ms"] = max(wire.STATS.get("tls_slowest_close_ms", 0), round(took * 1e3))
        return took


def tls_hydra(op: int, key: str = "", payload: bytes = b"") -> tuple[int, dict, bytes]:
    """One Hydra request over TLS; the reply (well-formed, non-OK with an ``error``)."""
    with _tls() as s:
        s.sendall(encode_request(op, key=key, payload=payload, trace_id="fuzz-tls"))
        dec, status, meta, body = ResponseDecoder(), None, {}, bytearray()
        while data := s.recv(1 << 16):
            dec.receive_data(data)
            while (ev := dec.next_event()) is not NEED_DATA:
                if isinstance(ev, ResponseStarted):
                    status, meta = ev.header.status, ev.meta
                elif isinstance(ev, PayloadChunk):
                    body += ev.data
                elif isinstance(ev, ResponseEnded):
                    assert status == Status.OK or meta.get("error"), meta
                    return int(status), meta, bytes(body)  # type: ignore[arg-type]
    raise AssertionError(f"op 0x{op:02x} over TLS: closed without a reply")


def tls_http(path: str, header: bytes) -> tuple[int, bytes]:
    """One HTTPS/1.1 request with ``header`` (a whole line) and ``Connection: close``; ``(status, body)``."""
    with _tls() as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: fuzz\r\n".encode() + header + b"\r\nConnection: close\r\n\r\n")
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ssl.SSLError:  # ragged EOF after the reply (the node closes without close_notify)
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    return int(head.split()[1]), body


class TlsMachine(RuleBasedStateMachine):
    """Bad TLS and bad credentials over TLS against the access node (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.before = access.guarded_state()

    @rule(body=st.binary(max_size=2048))
    @timeouts_are_findings
    def garbage_record(self, body: bytes) -> None:
        _count("tls_garbage")
        _send_and_wait_close(b"\x16" + body)

    @rule(data=st.data())
    @timeouts_are_findings
    def truncated_handshake(self, data: st.DataObject) -> None:
        _count("tls_truncated")
        _send_and_wait_close(HELLO[: data.draw(st.integers(1, len(HELLO) - 1), label="cut")])

    @rule(flips=st.lists(st.tuples(st.integers(0, len(HELLO) - 1), st.integers(1, 255)), min_size=1, max_size=8))
    @timeouts_are_findings
    def mutated_handshake(self, flips: list[tuple[int, int]]) -> None:
        _count("tls_mutated")
        hello = bytearray(HELLO)
        for at, xor in flips:
            hello[at] ^= xor
        hello[0] = 0x16
        _send_and_wait_close(bytes(hello))

    @rule()
    @timeouts_are_findings
    def certificate_of_another_ca(self) -> None:
        """The node asks for no client certificate: one from a stranger is ignored, and the link works."""
        _count("tls_stranger_cert")
        with _tls(_context(TLS["other_cert"], TLS["other_key"])) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 200")

    @rule(inside=st.binary(min_size=1, max_size=4096))
    @timeouts_are_findings
    def garbage_inside_tls(self, inside: bytes) -> None:
        _count("tls_inside")
        raw = socket.create_connection(("127.0.0.1", _port()), timeout=wire.TIMEOUT)
        tcp = raw.dup()  # the same TCP connection, to end it under the TLS layer
        try:
            with _context().wrap_socket(raw, server_hostname="127.0.0.1") as s:
                try:
                    s.sendall(inside)
                except OSError:
                    return
                tcp.shutdown(socket.SHUT_WR)  # EOF without close_notify: whatever waits for more must give up
                _seconds_to_close(tcp, wire.TIMEOUT)
        finally:
            tcp.close()

    @rule(data=st.one_of(st.just(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"), st.binary(min_size=1, max_size=512)))
    @timeouts_are_findings
    def plaintext_where_tls_is_required(self, data: bytes) -> None:
        own = TLS["own"]
        if own is None or data[:1] == b"\x16":
            wire.STATS["plaintext_skipped"] = wire.STATS.get("plaintext_skipped", 0) + 1
            return
        _count("tls_plaintext_refused")
        with socket.create_connection((str(own), _port()), timeout=wire.TIMEOUT) as s:
            try:
                s.sendall(data)
            except OSError:
                return
            s.settimeout(CLASSIFY_TIMEOUT + SLACK)
            try:
                assert s.recv(65536) == b"", "plain answered despite --tls-required"
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise StepTimeout("plain from outside not closed within the classify timeout") from None

    @rule(
        key=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
        path=st.sampled_from(["/v1/models", "/slots", "/props", "/v1/completions"]),
    )
    @timeouts_are_findings
    def wrong_key_over_https(self, key: str, path: str) -> None:
        if key == access.TARGET["key"]:
            return
        _count("tls_wrong_key")
        status, body = tls_http(path, f"Authorization: Bearer {key}".encode())
        assert status == 401 and json.loads(body) == access.UNAUTHORIZED, (status, body)

    @rule(op=st.sampled_from(access.CONTROL), payload=st.binary(max_size=2048))
    @timeouts_are_findings
    def refused_control_op_over_tls(self, op: int, payload: bytes) -> None:
        _count("tls_refused_control")
        status, meta, body = tls_hydra(op, payload=payload)
        assert status == Status.BAD_REQUEST and body == b"", (op, status, meta)
        assert meta.get("refused") in ("not_allowed", "invalid_token"), meta

    @invariant()
    def nothing_changed(self) -> None:
        wire.STATS["steps"] += 1
        assert access.guarded_state() == self.before
        status, _, _ = tls_hydra(Op.INFO)
        assert status == Status.OK
