"""Text that is not Unicode is refused naming the field, and a refused request changes nothing.

A real node (SmolLM2, 2 slots, a slot-file directory) runs in this process on a real socket (HTTP and
Hydra on one port), so the put-back test can make llama.cpp really refuse a slot's own backup.
Bodies are sent as raw bytes: ``\\ud800`` below is JSON's escape for a lone surrogate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from hydra_trio import EngineConfig, ServerConfig
from hydra_trio.engine.kv import state
from hydra_trio.engine.kv.blobbuf import BlobBuffer
from hydra_trio.engine.kv.state import blob_checksum, parse_header
from hydra_trio.models.presets import resolve_model
from hydra_trio.protocol.hydra import Op, Status, encode_request_header
from hydra_trio.testing.hydra_wire import Wire

from .conftest import embedded_node, streaming

HI = '[{"role":"user","content":"Say hi."}]'


@attrs.define
class Node:
    base: str
    port: int
    slot_dir: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=120)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for the module, served by trio in a thread of this process."""
    slot_dir = tmp_path_factory.mktemp("won") / "slots"
    slot_dir.mkdir()
    path, _ = resolve_model("smollm2-135m")
    config = ServerConfig(
        port=0,
        rpc_backend=None,
        engine=EngineConfig(
            model_path=path, model_alias="won", n_parallel=2, n_ctx=2048, slot_save_path=slot_dir, cache_ram_mib=0
        ),
    )  # a cleared slot must evaluate from scratch here, not get its prompt from the RAM cache
    with embedded_node(config) as server:
        yield Node(f"http://127.0.0.1:{server.port}", server.port, slot_dir)


def guarded_state(node: Node) -> dict[str, Any]:
    """What a refused request must not change: sampling defaults (/props, INFO), slots' tokens, mode, chunk size."""
    with node.client() as c, Wire(node.port) as w:
        props = c.get("/props").json()["default_generation_settings"]
        slots = [s["n_past"] for s in c.get("/slots").json()]
        info = w.call(Op.INFO)[1]
        metas = [w.call(Op.STATE_META, key=str(i))[1]["n_past"] for i in range(len(slots))]
    return {
        "props": props,
        "slots": slots,
        "state_meta": metas,
        "sampling_defaults": info["sampling_defaults"],
        "mode": info["mode"],
        "state_chunk_size": info["state_chunk_size"],
        "n_ctx": info["n_ctx"],
    }


def fill_slot(node: Node, id_slot: int) -> None:
    with node.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": json.loads(HI), "max_tokens": 4, "temperature": 0, "id_slot": id_slot},
        )
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- §1 HTTP

HTTP_CASES = [
    # (path, raw JSON body, the field the error names)
    (
        "/v1/chat/completions",
        r'{"messages":[{"role":"user","content":"hi \ud800"}],"max_tokens":2}',
        "messages[0].content",
    ),
    ("/v1/chat/completions", '{"messages":%s,"max_tokens":2,"stop":["ok","\\udfff"]}' % HI, "stop[1]"),
    ("/v1/chat/completions", '{"messages":%s,"max_tokens":2,"grammar":"root ::= \\"\\ud800\\""}' % HI, "grammar"),
    (
        "/v1/chat/completions",
        '{"messages":%s,"max_tokens":2,"tools":[{"type":"function","function":{"name":"f",'
        '"parameters":{"type":"object","properties":{"a\\udc00":{"type":"string"}}}}}]}' % HI,
        'tools[0].function.parameters.properties: key "a\\udc00"',
    ),
    (
        "/v1/chat/completions",
        '{"messages":[{"role":"user","content":[{"type":"text","text":"\\ud83d"}]}],"max_tokens":2}',
        "messages[0].content[0].text",
    ),
    (
        "/v1/chat/completions",
        '{"messages":%s,"max_tokens":2,"response_format":{"type":"json_schema","json_schema":'
        '{"schema":{"enum":["\\udbff"]}}}}' % HI,
        "response_format.json_schema.schema.enum[0]",
    ),
    ("/v1/completions", r'{"prompt":"a\ud800b","max_tokens":2}', "prompt"),
    ("/v1/completions", r'{"prompt":"ab","max_tokens":2,"logit_bias":{"\ud800":1}}', 'logit_bias: key "\\ud800"'),
    ("/completion", r'{"prompt":["x","\ud800"],"n_predict":2}', "prompt[1]"),
    ("/tokenize", r'{"content":"hi \ud800"}', "content"),
    ("/detokenize", r'{"tokens":[1],"\ud800":1}', 'key "\\ud800"'),
    ("/apply-template", r'{"messages":[{"role":"user\ud800","content":"x"}]}', "messages[0].role"),
    ("/slots/0?action=save", r'{"filename":"a\ud800.bin"}', "filename"),
    ("/slots/0?action=restore", r'{"filename":"a\udfff"}', "filename"),
]


