"""hydra_trio.models.files: a model file is replaced whole or not at all (real files in a temporary folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydra_trio.models.files import atomic_path


def test_a_complete_write_replaces_the_target(tmp_path: Path) -> None:
    dst = tmp_path / "sub" / "m.gguf"
    with atomic_path(dst) as tmp:
        assert tmp.parent == dst.parent and tmp != dst
        tmp.write_bytes(b"new")
        assert not dst.exists()  # nobody sees a part while it is written
    assert dst.read_bytes() == b"new"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["m.gguf"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    dst = tmp_path / "m.gguf"
    dst.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="quantizer failed"), atomic_path(dst) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("quantizer failed")
    assert dst.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
