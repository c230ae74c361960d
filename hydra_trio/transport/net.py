"""Small socket helpers the product and its tests share, and the bulk loops of the KV transfers."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable

import trio


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may take it
    before the caller binds it, so a caller that starts a server on it must handle that)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def wait_peer_closed(stream: object) -> None:
    """Return once the peer of ``stream`` (a ``trio.SocketStream``, or a TLS stream over one: its
    ``transport_stream``) has closed or reset the connection, seen without consuming anything
    (``MSG_PEEK``, as the front door classifies).  Waits forever when the peer sends bytes first (a
    pipelined request, a TLS alert: it cannot tell, so the connection counts as alive) or the stream has
    no socket.  For a request handler that has read its whole request and works before it replies."""
    sock = getattr(stream, "socket", None) or getattr(getattr(stream, "transport_stream", None), "socket", None)
    if sock is not None:
        try:
            if await sock.recv(1, socket.MSG_PEEK) == b"":
                return
        except OSError:  # reset, or the socket was closed meanwhile
            return
    await trio.sleep_forever()


# ----------------------------------------------------------------------------- bulk bytes on a trio socket

BULK_WRITE = 4 * 1024 * 1024
"""Bytes one system call of :func:`send_view` hands the kernel at most (it takes what its buffer holds)."""

RECEIVED_BATCH = 1024 * 1024
"""Bytes :func:`recv_into_view` lets arrive before it hands them to its ``received`` callback (they are still
in the CPU's cache then)."""

FAIR_BYTES = 16 * 1024 * 1024
"""Bytes a bulk loop moves between two checkpoints when the socket never makes it wait, so other tasks
of the event loop still run during a multi-GB transfer."""


def _fd(stream: trio.SocketStream) -> int:
    fd = stream.socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the socket was closed")
    return fd


async def send_view(
    stream: trio.SocketStream,
    view: memoryview,
    step: int,
    sent: Callable[[int], None] | None = None,
    progress_timeout: float = math.inf,
    head: bytes = b"",
) -> None:
    """Send ``head`` then all of ``view`` on a plain TCP stream, straight from its memory, in pieces of at
    most ``step`` bytes: non-blocking ``writev`` calls of up to :data:`BULK_WRITE` bytes (several pieces
    each; ``head``, a frame header, rides in the first, so the peer wakes once rather than for a header
    alone: a loopback send costs about 0.13 ms on a 2-core x86-64 VM), waiting (``wait_writable``) only
    when the kernel's send buffer is full.

    The loop trio's ``send_all`` runs, without its two scheduler checkpoints per write and with fewer
    system calls (measured on loopback: trio's ``send_all`` of 256 KiB pieces and one write per
    256 KiB both reach 0.6-0.75x of a blocking ``sendall``; 4 MiB per call about 1x); it checkpoints
    every :data:`FAIR_BYTES`.  ``sent(n)`` is called after each call with the bytes of ``view`` it took.
    The caller holds the stream (no other task sends on it).

    Raises:
        trio.TooSlowError: the kernel took no byte for ``progress_timeout`` seconds.
        trio.BrokenResourceError: the peer reset or closed the connection.
        trio.ClosedResourceError: the stream was closed.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    pos, since, total = 0, 0, len(view)
    rest = memoryview(head)  # what is left of the head
    while pos < total or rest:
        end = min(total, pos + max(step, BULK_WRITE // step * step))
        pieces = [view[i : min(i + step, end)] for i in range(pos, end, step)]
        try:
            n = os.writev(_fd(stream), [rest, *pieces] if rest else pieces)
        except BlockingIOError:
            with trio.fail_after(progress_timeout):
                await trio.lowlevel.wait_writable(stream.socket)
            since = 0
            continue
        except OSError as exc:
            raise trio.BrokenResourceError(f"send failed: {exc}") from exc
        if rest:
            took = min(n, len(rest))
            rest, n = rest[took:], n - took
        pos += n
        since += n
        if sent is not None and n:
            sent(n)
        if since >= FAIR_BYTES:
            await trio.lowlevel.checkpoint()
            since = 0
    await trio.lowlevel.cancel_shielded_checkpoint()


async def recv_into_view(
    stream: trio.SocketStream,
    view: memoryview,
    progress_timeout: float,
    received: Callable[[memoryview], None] | None = None,
) -> tuple[int, bool]:
    """Receive into ``view`` from a plain TCP stream until it is full, the peer closes, or no byte comes
    for ``progress_timeout`` seconds.  Returns ``(received, closed)``: fewer than ``len(view)`` bytes
    with ``closed`` False means it stalled.  ``received(piece)`` is called with consecutive pieces of
    ``view`` as they are filled (still in cache: the place to hash them): once :data:`RECEIVED_BATCH`
    bytes have come since the last call, before the loop waits for more (the callback's work then fills
    the wait) and before it returns (a call per read cost more than the hashing: a read on loopback
    brings 60-100 KB).

    Non-blocking reads of as much as the kernel holds, straight into the view, waiting
    (``wait_readable``) only when nothing is there; a checkpoint every :data:`FAIR_BYTES`.  Bytes
    received before a cancellation are lost to the caller: use it where the connection is given up then.

    Raises:
        trio.BrokenResourceError: the peer reset the connection.
        trio.ClosedResourceError: the stream was closed.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    pos, since, told, total = 0, 0, 0, len(view)

    def tell() -> None:  # hand over what was filled since the last call
        nonlocal told
        if received is not None and pos > told:
            received(view[told:pos])
        told = pos

    while pos < total:
        try:
            n = os.readv(_fd(stream), [view[pos:]])
        except BlockingIOError:
            tell()
            with trio.move_on_after(progress_timeout) as waited:
                await trio.lowlevel.wait_readable(stream.socket)
            if waited.cancelled_caught:
                return pos, False
            since = 0
            continue
        except OSError as exc:
            tell()
            raise trio.BrokenResourceError(f"receive failed: {exc}") from exc
        if n == 0:
            tell()
            return pos, True
        pos += n
        since += n
        if pos - told >= RECEIVED_BATCH:
            tell()
        if since >= FAIR_BYTES:
            await trio.lowlevel.checkpoint()
            since = 0
    tell()
    await trio.lowlevel.cancel_shielded_checkpoint()
    return pos, False
