"""What TLS costs, same run: COMBINED decode through the --rpc-tls tunnel vs plain ggml-RPC, and HTTPS vs HTTP.

    .venv/bin/python bench/tls.py [--tokens 48] [--runs 5] [--requests 20]

Makes a CA and a node certificate with ``trustme`` (the test extra) in a
temporary directory.  COMBINED decode through the ``--rpc-tls`` tunnel
against plain COMBINED, in interleaved rounds: two compute-only peers and two
heads with the test MoE (``smollm2-135m-moe``), one plain and one through the
tunnel (:func:`bench.combined.measure`).  Then a node with the default model
and TLS: the time of ``--requests`` small completions (8 tokens) over HTTP
and over HTTPS, on a keep-alive connection and with a new connection (and
handshake) per request, in alternating rounds of 5.  One table
(:mod:`bench._table`).
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
from bench._table import Row, print_table  # noqa: E402
from bench.combined import certificates, measure  # noqa: E402
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402


def start(*args: str) -> tuple[subprocess.Popen, int]:
    proc, port = spawn("--log-level", "WARNING", *args)
    wait_healthy(port, proc, timeout=300)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


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


def interleaved(port: int, verify: ssl.SSLContext, n: int, fresh: bool) -> tuple[list[float], list[float]]:
    """Median ms per request of each round of 5, plain and HTTPS, in alternating rounds (a busy machine drifts)."""
    plain: list[float] = []
    https: list[float] = []
    for _ in range(max(1, n // 5)):
        plain.append(statistics.median(http_ms(f"http://127.0.0.1:{port}", 5, False, fresh)))
        https.append(statistics.median(http_ms(f"https://127.0.0.1:{port}", 5, verify, fresh)))
    return https, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20)
    a = ap.parse_args()
    rows, _ = measure(a.tokens, a.runs, tls=True, solo=False)
    with tempfile.TemporaryDirectory() as d:
        flags, ca_pem = certificates(d)
        h, hport = start("-np", "1", *flags)  # the default model, for HTTP
        try:
            verify = ssl.create_default_context(cafile=str(ca_pem))
            http_ms(f"http://127.0.0.1:{hport}", 2, False, False)  # warm up
            keep = interleaved(hport, verify, a.requests, fresh=False)
            fresh = interleaved(hport, verify, a.requests, fresh=True)
        finally:
            stop(h)
    rows.append(Row("tls", "HTTPS vs HTTP completion (8 tokens), kept connection", "ms", *keep, higher_is_better=False))
    rows.append(
        Row(
            "tls",
            "HTTPS vs HTTP completion (8 tokens), new connection and handshake each",
            "ms",
            *fresh,
            higher_is_better=False,
        )
    )
    print_table(rows, "bench/tls.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
