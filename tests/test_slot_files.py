"""Slot files (llama-server's ``--slot-save-path``): ``POST /slots/{id}?action=save|restore|erase``.

A real node (SmolLM2, 2 slots) runs in this process on a real socket, with a real directory of slot files
(``EngineConfig.slot_save_path``; the CLI flag is wired elsewhere).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from hydra_trio import EngineConfig, ServerConfig
from hydra_trio.engine.kv import state
from hydra_trio.models.presets import resolve_model

from .conftest import embedded_node, streaming

PROMPT = (
    "A painter mixes colors on a wooden palette in the morning light, and explains to the students that "
    "the three primary colors are"
)


@attrs.define
class Node:
    base: str
    slot_dir: Path
    outside: Path  # the slot directory's parent: nothing may appear here
    server: Any

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=120)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for the module, served by trio in a thread of this process."""
    outside = tmp_path_factory.mktemp("slotsave")
    slot_dir = outside / "slots"
    slot_dir.mkdir()
    path, _ = resolve_model("smollm2-135m")
    config = ServerConfig(
        port=0,
        rpc_backend=None,
        engine=EngineConfig(model_path=path, model_alias="slots", n_parallel=2, n_ctx=4096, slot_save_path=slot_dir),
    )
    with embedded_node(config) as server:
        yield Node(f"http://127.0.0.1:{server.port}", slot_dir, outside, server)


def complete(c: httpx.Client, id_slot: int = 0, prompt: str = PROMPT) -> dict[str, Any]:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "id_slot": id_slot})
    assert r.status_code == 200, r.text
    return r.json()


def n_past(c: httpx.Client, id_slot: int = 0) -> int:
    return c.get("/slots").json()[id_slot]["n_past"]


def action(c: httpx.Client, act: str, body: Any = None, id_slot: int = 0) -> httpx.Response:
    return c.post(f"/slots/{id_slot}?action={act}", json=body)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["type"], str)
    return err["message"]


def listing(node: Node) -> set[str]:
    """Every path under the slot directory's parent (relative), so a file written anywhere near shows up."""
    return {str(p.relative_to(node.outside)) for p in node.outside.rglob("*")}


def test_save_erase_restore_gives_the_cached_prompt_and_the_same_output(node: Node) -> None:
    with node.client() as c:
        for id_slot in (0, 1):  # no other slot holds the prompt to share
            assert action(c, "erase", id_slot=id_slot).status_code == 200
        first = complete(c)
        held = n_past(c)
        # the slot holds the prompt and every generated token but the last (sampled, not yet evaluated)
        assert held == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
        assert first["usage"]["prompt_tokens"] > 20

        r = action(c, "save", {"filename": "colors.bin"})
        assert r.status_code == 200, r.text
        saved = r.json()
        on_disk = (node.slot_dir / "colors.bin").stat().st_size
        assert saved["id_slot"] == 0 and saved["filename"] == "colors.bin"
        assert saved["n_saved"] == held and saved["n_written"] == on_disk > 4 * held
        assert saved["timings"]["save_ms"] > 0
        assert sorted(os.listdir(node.slot_dir)) == ["colors.bin"]  # no temporary file left behind
        assert (node.slot_dir / "colors.bin").read_bytes()[:4] == state.BLOB_MAGIC  # the node's KV blob

        r = action(c, "erase")
        assert r.status_code == 200 and r.json() == {"id_slot": 0, "n_erased": held}
        cold = complete(c)  # the control: an empty slot evaluates the whole prompt
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert action(c, "erase").status_code == 200 and n_past(c) == 0

        r = action(c, "restore", {"filename": "colors.bin"})
        assert r.status_code == 200, r.text
        restored = r.json()
        assert restored["id_slot"] == 0 and restored["filename"] == "colors.bin"
        assert restored["n_restored"] == held and restored["n_read"] == on_disk
        assert restored["timings"]["restore_ms"] > 0
        assert n_past(c) == held

        warm = complete(c)
        n_prompt = warm["usage"]["prompt_tokens"]
        assert n_prompt == first["usage"]["prompt_tokens"]
        # every prompt token but the last (which is evaluated again for its logits) came from the file
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
        assert warm["timings"]["cache_n"] == n_prompt - 1
        assert warm["choices"][0]["text"] == first["choices"][0]["text"] == cold["choices"][0]["text"]


