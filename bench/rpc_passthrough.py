"""ggml-RPC through hydra-trio's front door vs. straight to its ggml-RPC child, same run.

    .venv/bin/python bench/rpc_passthrough.py [--rounds 2000] [--loads 3]

1. bulk: a stock llama.cpp client (tests/rpc_client_probe.py) loads SmolLM2
   with every layer on the RPC device: ~100 MB of SET_TENSOR uploads (the
   node runs without its tensor cache so every load uploads everything);
2. small messages: RPC_CMD_DEVICE_COUNT round trips on one connection.
Both measured in alternating rounds; one table (:mod:`bench._table`): MB/s
and microseconds per round trip for both paths, and the ratios (direct /
front door for the round trip: the target is front door ≤ 1.5×
direct, a ratio ≥ 0.67).

A third path, in the same rounds, is the child behind the bare relay
(``bench/bare_relay.c``, :mod:`bench._relay`): a C relay that copies bytes
and does nothing else.  Its row against direct is the machine's floor for
any relay (what the two more wake-ups per round trip cost here), and the
front door's row against it is what the front door adds over that floor
(validation, tracking, deadlines, Python).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._relay import start as start_relay
from bench._table import Row, print_table
from hydra_trio.models.presets import resolve_model
from hydra_trio.testing.spawn import ROOT, spawn, wait_healthy


def rtt_us(port: int, rounds: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"\x0e" + (24).to_bytes(8, "little") + bytes(24))
        _recv(s, 8 + 28)
        msg = bytes([15]) + bytes(8)  # RPC_CMD_DEVICE_COUNT, empty payload
        t0 = time.perf_counter()
        for _ in range(rounds):
            s.sendall(msg)
            _recv(s, 8 + 4)
        return (time.perf_counter() - t0) / rounds * 1e6


def _recv(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def load_s(port: int) -> float:
    model = str(resolve_model("smollm2-135m")[0])  # the probe takes HOST:PORT MODEL.gguf PROMPT N
    out = subprocess.run(
        [sys.executable, "tests/rpc_client_probe.py", f"127.0.0.1:{port}", model, "Hi", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["load_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rounds", type=int, default=2000, help="DEVICE_COUNT round trips per path, in 4 interleaved parts"
    )
    ap.add_argument("--loads", type=int, default=3)
    a = ap.parse_args()
    log = open("/tmp/rpc-bench-node.log", "w+")
    node, port = spawn("--no-model", "--rpc-cache-dir", "", output=log)
    relay = None
    try:
        wait_healthy(port, node)
        log.seek(0)
        child = int(re.search(r"ggml-RPC backend serving on 127\.0\.0\.1:(\d+)", log.read()).group(1))
        relay, relayed = start_relay(child)

        def bytes_in() -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            return float(re.search(r'hydra_trio:rpc_bytes_total\{direction="in"\} (\S+)', text).group(1))

        before = bytes_in()
        fd_load, direct_load, relay_load = [], [], []
        for _ in range(a.loads):  # alternating, so that a busy machine's drift hits every path
            fd_load.append(load_s(port))
            direct_load.append(load_s(child))
            relay_load.append(load_s(relayed))
        mb = (bytes_in() - before) / a.loads / 1e6
        fd_rtt, direct_rtt, relay_rtt = [], [], []
        for _ in range(4):
            fd_rtt.append(rtt_us(port, a.rounds // 4))
            direct_rtt.append(rtt_us(child, a.rounds // 4))
            relay_rtt.append(rtt_us(relayed, a.rounds // 4))
    finally:
        if relay is not None:
            relay.kill()
            relay.wait()
        node.send_signal(signal.SIGTERM)
        node.wait(30)
    print_table(
        [
            Row(
                "rpc_passthrough",
                f"bulk upload through the front door vs direct to its child ({mb:.0f} MB per load)",
                "MB/s",
                [mb / t for t in fd_load],
                [mb / t for t in direct_load],
            ),
            Row(
                "rpc_passthrough",
                "DEVICE_COUNT round trip through the front door vs direct",
                "us",
                fd_rtt,
                direct_rtt,
                higher_is_better=False,
                target=1 / 1.5,
            ),
            Row(
                "rpc_passthrough",
                "bulk upload through the bare C relay vs direct (the floor of a relay)",
                "MB/s",
                [mb / t for t in relay_load],
                [mb / t for t in direct_load],
            ),
            Row(
                "rpc_passthrough",
                "DEVICE_COUNT round trip through the bare C relay vs direct (the floor of a relay)",
                "us",
                relay_rtt,
                direct_rtt,
                higher_is_better=False,
            ),
            Row(
                "rpc_passthrough",
                "bulk upload through the front door vs the bare C relay",
                "MB/s",
                [mb / t for t in fd_load],
                [mb / t for t in relay_load],
            ),
            Row(
                "rpc_passthrough",
                "DEVICE_COUNT round trip through the front door vs the bare C relay",
                "us",
                fd_rtt,
                relay_rtt,
                higher_is_better=False,
            ),
        ],
        "bench/rpc_passthrough.py " + " ".join(sys.argv[1:]),
    )


if __name__ == "__main__":
    main()