@pytest.mark.parametrize(("path", "body", "field"), HTTP_CASES, ids=[f"{p}:{f}" for p, _, f in HTTP_CASES])
def test_http_lone_surrogate_is_a_400_naming_the_field(node: Node, path: str, body: str, field: str) -> None:
    fill_slot(node, 0)
    before = guarded_state(node)
    with node.client() as c:
        r = c.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(field) and "not valid Unicode" in error["message"], error
        assert c.get("/health").status_code == 200
    assert guarded_state(node) == before
    assert not any(node.slot_dir.iterdir())


def test_http_surrogate_pair_is_text(node: Node) -> None:
    """A pair is a character (U+1F600), not a surrogate: it is served."""
    with node.client() as c:
        r = c.post("/tokenize", content=rb'{"content":"\ud83d\ude00"}', headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["tokens"], r.text
        r = c.post("/tokenize", content=b'{"content":"\xed\xa0\x80"}')  # a surrogate as UTF-8 bytes: not UTF-8
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------------------------------------- §1 Hydra

HYDRA_CASES = [
    # (op, key, raw payload, the field the error names)
    (Op.CONFIGURE, "", rb'{"temperature":0.5,"\ud800":1}', 'key "\\ud800"'),
    (Op.CONFIGURE, "", rb'{"temperature":0.5,"dry_sequence_breakers":["\n","\udfff"]}', "dry_sequence_breakers[1]"),
    (Op.CONFIGURE, "", rb'{"top_k":5,"n_ctx":2048,"model":"\ud800.gguf"}', "model"),
    (Op.DECODE, "0", b'{"n_predict":2,"messages":' + HI.encode() + rb',"\udbff":1}', 'key "\\udbff"'),
    (Op.DECODE, "0", rb'{"n_predict":2,"messages":null,"stop":["\ud800"]}', "stop[0]"),
    (Op.PREFILL, "0", rb'{"messages":[{"role":"user","content":"x\udc00"}]}', "messages[0].content"),
    (Op.PREFILL, "0", b'{"messages":' + HI.encode() + rb',"grammar":"root ::= \"\ud800\""}', "grammar"),
    (Op.SET_EXPERT_MODE, "", rb'{"mode":"combined","peer":"\ud800:50052"}', "peer"),
    (Op.SET_EXPERT_MODE, "", rb'"\ud800"', "the payload"),
    (Op.PIPELINE_ATTACH, "", rb'{"peer":"127.0.0.1:1","ot_split":"blk\\.\ud800"}', "ot_split"),
]


@pytest.mark.parametrize(
    ("op", "key", "payload", "field"), HYDRA_CASES, ids=[f"{Op(o).name}:{f}" for o, _, _, f in HYDRA_CASES]
)
def test_hydra_lone_surrogate_is_bad_request_naming_the_field(
    node: Node, op: int, key: str, payload: bytes, field: str
) -> None:
    fill_slot(node, 0)
    before = guarded_state(node)
    with Wire(node.port) as w:
        status, meta, _ = w.call(op, key=key, payload=payload)
        assert status == Status.BAD_REQUEST, (status, meta)
        assert meta["error"].startswith(field) and "not valid Unicode" in meta["error"], meta
        assert w.call(Op.INFO)[0] == Status.OK  # the connection is still in sync
    assert guarded_state(node) == before


def test_hydra_text_that_is_not_utf8(node: Node) -> None:
    """A surrogate sent as UTF-8 bytes is not UTF-8: SWAP_QUANT's key, a slot key, a CONFIGURE body."""
    before = guarded_state(node)
    with Wire(node.port) as w:
        status, meta, _ = w.call(Op.SWAP_QUANT, payload=(3).to_bytes(2, "little") + b"\xed\xa0\x80")
        assert status == Status.BAD_REQUEST and "UTF-8" in meta["error"], meta
        status, meta, _ = w.call(Op.CONFIGURE, payload=b'{"temperature":0.5,"\xed\xa0\x80":1}')
        assert status == Status.BAD_REQUEST and "UTF-8" in meta["error"], meta
        header = bytearray(encode_request_header(Op.STATE_META, "", "", 0))
        header[4:6] = (3).to_bytes(2, "little")  # key_len: the key is a surrogate's UTF-8 bytes
        w.send(bytes(header) + b"\xed\xa0\x80")
        status, meta, _ = w.read_reply()
        assert status == Status.BAD_REQUEST and "UTF-8" in meta["error"], meta
        assert w.call(Op.INFO)[0] == Status.OK
    assert guarded_state(node) == before


# ---------------------------------------------------------------------------------------------- §5 CONFIGURE


def test_configure_busy_on_tier2_leaves_tier1_unchanged(node: Node) -> None:
    before = guarded_state(node)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "id_slot": 1}
    with Wire(node.port) as w, streaming(node.base, body):
        change = {
            "temperature": 0.3,
            "top_k": 7,
            "state_chunk_size": 1 << 20,
            "allow_cross_model_kv": True,
            "n_ctx": before["n_ctx"],
        }
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps(change).encode())
        assert status == Status.BUSY, meta
        assert meta["success"] is False and meta["params_applied"] == {} and meta["busy_slots"] == [1]
        info = w.call(Op.INFO)[1]
        assert info["sampling_defaults"] == before["sampling_defaults"]
        assert info["state_chunk_size"] == before["state_chunk_size"]
        # a model that does not exist is refused before anything applies, busy or not
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"temperature": 0.3, "model": "nope.gguf"}).encode())
        assert status == Status.BAD_REQUEST and meta["params_applied"] == {} and "nope.gguf" in meta["error"], meta
        # and a bad tier-1 value refuses the whole request, tier 2 included
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"temperature": -9, "n_ctx": 2048}).encode())
        assert status == Status.BAD_REQUEST and "temperature" in meta["error"], meta
    after = guarded_state(node)
    assert after["sampling_defaults"] == before["sampling_defaults"] and after["props"] == before["props"]
    assert after["state_chunk_size"] == before["state_chunk_size"]
    with Wire(node.port) as w:  # the same request alone (tier 1 only) applies
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"temperature": 0.3}).encode())
        assert status == Status.OK and meta["params_applied"] == {"temperature": 0.3}
        assert w.call(Op.INFO)[1]["sampling_defaults"]["temperature"] == 0.3
        w.call(Op.CONFIGURE, payload=json.dumps({"temperature": before["sampling_defaults"]["temperature"]}).encode())