def test_save_overwrites_and_restore_empties_with_an_empty_slots_file(node: Node) -> None:
    with node.client() as c:
        assert action(c, "erase", id_slot=1).status_code == 200
        r = action(c, "save", {"filename": "empty.bin"}, id_slot=1)
        assert r.status_code == 200 and r.json()["n_saved"] == 0
        complete(c, id_slot=1)
        r = action(c, "save", {"filename": "empty.bin"}, id_slot=1)  # replaced whole, atomically
        assert r.status_code == 200 and r.json()["n_saved"] == n_past(c, 1) > 0
        assert not [n for n in os.listdir(node.slot_dir) if n.endswith(".part")]
        (node.slot_dir / "empty.bin").unlink()


BAD_NAMES = [
    ("../escape.bin", "'/'"),
    ("..", "end with"),
    (".", "end with"),
    ("", "empty"),
    ("/", "'/'"),
    ("/tmp/abs.bin", "'/'"),
    ("sub/x.bin", "'/'"),
    ("back\\slash.bin", "'\\\\'"),
    ("nul\x00.bin", "U+0000"),
    ("tab\t.bin", "U+0009"),
    ("x" * 256, "255 bytes"),
    ("é" * 128, "255 bytes"),  # 128 characters, 256 bytes
    ("\udcff.bin", "UTF-8"),  # a lone surrogate: JSON's way of sending a name that is not UTF-8
    ("a:b.bin", "':'"),
    ("trailing.", "end with"),
    (" lead.bin", "start with"),
    ("ok..bin", ".."),
    ("\u2215slash.bin", "'∕'"),
    # the rest of fs_validate_filename's list (common/common.cpp): every character it forbids
    *((f"a{ch}b.bin", repr(ch)) for ch in '*?"<>|\uff0e\u2216\ufffd\ufeff'),
    ("del\x7f.bin", "U+007F"),
    ("c1\x85.bin", "U+0085"),
]


@pytest.mark.parametrize("act", ["save", "restore"])
def test_bad_filenames_are_refused_and_write_nothing(node: Node, act: str) -> None:
    before = listing(node)
    with node.client() as c:
        complete(c)
        held = n_past(c)
        for name, needle in BAD_NAMES:
            r = c.post(
                f"/slots/0?action={act}",
                content=json.dumps({"filename": name}).encode(),
                headers={"Content-Type": "application/json"},
            )
            message = error_of(r, 400)
            assert message.startswith("filename:") and needle in message, (name, message)
        assert n_past(c) == held
    assert listing(node) == before
    assert not Path("/tmp/abs.bin").exists()


def test_filename_that_is_a_directory(node: Node) -> None:
    (node.slot_dir / "adir").mkdir()
    try:
        with node.client() as c:
            complete(c)
            held = n_past(c)
            for act in ("save", "restore"):
                assert "is a directory" in error_of(action(c, act, {"filename": "adir"}), 400)
            assert n_past(c) == held and (node.slot_dir / "adir").is_dir()
            assert os.listdir(node.slot_dir / "adir") == []
    finally:
        (node.slot_dir / "adir").rmdir()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"", "invalid JSON"),
        (b"{}", "filename"),
        (b'{"filename": 3}', "filename"),
        (b'{"filename": null}', "filename"),
        (b'{"filename": "\xff.bin"}', "utf-8"),  # raw bytes that are not UTF-8
        (b"[]", "JSON object"),
    ],
)
def test_bad_bodies(node: Node, body: bytes, needle: str) -> None:
    with node.client() as c:
        for act in ("save", "restore"):
            assert needle in error_of(c.post(f"/slots/0?action={act}", content=body), 400)


