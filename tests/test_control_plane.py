"""Status reads answer from the engine's published snapshot, never behind a prefill.

A real node (``-c 4096 -np 2 -b 32``: a 1,500-token prompt is evaluated in
about 47 batching steps) evaluates a long prompt on slot 0 while the tests
read ``/slots``, ``/slots/1/state/meta``, ``/health``, ``/props``, Hydra
INFO and STATE_META.  Nothing here measures time: the order of events is
what is asserted (a reply arrives before slot 0's request ends), and the
values are compared with what the engine itself reports (PREFILL's reply,
STATE_GET, which runs on the engine thread).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess, wait_for

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "bright jovial nymphs near misty harbours and old lanterns glow "
).split()
LONG_TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(1500))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("control") / "server.log", "-c", "4096", "-np", "2", "-b", "32")
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server exit code {code}:\n{srv.log()}"


def _meta(w: Wire, op: int, key: str = "") -> dict:
    status, meta, _ = w.call(op, key=key)
    assert status == Status.OK, meta
    return meta


class Prefill(threading.Thread):
    """Hydra PREFILL of ``LONG_TEXT`` on slot 0 in a thread; ``done`` is set once its reply has arrived."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.done = threading.Event()
        self.reply: tuple[int, dict, bytes] | None = None

    def run(self) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": LONG_TEXT}]}).encode()
        try:
            with Wire(self.port, timeout=600) as w:
                self.reply = w.call(Op.PREFILL, key="0", payload=body)
        finally:
            self.done.set()

    def result(self) -> dict:
        self.join(600)
        assert self.reply is not None, "PREFILL got no reply"
        status, meta, _blob = self.reply
        assert status == Status.OK, meta
        return meta


def _prime_slot_1(http: httpx.Client) -> int:
    """Empty slot 0 (so the long prompt is evaluated, not found cached) and put a short prompt in
    slot 1; its n_past."""
    assert http.post("/slots/0?action=erase").status_code == 200
    r = http.post(
        "/completion", json={"prompt": "A short note for slot one.", "n_predict": 3, "id_slot": 1, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    n = http.get("/slots").json()[1]["n_past"]
    assert n > 0
    return n


def _wait_processing(http: httpx.Client, prefill: Prefill) -> None:
    wait_for(lambda: prefill.done.is_set() or http.get("/slots").json()[0]["is_processing"], 300, "slot 0 processing")
    assert not prefill.done.is_set(), "the prefill ended before it was seen processing"


def test_status_reads_during_a_long_prefill(node: ServerProcess) -> None:
    with httpx.Client(base_url=node.base, timeout=300) as http, Wire(node.port, timeout=300) as w:
        n_past_1 = _prime_slot_1(http)
        size_1 = _meta(w, Op.STATE_META, "1")["state_size"]
        prefill = Prefill(node.port)
        prefill.start()
        _wait_processing(http, prefill)

        # STATE_META of the idle slot answers while slot 0 still evaluates its prompt
        meta_1 = _meta(w, Op.STATE_META, "1")
        ended_before_reply = prefill.done.is_set()
        assert not ended_before_reply, "STATE_META of slot 1 waited for slot 0's prefill to end"
        assert meta_1["n_past"] == n_past_1 and meta_1["is_processing"] is False
        assert meta_1["state_size"] == size_1 and meta_1["slot_id"] == 1

        seen: list[int] = []  # slot 0's n_past, read after read, while it processes
        while not prefill.done.is_set():
            slots = http.get("/slots").json()
            s0, s1 = slots[0], slots[1]
            if not s0["is_processing"]:
                break  # it ended between two reads: the values after the end are checked below
            assert s0["n_decoded"] == 0  # a prefill generates nothing
            seen.append(s0["n_past"])
            assert s1["is_processing"] is False and s1["n_past"] == n_past_1
            meta = http.get("/slots/1/state/meta").json()
            assert meta["n_past"] == n_past_1 and meta["is_processing"] is False
            info = _meta(w, Op.INFO)
            assert info["n_slots"] == 2 and info["slots_processing"] in ([0], [])
            assert http.get("/health").json()["status"] == "ok"
            assert http.get("/props").json()["total_slots"] == 2
            m0 = _meta(w, Op.STATE_META, "0")
            assert m0["n_past"] >= seen[-1]
        assert seen == sorted(seen), f"slot 0's n_past went back: {seen}"
        assert len(set(seen)) >= 2, f"slot 0's n_past did not grow across reads: {seen}"

        # after the prefill: the snapshot holds exactly what the engine reports
        done = prefill.result()
        n_past = done["n_past"]
        assert n_past == done["tokens_processed"] + done["cache_n"] > 1500
        assert max(seen) < n_past
        m0 = _meta(w, Op.STATE_META, "0")  # read right after the reply: published before it was sent
        assert m0["n_past"] == n_past and m0["is_processing"] is False
        assert m0["state_size"] == done["state_size"]
        s0 = http.get("/slots").json()[0]
        assert s0["n_past"] == n_past and s0["is_processing"] is False and s0["n_decoded"] == 0
        assert http.get("/slots/0/state/meta").json()["n_past"] == n_past
        assert _meta(w, Op.INFO)["slots_processing"] == []
        status, got, blob = w.call(Op.STATE_GET, key="0")  # the engine thread's own answer
        assert status == Status.OK and got["n_past"] == n_past and len(blob) == m0["state_size"]


def test_engine_thread_ops_wait_at_most_a_batch(node: ServerProcess) -> None:
    """STATE_GET and an erase of the idle slot run between two batching steps of the prefill; an
    erase is visible to the next status read (the snapshot is published before the reply)."""
    with httpx.Client(base_url=node.base, timeout=300) as http, Wire(node.port, timeout=300) as w:
        n_past_1 = _prime_slot_1(http)
        prefill = Prefill(node.port)
        prefill.start()
        _wait_processing(http, prefill)
        status, got, blob = w.call(Op.STATE_GET, key="1")
        assert not prefill.done.is_set(), "STATE_GET of slot 1 waited for slot 0's prefill to end"
        assert status == Status.OK and got["n_past"] == n_past_1 and len(blob) == got["state_size"]
        status, meta, _ = w.call(Op.STATE_GET, key="0")
        assert status == Status.BUSY, meta
        r = http.post("/slots/1?action=erase")
        assert r.status_code == 200 and r.json()["n_erased"] == n_past_1
        assert not prefill.done.is_set(), "erasing slot 1 waited for slot 0's prefill to end"
        meta_1 = _meta(w, Op.STATE_META, "1")
        assert meta_1["n_past"] == 0 and meta_1["is_processing"] is False
        assert http.get("/slots").json()[1]["n_past"] == 0
        assert prefill.result()["n_past"] > 1500
