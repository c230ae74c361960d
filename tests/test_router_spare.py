"""A router's children are forked from the warm interpreter it keeps (``hydra_trio/cli/spare.py``), and files'
digests are remembered on disk by the file's identity (``hydra_trio/engine/llama/model.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from hydra_trio.engine.llama.model import hash_cache_dir, remembered_digest, sha256_file

from .conftest import listening_pid
from .test_router import TWO_MODELS, Router, chat, router
from .test_router_ops import ONE_MODEL, children_of


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return []


def _child(r, name: str) -> int:  # type: ignore[no-untyped-def]
    args = r.models()[name]["status"]["args"]
    return listening_pid(int(args[args.index("--port") + 1]))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # gone meanwhile
        return ""


def _fork_server(router_pid: int, *exclude: int) -> int:
    """The router's fork server: its child named ``hydra-forksrv``."""
    deadline = time.monotonic() + 120
    while True:
        found = [p for p in children_of(router_pid) if p not in exclude and _comm(p) == "hydra-forksrv"]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no fork server"
        time.sleep(0.1)


SAME_FILE_TWICE = ONE_MODEL.replace("[small]", "[smollm2-135m]") + "[other]\nmodel = smollm2-135m\nc = 512\n"
"""Two models that cannot switch in place (another option): a switch is a new child."""


def test_children_are_forked_from_one_warm_server_and_adopted_by_the_router(tmp_path: Path) -> None:
    with router(tmp_path, SAME_FILE_TWICE, "--models-max", "1", "--no-rpc-backend") as r:
        server = _fork_server(r.proc.pid)
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        child = _child(r, "smollm2-135m")
        assert child != server and _comm(child) == "hydra-trio"  # forked from the warm interpreter
        # what ps shows: each wrote its own command line over the one it was forked with (the router's)
        assert _cmdline(server)[:2] == [b"hydra-trio", b"fork-server"] and set(_cmdline(server)[2:]) <= {b""}
        port = r.models()["smollm2-135m"]["status"]["args"]
        port = port[port.index("--port") + 1].encode()
        shown = _cmdline(child)
        assert shown[:3] == [b"hydra-trio", b"--alias", b"smollm2-135m"] and b"--models-preset" not in shown
        assert shown[3:7] == [b"--model", b"smollm2-135m", b"--port", port]  # what tells nodes apart, first
        assert child in children_of(r.proc.pid)  # the router's own child (its subreaper), not the server's
        # right after, the other model (the first child is stopped first: --models-max 1) forks from the same
        # server: nothing to wait for
        assert r.http.post("/v1/chat/completions", json=chat("other")).status_code == 200
        second = _child(r, "other")
        assert second not in (child, server) and second in children_of(r.proc.pid)
        assert _fork_server(r.proc.pid, second) == server and _comm(second) == "hydra-trio"
        # a child's exit is the router's to see: unloaded with its status
        os.kill(second, signal.SIGKILL)
        r.wait_status("other", "unloaded")
        assert r.models()["other"]["status"]["exit_code"] == 128 + signal.SIGKILL
        # a fork server that dies is replaced (a new interpreter: ``python -m hydra_trio.cli.spare``); a load
        # meanwhile starts its child cold
        os.kill(server, signal.SIGKILL)
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        again = _fork_server(r.proc.pid, _child(r, "smollm2-135m"), server)
        assert again != server and _cmdline(again)[:2] == [b"hydra-trio", b"fork-server"]
        r.http.post("/models/unload", json={"model": "smollm2-135m"})
        r.wait_status("smollm2-135m", "unloaded")
        assert r.http.post("/v1/chat/completions", json=chat("other")).status_code == 200
        third = _child(r, "other")
        assert _comm(third) == "hydra-trio" and _cmdline(third)[0] == b"hydra-trio"
    log = (tmp_path / "router.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def test_a_forked_child_dies_with_the_router(tmp_path: Path) -> None:
    (tmp_path / "preset.ini").write_text(TWO_MODELS)
    r = Router(tmp_path / "router.log", "--models-preset", str(tmp_path / "preset.ini"), "--no-rpc-backend")
    try:
        r.wait_listening()
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        child, server = _child(r, "smollm2-135m"), _fork_server(r.proc.pid)
        r.proc.kill()  # no clean-up by the router: the children's death signal
        r.proc.wait()
        deadline = time.monotonic() + 120
        while any(_state(p) != "Z" for p in (child, server)):
            assert time.monotonic() < deadline, "a child outlived the router"
            time.sleep(0.1)
    finally:
        r.stop()


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_long_flags_the_environment_and_an_unload_while_the_fork_server_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flag longer than a socket message (a 70 KB chat template) is forked as any other; a forked process's
    environment is its own (the router's less ``LLAMA_ARG_MODELS_*``), in /proc too; an unload while the
    fork server does not answer ends the load at once (nothing ran: ``unloaded``, not failed), and the
    next load has a fork server again."""
    monkeypatch.setenv("LLAMA_ARG_MODELS_MAX", "1")  # the router's: not its children's
    template = '{% set pad = "' + "x" * 70_000 + '" %}{% for m in messages %}{{ m.content }}{% endfor %}'
    preset = SAME_FILE_TWICE + f"chat-template = {template}\n"  # on [other]
    with router(tmp_path, preset, "--no-rpc-backend") as r:
        assert r.http.post("/v1/chat/completions", json=chat("other")).status_code == 200
        child, server = _child(r, "other"), _fork_server(r.proc.pid)
        assert _comm(child) == "hydra-trio" and child in children_of(r.proc.pid)  # forked, not started cold
        for pid in (child, server):
            assert not [e for e in _environ(pid) if e.startswith(b"LLAMA_ARG_MODELS_")], pid
            assert b"OMP_WAIT_POLICY=PASSIVE" in _environ(pid)  # the rest is the router's
        os.kill(server, signal.SIGSTOP)
        try:
            r.http.post("/models/load", json={"model": "smollm2-135m"})
            time.sleep(0.5)  # the fork waits for the stopped server
            t0 = time.monotonic()
            assert r.http.post("/models/unload", json={"model": "smollm2-135m"}).json() == {"success": True}
            r.wait_status("smollm2-135m", "unloaded")
            assert time.monotonic() - t0 < 4  # not the fork's own time limit (5 s)
            status = r.models()["smollm2-135m"]["status"]
            assert "failed" not in status, status
        finally:
            with contextlib.suppress(ProcessLookupError):  # the router stopped it: it failed to answer
                os.kill(server, signal.SIGCONT)
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        assert _fork_server(r.proc.pid, server, _child(r, "smollm2-135m"), child) != server  # a new one


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_without_the_spare_a_child_starts_cold(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--models-max", "1", "--no-rpc-backend", "--no-router-spare") as r:
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200
        child = _child(r, "smollm2-135m")
        argv = _cmdline(child)
        assert b"hydra_trio" in argv and b"--model" in argv and b"--models-preset" not in argv  # its own flags
        assert _comm(child) != "hydra-trio"
        assert not [p for p in children_of(r.proc.pid) if _comm(p) == "hydra-forksrv"]


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
