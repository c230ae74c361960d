"""ggml-RPC on the same port: compute-only nodes, a stock llama.cpp client, crash recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from hydra_trio.protocol.hydra import Op, Status

from .conftest import ROOT
from .hydra_wire import Wire


def probe(where: str, prompt: str = "The capital of France is", n: int = 16) -> dict:
    out = subprocess.run(
        [sys.executable, "tests/rpc_client_probe.py", where, prompt, str(n)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def info(port: int) -> dict:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK
    return meta


def test_compute_only_node_serves_a_stock_llama_cpp_client(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    assert httpx.get(node.base + "/slots").json() == []
    assert httpx.get(node.base + "/version").json()["engine"] == "hydra-trio"
    before = info(node.port)
    assert before["rpc_backend_active"] is True and before["solo_active"] is False
    assert "ggml_rpc" in before["protocols"]
    # ops that need a model answer a clear error
    with Wire(node.port) as w:
        status, meta, _ = w.call(Op.STATE_META, key="0")
        assert status == Status.ERROR and "no model" in meta["error"]
    r = httpx.post(node.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 501 and "compute-only" in r.json()["error"]["message"]
    remote = probe(f"127.0.0.1:{node.port}")
    local = probe("local")
    assert remote["devices"] == ["RPC0"] and local["devices"] == ["CPU"]
    assert remote["text"].startswith(" Paris.") and local["text"].startswith(" Paris.")
    after = info(node.port)["rpc_backend"]
    assert after["bytes_in"] - before["rpc_backend"]["bytes_in"] > 50_000_000  # the weights went over
    assert after["connections"] > before["rpc_backend"]["connections"]


def test_backend_crash_restarts_and_http_stays_up(spawn) -> None:
    node = spawn("--no-model")
    node.wait_ready()
    first = info(node.port)["rpc_backend"]
    os.kill(first["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert httpx.get(node.base + "/health").status_code in (200, 503)
        now = info(node.port)
        if now["rpc_backend"]["restarts"] == 1 and now["rpc_backend_active"]:
            break
        time.sleep(0.1)
    assert now["rpc_backend"]["restarts"] == 1 and now["rpc_backend_active"] is True
    assert now["rpc_backend"]["pid"] != first["pid"]
    assert probe(f"127.0.0.1:{node.port}", n=4)["text"].startswith(" Paris")
    assert "restarting in" in node.log()
