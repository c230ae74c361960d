"""Slot files: llama-server's ``--slot-save-path`` (``POST /slots/{id}?action=save|restore``).

A slot file is the node's own KV state blob (:mod:`.state`, the bytes
STATE_GET returns), not llama.cpp's ``llama_state_seq_save_file`` format: it
carries the model hash and KV identity, so a file of another model is refused
before the slot is touched, and a checksum, so a damaged file is too.

* **save** takes the idle slot's blob on the engine thread (:func:`.slots.save`), then
  writes it in a worker thread to a temporary file in the same directory
  (mode 0600), fsyncs it and renames it over ``filename``: a reader never
  sees half a file, and a failed save leaves the old file (if any) as it was.
* **restore** reads the file in a worker thread, then restores it as every blob is
  (:func:`.slots.restore`: the checksum off the engine thread, then the engine thread), all or
  nothing: a refused restore leaves the slot's KV cache and ``n_past`` as they were (llama-server
  clears the slot instead).

File names follow llama-server's ``fs_validate_filename`` (``common/common.cpp``,
subdirectories not allowed): :func:`check_filename`.  So a name is one path component, and that
component is never a link followed: restore opens it with ``O_NOFOLLOW`` in the directory, save refuses
a name that is a symbolic link (and would replace, never write through, one that appears meanwhile).
A slot file is a regular file the node wrote, or the operator put, in the directory; a link planted there
reaches nothing outside it (llama-server follows links both ways).

No refusal quotes a file's bytes: a file that does not start with the state blob's magic is refused
without any of them (only its size may be named); the facts a hydra-trio header declares (format
version, token count, model identity) are named, so an operator can tell why a slot file is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..engine import BlobBuffer, StateError
from ..errors import HydraTrioError, InvalidRequest
from . import slots

if TYPE_CHECKING:
    from ..engine import Engine

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


def _is_link(directory: Path, filename: str) -> bool:
    """Whether ``directory/filename`` is a symbolic link (dangling or not); False when it does not exist."""
    try:
        return stat.S_ISLNK(os.lstat(directory / filename).st_mode)
    except OSError:
        return False


def _refuse_link(filename: str) -> InvalidRequest:
    return InvalidRequest(
        f"filename: {filename!r} is a symbolic link; slot files are regular files in the slot "
        "save path, and links there are never followed"
    )


def write_file(directory: Path, filename: str, blob: bytes | bytearray | BlobBuffer) -> int:
    """Worker thread: write ``blob`` to ``directory/filename`` atomically (temporary file, fsync, rename).

    Returns the bytes written.  A symbolic link at ``filename`` is refused and left as it is; the rename
    replaces a directory entry, so even a link that appears after that check is replaced, never written
    through.

    Raises:
        InvalidRequest: ``filename`` names a directory or a symbolic link.
        SlotFileError: the directory is missing or unwritable, the disk is full, ... (nothing is left behind).
    """
    final = directory / filename
    if _is_link(directory, filename):
        raise _refuse_link(filename)
    if final.is_dir():
        raise InvalidRequest(f"filename: {filename!r} is a directory in the slot save path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".slot-", suffix=".part", dir=directory)  # O_EXCL: never through a link
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
    """Worker thread: the bytes of ``directory/filename``, a regular file, opened without following a link.

    Raises:
        InvalidRequest: no such file, a symbolic link, a directory or other non-regular file (a FIFO is
            never waited on), or unreadable (all 400, as llama-server's "Unable to restore slot").
    """
    try:
        fd = os.open(directory / filename, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise InvalidRequest(f"filename: no file {filename!r} in the slot save path") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP or _is_link(directory, filename):  # O_NOFOLLOW met a link
            raise _refuse_link(filename) from None
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
    n_saved, blob = await slots.save(engine, id_slot, pool=None)
    n_written = await trio.to_thread.run_sync(write_file, directory, filename, blob)  # file I/O off the loop
    return {
        "id_slot": id_slot,
        "filename": filename,
        "n_saved": n_saved,
        "n_written": n_written,
        "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
    }


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
    blob = await trio.to_thread.run_sync(read_file, directory, filename)  # file I/O: off the loop and the engine
    try:
        done = await slots.restore(engine, id_slot, blob)
    except StateError as exc:
        raise InvalidRequest(f"filename: {filename!r} cannot be restored on this node: {exc}") from None
    return {
        "id_slot": id_slot,
        "filename": filename,
        "n_restored": done.n_past,
        "n_read": done.bytes,
        "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3},
    }
