"""The KV move of docs/hydra.md, with the hydra-trio CLI as a new user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from .conftest import ROOT, ServerProcess

MSGS = [{"role": "user", "content": "Tell me about Paris."}]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hydra_trio", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_move_slot_with_cli(server: ServerProcess, spawn, tmp_path) -> None:
    b = spawn("-np", "2")
    b.wait_ready()
    r = httpx.post(
        server.base + "/v1/chat/completions",
        json={"messages": MSGS, "temperature": 0, "max_tokens": 0, "id_slot": 0},
        timeout=60,
    )
    assert r.status_code == 200
    n_prompt = r.json()["usage"]["prompt_tokens"]
    blob = tmp_path / "slot0.kv"
    got = cli("state", "get", f"127.0.0.1:{server.port}", "0", str(blob))
    assert got.returncode == 0, got.stderr
    meta = json.loads(got.stdout)
    assert meta["n_past"] == n_prompt and blob.stat().st_size == meta["state_size"]
    put = cli("state", "put", f"127.0.0.1:{b.port}", "1", str(blob))
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout)["restored"] is True
    shown = cli("state", "meta", f"127.0.0.1:{b.port}", "1")
    assert json.loads(shown.stdout)["n_past"] == n_prompt
    body = {"messages": MSGS, "temperature": 0, "max_tokens": 16, "id_slot": 1}
    on_b = httpx.post(b.base + "/v1/chat/completions", json=body, timeout=60).json()
    assert on_b["timings"]["cache_n"] == n_prompt - 1
    body["id_slot"] = 0
    on_a = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60).json()
    assert on_b["choices"][0]["message"]["content"] == on_a["choices"][0]["message"]["content"]
    info = cli("info", f"127.0.0.1:{b.port}")
    assert info.returncode == 0 and json.loads(info.stdout)["n_slots"] == 2
    mode = cli("mode", f"127.0.0.1:{b.port}", "solo")
    assert mode.returncode == 0 and json.loads(mode.stdout)["mode"] == "solo"
    refused = cli("state", "put", f"127.0.0.1:{b.port}", "7", str(blob))
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr
