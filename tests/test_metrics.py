"""/metrics against a live node: every documented family is exported, and each moves when its action happens.

The exposition is read with prometheus-client's own parser; values are
compared before and after an action (the shared server serves other tests
too, so only differences count).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from hydra_trio.cli import main
from hydra_trio.engine.settings import N_PARALLEL_MAX
from hydra_trio.hydra.client import HydraClient
from hydra_trio.hydra.errors import HydraNotFound
from hydra_trio.observability.logs import TextFormatter
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ROOT, ServerProcess, streaming

# family -> type, as prometheus-client's parser names them (a counter without its _total)
FAMILIES = {
    "hydra_trio:connections": "counter",
    "hydra_trio:connections_open": "gauge",
    "hydra_trio:protocol_connections_open": "gauge",
    "hydra_trio:refused": "counter",
    "hydra_trio:event_subscribers": "gauge",
    "hydra_trio:events_dropped": "counter",
    "hydra_trio:hydra_requests": "counter",
    "hydra_trio:hydra_request_seconds": "histogram",
    "hydra_trio:state_bytes": "counter",
    "hydra_trio:state_transfer_mb_per_second": "histogram",
    "hydra_trio:control_changes": "counter",
    "hydra_trio:expert_mode": "gauge",
    "hydra_trio:kv_cache_info": "gauge",
    "hydra_trio:memory_bytes": "gauge",
    "hydra_trio:combined_mode": "gauge",
    "hydra_trio:pipeline_mode": "gauge",
    "hydra_trio:peer_reachable": "gauge",
    "hydra_trio:expert_mode_switches": "counter",
    "hydra_trio:combined_fallbacks": "counter",
    "hydra_trio:peer_losses": "counter",
    "hydra_trio:requests_deferred": "counter",
    "hydra_trio:engine_tasks": "counter",
    "hydra_trio:rpc_bytes": "counter",
    "hydra_trio:rpc_backend_active": "gauge",
    "hydra_trio:rpc_backend_restarts": "counter",
    "hydra_rpc_clients_waiting": "gauge",
    "hydra_trio:http_requests_in_flight": "gauge",
    "hydra_rpc_clients_serving": "gauge",
    "hydra_rpc_clients_handshaking": "gauge",
    "hydra_rpc_clients_served": "counter",
    "hydra_rpc_clients_closed": "counter",
    "hydra_rpc_invalid_messages": "counter",
    "hydra_rpc_backend_crashes": "counter",
    "llamacpp:prompt_tokens": "counter",
    "llamacpp:prompt_seconds": "counter",
    "llamacpp:tokens_predicted": "counter",
    "llamacpp:tokens_predicted_seconds": "counter",
    "llamacpp:n_decode": "counter",
    "llamacpp:prompt_tokens_cached": "counter",
    "llamacpp:n_tokens_max": "counter",
    "llamacpp:spec_decode_num_draft_tokens": "counter",
    "llamacpp:spec_decode_num_accepted_tokens": "counter",
    "llamacpp:spec_decode_num_drafts": "counter",
    "llamacpp:n_busy_slots_per_decode": "gauge",
    "llamacpp:prompt_tokens_seconds": "gauge",
    "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:requests_processing": "gauge",
    "llamacpp:requests_deferred": "gauge",
    "hydra_trio:prompt_cache_hits": "counter",
    "hydra_trio:prompt_cache_misses": "counter",
    "hydra_trio:prompt_cache_saves": "counter",
    "hydra_trio:prompt_cache_restore_failures": "counter",
    "hydra_trio:prompt_cache_evictions": "counter",
    "hydra_trio:prompt_cache_bytes": "gauge",
    "hydra_trio:prompt_cache_entries": "gauge",
    "hydra_trio:prompt_cache_limit_bytes": "gauge",
}


class Scrape:
    """One parsed /metrics: ``scrape[sample_name, labels...]`` is the sample's value (0 when absent)."""

    def __init__(self, base: str) -> None:
        text = httpx.get(base + "/metrics", timeout=60).text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        for fam in self.families.values():
            for s in fam.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


