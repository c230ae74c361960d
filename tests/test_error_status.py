"""Errors carry their wire status: each HydraTrioError class names its HTTP status and its Hydra status, and
both front ends answer with them.  Checked on the classes, then over real sockets on the real
default model: state blobs this node cannot take (HTTP GET/PUT /slots/{id}/state and Hydra STATE_PUT say the
same), and a chat template that raises (HTTP 400 with its message, Hydra BAD_REQUEST on a connection that
stays in sync)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import struct
from pathlib import Path

import httpx
import pytest

import hydra_trio
from hydra_trio.engine.kv.state import HEADER_SIZE, blob_checksum
from hydra_trio.errors import (
    BodyError,
    BodyTimeout,
    BodyTooLarge,
    Busy,
    Cancelled,
    EngineFailure,
    HydraTrioError,
    InvalidRequest,
    NoModel,
    NotFound,
    NotReady,
    NotSupported,
    Overloaded,
)
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess, streaming


def _all_error_classes() -> list[type[HydraTrioError]]:
    for info in pkgutil.walk_packages(hydra_trio.__path__, "hydra_trio."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
    out, todo = [], [HydraTrioError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(c for c in cls.__subclasses__() if c.__module__.startswith("hydra_trio"))
    return sorted(set(out), key=lambda c: f"{c.__module__}.{c.__qualname__}")


def test_every_error_class_names_its_wire_statuses() -> None:
    classes = _all_error_classes()
    names = {c.__name__ for c in classes}
    # the scan reaches subclasses all over the package
    assert {
        "StateError",
        "KvTypesDiffer",
        "ChatTemplateError",
        "ParameterError",
        "SlotFileError",
        "HydraBusy",
        "MessageError",
    } <= names, names
    for cls in classes:
        assert isinstance(cls.http_status, int) and 400 <= cls.http_status <= 599, cls
        assert isinstance(cls.hydra_status, Status) and cls.hydra_status != Status.OK, cls
        if issubclass(cls, InvalidRequest):  # the client's fault, whatever else it is (KvTypesDiffer is a StateError)
            assert (cls.http_status, cls.hydra_status) == (400, Status.BAD_REQUEST), cls
    table = {
        HydraTrioError: (500, Status.ERROR),
        InvalidRequest: (400, Status.BAD_REQUEST),
        Busy: (409, Status.BUSY),
        NotReady: (503, Status.ERROR),
        Cancelled: (503, Status.ERROR),
        EngineFailure: (500, Status.ERROR),
        NotFound: (404, Status.NOT_FOUND),
        NotSupported: (501, Status.NOT_IMPLEMENTED),
        NoModel: (501, Status.NOT_IMPLEMENTED),
        Overloaded: (503, Status.BUSY),
        BodyError: (400, Status.BAD_REQUEST),
        BodyTooLarge: (413, Status.BAD_REQUEST),
        BodyTimeout: (408, Status.BAD_REQUEST),
    }
    for cls, want in table.items():
        assert (cls.http_status, cls.hydra_status) == want, cls
    by_name = {c.__name__: c for c in classes}
    assert (by_name["StateError"].http_status, by_name["StateError"].hydra_status) == (400, Status.ERROR)
    assert (by_name["SlotFileError"].http_status, by_name["SlotFileError"].hydra_status) == (500, Status.ERROR)
    # the Hydra client raises, for each reply status, the class whose hydra_status it is
    from hydra_trio.hydra.errors import error_for_status

    for st in Status:
        if st != Status.OK:
            assert type(error_for_status(st, {})).hydra_status == st
    assert Busy("x", [2]).wire_meta() == {"busy_slots": [2]} and NotReady("x", "loading").wire_meta() == {
        "stage": "loading"
    }
    # an op's own reply keys join the error's, and win
    assert Busy("x", [2]).with_meta(success=False, busy_slots=[3]).reply_meta() == {"busy_slots": [3], "success": False}


# ----------------------------------------------------------------------------- state errors over both front ends


def _other_model(blob: bytes) -> bytes:
    """The same blob as another model's node would have sealed it: another model hash, a fresh checksum."""
    other = bytearray(blob)
    other[12:44] = bytes(32)
    other[52:60] = blob_checksum(other).to_bytes(8, "little")
    return bytes(other)


def _other_kv_types(blob: bytes) -> bytes:
    """The same blob with a KV identity whose K cache type is q8_0 (a node started with ``-ctk q8_0``)."""
    ident = struct.Struct("<32sI")
    digest, n = ident.unpack_from(blob, HEADER_SIZE)
    start = HEADER_SIZE + ident.size
    identity = json.loads(blob[start : start + n])
    assert identity["type_k"] != 8
    identity["type_k"] = 8  # GGML_TYPE_Q8_0
    text = json.dumps(identity).encode()
    out = bytearray(blob[:HEADER_SIZE] + ident.pack(digest, len(text)) + text + blob[start + n :])
    out[52:60] = blob_checksum(out).to_bytes(8, "little")
    return bytes(out)


