"""Writing model files: to a temporary path beside the target, renamed into place only when complete."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(dst: Path) -> Iterator[Path]:
    """A temporary path beside ``dst`` (``dst.tmp<pid>``) to write to.

    When the block ends without an exception the file is renamed to ``dst`` (``os.replace``: a reader
    sees the old file or the whole new one, never a part); when it raises, the temporary file is removed
    and the exception goes on.  ``dst``'s folder is created if missing.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def copy_field(writer: Any, field: Any) -> None:
    """Copy one key-value ``field`` of a ``gguf.GGUFReader`` to a ``gguf.GGUFWriter``, with its type (and an
    array's element type)."""
    import gguf

    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
