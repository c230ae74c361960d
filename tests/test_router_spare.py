"""A router's children start in the interpreter it keeps ready (``hydra_trio/cli/spare.py``), and files'
digests are remembered on disk by the file's identity (``hydra_trio/engine/llama/model.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hydra_trio.engine.llama.model import hash_cache_dir, remembered_digest, sha256_file

from .conftest import listening_pid
from .test_router import TWO_MODELS, chat, router
from .test_router_ops import children_of


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return []


def _child(r, name: str) -> int:  # type: ignore[no-untyped-def]
    args = r.models()[name]["status"]["args"]
    return listening_pid(int(args[args.index("--port") + 1]))


def test_a_child_runs_in_the_spare_and_the_next_spare_waits(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--models-max", "1", "--no-rpc-backend") as r:
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        child = _child(r, "smollm2-135m")
        assert b"hydra_trio.cli.spare" in _cmdline(child)  # the node runs in the interpreter kept ready
        # once it serves, the next spare is started: a child of the router with no model
        deadline = time.monotonic() + 120
        while not any(b"hydra_trio.cli.spare" in _cmdline(p) for p in children_of(r.proc.pid) if p != child):
            assert time.monotonic() < deadline, "no next spare"
            time.sleep(0.2)
        # the other model starts in it (the first child is stopped first: --models-max 1)
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m-q8")).status_code == 200
        assert b"hydra_trio.cli.spare" in _cmdline(_child(r, "smollm2-135m-q8"))


def test_without_the_spare_a_child_starts_cold(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--models-max", "1", "--no-rpc-backend", "--no-router-spare") as r:
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        argv = _cmdline(_child(r, "smollm2-135m"))
        assert b"hydra_trio" in argv and b"hydra_trio.cli.spare" not in argv and b"--port" in argv


def test_a_files_digest_is_remembered_until_the_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"a" * 100_000)
    want = sha256_file(f)
    assert remembered_digest(f, "sha256") == want and len(list(hash_cache_dir().iterdir())) == 1
    read: list[int] = []
    assert sha256_file(f, on_block=read.append) == want and read == [100_000]  # not read again: one call, whole
    # another content of the same size, the same modification time: the inode's change time differs
    st = os.stat(f)
    f.write_bytes(b"b" * 100_000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert remembered_digest(f, "sha256") is None
    assert sha256_file(f) != want
    for entry in hash_cache_dir().iterdir():  # a damaged entry (not UTF-8) is read afresh, not an error
        entry.write_bytes(b"\xff\xfe" * 32)
    assert remembered_digest(f, "sha256") is None and sha256_file(f) == sha256_file(f, remember=False)
    assert sha256_file(f, remember=False) == sha256_file(f)


def test_the_special_token_table_is_read_once_per_file_and_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's special-token table (a pass over the vocabulary on its first request) is remembered beside
    its file's digests: the next model on the same file (a router's next child) reads it back, equal to
    what reading the vocabulary gives; another ``--override-kv`` reads the vocabulary again, and an entry
    that does not parse is read again and replaced."""
    from hydra_trio.engine.llama.model import LoadedModel
    from hydra_trio.engine.llama.tokenize import SpecialTokens
    from hydra_trio.engine.settings import LlamaOptions
    from hydra_trio.models.presets import resolve_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = resolve_model("smollm2-135m")[0]

    def table(**options: object) -> tuple[SpecialTokens, SpecialTokens]:
        m = LoadedModel(path, n_ctx=256, n_parallel=1, n_batch=64, n_threads=1, options=LlamaOptions(**options))
        try:
            return m.special_tokens, SpecialTokens(m.vocab)
        finally:
            m.close()

    first, read = table()
    assert (first.classes, first.max_token_bytes) == (read.classes, read.max_token_bytes)
    assert any(t == b"<|im_end|>" for c in read.classes for t, _, _ in c) and read.max_token_bytes > 1
    entries = set(hash_cache_dir().iterdir())
    assert len(entries) == 1
    again, _ = table()
    assert (again.classes, again.max_token_bytes) == (read.classes, read.max_token_bytes)
    assert set(hash_cache_dir().iterdir()) == entries  # read back: nothing new written
    table(kv_overrides=(("tokenizer.ggml.add_bos_token", "bool", False),))
    assert len(set(hash_cache_dir().iterdir())) == 2  # another override: its own entry
    (entry,) = entries
    damaged = [
        b'{"max_token_bytes": 0, "classes": []}',  # the wrong values
        b'{"max_token_bytes": Infinity, "classes": []}',  # a length no int holds
        bytes(range(128, 256)) * 3,  # not UTF-8
        b"[" * 200_000,  # deeper than the JSON parser goes
        b"",
    ]
    for data in damaged:
        entry.write_bytes(data)
        broken, _ = table()
        assert (broken.classes, broken.max_token_bytes) == (read.classes, read.max_token_bytes), data[:40]
        assert entry.read_bytes() != data and '"max_token_bytes":0' not in entry.read_text()  # read again, replaced