def test_state_errors_over_http_and_hydra(server: ServerProcess) -> None:
    http = httpx.Client(base_url=server.base, timeout=120)
    r = http.post("/completion", json={"prompt": "The state of the slot. " * 4, "n_predict": 0, "id_slot": 3})
    assert r.status_code == 200, r.text
    got = http.get("/slots/3/state")
    assert got.status_code == 200
    blob = got.content
    n_past = int(got.headers["x-n-past"])
    with Wire(server.port) as w:
        # another model's blob: HTTP 400 and Hydra ERROR, with the same message and the same hashes
        put = http.put("/slots/3/state", content=_other_model(blob))
        assert put.status_code == 400, put.text
        err = put.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        status, meta, _ = w.call(Op.STATE_PUT, key="3", payload=_other_model(blob))
        assert status == Status.ERROR, meta
        assert err["message"] == meta["error"] and "another model" in meta["error"]
        assert err["expected_hash"] == meta["expected_hash"] == got.headers["x-model-hash"]
        assert err["got_hash"] == meta["got_hash"] == "00" * 32
        assert err["kv_identity_match"] is meta["kv_identity_match"]
        # other KV cache types: a bad request on both (HTTP 400, Hydra BAD_REQUEST), the same meta
        put = http.put("/slots/3/state", content=_other_kv_types(blob))
        assert put.status_code == 400, put.text
        err = put.json()["error"]
        status, meta, _ = w.call(Op.STATE_PUT, key="3", payload=_other_kv_types(blob))
        assert status == Status.BAD_REQUEST, meta
        assert err["message"] == meta["error"] and "KV cache types differ" in meta["error"]
        assert err["kv_identity_match"] is False and err["kv_cache_types"] == meta["kv_cache_types"]
        assert meta["kv_cache_types"]["blob"]["type_k"] == "q8_0"
        # not a blob at all
        put = http.put("/slots/3/state", content=b"HYKV" + bytes(80))
        status, meta, _ = w.call(Op.STATE_PUT, key="3", payload=b"HYKV" + bytes(80))
        assert put.status_code == 400 and status == Status.ERROR and put.json()["error"]["message"] == meta["error"]
        # nothing was applied: the slot still holds its prompt, and its own blob still restores
        assert w.call(Op.STATE_META, key="3")[1]["n_past"] == n_past
        put = http.put("/slots/3/state", content=blob)
        assert put.status_code == 200 and put.json()["n_past"] == n_past, put.text
        # a slot that is processing: HTTP 409 with busy_slots, as Hydra's BUSY carries them
        with streaming(server.base, {"prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "id_slot": 2}):
            busy = http.get("/slots/2/state")
            assert busy.status_code == 409, busy.text
            status, meta, _ = w.call(Op.STATE_GET, key="2")
            assert status == Status.BUSY
            assert busy.json()["error"]["busy_slots"] == meta["busy_slots"] == [2]
            assert busy.json()["error"]["type"] == "conflict_error"
            busy = http.put("/slots/2/state", content=blob)
            assert busy.status_code == 409 and busy.json()["error"]["busy_slots"] == [2], busy.text
        assert w.call(Op.INFO)[0] == Status.OK  # the connection is still in sync
    http.close()


# ----------------------------------------------------------------------------- a chat template that raises

REFUSING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('This template accepts user and assistant turns only, not ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REFUSAL = "This template accepts user and assistant turns only, not system"
REFUSED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
ACCEPTED = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    d: Path = tmp_path_factory.mktemp("refusing")
    (d / "refusing.jinja").write_text(REFUSING_TEMPLATE)
    with ServerProcess(
        d / "server.log",
        "--chat-template-file",
        str(d / "refusing.jinja"),
        "-np",
        "1",
        "-c",
        "2048",
        "--no-rpc-backend",
    ).serving() as srv:
        yield srv


def test_raising_template_is_a_bad_request_over_http(refusing: ServerProcess) -> None:
    with httpx.Client(base_url=refusing.base, timeout=120) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"messages": REFUSED, "max_tokens": 4, "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == 400
            assert REFUSAL in err["message"], err
        r = http.post("/apply-template", json={"messages": REFUSED})
        assert r.status_code == 400 and REFUSAL in r.json()["error"]["message"], r.text
        # the node serves on: the template accepts a user turn
        r = http.post("/v1/chat/completions", json={"messages": ACCEPTED, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert http.post("/apply-template", json={"messages": ACCEPTED}).json()["prompt"] == (
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        )
    assert "Traceback" not in refusing.log()


def test_raising_template_is_a_bad_request_over_hydra(refusing: ServerProcess) -> None:
    with Wire(refusing.port) as w:
        for op, body in ((Op.PREFILL, {"messages": REFUSED}), (Op.DECODE, {"messages": REFUSED, "n_predict": 4})):
            status, meta, payload = w.call(op, key="0", payload=json.dumps(body).encode())
            assert status == Status.BAD_REQUEST, (op, meta)
            assert REFUSAL in meta["error"] and payload == b""
        # the same connection serves the next requests
        status, meta, blob = w.call(Op.PREFILL, key="0", payload=json.dumps({"messages": ACCEPTED}).encode())
        assert status == Status.OK, meta
        assert meta["n_past"] > 0 and len(blob) == meta["state_size"]
        status, meta, frames = w.call(
            Op.DECODE, key="0", payload=json.dumps({"messages": ACCEPTED, "n_predict": 2}).encode()
        )
        assert status == Status.OK and len(frames) == 9 * 2, meta
        assert w.call(Op.INFO)[0] == Status.OK
