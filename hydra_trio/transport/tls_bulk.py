"""A KV blob's bytes over TLS on a worker thread: the ssl module's record loop instead of trio's.

Through :class:`trio.SSLStream` each 16 KiB TLS record costs scheduler work
on the event loop: a receive decrypts into a fresh ``bytes`` per call that
the caller copies again, a send encrypts on the event loop between its
writes.  Measured with ``bench/kv_transfer.py`` that held a KV transfer to
0.1-0.4x of the ssl module's own blocking socket.  Here the stream's own
:class:`ssl.SSLObject` and memory BIOs go on on a worker thread, over a
blocking duplicate of the socket (:class:`~hydra_trio.transport.blocking.TlsPipe`,
as the ggml-RPC pump and the TLS tunnel do): OpenSSL's record work and the
socket calls run without the GIL, and decrypted bytes land straight in the
caller's buffer.  When the thread is done, the trio stream carries on with
the same TLS state (ciphertext read past the bulk stays in its incoming BIO,
plaintext past it in OpenSSL's buffer, or for a server stream in its
pushback), so the next request and reply on the connection go through trio
as before.

The caller must hold the stream: no other task sends or receives on it
while a bulk call runs (a Hydra connection runs one request at a time).

:func:`send_bulk`, :func:`receives_bulk` and :func:`recv_bulk_into` choose the path for a payload
on any stream (plain TCP: :mod:`hydra_trio.transport.net`; TLS: the worker thread, or trio's records
under :data:`BULK_TLS_MIN`), for the node's and the client's side alike.
"""

from __future__ import annotations

import math
import socket
import ssl
from collections.abc import Callable
from typing import Any

import trio

from .blocking import TlsPipe, blocking_dup, restore, run_blocking, shutdown_all
from .net import recv_into_view, send_view

__all__ = [
    "BULK_TLS_MIN",
    "receives_bulk",
    "recv_bulk_into",
    "send_bulk",
    "ssl_stream_of",
    "tls_recv_into_view",
    "tls_send_view",
]

BULK_TLS_MIN = 256 * 1024
"""Bytes from which a payload over TLS takes the worker thread (below it, the thread and the duplicate
socket cost more than trio's records)."""

SEND_PIECE = 1 << 20
"""Bytes encrypted per step of :func:`tls_send_view` (the ciphertext of one piece is held at a time)."""


def ssl_stream_of(stream: Any) -> trio.SSLStream[Any] | None:
    """The :class:`trio.SSLStream` of ``stream`` (itself, or a :class:`~hydra_trio.transport.tls.TlsStream`'s),
    or None for a stream that is not TLS over a trio socket, or when this trio keeps its TLS state where
    :meth:`TlsPipe.take_over` does not look."""
    inner = stream if isinstance(stream, trio.SSLStream) else getattr(stream, "ssl_stream", None)
    if (
        isinstance(inner, trio.SSLStream)
        and isinstance(inner.transport_stream, trio.SocketStream)
        and all(hasattr(inner, a) for a in ("_ssl_object", "_incoming", "_outgoing"))
    ):  # TlsPipe.take_over's
        return inner
    return None


def _pipe(ssl_stream: trio.SSLStream[Any], timeout: float, plain: bytes) -> tuple[TlsPipe | None, socket.socket]:
    dup = blocking_dup(ssl_stream.transport_stream.socket)
    dup.settimeout(None if math.isinf(timeout) else timeout)  # a socket call waits at most this long
    pipe = TlsPipe.take_over(ssl_stream, dup, plain=plain)
    if pipe is None:
        restore(dup)
    else:  # at the peer's end the trio stream is broken and closed without a word, as trio's own receive does
        pipe.alert_at_end = False
    return pipe, dup


def _hand_back(ssl_stream: trio.SSLStream[Any], pipe: TlsPipe, dup: socket.socket, broken: bool) -> None:
    """Ciphertext the pipe took over and did not send (TLS 1.3 session tickets trio holds back until the
    first write) goes back to the trio stream, which sends it first; the socket is trio's again.
    ``broken``: the connection ended or failed on the thread, so the trio stream is marked broken as its
    own receive would have (its close then sends no close_notify from a TLS state that saw the end)."""
    if pipe._early:
        ssl_stream._delayed_outgoing = pipe._early
        pipe._early = b""
    state = getattr(ssl_stream, "_state", None)
    if broken and state is not None and hasattr(type(state), "BROKEN"):
        ssl_stream._state = type(state).BROKEN
    restore(dup)


async def tls_send_view(
    stream: Any, view: memoryview, timeout: float = math.inf, sent: Callable[[int], None] | None = None
) -> bool:
    """Send all of ``view`` on the TLS ``stream`` (a :class:`trio.SSLStream` or a server's
    :class:`~hydra_trio.transport.tls.TlsStream`) from a worker thread, :data:`SEND_PIECE` bytes encrypted
    at a time; ``sent(n)`` after each piece (on that thread).  False (nothing sent) when this trio keeps
    its TLS state where :class:`TlsPipe` does not find it: the caller sends through trio then.

    Raises:
        trio.TooSlowError: the socket took no byte for ``timeout`` seconds.
        trio.BrokenResourceError: the connection broke (or a TLS error).  When the socket refused the
            bytes (the peer closed or reset), the stream can still receive what the peer sent before.
    """
    ssl_stream = ssl_stream_of(stream)
    if ssl_stream is None:
        return False
    await trio.lowlevel.checkpoint_if_cancelled()
    pipe, dup = _pipe(ssl_stream, timeout, b"")
    if pipe is None:
        return False

    def loop() -> None:
        for i in range(0, len(view), SEND_PIECE):
            piece = view[i : i + SEND_PIECE]
            pipe.sendall(piece)
            if sent is not None:
                sent(len(piece))

    ok = False
    try:
        await run_blocking(loop, lambda: shutdown_all([dup]), name="tls-bulk-send")
        ok = True
    except TimeoutError as exc:  # socket.timeout
        raise trio.TooSlowError(f"the peer took no byte for {timeout:g} s") from exc
    except OSError as exc:
        # the socket refused the bytes (the peer closed or reset): the receiving half of the TLS state is
        # intact, so what the peer sent before it closed (a server's refusal of the request being sent)
        # can still be read through the trio stream, as on a plain socket
        ok = not isinstance(exc, ssl.SSLError)
        raise trio.BrokenResourceError(f"TLS send failed: {exc}") from exc
    finally:
        _hand_back(ssl_stream, pipe, dup, broken=not ok)
    return True