# ---------------------------------------------------------------------------------------------- §5 STATE_PUT


def reseal(blob: bytearray) -> None:
    blob[52:60] = blob_checksum(blob).to_bytes(8, "little")


def spoil(blob: bytearray) -> bytearray:
    """The blob with an impossible cell count in its KV bytes, resealed: every check passes, llama.cpp refuses it."""
    bad = bytearray(blob)
    header = parse_header(bad)
    kv_at = header.tokens_at + 4 * header.n_tokens
    bad[kv_at : kv_at + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    reseal(bad)
    return bad


@pytest.fixture
def backup_refused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """llama.cpp refuses the slot's own backup too.  A backup is made by this node from its own context, so
    nothing a client sends can make it fail: the fault is injected by spoiling the backup's bytes (as
    :func:`spoil` does) before the real put-back hands them to llama.cpp, which then really refuses them."""
    calls: list[int] = []
    real = state.put_back

    def put_back(m: Any, id_slot: int, backup: BlobBuffer) -> bool:
        calls.append(id_slot)
        view = backup.view()  # save_slot's blob: one buffer, spoiled in place
        view[:] = spoil(bytearray(view))
        return real(m, id_slot, backup)

    monkeypatch.setattr(state, "put_back", put_back)
    return calls


def test_state_put_put_back_fails_slot_is_cleared(node: Node, backup_refused: list[int]) -> None:
    fill_slot(node, 0)
    with Wire(node.port) as w, node.client() as c:
        status, meta, blob = w.call(Op.STATE_GET, key="0")
        assert status == Status.OK and meta["n_past"] > 0
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=bytes(spoil(bytearray(blob))))
        assert status == Status.ERROR, meta
        assert meta["slot_cleared"] is True and meta["n_past"] == 0 and "now empty" in meta["error"], meta
        assert backup_refused == [0]
        assert w.call(Op.STATE_META, key="0")[1]["n_past"] == 0
        assert c.get("/slots").json()[0]["n_past"] == 0
        # the same over HTTP PUT /slots/{id}/state
        fill_slot(node, 0)
        r = c.put("/slots/0/state", content=bytes(spoil(bytearray(blob))))
        assert r.status_code == 400 and r.json()["error"]["slot_cleared"] is True, r.text
        assert w.call(Op.STATE_META, key="0")[1]["n_past"] == 0
        # the slot serves again, from scratch (no prefix claimed that the KV cache does not hold)
        r = c.post(
            "/v1/chat/completions", json={"messages": json.loads(HI), "max_tokens": 4, "temperature": 0, "id_slot": 0}
        )
        assert r.status_code == 200 and r.json()["timings"]["cache_n"] == 0, r.text
        # and the real blob still restores
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=blob)
        assert status == Status.OK and meta["n_past"] > 0


