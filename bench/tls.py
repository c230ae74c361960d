"""What TLS costs, same run: COMBINED decode through the --rpc-tls tunnel vs plain ggml-RPC, and HTTPS vs HTTP.

    .venv/bin/python bench/tls.py [--tokens 64] [--runs 3] [--requests 20]

Makes a CA and a node certificate with ``trustme`` (the test extra) in a
temporary directory.  Starts one compute-only node B with TLS on its port
(plain still served); then, one after the other (B serves one ggml-RPC
client at a time), a head with the test MoE (``smollm2-135m-moe``) and
``--rpc-engine B`` plain, the same head through the TLS tunnel, and plain
again; each reports COMBINED greedy decode tokens/s (median of ``--runs``).
Then a node with the default model and TLS: the median time of ``--requests``
small completions (8 tokens) over HTTP and over HTTPS, on a keep-alive
connection and with a new connection (and handshake) per request, measured
in alternating rounds of 5.
"""

from __future__ import annotations

import argparse
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hydra_trio._spawn import spawn, wait_healthy  # noqa: E402
from hydra_trio.hydra.client import HydraClient  # noqa: E402

from bench._decode import tok_s  # noqa: E402


def start(*args: str) -> tuple[subprocess.Popen, int]:
    proc, port = spawn("--log-level", "WARNING", *args)
    wait_healthy(port, proc, timeout=300)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


async def _mode(port: int) -> str:
    async with HydraClient("127.0.0.1", port) as c:
        return (await c.info())["mode"]


def combined_tok_s(bport: int, tokens: int, runs: int, *extra: str) -> float:
    import trio

    h, hport = start("-m", "smollm2-135m-moe", "-np", "1", "-c", "2048", "--no-rpc-backend",
                     "--rpc-engine", f"127.0.0.1:{bport}", *extra)
    try:
        deadline = time.monotonic() + 300
        while trio.run(_mode, hport) != "combined":
            assert time.monotonic() < deadline, "the head did not reach COMBINED"
            time.sleep(0.5)
        tok_s(hport, 8)
        return statistics.median(tok_s(hport, tokens) for _ in range(runs))
    finally:
        stop(h)


BODY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def http_ms(base: str, n: int, verify: ssl.SSLContext | bool, fresh: bool) -> list[float]:
    """Milliseconds of each of ``n`` completions; one keep-alive connection, or a new one each (``fresh``)."""
    out = []
    with httpx.Client(verify=verify, timeout=120) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            if fresh:
                httpx.post(base + "/v1/completions", json=BODY, verify=verify, timeout=120).raise_for_status()
            else:
                c.post(base + "/v1/completions", json=BODY).raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def interleaved(port: int, verify: ssl.SSLContext, n: int, fresh: bool) -> tuple[float, float]:
    """Median ms per request, plain and HTTPS, measured in alternating rounds of 5 (a busy machine drifts)."""
    plain: list[float] = []
    https: list[float] = []
    for _ in range(max(1, n // 5)):
        plain += http_ms(f"http://127.0.0.1:{port}", 5, False, fresh)
        https += http_ms(f"https://127.0.0.1:{port}", 5, verify, fresh)
    return statistics.median(plain), statistics.median(https)


def main() -> None:
    import trustme

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ca = trustme.CA()
        ca_pem, cert, key = Path(d, "ca.pem"), Path(d, "node.pem"), Path(d, "node.key")
        ca.cert_pem.write_to_path(str(ca_pem))
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        leaf.private_key_pem.write_to_path(str(key))
        for i, blob in enumerate(leaf.cert_chain_pems):
            blob.write_to_path(str(cert), append=i > 0)
        tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
        b, bport = start("--no-model", *tls)
        try:
            plain1 = combined_tok_s(bport, a.tokens, a.runs)
            through = combined_tok_s(bport, a.tokens, a.runs, "--rpc-tls", "--tls-ca", str(ca_pem), *tls)
            plain2 = combined_tok_s(bport, a.tokens, a.runs)
        finally:
            stop(b)
        h, hport = start("-np", "1", *tls)  # the default model, for HTTP
        try:
            verify = ssl.create_default_context(cafile=str(ca_pem))
            http_ms(f"http://127.0.0.1:{hport}", 2, False, False)  # warm up
            keep = interleaved(hport, verify, a.requests, fresh=False)
            fresh = interleaved(hport, verify, a.requests, fresh=True)
        finally:
            stop(h)
    plain = (plain1 + plain2) / 2
    print(f"COMBINED decode, {a.tokens} tokens, median of {a.runs}: plain {plain1:.1f} / {plain2:.1f} tok/s "
          f"(before/after) | TLS tunnel {through:.1f} tok/s | ratio TLS/plain {through / plain:.2f}")
    print(f"HTTP completions (8 tokens), median of {a.requests} each, alternating rounds, keep-alive: "
          f"plain {keep[0]:.1f} ms | HTTPS {keep[1]:.1f} ms | ratio HTTPS/plain {keep[1] / keep[0]:.2f}")
    print(f"  a new connection per request: plain {fresh[0]:.1f} ms | HTTPS {fresh[1]:.1f} ms | "
          f"ratio {fresh[1] / fresh[0]:.2f}")

if __name__ == "__main__":
    main()
