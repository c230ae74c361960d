"""A slot holding an image moves whole between nodes on real sockets: Hydra PREFILL (a chat with an image) and
STATE_GET give a version 5 blob (its media layout and its cells' placeholders), STATE_PUT and HTTP
``PUT /slots/{id}/state`` and slot files (``--slot-save-path``) restore it, and the restored slot decodes on as
the slot it came from and is a cache hit through the image for a returning request; a blob whose layout was
tampered with is refused naming why, the slot untouched (docs/protocol-notes.md, the blob's version 5).

Nodes: ``-m tiny-vision`` with its projector (A), and the same model without one (B, ``--no-mmproj``): the KV
cache holds the image's embeddings, so B continues the conversation without a projector.  A tiny model's exact
tokens depend on the kernels' arithmetic, so the tests compare one machine's nodes with each other.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hydra_trio.engine.kv.state import blob_checksum, verify_checksum
from hydra_trio.engine.llama.media import placeholder
from hydra_trio.models import tiny_vision
from hydra_trio.protocol.decode_frames import unpack_decode_frames
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess

PNG = tiny_vision.png_image(3)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
CHAT = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": DATA_URL}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ],
    "max_tokens": 4,
    "temperature": 0,
}
N_DECODE = 8


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess, Path]]:
    """A: ``tiny-vision`` with its projector, 2 slots, slot files in a directory; B: the same model, no projector."""
    d = tmp_path_factory.mktemp("media_kv")
    (d / "slots").mkdir()
    a = ServerProcess(
        d / "a.log", "-m", "tiny-vision", "-np", "2", "-c", "4096", "-t", "1", "--slot-save-path", str(d / "slots")
    )
    b = ServerProcess(d / "b.log", "-m", "tiny-vision", "--no-mmproj", "-np", "2", "-c", "4096", "-t", "1")
    with a.serving(timeout=300), b.serving(timeout=300):
        yield a, b, d / "slots"


def decode_on(w: Wire, id_slot: int) -> list[int]:
    """DECODE continuing slot ``id_slot``'s KV cache (no messages), greedy, ``N_DECODE`` tokens; their ids."""
    body = {"n_predict": N_DECODE, "temperature": 0, "ignore_eos": True, "stream": False}
    status, meta, payload = w.call(Op.DECODE, key=str(id_slot), payload=json.dumps(body).encode())
    assert status == Status.OK, meta
    return [tok for tok, _, _ in unpack_decode_frames(payload)]


def media_section(blob: bytes) -> tuple[int, int]:
    """Where a version 5 blob's media layout's length field is, and where its tokens start."""
    header = verify_checksum(blob)
    ident_end = 96 + struct.unpack_from("<I", blob, 92)[0]
    return ident_end, header.tokens_at


def with_layout(blob: bytes, layout: dict) -> bytes:
    """``blob`` with another media layout (the JSON as given), its checksum made good again."""
    at, tokens_at = media_section(blob)
    raw = json.dumps(layout, separators=(",", ":"), sort_keys=True).encode()
    out = bytearray(blob[:at] + struct.pack("<I", len(raw)) + raw + blob[tokens_at:])
    struct.pack_into("<Q", out, 52, blob_checksum(out))
    return bytes(out)


def with_token(blob: bytes, index: int, value: int) -> bytes:
    """``blob`` with token ``index`` set to ``value`` (int32), its checksum made good again."""
    out = bytearray(blob)
    struct.pack_into("<i", out, verify_checksum(blob).tokens_at + 4 * index, value)
    struct.pack_into("<Q", out, 52, blob_checksum(out))
    return bytes(out)


def test_a_prefilled_image_chat_moves_to_a_node_without_a_projector_and_decodes_on_the_same(nodes) -> None:
    """A's PREFILL of a chat with an image answers a version 5 blob whose layout is the image's chunk (the
    SHA-256 of the PNG, 12 cells advancing the position by 4: M-RoPE) with its placeholders in the token list;
    B (no projector) takes it by STATE_PUT and its DECODE gives the tokens A's own DECODE gives (greedy)."""
    a, b, _ = nodes
    with Wire(a.port, timeout=300) as wa, Wire(b.port, timeout=300) as wb:
        status, meta, blob = wa.call(Op.PREFILL, key="0", payload=json.dumps(CHAT).encode())
        assert status == Status.OK, meta
        header = verify_checksum(blob)
        assert header.version == 5 and meta["n_past"] == header.n_tokens
        (chunk,) = header.media
        assert (chunk.id, chunk.kind, chunk.n_tokens, chunk.n_pos) == (tiny_vision_id(), "image", 12, 4)
        tokens = struct.unpack_from(f"<{header.n_tokens}i", blob, header.tokens_at)
        assert tokens[chunk.start : chunk.end] == (placeholder(chunk.id, 12),) * 12
        assert all(t >= 0 for t in tokens[: chunk.start] + tokens[chunk.end :])
        status, meta, _ = wb.call(Op.STATE_PUT, key="1", payload=blob)
        assert status == Status.OK and meta["n_past"] == header.n_tokens, meta
        there = decode_on(wb, 1)
        here = decode_on(wa, 0)
        assert there == here and len(here) == N_DECODE


