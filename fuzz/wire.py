"""What the fuzzer's machines share about the server under test: where it is, the step timeout, the
counters, and blocking wire helpers (one Hydra exchange, one ggml-RPC reply, reading until a close).

:func:`configure` points every machine at a server; :data:`TIMEOUT` is read at each use (``wire.TIMEOUT``),
as :func:`configure` may change it.
"""

from __future__ import annotations

import socket
import struct
import time

from hydra_trio.protocol import ggml_rpc as _g
from hydra_trio.protocol.hydra import (
    NEED_DATA,
    Op,
    PayloadChunk,
    ProtocolError,
    ResponseDecoder,
    ResponseEnded,
    ResponseStarted,
    Status,
    encode_request,
)

from .findings import StepTimeout

TIMEOUT = 60.0  # seconds any single exchange may take: generous, so that only a hang reaches it
TARGET: dict[str, object] = {"port": None, "n_slots": 2}
STATS: dict[str, int] = {
    "examples": 0,
    "steps": 0,
    "http": 0,
    "hydra": 0,
    "ggml_rpc": 0,
    "garbage": 0,
    "disconnects": 0,
    "prefill_status_reads": 0,
}


def configure(port: int, n_slots: int, timeout: float | None = None) -> None:
    """Point the machine at a server on 127.0.0.1:``port`` with ``n_slots`` slots (and a step timeout, seconds)."""
    global TIMEOUT
    TARGET["port"] = port
    TARGET["n_slots"] = n_slots
    if timeout is not None:
        TIMEOUT = timeout


def port() -> int:
    """The port :func:`configure` set."""
    port = TARGET["port"]
    assert isinstance(port, int), "call fuzz.wire.configure(port, n_slots) first"
    return port


def base() -> str:
    """``http://127.0.0.1:PORT``."""
    return f"http://127.0.0.1:{port()}"


def connect() -> socket.socket:
    """A blocking TCP connection to the server, :data:`TIMEOUT` on each operation."""
    return socket.create_connection(("127.0.0.1", port()), timeout=TIMEOUT)


def hydra_exchange(frames: list[bytes], pause: float = 0.0, half_close: bool = False) -> tuple[int, dict, bytes] | None:
    """Send ``frames`` (pieces of one request) and read one reply; None if the server closed instead.

    ``half_close`` sends EOF after the frames (for frames that may declare
    more payload than they carry: the server must then close, not wait).
    Raises AssertionError for a malformed reply or a hang past TIMEOUT.
    """
    with connect() as s:
        try:
            for piece in frames:
                s.sendall(piece)
                if pause:
                    time.sleep(pause)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first (bad magic, oversize): a close is an answer
            pass
        dec = ResponseDecoder()
        status, meta, body = None, None, bytearray()
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                data = s.recv(1 << 20)
            except ConnectionResetError:
                return None
            except TimeoutError as exc:
                raise StepTimeout("no reply and no close within the timeout") from exc
            if not data:
                assert status is None, "connection closed in the middle of a reply"
                return None
            dec.receive_data(data)
            while True:
                try:
                    ev = dec.next_event()
                except ProtocolError as exc:
                    raise AssertionError(f"malformed reply: {exc}") from exc
                if ev is NEED_DATA:
                    break
                if isinstance(ev, ResponseStarted):
                    status, meta = ev.header.status, ev.meta
                elif isinstance(ev, PayloadChunk):
                    body += ev.data
                elif isinstance(ev, ResponseEnded):
                    assert status in set(Status), f"unknown status {status}"
                    if status != Status.OK:
                        assert isinstance(meta.get("error"), str) and meta["error"], meta
                    return status, meta, bytes(body)
        raise StepTimeout("reply not finished within the timeout")


def exchange_until_close(data: bytes) -> bytes:
    """Send ``data``, half-close, read until the server closes; AssertionError on a hang."""
    with connect() as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server already closed: fine
        out = b""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                return out
            except TimeoutError as exc:
                raise StepTimeout("server neither answered nor closed") from exc
            if not chunk:
                return out
            out += chunk
        raise StepTimeout("server kept the connection open past the timeout")


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s``; ConnectionError if the server closes first."""
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def ggml_reply(s: socket.socket) -> bytes:
    """One ggml-RPC reply ``[u64 size][payload]``; ConnectionError if the server closed instead."""
    (size,) = struct.unpack("<Q", recv_exact(s, 8))
    return recv_exact(s, size)


def closes(s: socket.socket) -> bool:
    """Read until the server closes (True) or TIMEOUT passes (False)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            if not s.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def rpc_pid() -> int:
    """The pid of the node's ggml-RPC child (INFO's ``rpc_backend.pid``)."""
    status, meta, _ = hydra_exchange([encode_request(Op.INFO)])  # type: ignore[misc]
    assert status == Status.OK
    return meta["rpc_backend"]["pid"]


def ggml_backend_answers(pid: int) -> None:
    """A real HELLO is answered, and the ggml-RPC child is still the one it was (pid unchanged)."""
    with connect() as s:
        s.sendall(_g.hello_request())
        reply = ggml_reply(s)
        assert reply[0] == _g.RPC_PROTO_MAJOR_VERSION, reply
    assert rpc_pid() == pid, "the ggml-RPC child was restarted: something crashed it"
