"""hydra_trio.transport.blocking: TLS on blocking sockets for relay threads, on real sockets with trustme certificates.

What is covered: a client :class:`TlsPipe` (the head's tunnel) against a trio
TLS server whose stream a :class:`TlsPipe` takes over after the handshake and
a first read (the peer's ggml-RPC pump): the bytes trio had received but not
handed out, the pushed-back bytes and TLS 1.3's held-back session tickets all
come through, megabytes cross both ways at once with one thread per direction
on each end, and the end of the connection reads as ``b""``.  Also
:func:`run_blocking`'s cancellation (the thread is woken and waited for).
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import threading

import pytest
import trio
import trustme

from hydra_trio.transport.blocking import TlsPipe, blocking_dup, restore, run_blocking, shutdown_all
from hydra_trio.transport.tls import client_context

SIZE = 3 << 20  # bytes each way


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    return server, client_context(d / "ca.pem")


def _recv_exactly(pipe: TlsPipe, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = pipe.recv(1 << 16)
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_a_taken_over_trio_stream_carries_on_both_ways_at_once(tls_contexts) -> None:
    server_ctx, client_ctx = tls_contexts
    up, down = os.urandom(SIZE), os.urandom(SIZE)
    result: dict[str, object] = {}

    def client(port: int) -> None:
        pipe = TlsPipe.connect("127.0.0.1", port, client_ctx, timeout=30)
        assert pipe.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        sender = threading.Thread(target=pipe.sendall, args=(b"FIRST" + up,))
        sender.start()  # sends while the main thread receives: the two use one TLS object
        result["down"] = _recv_exactly(pipe, SIZE)
        sender.join()
        result["end"] = pipe.recv()  # the server shut its socket down
        pipe.close()

    async def main() -> None:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        thread = threading.Thread(target=client, args=(port,))
        thread.start()
        tcp = await listener.accept()
        stream = trio.SSLStream(tcp, server_ctx, server_side=True)
        await stream.do_handshake()
        first = bytearray()
        while len(first) < 5:  # a first read, as the front door classifies: the rest stays in trio's objects
            first += await stream.receive_some(5 - len(first))
        assert first == b"FIRST"
        await trio.sleep(0.2)  # more arrives in trio's buffers meanwhile
        raw = blocking_dup(tcp.socket)
        pipe = TlsPipe.take_over(stream, raw, plain=b"")
        assert pipe is not None, "trio.SSLStream keeps its TLS state elsewhere: TlsPipe.take_over needs updating"

        def serve() -> None:
            sender = threading.Thread(target=pipe.sendall, args=(down,))
            sender.start()
            got = hashlib.sha256(_recv_exactly(pipe, SIZE)).digest()
            sender.join()
            result["up"] = got
            pipe.shutdown(socket.SHUT_RDWR)

        await trio.to_thread.run_sync(serve)
        restore(pipe)
        await trio.to_thread.run_sync(thread.join)
        await trio.aclose_forcefully(tcp)
        await listener.aclose()

    trio.run(main)
    assert result["up"] == hashlib.sha256(up).digest()
    assert result["down"] == down
    assert result["end"] == b""


def test_pushed_back_bytes_come_first(tls_contexts) -> None:
    server_ctx, client_ctx = tls_contexts

    async def main() -> bytes:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]

        def client() -> None:
            pipe = TlsPipe.connect("127.0.0.1", port, client_ctx, timeout=30)
            pipe.sendall(b"abcdef")
            assert pipe.recv() == b"ok"
            pipe.close()

        thread = threading.Thread(target=client)
        thread.start()
        tcp = await listener.accept()
        stream = trio.SSLStream(tcp, server_ctx, server_side=True)
        await stream.do_handshake()
        got = b""
        while len(got) < 6:
            got += await stream.receive_some(6 - len(got))
        pipe = TlsPipe.take_over(stream, blocking_dup(tcp.socket), plain=got[3:])  # "def" was pushed back
        assert pipe is not None
        data = await trio.to_thread.run_sync(pipe.recv, 2)
        data += await trio.to_thread.run_sync(pipe.recv)
        await trio.to_thread.run_sync(pipe.sendall, b"ok")
        await trio.to_thread.run_sync(thread.join)
        restore(pipe)
        await trio.aclose_forcefully(tcp)
        await listener.aclose()
        return data

    assert trio.run(main) == b"def"


def test_a_client_pipe_refuses_a_certificate_for_another_name(tls_contexts) -> None:
    server_ctx, _ = tls_contexts
    ca = trustme.CA()
    other = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(other)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def serve() -> None:
            conn, _ = srv.accept()
            with conn:
                try:
                    server_ctx.wrap_socket(conn, server_side=True).close()
                except (ssl.SSLError, OSError):
                    pass

        t = threading.Thread(target=serve)
        t.start()
        with pytest.raises(ssl.SSLCertVerificationError):
            TlsPipe.connect("127.0.0.1", port, other, timeout=10)
        t.join(10)


def test_run_blocking_wakes_the_thread_when_cancelled() -> None:
    a, b = socket.socketpair()
    got: list[bytes] = []

    async def main() -> bool:
        with trio.move_on_after(0.3) as scope:
            await run_blocking(lambda: got.append(a.recv(10)), lambda: shutdown_all([a]))
        return scope.cancelled_caught

    assert trio.run(main)  # cancelled while the thread waited in recv ...
    assert got == [b""]  # ... which the shutdown ended (EOF) before run_blocking returned
    a.close()
    b.close()
