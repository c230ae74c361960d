"""Byte relays on worker threads: blocking sockets, TLS on them, and the bridge back to trio.

The ggml-RPC pump (:mod:`hydra_trio.rpc_backend.pump`) and the head's TLS tunnel
(:mod:`hydra_trio.transport.tunnel`) move many small messages per token (a COMBINED
decode step is about 200 ggml-RPC messages and 60 round trips).  Through the
trio scheduler each costs several task switches; on a thread blocked in
``recv`` it costs one wake-up, and the socket calls (and OpenSSL's record
work in :class:`TlsPipe`) run without the GIL.

- :func:`blocking_dup` / :func:`restore`: a blocking duplicate of a trio socket's
  descriptor for a thread, and trio's socket non-blocking again afterwards.
- :class:`TlsPipe`: TLS over a blocking socket for two threads at once (one
  receives, one sends), on an :class:`ssl.SSLObject` with memory BIOs under a lock.
  Made by a client handshake (:meth:`TlsPipe.connect`) or by taking over a
  :class:`trio.SSLStream` whose handshake trio did (:meth:`TlsPipe.take_over`).
- :func:`run_blocking`: run a blocking loop on a thread from trio; when the
  caller is cancelled, a ``wake`` callback (shutting the sockets down) ends the
  loop, and the call waits for the thread.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import ssl
import struct
import termios
import threading
from collections.abc import Callable
from typing import Any

import trio

RECV_BUFFER = 1 << 20  # bytes per receive: ggml-RPC moves tensors in large messages
# Relays receive into a preallocated buffer (recv_into): socket.recv(1 MiB) makes a fresh 1 MiB
# object each time, an mmap and a munmap (~30 µs; a COMBINED token is ~270 receives).


def blocking_dup(sock: Any) -> socket.socket:
    """A blocking plain socket on a duplicate of ``sock``'s descriptor (a trio or stdlib socket), for a thread.

    The blocking flag belongs to the open file, not the descriptor, so trio's
    own socket is blocking too while the thread runs: trio does no I/O on it
    then, and :func:`restore` makes it non-blocking again before trio has it back.
    """
    dup = socket.socket(fileno=os.dup(sock.fileno()))
    dup.setblocking(True)
    return dup


def restore(dup: Any) -> None:
    """Non-blocking again (for trio), then close the duplicate (a socket or a :class:`TlsPipe`)."""
    try:
        dup.setblocking(False)
    except OSError:
        pass
    dup.close()


def send_pieces(sock: Any, pieces: list[bytes | memoryview]) -> int:
    """Send ``pieces`` in order, all of them (blocking), with as few system calls as they allow:
    one ``sendall`` for one piece, gathered ``sendmsg`` calls for several (a :class:`TlsPipe`:
    one encryption pass and one send).  Returns the bytes sent.

    Raises:
        OSError: the connection broke.
    """
    if len(pieces) == 1:
        sock.sendall(pieces[0])
        return len(pieces[0])
    if isinstance(sock, TlsPipe):
        return sock.send_pieces(pieces)
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    total = sum(len(v) for v in views)
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent:  # drop what went out; a partial piece is resent from where it stopped
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0
    return total


_IOV_MAX = 512  # pieces per sendmsg (Linux allows 1024)


class LowWater:
    """Receives on a plain blocking socket that wake only once ``at`` bytes are there (``SO_RCVLOWAT``).

    A relay that needs the rest of a message head before it can pass anything on is then woken
    once instead of once per TCP segment (ggml's client sends a request's command byte, its size
    and its payload in three sends).  The wait is a ``poll`` (the mark gates its readiness), then a
    non-blocking receive of all there is: a blocking ``recv`` under a mark would copy the bytes
    already queued and then wait for ``at`` *more* (Linux compares the mark with the bytes not yet
    copied), which can hang a connection whose message ends sooner.  The caller must never ask for
    more than the peer sends without waiting for an answer.  A socket that refuses the option
    receives as before.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.at = 1  # the kernel's default
        self.works = True
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)

    def set(self, at: int) -> None:
        """The mark for the next receives (bytes, at least 1); set in the kernel only when it changes."""
        if at != self.at and self.works:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, at)
                self.at = at
            except OSError:
                self.works = False

    def recv_into(self, buf: bytearray) -> int:
        """As ``socket.recv_into``: at least the mark's bytes (fewer at the end or on a shutdown), 0 at the end."""
        if self.at <= 1:
            return self.sock.recv_into(buf)
        while True:
            self._poll.poll()
            try:
                return self.sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:  # woken with nothing to read: wait again
                continue

    def queued(self) -> int:
        """Bytes received by the kernel and not yet read (``FIONREAD``); 0 when it cannot tell."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return 0


_TCP_INFO_ACKED = struct.Struct("<Q")  # tcpi_bytes_acked: offset 120 of Linux's struct tcp_info (since 4.1)


def bytes_acked(sock: Any) -> int:
    """Bytes sent on TCP socket ``sock`` that its peer's kernel acknowledged (``TCP_INFO``'s
    ``tcpi_bytes_acked``); 0 when it cannot tell (not TCP, an older kernel).

    Progress of a reader behind a blocked send: once its receive buffer is full, the count grows
    only as the peer's application reads.  ``sock``: anything with ``getsockopt`` (a socket, a trio
    socket); a :class:`TlsPipe` is read through its socket.
    """
    try:
        raw = sock.sock if isinstance(sock, TlsPipe) else sock
        info = raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
        return _TCP_INFO_ACKED.unpack_from(info, 120)[0] if len(info) >= 128 else 0
    except (OSError, AttributeError, ValueError):
        return 0


def shutdown_all(socks: list[Any]) -> None:
    """``shutdown(SHUT_RDWR)`` each of ``socks`` (sockets or pipes), ignoring errors: wakes their threads."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