def _completion(base: str, slot: int, n: int = 8) -> dict:
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": n, "temperature": 0, "id_slot": slot},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_every_family_is_exported_with_its_type_and_documented(server: ServerProcess) -> None:
    scrape = Scrape(server.base)
    page = (ROOT / "docs" / "operations.md").read_text()
    for name, kind in FAMILIES.items():
        assert name in scrape.families, f"{name} missing from /metrics"
        assert scrape.families[name].type == kind, (name, scrape.families[name].type)
        # the table's row: the family's own name (a counter without the `_total` it is exported with) and type
        assert f"| `{name}` | {kind} |" in page, f"{name} ({kind}) is not a row of docs/operations.md's metrics table"
    # and nothing is exported that the test (so docs/operations.md) does not know
    unknown = (
        set(scrape.families)
        - set(FAMILIES)
        - {"hydra_trio:hydra_request_seconds_created", "hydra_trio:state_transfer_mb_per_second_created"}
    )
    assert unknown == set(), unknown
    assert scrape.value("hydra_trio:expert_mode", mode="solo") == 1.0
    assert scrape.value("hydra_trio:expert_mode", mode="combined") == 0.0
    assert scrape.value("hydra_trio:expert_mode", mode="pipeline") == 0.0
    assert scrape.value("hydra_trio:peer_reachable") == 0.0


def test_hydra_ops_and_state_bytes_move(server: ServerProcess) -> None:
    _completion(server.base, slot=1)  # slot 1 holds some KV cache
    before = Scrape(server.base)

    async def run() -> tuple[int, int]:
        async with HydraClient("127.0.0.1", server.port, timeout=60) as c:
            await c.info()
            meta, blob = await c.state_get_bytes(1)
            put = await c.state_put(1, blob)
            assert put["restored"] is True
            try:
                await c.state_meta(99)
            except HydraNotFound:
                pass
            mid = Scrape(server.base)  # the client's connection is open now
            assert mid.value("hydra_trio:protocol_connections_open", protocol="hydra") >= 1
            return len(blob), meta["n_past"]

    size, n_past = trio.run(run)
    assert size > 0 and n_past > 0
    with Wire(server.port) as w:  # an opcode the protocol does not name
        assert w.call(0x7A)[0] == Status.NOT_IMPLEMENTED
    after = Scrape(server.base)

    def moved(sample: str, **labels: str) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert moved("hydra_trio:hydra_requests_total", op="INFO", status="OK") == 1
    assert moved("hydra_trio:hydra_requests_total", op="STATE_GET", status="OK") == 1
    assert moved("hydra_trio:hydra_requests_total", op="STATE_PUT", status="OK") == 1
    assert moved("hydra_trio:hydra_requests_total", op="STATE_META", status="NOT_FOUND") == 1
    assert moved("hydra_trio:hydra_requests_total", op="unknown", status="NOT_IMPLEMENTED") == 1
    assert moved("hydra_trio:hydra_request_seconds_count", op="INFO") == 1
    assert moved("hydra_trio:hydra_request_seconds_bucket", op="INFO", le="+Inf") == 1
    assert moved("hydra_trio:hydra_request_seconds_sum", op="STATE_PUT") > 0
    assert moved("hydra_trio:state_bytes_total", direction="out", op="STATE_GET") == size
    assert moved("hydra_trio:state_bytes_total", direction="in", op="STATE_PUT") == size
    for direction in ("out", "in"):  # one rate each, in MB/s: bytes over the request's seconds
        assert moved("hydra_trio:state_transfer_mb_per_second_count", direction=direction) == 1
        rate = moved("hydra_trio:state_transfer_mb_per_second_sum", direction=direction)
        assert rate > 0
        op = "STATE_GET" if direction == "out" else "STATE_PUT"
        seconds = moved("hydra_trio:hydra_request_seconds_sum", op=op)
        assert rate * 1e6 * seconds == pytest.approx(size, rel=1e-6)
    assert moved("hydra_trio:engine_tasks_total", type="save_slot") == 1  # STATE_GET's typed engine task
    assert moved("hydra_trio:engine_tasks_total", type="restore_slot") == 1
    assert moved("hydra_trio:connections_total", protocol="hydra") == 2
    # the server closes its side once the clients have gone: the open gauge comes back
    deadline = time.monotonic() + 60
    while Scrape(server.base).value("hydra_trio:protocol_connections_open", protocol="hydra") != 0:
        assert time.monotonic() < deadline, "hydra connections still counted open"
        time.sleep(0.1)


