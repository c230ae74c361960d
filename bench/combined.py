"""COMBINED vs SOLO, and COMBINED through the TLS tunnel vs plain, in interleaved rounds; the flip latency.

    .venv/bin/python bench/combined.py [--tokens 48] [--runs 5] [--no-tls] [--no-relay]
                                       [--passive none|peer|head|both] [--llama-server]

Starts a compute-only node B and a head A with the test MoE
(``smollm2-135m-moe``) and ``--rpc-engine B``; with TLS (the default) also a
compute-only node B2 with a certificate (made here with ``trustme``, the test
extra) and a head A2 with ``--rpc-tls --rpc-engine B2``.  Each round measures
greedy decode tokens/s of A in COMBINED (experts computed on B over ggml-RPC),
of A in SOLO (a flip: both models stay resident), and of A2 in COMBINED
through its tunnel, one after the other (only one decodes at a time), so a
busy machine's drift hits all three alike.  Prints one table
(:mod:`bench._table`) and the ``switch_ms`` of SET_EXPERT_MODE flips.

Unless ``--no-relay``, a fourth pair in the same rounds: a compute-only node
B3 and a head A3 whose ``--rpc-engine`` is the bare relay
(``bench/bare_relay.c``, :mod:`bench._relay`) in front of B3.  The relay
copies bytes and nothing else, so its row against plain COMBINED is what one
more hop costs on this machine: the floor of the TLS tunnel, which is one
more hop plus the cipher (the tunnel's row against it is what TLS and the
tunnel's own work add).

With ``--llama-server`` (built on first use by ``bench/build_llama_server.sh``,
as ``bench/vs_llama_server.py`` does) the rounds also time llama.cpp alone on
the same model and flags: llama-server with the same expert tensors on a bare
ggml-RPC server (``--rpc HOST:PORT -ngl 0 -ot 'ffn_(up|down|gate)_exps=RPC0[HOST:PORT]'``,
the server being this package's child, ``ggml_backend_rpc_start_server``
with no front door) against llama-server alone.  Two more rows: that ratio
(what llama.cpp's own ggml-RPC reaches on this machine: the ceiling of the
first row's), and hydra-trio's COMBINED against llama-server's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._decode import tok_s  # noqa: E402
from bench._relay import start as start_relay  # noqa: E402
from bench._table import Row, print_table  # noqa: E402
from hydra_trio.hydra.client import HydraClient  # noqa: E402
from hydra_trio.testing.spawn import free_port, spawn, wait_healthy  # noqa: E402

MOE = ("-m", "smollm2-135m-moe", "-np", "1", "-c", "2048", "--no-rpc-backend")


def start(*args: str, passive: bool = False) -> tuple[subprocess.Popen, int]:
    proc, port = spawn("--log-level", "WARNING", *args, env={"OMP_WAIT_POLICY": "PASSIVE"} if passive else None)
    wait_healthy(port, proc, timeout=300)
    return proc, port


async def _mode(port: int, m: str | None = None) -> dict:
    async with HydraClient("127.0.0.1", port) as c:
        return await c.set_expert_mode(m) if m else await c.info()


def set_mode(port: int, m: str) -> dict:
    import trio

    return trio.run(_mode, port, m)


def wait_combined(port: int, timeout: float = 300) -> None:
    import trio

    deadline = time.monotonic() + timeout
    while trio.run(_mode, port)["mode"] != "combined":
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head on {port} did not reach COMBINED")
        time.sleep(0.5)


def certificates(d: str) -> tuple[list[str], Path]:
    """Node flags ``--tls-cert/--tls-key`` for 127.0.0.1, and the CA file (trustme)."""
    import trustme

    ca = trustme.CA()
    ca_pem, cert, key = Path(d, "ca.pem"), Path(d, "node.pem"), Path(d, "node.key")
    ca.cert_pem.write_to_path(str(ca_pem))
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.private_key_pem.write_to_path(str(key))
    for i, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(str(cert), append=i > 0)
    return ["--tls-cert", str(cert), "--tls-key", str(key)], ca_pem


def llama_cpp_pair(procs: list[subprocess.Popen]) -> tuple[int, int]:
    """llama-server with the experts on a bare ggml-RPC server, and llama-server alone: their ports
    (the processes join ``procs``)."""
    from bench.vs_llama_server import build_anchor
    from hydra_trio.models.presets import resolve_model
    from hydra_trio.rpc_backend.supervisor import CHILD_ENV

    binary, model = str(build_anchor()), str(resolve_model("smollm2-135m-moe")[0])
    rpc = f"127.0.0.1:{free_port()}"
    child = subprocess.Popen(
        [sys.executable, "-m", "hydra_trio.rpc_backend.child", "--endpoint", rpc],
        env={**CHILD_ENV, **os.environ},
        stdout=subprocess.DEVNULL,
    )
    procs.append(child)
    ports = []
    for extra in (("--rpc", rpc, "-ngl", "0", "-ot", rf"ffn_(up|down|gate)_exps=RPC0[{rpc}]"), ()):
        if extra:
            _wait_listening(rpc, child)
        port = free_port()
        proc = subprocess.Popen(
            [
                binary,
                "-m",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-np",
                "1",
                "-c",
                "2048",
                "--no-webui",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        wait_healthy(port, proc, timeout=300)
        ports.append(port)
    return ports[0], ports[1]


def _wait_listening(endpoint: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    import socket

    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no ggml-RPC server on {endpoint}")


def measure(
    tokens: int,
    runs: int,
    *,
    tls: bool = True,
    solo: bool = True,
    relay: bool = True,
    passive: str = "none",
    llama_server: bool = False,
) -> tuple[list[Row], list[float]]:
    """The rows (COMBINED/SOLO, TLS/plain COMBINED, the bare relay's, llama.cpp's own) and the
    flip-to-COMBINED times (ms)."""
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        try:
            lport = lsolo = None
            if llama_server:
                lport, lsolo = llama_cpp_pair(procs)
                tok_s(lport, 8)
                tok_s(lsolo, 8)
            b, bport = start("--no-model", passive=passive in ("peer", "both"))
            procs.append(b)
            h, hport = start(*MOE, "--rpc-engine", f"127.0.0.1:{bport}", passive=passive in ("head", "both"))
            procs.append(h)
            h2port = None
            if tls:
                flags, ca_pem = certificates(d)
                b2, b2port = start("--no-model", *flags, passive=passive in ("peer", "both"))
                procs.append(b2)
                h2, h2port = start(
                    *MOE,
                    "--rpc-engine",
                    f"127.0.0.1:{b2port}",
                    "--rpc-tls",
                    "--tls-ca",
                    str(ca_pem),
                    passive=passive in ("head", "both"),
                )
                procs.append(h2)
                wait_combined(h2port)
                tok_s(h2port, 8)
            h3port = None
            if relay:
                b3, b3port = start("--no-model", passive=passive in ("peer", "both"))
                procs.append(b3)
                r3, r3port = start_relay(b3port)
                procs.append(r3)
                h3, h3port = start(*MOE, "--rpc-engine", f"127.0.0.1:{r3port}", passive=passive in ("head", "both"))
                procs.append(h3)
                wait_combined(h3port)
                tok_s(h3port, 8)
            wait_combined(hport)
            tok_s(hport, 8)
            comb, sol, through, relayed, lcomb, lsol = [], [], [], [], [], []
            for i in range(runs):
                print(f"  round {i + 1}/{runs}", file=sys.stderr, flush=True)
                set_mode(hport, "combined")
                comb.append(tok_s(hport, tokens))
                if solo:
                    set_mode(hport, "solo")
                    sol.append(tok_s(hport, tokens))
                if h2port is not None:
                    through.append(tok_s(h2port, tokens))
                if h3port is not None:
                    relayed.append(tok_s(h3port, tokens))
                if lport is not None and lsolo is not None:
                    lcomb.append(tok_s(lport, tokens))
                    lsol.append(tok_s(lsolo, tokens))
            flips = []
            for _ in range(5):
                set_mode(hport, "solo")
                flips.append(set_mode(hport, "combined")["switch_ms"])
        finally:
            for p in procs[::-1]:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(60)
    rows = []
    if solo:
        rows.append(
            Row(
                "combined",
                "COMBINED decode (experts on a loopback peer) vs SOLO, same head",
                "tok/s",
                comb,
                sol,
                target=0.5,
            )
        )
    if tls:
        rows.append(
            Row(
                "combined",
                "COMBINED through the --rpc-tls tunnel vs plain COMBINED",
                "tok/s",
                through,
                comb,
                target=0.85,
            )
        )
    if relay:
        rows.append(
            Row(
                "combined",
                "COMBINED through the bare C relay vs plain COMBINED (the floor of one more hop)",
                "tok/s",
                relayed,
                comb,
            )
        )
    if tls and relay:
        rows.append(
            Row(
                "combined",
                "COMBINED through the --rpc-tls tunnel vs through the bare C relay",
                "tok/s",
                through,
                relayed,
            )
        )
    if llama_server:
        rows.append(
            Row(
                "combined",
                "llama.cpp alone: llama-server --rpc (bare ggml-RPC server) vs llama-server",
                "tok/s",
                lcomb,
                lsol,
            )
        )
        rows.append(
            Row(
                "combined",
                "hydra-trio COMBINED (peer's front door) vs llama-server --rpc (bare server)",
                "tok/s",
                comb,
                lcomb,
            )
        )
    return rows, flips


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-tls", action="store_true", help="skip the TLS peer and head")
    ap.add_argument("--no-relay", action="store_true", help="skip the peer and head behind the bare C relay")
    ap.add_argument(
        "--passive",
        choices=["none", "peer", "head", "both"],
        default="none",
        help="which nodes' environment sets OMP_WAIT_POLICY=PASSIVE (default: none; the peer's "
        "ggml-RPC child waits passively anyway, see hydra_trio.rpc_backend.supervisor.CHILD_ENV)",
    )
    ap.add_argument(
        "--llama-server",
        action="store_true",
        help="also time llama.cpp alone: llama-server with the experts on a bare ggml-RPC server, and "
        "llama-server by itself (built on first use, about 10 minutes on 2 cores)",
    )
    a = ap.parse_args()
    rows, flips = measure(
        a.tokens, a.runs, tls=not a.no_tls, relay=not a.no_relay, passive=a.passive, llama_server=a.llama_server
    )
    print_table(rows, "bench/combined.py " + " ".join(sys.argv[1:]))
    print(
        f"\nflip to COMBINED with both models resident: median {statistics.median(flips):.2f} ms "
        f"(max {max(flips):.2f} ms over {len(flips)}); {a.tokens} tokens per decode, "
        f"OMP_WAIT_POLICY=PASSIVE on {a.passive}"
    )


if __name__ == "__main__":
    main()
