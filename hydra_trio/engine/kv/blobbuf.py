"""Buffers for KV state blobs: one anonymous memory mapping per blob, and a pool that keeps an idle one.

A blob moves through one buffer: STATE_GET has llama.cpp write the slot's
state into it and the socket sends from it; STATE_PUT receives the socket's
bytes into it, checks them and hands them to llama.cpp (:mod:`.state`).  The
buffer is a private anonymous mapping (:class:`BlobBuffer`): its pages come
from the kernel as they are first written, so a buffer sized for an
announced payload costs memory only as the bytes arrive, and it has
:data:`TAIL_ROOM` spare bytes after the blob for the framing a restore adds.

Why a pool: the first write to a page is a page fault that zero-fills it.
Measured on the project's 2-core VM, filling a fresh 256 MB mapping runs at
0.8-1.5 GB/s, rewriting one whose pages are in at 4.5-9 GB/s, and a loopback
TCP socket moves 1.1-2.5 GB/s: a fresh buffer per transfer costs about as
much as the transfer.  So the transfer paths take their buffer from
:data:`TRANSFER_POOL` and give it back once the bytes are sent or applied.
The pool keeps at most one idle mapping (the largest) and unmaps it after
``keep_s`` seconds unused (:meth:`BlobPool.trim`, called on every take and
by the node every few seconds, in a worker thread: unmapping a GB takes tens
of milliseconds).  While kept, the idle mapping counts in the node's RSS: at
most the largest blob moved in the last ``keep_s`` seconds.
"""

from __future__ import annotations

import mmap
import threading
import time

__all__ = ["TAIL_ROOM", "TRANSFER_POOL", "BlobBuffer", "BlobPool"]

TAIL_ROOM = 4 * 256
"""Spare bytes after a blob: a restore appends one 4-byte "no cells" count per other KV stream
(a context has at most 256 streams: llama.cpp's ``LLAMA_MAX_SEQ``)."""

_PAGE = mmap.PAGESIZE
_ROUND = 1 << 20  # pooled mappings are whole MiB, so one serves blobs that differ by a few tokens


def _new_map(size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(-1, max(size, _PAGE), flags=flags)


class BlobBuffer:
    """``size`` bytes of blob at the start of an anonymous mapping of at least ``size + TAIL_ROOM`` bytes.

    Args:
        size: the blob's length in bytes.
        populate: fault every page in now (``MAP_POPULATE``: cheaper than one
            fault per page as the bytes are written; only for a buffer that is
            filled at once, not for one sized for an announced payload).

    :meth:`view` is the blob (writable), :meth:`whole` the mapping, tail room
    included.  ``size`` may shrink after the blob is written (never past the
    mapping).  A buffer from a :class:`BlobPool` goes back with :meth:`release`
    once nothing reads or writes it any more; an unreleased one is unmapped when
    its last reference goes, as any Python object.
    """

    __slots__ = ("_map", "_pool", "size")

    def __init__(
        self, size: int, *, populate: bool = False, _map: mmap.mmap | None = None, _pool: BlobPool | None = None
    ) -> None:
        if size < 0:
            raise ValueError(f"a blob buffer of {size} bytes")
        self._map: mmap.mmap | None = _map if _map is not None else _new_map(size + TAIL_ROOM, populate)
        if len(self._map) < size + TAIL_ROOM:
            raise ValueError(f"a mapping of {len(self._map)} bytes has no room for a {size}-byte blob")
        self._pool = _pool
        self.size = size

    def __len__(self) -> int:
        return self.size

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError("the blob buffer was released")
        return self._map

    def view(self) -> memoryview:
        """The blob's ``size`` bytes (writable)."""
        return memoryview(self._mapping())[: self.size]

    def whole(self) -> memoryview:
        """The whole mapping: the blob, then at least :data:`TAIL_ROOM` bytes (writable)."""
        return memoryview(self._mapping())

    @property
    def capacity(self) -> int:
        """Bytes in the mapping."""
        return len(self._mapping())

    def release(self) -> None:
        """Give the mapping back to its pool (an unpooled buffer keeps it until it is collected).
        Only once nothing reads or writes the bytes any more; afterwards the buffer is empty."""
        m, self._map, self.size = self._map, None, 0
        if m is not None and self._pool is not None:
            self._pool.give_back(m)


class BlobPool:
    """Mappings for blob buffers, one idle mapping kept for the next transfer (see the module docstring).

    Thread-safe: buffers are taken on the engine thread (STATE_GET) and on the
    trio thread (STATE_PUT), and given back from either.

    Args:
        keep_s: seconds an idle mapping is kept before it is unmapped.
    """

    def __init__(self, keep_s: float = 30.0) -> None:
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._idle: tuple[mmap.mmap, float] | None = None  # (mapping, monotonic time it went idle)
        self.reused = 0  # takes served by the idle mapping
        self.created = 0  # takes that made a new mapping

    @property
    def idle_bytes(self) -> int:
        """Bytes of the idle mapping (0 when none is kept)."""
        idle = self._idle
        return len(idle[0]) if idle is not None else 0

    def take(self, size: int, *, populate: bool = False) -> BlobBuffer:
        """A buffer for a blob of ``size`` bytes: the idle mapping when it is large enough, else a new one
        (``populate``: see :class:`BlobBuffer`; a reused mapping's pages are mostly in already)."""
        need = size + TAIL_ROOM
        with self._lock:
            self._trim_locked(time.monotonic())
            idle, self._idle = self._idle, None
        if idle is not None and len(idle[0]) >= need:
            self.reused += 1
            return BlobBuffer(size, _map=idle[0], _pool=self)
        if idle is not None:
            _unmap(idle[0])  # too small: a larger one replaces it
        self.created += 1
        return BlobBuffer(size, _map=_new_map(-(-need // _ROUND) * _ROUND, populate), _pool=self)

    def give_back(self, m: mmap.mmap) -> None:
        """Keep ``m`` as the idle mapping if it is the largest (the other is unmapped)."""
        drop: mmap.mmap | None
        with self._lock:
            old = self._idle
            if old is not None and len(old[0]) >= len(m):
                drop = m
            else:
                drop = old[0] if old is not None else None
                self._idle = (m, time.monotonic())
        if drop is not None:
            _unmap(drop)

    def trim(self) -> None:
        """Unmap the idle mapping when it has been idle ``keep_s`` seconds."""
        with self._lock:
            self._trim_locked(time.monotonic())

    def _trim_locked(self, now: float) -> None:
        if self._idle is not None and now - self._idle[1] >= self.keep_s:
            _unmap(self._idle[0])
            self._idle = None

    def clear(self) -> None:
        """Unmap the idle mapping now."""
        with self._lock:
            idle, self._idle = self._idle, None
        if idle is not None:
            _unmap(idle[0])


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a view of it is still alive somewhere: it is unmapped when that goes
        pass


TRANSFER_POOL = BlobPool()
"""The node's pool for the transfer paths (Hydra STATE_GET / STATE_PUT, HTTP ``/slots/{id}/state``)."""
