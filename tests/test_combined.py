"""COMBINED mode with real processes: a compute-only peer B (and C), a head A with the test MoE and --rpc-engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ROOT, ServerProcess, free_port, streaming, wait_for
from .relay import Relay

BODY = {"prompt": "The capital of France is", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def info(port: int) -> dict:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK
    return meta


def rpc_bytes(port: int) -> int:
    return info(port)["rpc_backend"]["bytes_in"]


def complete(base: str) -> str:
    r = httpx.post(base + "/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def compute_threads(pid: int) -> set[int]:
    """The head's thread ids but trio's cached workers (``Trio thread N``: they come and go when idle)."""
    tasks = Path(f"/proc/{pid}/task")
    out = set()
    for t in tasks.iterdir():
        try:
            if not (t / "comm").read_text().startswith("Trio thread"):
                out.add(int(t.name))
        except FileNotFoundError:  # it exited meanwhile
            pass
    return out


def combined_head(spawn, peer_port: int, *extra: str) -> ServerProcess:
    """A head with the test MoE (1 slot, ``-t 2``) and ``--rpc-engine 127.0.0.1:PEER_PORT``, once it serves COMBINED."""
    a = spawn(
        "-m",
        "smollm2-135m-moe",
        "-np",
        "1",
        "-c",
        "1024",
        "--no-rpc-backend",
        "-t",
        "2",
        *extra,
        "--rpc-engine",
        f"127.0.0.1:{peer_port}",
    )
    a.wait_ready()
    wait_for(lambda: info(a.port)["mode"] == "combined", timeout=120)
    return a


def set_mode(port: int, payload: bytes) -> tuple[int, dict]:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=payload)
    return status, meta


def peer_dies_mid_request(head: ServerProcess, peer: ServerProcess) -> httpx.Response:
    """A non-streamed completion runs on ``head``; once it has generated a token, ``peer`` (the ggml-RPC
    node it decodes on) is killed with SIGKILL; the completion's reply."""
    replies: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: replies.append(
            httpx.post(head.base + "/v1/completions", json={**BODY, "max_tokens": 2000}, timeout=120)
        )
    )
    t.start()
    wait_for(
        lambda: any(s["is_processing"] and s["n_decoded"] > 0 for s in httpx.get(head.base + "/slots").json()),
        timeout=60,
    )
    peer.stop(signal.SIGKILL)
    t.join(120)
    assert replies, "the request got no reply"
    return replies[0]