async def run_blocking(fn: Callable[[], None], wake: Callable[[], None], name: str = "relay") -> None:
    """Run ``fn`` on a new daemon thread and wait for it; re-raise what it raised.

    When the caller is cancelled first, ``wake()`` is called (it must make ``fn``
    return soon, e.g. by shutting its sockets down) and the wait goes on, shielded,
    until the thread is done; then Cancelled propagates.
    """
    done = trio.Event()
    result: list[BaseException | None] = []
    token = trio.lowlevel.current_trio_token()

    def main() -> None:
        try:
            fn()
            result.append(None)
        except BaseException as exc:  # handed to the trio side
            result.append(exc)
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    # a plain thread, not trio.to_thread: a relay lives as long as its connection and would hold one of the
    # shared worker-thread limiter's 40 places all that time; it hands back only a wake-up (run_sync_soon)
    threading.Thread(target=main, name=name, daemon=True).start()
    try:
        await done.wait()
    finally:
        if not done.is_set():  # cancelled: the relay is ending
            wake()
            with trio.CancelScope(shield=True):
                await done.wait()
    if result and result[0] is not None:
        raise result[0]


class TlsPipe:
    """TLS over a blocking socket: :meth:`recv` on one thread and :meth:`sendall` on another at once.

    OpenSSL's objects must not be used by two threads at a time, so the
    :class:`ssl.SSLObject` and its BIOs are used under one lock (held for the
    record work only, never across a socket call); ciphertext goes to the
    socket under a second lock, in the order it was made, whichever thread made
    it (a receive can make some: a TLS 1.3 key update).  The record work
    releases the GIL (``_ssl``), so two relays on two threads overlap.

    The face is a socket's, as far as the relays use one: ``recv``,
    ``recv_into``, ``sendall``, ``shutdown``, ``setblocking``, ``close``, ``fileno``.
    ``recv`` returns ``b""`` (``recv_into`` 0) at the end (close_notify, or the peer's TCP end;
    the relays end either way).

    Raises (from ``recv``/``sendall``): OSError (``ssl.SSLError`` is one) for
    a broken connection or a TLS error.
    """

    def __init__(
        self,
        sock: socket.socket,
        obj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        plain: bytes = b"",
        early: bytes = b"",
    ) -> None:
        self.sock = sock
        self.obj = obj
        self._in = incoming
        self._out = outgoing
        self._plain = plain  # decrypted bytes read before the take-over, returned first
        self._early = early  # ciphertext made before the take-over and not yet sent, sent first
        self._ssl = threading.Lock()
        self._tx = threading.Lock()
        self._eof = False
        self._raw: bytearray | None = None  # ciphertext from the socket (the receiving thread's; made on first use)
        self._raw_view = memoryview(b"")
        self.alert_at_end = True  # send what OpenSSL queues on the peer's end (its fatal alert on a TCP end)

    # ------------------------------------------------------------ making one
    @classmethod
    def connect(cls, host: str, port: int, context: ssl.SSLContext, timeout: float) -> TlsPipe:
        """Client side: TCP to ``host:port`` (``TCP_NODELAY``), the handshake (the server's certificate
        must name ``host``), all within ``timeout`` seconds; the socket is blocking afterwards.

        Raises:
            OSError: the connect or the handshake failed (``ssl.SSLError``, ``TimeoutError``, ...).
        """
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            obj = context.wrap_bio(incoming, outgoing, server_hostname=host)
            while True:
                try:
                    obj.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                if out := outgoing.read():
                    sock.sendall(out)
                if done:
                    break
                data = sock.recv(RECV_BUFFER)
                if not data:
                    raise ConnectionResetError("the peer closed during the TLS handshake")
                incoming.write(data)
            sock.settimeout(None)
            return cls(sock, obj, incoming, outgoing)
        except BaseException:
            sock.close()
            raise

    @classmethod
    def take_over(cls, stream: trio.SSLStream[Any], sock: socket.socket, plain: bytes = b"") -> TlsPipe | None:
        """A pipe that carries on a handshaken :class:`trio.SSLStream` on ``sock`` (a blocking
        duplicate of its transport socket); None when this trio keeps its TLS state elsewhere.

        The stream must be idle (no task in it) and stay unused afterwards. ``plain``: bytes
        already decrypted and not yet consumed (a :class:`~hydra_trio.transport.tls.TlsStream`'s pushback).

        Uses ``trio.SSLStream``'s own :class:`ssl.SSLObject` and memory BIOs
        (``_ssl_object``, ``_incoming``, ``_outgoing``, and ``_delayed_outgoing``: TLS 1.3
        session tickets trio holds back until the first write; trio 0.32's
        ``trio/_ssl.py``), so whatever it had received and not yet decrypted goes on.
        """
        obj = getattr(stream, "_ssl_object", None)
        incoming = getattr(stream, "_incoming", None)
        outgoing = getattr(stream, "_outgoing", None)
        if not (
            isinstance(obj, ssl.SSLObject)
            and isinstance(incoming, ssl.MemoryBIO)
            and isinstance(outgoing, ssl.MemoryBIO)
        ):
            return None
        early = getattr(stream, "_delayed_outgoing", None) or b""
        stream._delayed_outgoing = None
        return cls(sock, obj, incoming, outgoing, plain=plain, early=bytes(early) + outgoing.read())

    # ------------------------------------------------------------ the socket face
    def recv(self, n: int = 1 << 16) -> bytes:
        """Up to ``n`` decrypted bytes, blocking until some come; ``b""`` at the end."""
        buf = bytearray(n)
        return bytes(buf[: self.recv_into(buf)])

    def recv_into(self, buf: bytearray | memoryview) -> int:
        """Decrypted bytes into ``buf`` (as many as are ready, at least one), blocking until some
        come; their count, 0 at the end."""
        view = memoryview(buf).cast("B")
        if self._plain:
            n = min(len(view), len(self._plain))
            view[:n] = self._plain[:n]
            self._plain = self._plain[n:]
            return n
        while True:
            with self._ssl:
                ready, flush = self._read(view)
            if flush and (self.alert_at_end or not self._eof):
                self._flush()
            if ready is not None:
                return ready
            if self._raw is None:
                self._raw = bytearray(RECV_BUFFER)
                self._raw_view = memoryview(self._raw)
            got = self.sock.recv_into(self._raw)
            with self._ssl:
                if got:
                    self._in.write(self._raw_view[:got])
                else:
                    self._in.write_eof()

    def _read(self, view: memoryview) -> tuple[int | None, bool]:
        """(bytes decrypted into ``view`` now, None: none yet, 0: the end), and whether
        ciphertext waits to be sent.  Under ``_ssl``."""
        if self._eof:
            return 0, False
        got = 0
        try:
            while got < len(view):
                n: int = self.obj.read(len(view) - got, view[got:])  # type: ignore[assignment]  # with a buffer: the count
                if not n:  # close_notify: _ssl returns 0 rather than raising once the peer's shutdown is in
                    self._eof = True
                    break
                got += n
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or the TCP end without one
            self._eof = True
        if got:
            return got, self._out.pending > 0
        return (0 if self._eof else None), self._out.pending > 0

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` and send it all (blocking)."""
        with self._tx:
            with self._ssl:
                view = memoryview(data)
                while view:
                    try:
                        n = self.obj.write(view)
                    except ssl.SSLWantReadError:  # renegotiation: not in TLS 1.3, not expected
                        raise ssl.SSLError("TLS renegotiation is not supported here") from None
                    view = view[n:]
                out = self._take_out()
            self.sock.sendall(out)

    def send_pieces(self, pieces: list[bytes | memoryview]) -> int:
        """:meth:`sendall` of ``pieces`` in order, encrypted in one pass and sent in one call; their size."""
        total = 0
        with self._tx:
            with self._ssl:
                for piece in pieces:
                    view = memoryview(piece)
                    total += len(view)
                    while view:
                        try:
                            n = self.obj.write(view)
                        except ssl.SSLWantReadError:
                            raise ssl.SSLError("TLS renegotiation is not supported here") from None
                        view = view[n:]
                out = self._take_out()
            self.sock.sendall(out)
        return total

    def _take_out(self) -> bytes:
        out = self._out.read()
        if self._early:
            out, self._early = self._early + out, b""
        return out

    def _flush(self) -> None:
        """Send the ciphertext a receive made (in order with the sends)."""
        with self._tx:
            with self._ssl:
                out = self._take_out()
            if out:
                self.sock.sendall(out)

    def shutdown(self, how: int) -> None:
        """Shut the socket down (no close_notify: the relays end the connection either way)."""
        self.sock.shutdown(how)

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
