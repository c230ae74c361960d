"""Every example in examples/ runs against a real node, and the deployment files say what the node needs."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import sys

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hydra_trio.cli import build_parser

from .conftest import ROOT, ServerProcess

EXAMPLES = ROOT / "examples"


def run_example(name: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_embed_example_answers_and_stops() -> None:
    out = run_example("embed_trio.py")
    assert re.search(r"serving on port \d+", out)
    assert "Paris" in out and out.rstrip().endswith("stopped")


def test_tiny_orchestrator_moves_the_kv_and_decodes_without_the_prompt() -> None:
    out = run_example("tiny_orchestrator.py")
    n_past = int(re.search(r"A prefilled (\d+) tokens", out).group(1))
    assert f"B restored slot 1: n_past {n_past}" in out
    cache_n, prompt_n = map(int, re.search(r"cache_n: (\d+) prompt_n: (\d+)", out).groups())
    assert cache_n == n_past - 1 and prompt_n == 1
    assert "Paris" in out


def test_openai_example_talks_to_a_node(server: ServerProcess) -> None:
    code = (EXAMPLES / "openai_chat.py").read_text().replace("http://127.0.0.1:8080", server.base)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout


def test_fuzz_example_fuzzes_a_node(server: ServerProcess) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", str(EXAMPLES / "fuzz_my_node.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "HYDRA_NODE": f"127.0.0.1:{server.port}", "HYDRA_FUZZ_EXAMPLES": "8"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"\b3 passed\b", out.stdout), out.stdout[-3000:]
    assert server.proc.poll() is None


def test_systemd_unit_and_scrape_config_match_the_node(server: ServerProcess) -> None:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(EXAMPLES / "hydra-trio.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/hydra-trio") and argv[1] == "run"
    args = build_parser().parse_args(argv[1:])  # the flags are the node's own (exits 2 on a wrong one)
    assert service["KillSignal"] == "SIGTERM"  # the node drains on SIGTERM
    assert service["KillMode"] == "mixed"  # SIGTERM to the node only: it stops its ggml-RPC child itself
    assert float(service["TimeoutStopSec"]) > args.shutdown_grace  # systemd waits out the drain
    scrape = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == [f"127.0.0.1:{args.port}"]
    # what Prometheus would scrape there parses, with llama-server's names and the node's own
    text = httpx.get(server.base + scrape["metrics_path"], timeout=30).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"llamacpp:prompt_tokens", "llamacpp:requests_processing", "hydra_trio:connections_open"} <= names


def test_watch_events_example_prints_a_completions_slot_events(server: ServerProcess) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "watch_events.py"), f"127.0.0.1:{server.port}", "slot", "4"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()  # hello: it is subscribed
        assert first.startswith("hello "), first + proc.stderr.read()
        reply = httpx.post(
            server.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}, timeout=120
        ).json()
        out, err = proc.communicate(timeout=120)  # it stops by itself after 4 events
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        [t, reply["id"]] for t in ("slot.assigned", "slot.first_token", "slot.finished")
    ]
    assert json.loads(lines[-1].split(" ", 2)[2])["timings"]["predicted_n"] == 3