@pytest.mark.slow
def test_combined_head_flips_switches_and_survives_its_peer(server: ServerProcess, spawn) -> None:
    dense = complete(server.base)  # SmolLM2 itself (the shared server)
    b = spawn("--no-model")
    c = spawn("--no-model")
    b.wait_ready()
    c.wait_ready()
    a = spawn(
        "-m",
        "smollm2-135m-moe",
        "-np",
        "2",
        "-c",
        "2048",
        "--no-rpc-backend",
        "-t",
        "2",
        "--rpc-engine",
        f"127.0.0.1:{b.port}",
    )
    a.wait_ready()
    # the start-up attach builds the head (combined_head_attached), then switches to it (mode)
    wait_for(lambda: info(a.port)["mode"] == "combined", timeout=60.0)
    meta = info(a.port)
    assert meta["mode"] == "combined" and meta["peer_addr"] == f"127.0.0.1:{b.port}"
    assert meta["peer_attach"] == "attached"
    assert meta["peer_reachable"] is True and meta["layer_split"] == "ffn_(up|down|gate)_exps"
    assert rpc_bytes(b.port) > 150_000_000  # the expert tensors were uploaded to B

    # COMBINED == SOLO == dense, token for token; B computes only in COMBINED
    before = rpc_bytes(b.port)
    combined_text = complete(a.base)
    during_combined = rpc_bytes(b.port) - before
    status, sw = set_mode(a.port, b"solo")
    assert status == Status.OK and sw["mode"] == "solo"
    before = rpc_bytes(b.port)
    solo_text = complete(a.base)
    during_solo = rpc_bytes(b.port) - before
    assert combined_text == solo_text == dense
    assert during_combined > 100_000 and during_solo == 0
    threads_solo = compute_threads(a.proc.pid)  # the engine thread's OpenMP team is in (-t 2: one more thread)
    before = rpc_bytes(b.port)
    status, sw = set_mode(a.port, b"combined")
    assert status == Status.OK and sw["mode"] == "combined" and 0 <= sw["switch_ms"] < 120_000
    # both models stay resident: switching back uploads no expert tensors again (the first upload was > 150 MB)
    assert rpc_bytes(b.port) - before < 1_000_000
    assert complete(a.base) == dense
    # one OpenMP team at a time (engine/llama/openmp.py): the engine thread's team left at the flip, and the peer
    # worker frees its own once the slots are idle (the reply goes out just before); with both teams alive,
    # libgomp would throttle every barrier of both for good (SOLO at about 0.7x)
    threads_back = wait_for(
        lambda: (t := compute_threads(a.proc.pid)) < threads_solo and len(threads_solo - t) == 1 and t,
        timeout=30,
        what="one OpenMP team left",
    )
    assert "detaching peer" not in a.log()
    assert "hydra_trio:combined_mode 1.0" in httpx.get(a.base + "/metrics").text

    # a switch while a stream runs: BUSY, nothing changes
    with streaming(a.base, {**BODY, "max_tokens": 400}):
        # while COMBINED decodes, the peer worker's team is the only one (-t 2: one more thread)
        assert len(compute_threads(a.proc.pid) - threads_back) == 1
        info_before = info(a.port)
        status, meta = set_mode(a.port, b"solo")
        assert status == Status.BUSY and meta["busy_slots"] and meta["success"] is False
        info_after = info(a.port)
        for k in ("mode", "peer_addr", "combined_head_attached"):
            assert info_after[k] == info_before[k]
    # the closed stream's slot frees once the node has seen the client go and the engine's next step (a
    # step over ggml-RPC) has run: seconds on a busy machine
    wait_for(
        lambda: not any(s["is_processing"] for s in httpx.get(a.base + "/slots").json()),
        timeout=120,
        what="the closed stream's slot free",
    )

    # move to peer C: B is detached, C gets the experts and does the work
    c_before = rpc_bytes(c.port)
    status, meta = set_mode(a.port, json.dumps({"mode": "combined", "peer": f"127.0.0.1:{c.port}"}).encode())
    assert status == Status.OK and meta["mode"] == "combined" and meta["peer"] == f"127.0.0.1:{c.port}"
    assert rpc_bytes(c.port) - c_before > 150_000_000
    b_before = rpc_bytes(b.port)
    assert complete(a.base) == dense
    assert rpc_bytes(b.port) == b_before
    assert info(a.port)["peer_addr"] == f"127.0.0.1:{c.port}"

    # kill C while a non-streamed request runs: that request gets OpenAI's JSON error
    # (not a bare 500 text), A goes back to SOLO and keeps serving
    reply = peer_dies_mid_request(a, c)
    assert reply.status_code == 500
    assert reply.headers["content-type"] == "application/json"
    assert "died mid-request" in reply.json()["error"]["message"]
    wait_for(lambda: info(a.port)["mode"] == "solo", timeout=30)
    meta = info(a.port)
    assert meta["peer_reachable"] is False and meta["combined_head_attached"] is False and meta["fallback_reason"]
    # the worker waits inside that decode for good (or its own thread aborted and parked); either way it
    # released the OpenMP team it computed with (a stuck one on a signal, engine/llama/openmp.py)
    wait_for(lambda: "worker released its OpenMP threads" in a.log(), timeout=60, what="the worker's team freed")
    assert "keeps its OpenMP threads" not in a.log()
    assert complete(a.base) == dense
    assert a.proc.poll() is None


def test_unreachable_peer_at_start_leaves_solo(spawn) -> None:
    dead = free_port()
    a = spawn(
        "-m", "smollm2-135m-moe", "-np", "1", "-c", "1024", "--no-rpc-backend", "--rpc-engine", f"127.0.0.1:{dead}"
    )
    a.wait_ready()
    wait_for(lambda: info(a.port)["fallback_reason"] is not None, timeout=30)
    meta = info(a.port)
    assert meta["mode"] == "solo" and meta["peer_reachable"] is False and meta["combined_head_attached"] is False
    assert "does not answer" in meta["fallback_reason"]
    status, sw = set_mode(a.port, b"combined")
    # OK with the mode in effect; success is false: it is not the mode asked for
    assert status == Status.OK and sw["mode"] == "solo" and sw["fallback_reason"] and sw["success"] is False
    assert info(a.port)["peer_attach"] == "failed"
    out = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "mode", f"127.0.0.1:{a.port}", "combined", "--wait", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3 and "does not answer" in out.stderr  # the CLI says COMBINED is not in effect
    assert json.loads(out.stdout)["success"] is False
    assert "Paris" in complete(a.base)


@pytest.mark.slow
def test_sigterm_on_a_compute_only_peer_lets_the_heads_request_finish(spawn) -> None:
    """The peer drains: the head's request in flight gets every decode step, then the peer closes and exits 0."""
    b = spawn("--no-model", "--shutdown-grace", "120")
    b.wait_ready()
    a = spawn(
        "-m", "smollm2-135m-moe", "-np", "1", "-c", "1024", "--no-rpc-backend", "--rpc-engine", f"127.0.0.1:{b.port}"
    )
    a.wait_ready()
    wait_for(lambda: info(a.port)["combined_head_attached"], timeout=120)
    result: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: result.append(
            httpx.post(a.base + "/v1/completions", json={**BODY, "max_tokens": 120}, timeout=600)
        )
    )
    t.start()
    wait_for(lambda: any(s["is_processing"] for s in httpx.get(a.base + "/slots", timeout=60).json()), timeout=60)
    wait_for(lambda: any(s["n_decoded"] > 2 for s in httpx.get(a.base + "/slots", timeout=60).json()), timeout=60)
    b.proc.send_signal(signal.SIGTERM)
    t.join(600)
    assert result and result[0].status_code == 200, result and result[0].text
    assert result[0].json()["usage"]["completion_tokens"] == 120  # not cut by the peer's shutdown
    assert b.proc.wait(120) == 0
    assert "grace period" not in b.log()
    wait_for(lambda: info(a.port)["mode"] == "solo", timeout=60)  # the head notices its peer left and keeps serving
    assert "Paris" in complete(a.base)


@pytest.mark.slow
def test_a_peer_that_died_while_solo_served_is_not_switched_back_to(spawn) -> None:
    """The peer dies while the head serves SOLO with the COMBINED model kept (the watchdog acts only in
    COMBINED): SET_EXPERT_MODE combined must not report success on that dead connection, fail the next
    request and leave the stuck worker with its OpenMP team; it falls back to SOLO, which keeps answering."""
    b = spawn("--no-model")
    b.wait_ready()
    a = combined_head(spawn, b.port)
    combined_text = complete(a.base)
    status, sw = set_mode(a.port, b"solo")
    assert status == Status.OK and sw["mode"] == "solo"
    assert complete(a.base) == combined_text
    threads_solo = compute_threads(a.proc.pid)
    assert info(a.port)["combined_head_attached"] is True  # kept for a fast flip back

    b.stop(signal.SIGKILL)
    status, sw = set_mode(a.port, b"combined")
    assert status == Status.OK and sw["success"] is False and sw["mode"] == "solo", sw
    assert f"127.0.0.1:{b.port}" in sw["fallback_reason"]
    meta = info(a.port)
    assert meta["mode"] == "solo" and meta["combined_head_attached"] is False and meta["peer_attach"] == "failed"
    assert meta["peer_reachable"] is False
    assert complete(a.base) == combined_text  # SOLO, not a 500 from a decode on the dead peer
    # the engine thread's OpenMP team stayed: no second team next to a stuck worker's (engine/llama/openmp.py)
    assert compute_threads(a.proc.pid) - threads_solo == set()
    # and the log does not claim otherwise: the parked worker had released its team at the flip to SOLO
    assert "parked for good" in a.log() and "keeps its OpenMP threads" not in a.log()
    assert a.proc.poll() is None