def test_slot_file_restore_put_back_fails_slot_is_cleared(node: Node, backup_refused: list[int]) -> None:
    fill_slot(node, 1)
    with Wire(node.port) as w, node.client() as c:
        blob = w.call(Op.STATE_GET, key="1")[2]
        (node.slot_dir / "spoiled.bin").write_bytes(bytes(spoil(bytearray(blob))))
        r = c.post("/slots/1?action=restore", json={"filename": "spoiled.bin"})
        assert r.status_code == 400 and "now empty" in r.json()["error"]["message"], r.text
        assert w.call(Op.STATE_META, key="1")[1]["n_past"] == 0
    (node.slot_dir / "spoiled.bin").unlink()


def test_state_put_refused_but_put_back_works(node: Node) -> None:
    """Without the injected fault the put-back works: the slot keeps its tokens and the reply says so."""
    fill_slot(node, 0)
    with Wire(node.port) as w:
        status, meta, blob = w.call(Op.STATE_GET, key="0")
        n_past = meta["n_past"]
        status, meta, _ = w.call(Op.STATE_PUT, key="0", payload=bytes(spoil(bytearray(blob))))
        assert status == Status.ERROR and meta["slot_cleared"] is False and "unchanged" in meta["error"], meta
        assert w.call(Op.STATE_META, key="0")[1]["n_past"] == n_past