def tiny_vision_id() -> str:
    import hashlib

    return hashlib.sha256(PNG).hexdigest()


def chat_on(c: httpx.Client, id_slot: int) -> dict:
    r = c.post("/v1/chat/completions", json={**CHAT, "id_slot": id_slot})
    assert r.status_code == 200, r.text
    return r.json()


def test_http_slot_state_and_slot_files_move_an_image_slot_and_the_image_returns_from_cache(nodes) -> None:
    """``GET /slots/1/state`` of a slot holding the image's chat is a version 5 blob; ``PUT`` of it onto the
    emptied slot, and a slot file saved and restored (``?action=save|restore``), each give the slot back so that
    the same chat again is served from the cache through the image (``cache_n`` = ``prompt_tokens`` - 1, as
    for text), with the same greedy answer."""
    a, _, slot_dir = nodes
    with httpx.Client(base_url=a.base, timeout=300) as c:
        first = chat_on(c, 1)
        n_prompt = first["usage"]["prompt_tokens"]
        r = c.get("/slots/1/state")
        assert r.status_code == 200, r.text
        assert verify_checksum(r.content).version == 5
        for restore in ("state", "file"):
            if restore == "file":
                saved = c.post("/slots/1?action=save", json={"filename": "image.bin"})
                assert saved.status_code == 200, saved.text
                assert (slot_dir / "image.bin").read_bytes() == r.content
            assert c.post("/slots/1?action=erase").status_code == 200
            assert c.get("/slots/1/state/meta").json()["n_past"] == 0
            if restore == "state":
                put = c.put("/slots/1/state", content=r.content)
            else:
                put = c.post("/slots/1?action=restore", json={"filename": "image.bin"})
            assert put.status_code == 200, put.text
            assert c.get("/slots/1/state/meta").json()["n_past"] == verify_checksum(r.content).n_tokens
            again = chat_on(c, 1)
            assert again["timings"]["cache_n"] == n_prompt - 1, (restore, again["timings"])
            assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_tampered_media_layout_is_refused_naming_why_and_the_slot_is_untouched(nodes) -> None:
    """A version 5 blob whose checksum is good but whose layout disagrees with its tokens is refused before the
    slot is touched: Hydra STATE_PUT BAD_REQUEST and HTTP ``PUT /slots/{id}/state`` 400, each naming the fault (a
    placeholder changed, a chunk past the tokens, a chunk moved off its placeholders, chunks overlapping, an
    unknown kind); the slot keeps what it held, and the chat returns from its cache through the image."""
    a, _, _ = nodes
    with httpx.Client(base_url=a.base, timeout=300) as c, Wire(a.port, timeout=300) as w:
        first = chat_on(c, 1)
        blob = c.get("/slots/1/state").content
        header = verify_checksum(blob)
        (chunk,) = header.media
        good = {"id": chunk.id, "kind": "image", "n_pos": 4, "n_tokens": 12, "start": chunk.start}
        n = header.n_tokens
        cases = [
            (
                with_token(blob, chunk.start + 5, placeholder(chunk.id, 12) - 1),
                f"token {chunk.start + 5} is {placeholder(chunk.id, 12) - 1}, not the placeholder",
            ),
            (with_token(blob, 0, -7), "token 0 is -7, outside every media chunk"),
            (
                with_layout(blob, {"chunks": [{**good, "start": n - 6}]}),
                f"media chunk 0 (tokens {n - 6}..{n + 5}) lies outside the blob's {n} tokens",
            ),
            (
                with_layout(blob, {"chunks": [{**good, "start": chunk.start + 1}]}),
                f"token {chunk.start} is {placeholder(chunk.id, 12)}, outside every media chunk",
            ),
            (
                with_layout(blob, {"chunks": [good, {**good, "start": chunk.start + 6}]}),
                "media chunk 1 starts at token",
            ),
            (with_layout(blob, {"chunks": [{**good, "kind": "video"}]}), "kind 'video' is not one of"),
            (with_layout(blob, {"chunks": []}), "one chunk at least"),
        ]
        for bad, why in cases:
            r = c.put("/slots/1/state", content=bad)
            assert r.status_code == 400 and why in r.json()["error"]["message"], (why, r.text)
            status, meta, _ = w.call(Op.STATE_PUT, key="1", payload=bad)
            assert status == Status.BAD_REQUEST and why in meta["error"], (why, meta)
        assert c.get("/slots/1/state").content == blob  # untouched
        again = chat_on(c, 1)
        assert again["timings"]["cache_n"] == first["usage"]["prompt_tokens"] - 1