@pytest.mark.slow
def test_a_peer_that_dies_mid_decode_leaves_one_openmp_team(spawn) -> None:
    """The peer dies while COMBINED decodes: the request fails, the head goes back to SOLO, and the worker
    stuck inside that decode for good frees its OpenMP team (on a signal, engine/llama/openmp.py), so SOLO's
    team is the only one and libgomp does not throttle SOLO's barriers (two teams on 2 cores: SOLO at
    0.80-0.94x; bench/peer_death.py measures it)."""
    b = spawn("--no-model")
    b.wait_ready()
    a = combined_head(spawn, b.port)
    text = complete(a.base)
    status, sw = set_mode(a.port, b"solo")
    assert status == Status.OK and sw["mode"] == "solo"
    assert complete(a.base) == text
    n_solo = len(compute_threads(a.proc.pid))  # SOLO's team, the worker (its team freed at the flip), ggml-RPC's
    status, sw = set_mode(a.port, b"combined")
    assert status == Status.OK and sw["success"] is True

    reply = peer_dies_mid_request(a, b)
    assert reply.status_code == 500 and "died mid-request" in reply.json()["error"]["message"]
    wait_for(lambda: info(a.port)["mode"] == "solo", timeout=60)
    assert complete(a.base) == text
    wait_for(lambda: len(compute_threads(a.proc.pid)) == n_solo, timeout=60, what="the stuck worker's team freed")
    assert "worker released its OpenMP threads" in a.log() and "keeps its OpenMP threads" not in a.log()
    assert a.proc.poll() is None


