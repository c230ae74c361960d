"""Slot files: llama-server's ``--slot-save-path`` (``POST /slots/{id}?action=save|restore``).

A slot file is the node's own KV state blob (:mod:`.state`, the bytes
STATE_GET returns), not llama.cpp's ``llama_state_seq_save_file`` format: it
carries the model hash and KV identity, so a file of another model is refused
before the slot is touched, and a checksum, so a damaged file is too.

* **save** takes the idle slot's blob on the engine thread
  (:meth:`Engine.save_slot <hydra_trio.engine.engine.Engine.save_slot>`), then
  writes it in a worker thread to a temporary file in the same directory
  (mode 0600), fsyncs it and renames it over ``filename``: a reader never
  sees half a file, and a failed save leaves the old file (if any) as it was.
* **restore** reads the file and checks its checksum in a worker thread, then
  applies it on the engine thread
  (:meth:`Engine.restore_slot <hydra_trio.engine.engine.Engine.restore_slot>`),
  all or nothing: a refused restore leaves the slot's KV cache and ``n_past``
  as they were (llama-server clears the slot instead).

File names follow llama-server's ``fs_validate_filename`` (``common/common.cpp``,
subdirectories not allowed): :func:`check_filename`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..errors import HydraTrioError, InvalidRequest
from .blobbuf import BlobBuffer
from .state import StateError, verify_checksum

if TYPE_CHECKING:
    from .engine import Engine

MAX_FILENAME_BYTES = 255
"""The longest file name, in UTF-8 bytes (Linux's NAME_MAX; llama-server's limit)."""

_FORBIDDEN = frozenset('/\\:*?"<>|') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


class SlotFileError(HydraTrioError):
    """The node could not write a slot file (the directory is missing or unwritable, the disk is full): a server
    error (HTTP 500, as llama-server's "Unable to save slot")."""


def check_filename(name: str) -> str:
    """Return ``name`` if it is a plain file name llama-server would accept, else raise InvalidRequest naming
    ``filename``.

    Refused (``fs_validate_filename`` in llama.cpp's ``common/common.cpp``): empty; over 255 UTF-8 bytes;
    not valid UTF-8 (a lone surrogate); control characters (C0, DEL, C1; NUL included); ``/ \\ : * ? " < > |``
    and their look-alikes U+FF0E, U+2215, U+2216; U+FFFD and U+FEFF; a leading or trailing space or a
    trailing ``.``; any ``..``; ``.``.  So a name never leaves the directory or names a subdirectory.
    """
    if not name:
        raise InvalidRequest("filename: must not be empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest("filename: is not valid UTF-8") from None
    if size > MAX_FILENAME_BYTES:
        raise InvalidRequest(f"filename: at most {MAX_FILENAME_BYTES} bytes (UTF-8), got {size}")
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or 0x7F <= c <= 0x9F:
            raise InvalidRequest(f"filename: control character U+{c:04X} is not allowed")
        if ch in _FORBIDDEN:
            raise InvalidRequest(f"filename: {ch!r} is not allowed (a plain file name in the slot save path)")
    if name[0] == " " or name[-1] in " .":
        raise InvalidRequest("filename: must not start with a space or end with a space or '.'")
    if ".." in name:
        raise InvalidRequest("filename: must not contain '..'")
    return name


def write_file(directory: Path, filename: str, blob: bytes | bytearray | BlobBuffer) -> int:
    """Worker thread: write ``blob`` to ``directory/filename`` atomically (temporary file, fsync, rename).

    Returns the bytes written.

    Raises:
        InvalidRequest: ``filename`` names a directory.
        SlotFileError: the directory is missing or unwritable, the disk is full, ... (nothing is left behind).
    """
    final = directory / filename
    if final.is_dir():
        raise InvalidRequest(f"filename: {filename!r} is a directory in the slot save path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".slot-", suffix=".part", dir=directory)
    except OSError as exc:
        raise SlotFileError(f"Unable to save slot: cannot write in the slot save path: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob.view() if isinstance(blob, BlobBuffer) else blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, IsADirectoryError):
            raise InvalidRequest(f"filename: {filename!r} is a directory in the slot save path") from None
        if isinstance(exc, OSError):
            raise SlotFileError(f"Unable to save slot: {exc.strerror}") from None
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return len(blob)


def read_file(directory: Path, filename: str) -> bytearray:
    """Worker thread: the bytes of ``directory/filename``, a regular file.

    Raises:
        InvalidRequest: no such file, a directory or other non-regular file (a FIFO is never waited on),
            or unreadable (all 400, as llama-server's "Unable to restore slot").
    """
    try:
        fd = os.open(directory / filename, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidRequest(f"filename: no file {filename!r} in the slot save path") from None
    except OSError as exc:
        raise InvalidRequest(f"filename: cannot read {filename!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InvalidRequest(f"filename: {filename!r} is a directory in the slot save path")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"filename: {filename!r} is not a regular file")
        data = bytearray(st.st_size)
        got = 0
        with memoryview(data) as view:
            while got < len(data) and (n := os.readv(fd, [view[got:]])):
                got += n
        if got != len(data):
            raise InvalidRequest(f"filename: {filename!r} changed while it was read")
        return data
    except OSError as exc:
        raise InvalidRequest(f"filename: cannot read {filename!r}: {exc.strerror}") from None
    finally:
        os.close(fd)


async def save(engine: Engine, id_slot: int, directory: Path, filename: str) -> dict[str, Any]:
    """Save the idle slot to ``directory/filename``; llama-server's reply
    ``{"id_slot", "filename", "n_saved": tokens, "n_written": bytes, "timings": {"save_ms"}}``.

    Raises:
        InvalidRequest: a bad ``filename`` (nothing is written).
        Busy: the slot is processing a request.
        SlotFileError: the file could not be written.
    """
    check_filename(filename)
    t0 = time.perf_counter()
    n_saved, blob = await engine.call(lambda e: e.save_slot(id_slot))
    n_written = await trio.to_thread.run_sync(write_file, directory, filename, blob)
    return {"id_slot": id_slot, "filename": filename, "n_saved": n_saved, "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


async def restore(engine: Engine, id_slot: int, directory: Path, filename: str) -> dict[str, Any]:
    """Restore the idle slot from ``directory/filename``, all or nothing; llama-server's reply
    ``{"id_slot", "filename", "n_restored": tokens, "n_read": bytes, "timings": {"restore_ms"}}``.

    Raises:
        InvalidRequest: a bad ``filename``, no such file, or a file this node cannot restore (not a
            state blob, damaged, another model's, more tokens than a slot holds); the slot is unchanged.
        Busy: the slot is processing a request.
    """
    check_filename(filename)
    t0 = time.perf_counter()
    blob = await trio.to_thread.run_sync(read_file, directory, filename)
    n_read = len(blob)  # restore_slot consumes the blob (frames it in place)
    try:
        await trio.to_thread.run_sync(verify_checksum, blob)
        done = await engine.call(lambda e: e.restore_slot(id_slot, blob, checksum_verified=True))
    except StateError as exc:
        raise InvalidRequest(f"filename: {filename!r} cannot be restored on this node: {exc}") from None
    return {"id_slot": id_slot, "filename": filename, "n_restored": done.n_past, "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}
