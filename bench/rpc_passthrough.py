"""ggml-RPC through hydra-trio's front door vs. straight to its ggml-RPC child, same run.

    .venv/bin/python bench/rpc_passthrough.py [--rounds 2000] [--loads 3]

1. bulk: a stock llama.cpp client (tests/rpc_client_probe.py) loads SmolLM2
   with every layer on the RPC device: ~100 MB of SET_TENSOR uploads (the
   node runs without its tensor cache so every load uploads everything);
2. small messages: RPC_CMD_DEVICE_COUNT round trips on one connection.
Prints MB/s and microseconds per round trip for both paths and the ratio
front door / direct.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from hydra_trio._spawn import ROOT, spawn, wait_healthy



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
    out = subprocess.run([sys.executable, "tests/rpc_client_probe.py", f"127.0.0.1:{port}", "Hi", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["load_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--loads", type=int, default=3)
    a = ap.parse_args()
    log = open("/tmp/rpc-bench-node.log", "w+")
    node, port = spawn("--no-model", "--rpc-cache-dir", "", output=log)
    try:
        wait_healthy(port, node)
        log.seek(0)
        child = int(re.search(r"ggml-RPC backend serving on 127\.0\.0\.1:(\d+)", log.read()).group(1))
        before = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        fd_load = [load_s(port) for _ in range(a.loads)]
        after = httpx.get(f"http://127.0.0.1:{port}/metrics").text

        def bytes_in(text: str) -> float:
            return float(re.search(r'hydra_trio:rpc_bytes_total\{direction="in"\} (\S+)', text).group(1))

        per_load = (bytes_in(after) - bytes_in(before)) / a.loads
        direct_load = [load_s(child) for _ in range(a.loads)]
        fd_rtt = rtt_us(port, a.rounds)
        direct_rtt = rtt_us(child, a.rounds)
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(30)
    f, d = statistics.median(fd_load), statistics.median(direct_load)
    mb = per_load / 1e6
    print(f"bulk upload ({mb:.0f} MB per model load, median of {a.loads}):")
    print(f"  front door {mb / f:7.1f} MB/s | direct {mb / d:7.1f} MB/s | ratio {d / f:.2f}")
    print(f"small messages (DEVICE_COUNT round trip, {a.rounds} rounds):")
    print(f"  front door {fd_rtt:7.1f} us | direct {direct_rtt:7.1f} us | ratio {fd_rtt / direct_rtt:.2f}")


if __name__ == "__main__":
    main()