def test_completions_move_llamacpp_counters(server: ServerProcess) -> None:
    before = Scrape(server.base)
    reply = _completion(server.base, slot=2, n=6)
    after = Scrape(server.base)
    assert (
        after.value("llamacpp:tokens_predicted_total") - before.value("llamacpp:tokens_predicted_total")
        == (reply["usage"]["completion_tokens"])
    )
    assert after.value("llamacpp:n_decode_total") > before.value("llamacpp:n_decode_total")
    assert after.value("hydra_trio:connections_total", protocol="http") > before.value(
        "hydra_trio:connections_total", protocol="http"
    )


def test_control_changes_applied_refused_busy_and_failed(server: ServerProcess) -> None:
    before = Scrape(server.base)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "id_slot": 0}
    with Wire(server.port) as w:
        with streaming(server.base, body):
            status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo")
            assert status == Status.BUSY, meta
            busy = Scrape(server.base)
            assert busy.value("llamacpp:requests_processing") >= 1
        deadline = time.monotonic() + 60  # the closed stream's slot frees at the engine's next step
        while (status := w.call(Op.SET_EXPERT_MODE, payload=b"solo")[0]) == Status.BUSY:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert status == Status.OK
        # a change the engine refuses as it applies it: more slots than llama.cpp's most sequences (-np's bound too)
        status, meta, _ = w.call(Op.CONFIGURE, payload=json.dumps({"n_parallel": N_PARALLEL_MAX + 1}).encode())
        assert status == Status.BAD_REQUEST and "n_parallel" in meta["error"]
    after = Scrape(server.base)

    def moved(sample: str, **labels: str) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    refused = moved("hydra_trio:control_changes_total", result="refused_busy")
    assert refused >= 1 and moved("hydra_trio:hydra_requests_total", op="SET_EXPERT_MODE", status="BUSY") == refused
    assert moved("hydra_trio:control_changes_total", result="applied") == 1
    assert moved("hydra_trio:control_changes_total", result="failed") == 1
    # the changes that ran are typed engine tasks; a change refused BUSY never reached its task
    assert moved("hydra_trio:engine_tasks_total", type="set_expert_mode") == 1
    assert moved("hydra_trio:engine_tasks_total", type="configure") == 1
    assert moved("hydra_trio:hydra_requests_total", op="CONFIGURE", status="BAD_REQUEST") == 1
    assert after.value("hydra_trio:expert_mode", mode="solo") == 1.0


# ----------------------------------------------------------------------------- logs


def _log_records(path: Path) -> list[dict]:
    """Every line of a --log-format json log, parsed; fails on a line that is not one JSON object."""
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"line {n} is not JSON: {line!r}") from None
        assert isinstance(rec, dict) and {"ts", "level", "logger", "msg"} <= rec.keys(), line
        records.append(rec)
    return records