async def tls_recv_into_view(
    stream: Any, view: memoryview, timeout: float = math.inf, received: Callable[[memoryview], None] | None = None
) -> tuple[int, bool] | None:
    """Receive into ``view`` from the TLS ``stream`` on a worker thread until it is full, the peer closes or
    no byte comes for ``timeout`` seconds, as :func:`~hydra_trio.transport.net.recv_into_view` does on a
    plain socket: ``(received, closed)``; ``received(piece)`` with each piece of ``view`` as it is filled
    (on that thread, the piece still in cache).  A server stream's pushed-back bytes come first, and
    those past ``view`` are pushed back again.  None (nothing received) when this trio keeps its TLS
    state where :class:`TlsPipe` does not find it.

    Raises:
        trio.BrokenResourceError: the connection broke (or a TLS error).
    """
    ssl_stream = ssl_stream_of(stream)
    if ssl_stream is None:
        return None
    await trio.lowlevel.checkpoint_if_cancelled()
    take = getattr(stream, "take_pushback", None)
    plain = take() if take is not None else b""
    pipe, dup = _pipe(ssl_stream, timeout, plain)
    if pipe is None:
        if plain:
            stream.unread(plain)
        return None
    pos, closed = 0, False

    def loop() -> None:
        nonlocal pos, closed
        while pos < len(view):
            try:
                n = pipe.recv_into(view[pos:])
            except TimeoutError:  # socket.timeout: stalled
                return
            if n == 0:
                closed = True
                return
            if received is not None:
                received(view[pos : pos + n])
            pos += n

    ok = False
    try:
        await run_blocking(loop, lambda: shutdown_all([dup]), name="tls-bulk-recv")
        ok = pos == len(view)
    except OSError as exc:
        raise trio.BrokenResourceError(f"TLS receive failed: {exc}") from exc
    finally:
        if pipe._plain:  # pushed-back bytes past the view
            stream.unread(bytes(pipe._plain))
            pipe._plain = b""
        _hand_back(ssl_stream, pipe, dup, broken=not ok)
    return pos, closed


async def send_bulk(
    stream: Any,
    view: memoryview,
    step: int,
    timeout: float,
    *,
    head: bytes = b"",
    sent: Callable[[int], None] | None = None,
) -> None:
    """Send ``head`` (a frame header), then all of ``view`` in pieces of at most ``step`` bytes, on any
    stream: plain TCP by :func:`~hydra_trio.transport.net.send_view` (``head`` in its first write); TLS
    by :func:`tls_send_view` from :data:`BULK_TLS_MIN` bytes on, else ``send_all`` of each piece.
    ``timeout`` bounds each wait for progress; ``sent(n)`` counts the bytes of ``view`` sent.

    Raises:
        trio.TooSlowError: no progress for ``timeout`` seconds.
        trio.BrokenResourceError, trio.ClosedResourceError: the connection broke or was closed.
    """
    if isinstance(stream, trio.SocketStream):
        await send_view(stream, view, step, sent=sent, progress_timeout=timeout, head=head)
        return
    if head:
        with trio.fail_after(timeout):
            await stream.send_all(head)
    if len(view) >= BULK_TLS_MIN and await tls_send_view(stream, view, timeout, sent=sent):
        return
    for i in range(0, len(view), step):
        piece = view[i : i + step]
        with trio.fail_after(timeout):
            await stream.send_all(piece)
        if sent is not None:
            sent(len(piece))


def receives_bulk(stream: Any, n: int) -> bool:
    """Whether the next ``n`` payload bytes on ``stream`` can go straight into a buffer
    (:func:`recv_bulk_into`): on plain TCP always, over TLS from :data:`BULK_TLS_MIN` bytes on when
    :func:`ssl_stream_of` finds the TLS state."""
    return isinstance(stream, trio.SocketStream) or (n >= BULK_TLS_MIN and ssl_stream_of(stream) is not None)


async def recv_bulk_into(
    stream: Any, view: memoryview, timeout: float, received: Callable[[memoryview], None] | None = None
) -> tuple[int, bool]:
    """Receive into ``view`` straight from ``stream`` (for which :func:`receives_bulk` holds): plain TCP by
    :func:`~hydra_trio.transport.net.recv_into_view`, TLS by :func:`tls_recv_into_view`;
    ``(received, closed)`` as they return.  Raises as they do."""
    if isinstance(stream, trio.SocketStream):
        return await recv_into_view(stream, view, timeout, received)
    done = await tls_recv_into_view(stream, view, timeout, received)
    assert done is not None  # receives_bulk found the TLS state
    return done