def embed(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/embeddings", json={"input": "The capital of France is Paris."}, timeout=120)


@pytest.mark.slow
def test_embeddings_on_a_combined_head_and_a_peer_connection_that_breaks(spawn) -> None:
    """--embedding with the MoE on a COMBINED head: the peer computes the experts and the vector is SOLO's;
    when the head's ggml-RPC connection breaks (a relay cuts it and keeps accepting, so the watchdog's
    connect probe sees nothing), the embedding gets OpenAI's JSON error, not a hang, and the head is back in
    SOLO with the same vectors."""
    b = spawn("--no-model")
    b.wait_ready()
    with Relay(b.port) as relay:
        a = combined_head(spawn, relay.port, "--embedding", "--pooling", "mean")
        before = rpc_bytes(b.port)
        r = embed(a.base)
        assert r.status_code == 200, r.text
        combined_vec = r.json()["data"][0]["embedding"]
        assert rpc_bytes(b.port) - before > 100_000  # the peer computed the experts
        status, sw = set_mode(a.port, b"solo")
        assert status == Status.OK and sw["mode"] == "solo"
        solo_vec = embed(a.base).json()["data"][0]["embedding"]
        assert len(solo_vec) == len(combined_vec) == 576
        assert max(abs(x - y) for x, y in zip(combined_vec, solo_vec, strict=False)) < 1e-5
        status, sw = set_mode(a.port, b"combined")
        assert status == Status.OK and sw["success"] is True and sw["mode"] == "combined"

        relay.cut()
        r = embed(a.base)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert "died mid-request" in r.json()["error"]["message"]
        meta = info(a.port)
        assert meta["mode"] == "solo" and meta["combined_head_attached"] is False and meta["fallback_reason"]
        r = embed(a.base)
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == solo_vec
        assert a.proc.poll() is None


@pytest.mark.slow
def test_a_connection_that_breaks_while_combined_is_idle_leaves_one_openmp_team(spawn) -> None:
    """The head's ggml-RPC connection breaks while COMBINED is idle (a relay cuts it and keeps accepting:
    the watchdog sees nothing); the next request fails with the JSON error and the head goes back to SOLO.
    The worker, parked for good, must hold no OpenMP team: it released its team when the slots went idle
    and checked the peer before computing again, so SOLO's team is the only one (engine/llama/openmp.py)."""
    b = spawn("--no-model")
    b.wait_ready()
    with Relay(b.port) as relay:
        a = combined_head(spawn, relay.port)
        text = complete(a.base)
        status, sw = set_mode(a.port, b"solo")
        assert status == Status.OK and sw["mode"] == "solo"
        assert complete(a.base) == text
        n_solo = len(compute_threads(a.proc.pid))
        status, sw = set_mode(a.port, b"combined")
        assert status == Status.OK and sw["success"] is True
        assert complete(a.base) == text

        relay.cut()
        r = httpx.post(a.base + "/v1/completions", json=BODY, timeout=120)
        assert r.status_code == 500 and "died mid-request" in r.json()["error"]["message"]
        assert info(a.port)["mode"] == "solo"
        assert complete(a.base) == text
        # SOLO's team, the parked worker and ggml-RPC's parked thread: no second team
        wait_for(lambda: len(compute_threads(a.proc.pid)) == n_solo, timeout=30, what="no second OpenMP team")
        assert "parked for good" in a.log() and "keeps its OpenMP threads" not in a.log()
        assert a.proc.poll() is None


@pytest.mark.slow
def test_a_hung_peer_fails_the_request_and_frees_its_connection_when_it_answers_again(spawn) -> None:
    """The peer hangs (SIGSTOP; its kernel still accepts, so the watchdog sees nothing) while COMBINED is
    idle: the next request's check of the peer (PeerWorker.decode) gives up after its 30 s, the request gets
    the JSON error and SOLO serves, instead of the head waiting on the peer for good.  When the peer runs
    again, the connection given up on is freed (the peer serves one ggml-RPC client at a time), so
    COMBINED attaches to it again and gives the same text."""
    b = spawn("--no-model")
    b.wait_ready()
    a = combined_head(spawn, b.port)
    text = complete(a.base)
    b.proc.send_signal(signal.SIGSTOP)
    try:
        r = httpx.post(a.base + "/v1/completions", json=BODY, timeout=120)
        assert r.status_code == 500 and "died mid-request" in r.json()["error"]["message"]
        assert info(a.port)["mode"] == "solo"
        assert complete(a.base) == text
    finally:
        b.proc.send_signal(signal.SIGCONT)
    wait_for(
        lambda: set_mode(a.port, b"combined")[1]["success"],
        timeout=60,
        every=1.0,
        what="COMBINED on the peer that answers again",
    )
    assert complete(a.base) == text
    assert info(a.port)["peer_addr"] == f"127.0.0.1:{b.port}" and a.proc.poll() is None


@pytest.mark.slow
def test_drafts_compose_with_combined_mode(spawn) -> None:
    """A COMBINED head that drafts with model-free types (``--spec-type ngram-simple,suffix``) verifies its
    drafts through the peer's expert tensors in the same batch: its greedy tokens are a non-drafting COMBINED
    head's, and it did draft and accept."""
    from .test_speculative import ALPHABET_BODY

    peers = [spawn("--no-model"), spawn("--no-model")]
    for p in peers:
        p.wait_ready()
    plain = combined_head(spawn, peers[0].port)
    drafting = combined_head(spawn, peers[1].port, "--spec-type", "ngram-simple,suffix")
    body = ALPHABET_BODY
    want, got = (httpx.post(h.base + "/completion", json=body, timeout=300).json() for h in (plain, drafting))
    assert got["tokens"] == want["tokens"] and got["content"] == want["content"]
    assert got["timings"]["draft_n_accepted"] > 0 and "draft_n" not in want["timings"]
    assert info(drafting.port)["mode"] == "combined"