def test_unknown_action_and_slot_ids(node: Node) -> None:
    with node.client() as c:
        assert "action" in error_of(action(c, "explode", {"filename": "x.bin"}), 400)
        assert "action" in error_of(c.post("/slots/0", json={"filename": "x.bin"}), 400)
        assert "not found" in error_of(action(c, "save", {"filename": "x.bin"}, id_slot=2), 404)
        assert "id_slot" in error_of(c.post("/slots/-1?action=save", json={"filename": "x.bin"}), 400)
    assert not (node.slot_dir / "x.bin").exists()


def _blob_with(blob: bytes, **changes: bytes) -> bytes:
    """A copy of a saved blob with its model hash and/or identity JSON changed, its checksum made right again:
    what another model's node would have written."""
    out = bytearray(blob)
    if "model_hash" in changes:
        out[12:44] = changes["model_hash"]
    if "identity" in changes:
        (ident_len,) = struct.unpack_from("<I", out, 92)
        old = bytes(out[96 : 96 + ident_len])
        new = changes["identity"](old)
        assert len(new) == len(old)
        out[96 : 96 + ident_len] = new
    struct.pack_into("<Q", out, 52, state.blob_checksum(out))
    return bytes(out)


def test_refused_restores_change_nothing(node: Node) -> None:
    with node.client() as c:
        assert action(c, "erase").status_code == 200
        complete(c)
        assert action(c, "save", {"filename": "good.bin"}).status_code == 200
        good = (node.slot_dir / "good.bin").read_bytes()
        layer = b'"n_layer":30,'
        assert layer in good  # SmolLM2-135M has 30 layers
        files = {
            "garbage.bin": os.urandom(4096),
            "empty-file.bin": b"",
            "truncated.bin": good[: len(good) // 2],
            "flipped.bin": good[:-1] + bytes([good[-1] ^ 1]),
            "other-file.bin": _blob_with(good, model_hash=b"\x11" * 32),
            "other-model.bin": _blob_with(
                good, model_hash=b"\x22" * 32, identity=lambda j: j.replace(layer, b'"n_layer":31,')
            ),
        }
        for name, data in files.items():
            (node.slot_dir / name).write_bytes(data)
        held = n_past(c)
        messages = {}
        for name in [*files, "missing.bin"]:
            messages[name] = error_of(action(c, "restore", {"filename": name}), 400)
            assert messages[name].startswith("filename:"), messages[name]
            assert n_past(c) == held, name
        assert "no file 'missing.bin'" in messages["missing.bin"]
        assert "not a hydra-trio state blob" in messages["garbage.bin"]
        assert repr(files["garbage.bin"][:4]) not in messages["garbage.bin"]  # no byte of the file quoted
        assert "corrupt" in messages["flipped.bin"]
        assert "another model file" in messages["other-file.bin"]
        assert "n_layer: this node 30, the blob 31" in messages["other-model.bin"]
        # the slot's KV cache is still whole: the same prompt finds all of it cached
        again = complete(c)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        for name in [*files, "good.bin"]:
            (node.slot_dir / name).unlink()


def test_links_in_the_slot_directory_are_never_followed(node: Node) -> None:
    """A symbolic link planted in the slot save path reaches nothing: restore opens the name without following
    it (O_NOFOLLOW), save refuses it and leaves the link and its target as they were, and no refusal quotes a
    byte of any file.  (llama-server follows links both ways: ``fopen`` of ``slot_save_path + filename``.)"""
    secret = node.outside / "secret.txt"
    secret.write_bytes(b"root:x:0:0:SECRET-LINE\n" * 200)
    with node.client() as c:
        assert action(c, "erase").status_code == 200
        complete(c)
        assert action(c, "save", {"filename": "good.bin"}).status_code == 200
        good_outside = node.outside / "good-outside.bin"  # a slot file this node would restore, outside
        good_outside.write_bytes((node.slot_dir / "good.bin").read_bytes())
        (node.slot_dir / "good.bin").unlink()
        (node.outside / "adir").mkdir(exist_ok=True)
        links = {
            "to-secret.bin": secret,
            "to-good.bin": good_outside,
            "to-dir.bin": node.outside / "adir",
            "dangling.bin": node.outside / "nothing-here.bin",
            "relative.bin": Path("../secret.txt"),
        }
        for name, target in links.items():
            os.symlink(target, node.slot_dir / name)
        (node.slot_dir / "plain.bin").write_bytes(b"root:" + os.urandom(4000))  # a regular file, not a blob
        held = n_past(c)
        try:
            for name in links:
                message = error_of(action(c, "restore", {"filename": name}), 400)
                assert message.startswith("filename:") and "symbolic link" in message, (name, message)
                assert "root" not in message and "SECRET" not in message
                assert n_past(c) == held, name
            message = error_of(action(c, "restore", {"filename": "plain.bin"}), 400)
            assert "not a hydra-trio state blob" in message and "root" not in message, message
            for name in links:
                message = error_of(action(c, "save", {"filename": name}), 400)
                assert message.startswith("filename:") and "symbolic link" in message, (name, message)
                assert (node.slot_dir / name).is_symlink() and os.readlink(node.slot_dir / name) == str(links[name])
            assert secret.read_bytes() == b"root:x:0:0:SECRET-LINE\n" * 200
            assert good_outside.read_bytes()[:4] == state.BLOB_MAGIC
            assert not (node.outside / "nothing-here.bin").exists() and os.listdir(node.outside / "adir") == []
            assert not [n for n in os.listdir(node.slot_dir) if n.endswith(".part")]
        finally:
            for name in [*links, "plain.bin"]:
                (node.slot_dir / name).unlink()


def test_busy_slot_is_refused(node: Node) -> None:
    with node.client() as c:
        complete(c, id_slot=1)
        assert action(c, "save", {"filename": "busy.bin"}, id_slot=1).status_code == 200
        with streaming(
            node.base, {"prompt": "Count to one thousand:", "max_tokens": 4000, "ignore_eos": True, "id_slot": 1}
        ):
            assert c.get("/slots").json()[1]["is_processing"]
            for act in ("save", "restore", "erase"):
                assert "processing" in error_of(action(c, act, {"filename": "busy.bin"}, id_slot=1), 409)
        (node.slot_dir / "busy.bin").unlink()


def test_unwritable_save_path_is_a_server_error(node: Node) -> None:
    engine = node.server.engine
    kept = engine.config
    engine.config = attrs.evolve(kept, slot_save_path=node.slot_dir / "gone")  # deleted after the node started
    try:
        with node.client() as c:
            message = error_of(action(c, "save", {"filename": "x.bin"}), 500)
            assert message.startswith("Unable to save slot") and "No such file or directory" in message
            assert c.post("/slots/0?action=save", json={"filename": "x.bin"}).json()["error"]["type"] == "server_error"
            assert "no file 'x.bin'" in error_of(action(c, "restore", {"filename": "x.bin"}), 400)
    finally:
        engine.config = kept
    assert not (node.slot_dir / "gone").exists()


def test_without_slot_save_path(http: httpx.Client) -> None:
    """The shared node has no slot save path: save and restore are llama-server's 501; erase still works."""
    for act in ("save", "restore"):
        r = http.post(f"/slots/0?action={act}", json={"filename": "x.bin"})
        assert r.status_code == 501
        assert r.json()["error"] == {
            "message": "This server does not support slots action. Start it with `--slot-save-path`",
            "type": "not_supported_error",
            "code": 501,
        }
    assert http.post("/slots/0?action=erase").status_code == 200