def test_json_log_format_one_object_per_line_with_request_fields(spawn) -> None:
    srv = spawn("-np", "2", "-c", "2048", "--log-format", "json")
    srv.wait_ready()
    reply = _completion(srv.base, slot=1)
    for _ in range(3):
        assert httpx.get(srv.base + "/version", timeout=30).status_code == 200
    with Wire(srv.port) as w:
        assert w.call(Op.INFO, trace_id="trace-info-1")[0] == Status.OK
        assert w.call(Op.STATE_META, key="1", trace_id="trace-meta-1")[0] == Status.OK
        assert w.call(Op.SET_EXPERT_MODE, payload=b"solo", trace_id="trace-mode-1")[0] == Status.OK
    deadline = time.monotonic() + 60
    while "trace-mode-1" not in srv.log() or '"GET /version' not in srv.log():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert srv.stop() == 0
    records = _log_records(srv.log_path)
    assert any(r["msg"].startswith("listening on") for r in records)
    # the engine's timing line: the reply's id, the slot, the milliseconds
    timing = [r for r in records if r.get("trace_id") == reply["id"] and r["logger"] == "hydra_trio.engine"]
    assert len(timing) == 1 and timing[0]["slot"] == 1 and timing[0]["ms"] > 0, timing
    assert timing[0]["level"] == "INFO" and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", timing[0]["ts"])
    # the access line: one per request, with the same trace id
    access = [r for r in records if r["logger"] == "hydra_trio.http.access" and r.get("op") == "POST /v1/completions"]
    assert len(access) == 1 and access[0]["trace_id"] == reply["id"] and access[0]["ms"] > 0
    assert sum(r.get("op") == "GET /version" for r in records) == 3
    # Hydra op lines and the control change
    info = [r for r in records if r.get("trace_id") == "trace-info-1"]
    assert len(info) == 1 and info[0]["op"] == "INFO" and info[0]["ms"] >= 0 and "slot" not in info[0]
    meta = [r for r in records if r.get("trace_id") == "trace-meta-1"]
    assert len(meta) == 1 and meta[0]["op"] == "STATE_META" and meta[0]["slot"] == 1
    mode = {r["logger"]: r for r in records if r.get("trace_id") == "trace-mode-1"}
    assert mode["hydra_trio.hydra"]["op"] == "SET_EXPERT_MODE"
    assert (
        mode["hydra_trio.control"]["op"].startswith("set_expert_mode")
        and "applied" in mode["hydra_trio.control"]["msg"]
    )


def test_text_log_format_appends_the_request_fields(server: ServerProcess) -> None:
    reply = _completion(server.base, slot=3, n=4)
    deadline = time.monotonic() + 60
    while not (lines := [ln for ln in server.log().splitlines() if f"| {reply['id']} |" in ln]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert re.search(rf" finish \w+ \(\w+\) trace_id={reply['id']} slot=3 ms=[0-9.]+$", lines[0]), lines[0]


def test_log_format_is_checked_and_text_keeps_tracebacks_below_the_fields(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--log-format", "xml"])
    assert exc.value.code == 2 and "--log-format" in capsys.readouterr().err
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("op",), sys.exc_info())
    record.trace_id, record.ms = "t-1", 2.5
    head, *rest = TextFormatter().format(record).splitlines()
    assert head.endswith("x: failed op trace_id=t-1 ms=2.5") and rest[0].startswith("Traceback") and "boom" in rest[-1]


FORGED = "2026-01-01 00:00:00,000 CRITICAL hydra_trio.forged: injected"


def test_text_log_lines_cannot_be_forged_by_a_client(server: ServerProcess) -> None:
    """A path or trace id with CR/LF (or a terminal escape) is written escaped on its one line:
    a client cannot add a line of its own to the node's log (CWE-117)."""
    httpx.get(server.base + "/nowhere%0d%0a" + FORGED.replace(" ", "%20") + "%1b[2J", timeout=60)
    with Wire(server.port) as w:
        assert w.call(Op.INFO, trace_id="forged-trace\n" + FORGED + "\x1b[2J")[0] == Status.OK
    deadline = time.monotonic() + 60
    while (server.log().count(FORGED) < 2) or "forged-trace" not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    log = server.log()
    assert not any(line.startswith(FORGED) for line in log.splitlines()), log[-3000:]
    assert "\x1b" not in log and "forged-trace\\n" + FORGED + "\\x1b[2J" in log


def test_text_formatter_escapes_control_characters_but_not_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "bad %s", ("a\nb\r\x1b\x85\u2028é",), sys.exc_info()
        )
    record.op = "GET /x\ny"
    head, *rest = TextFormatter().format(record).splitlines()
    assert head.endswith("x: bad a\\nb\\r\\x1b\\x85\\u2028é op=GET /x\\ny"), head
    assert rest[0].startswith("Traceback") and "boom" in rest[-1]
