"""Where one STATE_GET / STATE_PUT's time goes, on both sides: timing wrappers in an embedded node.

    .venv/bin/python bench/kv_profile.py [--mb 256] [--runs 3]

Starts a node in a child process that is this script (``--node``): it wraps,
before serving, the functions a KV transfer runs through (llama.cpp's state
copy, the checksum, the engine-thread hop, the worker-thread hop, the send
and receive loops) with timers, and prints one line per request with the
time each took (ms) and the time from the request's arrival.  The parent
fills slot 0 to ``--mb`` MB as ``bench/kv_transfer.py`` does, then runs
``--runs`` STATE_GET + STATE_PUT rounds (after a warm-up round) on one kept
plain connection, timing its own side (the receive and send loops, their
system calls and waits), and prints the node's lines: ``name=ms[/calls]``,
then ``name.start@ms`` / ``name.end@ms`` from the request's start (for a
STATE_PUT, from the end of the previous reply: the bench's erase comes first).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

T: dict[str, float] = collections.defaultdict(float)  # name -> ms in this request
N: dict[str, int] = collections.defaultdict(int)
MARK: dict[str, float] = {}  # name -> ms since the request began
_t0 = [0.0]
_lock = threading.Lock()


def _timed(owner: object, name: str, label: str | None = None, mark: bool = False) -> None:
    fn = getattr(owner, name)
    label = label or name

    def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            e = time.perf_counter()
            with _lock:
                T[label] += (e - t) * 1e3
                N[label] += 1
                if mark:
                    MARK.setdefault(label + ".start", (t - _t0[0]) * 1e3)
                    MARK[label + ".end"] = (e - _t0[0]) * 1e3

    setattr(owner, name, wrapper)


def _atimed(owner: object, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name)
    label = label or name

    async def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return await fn(*a, **k)
        finally:
            e = time.perf_counter()
            T[label] += (e - t) * 1e3
            N[label] += 1
            MARK.setdefault(label + ".start", (t - _t0[0]) * 1e3)
            MARK[label + ".end"] = (e - _t0[0]) * 1e3

    setattr(owner, name, wrapper)


def _report(what: str) -> str:
    parts = [f"{k}={v:.1f}" + (f"/{N[k]}" if N[k] > 1 else "") for k, v in sorted(T.items())]
    marks = [f"{k}@{v:.1f}" for k, v in sorted(MARK.items(), key=lambda kv: kv[1])]
    T.clear(), N.clear(), MARK.clear()
    return f"{what}: " + " ".join(parts) + " | " + " ".join(marks)


def node_main(argv: list[str]) -> int:
    """The node, with timers around the transfer path."""
    import llama_cpp

    import hydra_trio.engine.kv.state as state
    import hydra_trio.hydra.connection as connection
    import hydra_trio.hydra.ops as ops
    import hydra_trio.hydra.session as session
    from hydra_trio.cli import main
    from hydra_trio.engine.engine import Engine

    _timed(llama_cpp, "llama_state_seq_get_data", "llama.get_data", mark=True)
    _timed(llama_cpp, "llama_state_seq_set_data", "llama.set_data", mark=True)
    _timed(state, "blob_checksum", "xxh3.whole", mark=True)
    _timed(state.RunningChecksum, "update", "xxh3.running")
    _timed(state, "save_slot", "save_slot", mark=True)
    _timed(state, "restore_slot", "restore_slot", mark=True)
    _timed(state, "verify_checksum", "verify", mark=True)
    _timed(Engine, "execute", "engine.execute", mark=True)
    _timed(os, "writev", "os.writev")
    _timed(os, "readv", "os.readv")
    import hydra_trio.transport.tls_bulk as tls_bulk

    _atimed(tls_bulk, "send_view", "send_view")  # the plain-TCP send and receive loops, where they are called
    _atimed(tls_bulk, "recv_into_view", "recv_into_view")
    _atimed(ops.OpContext, "send_blob", "send_blob")
    _timed(ops, "payload_buffer", "payload_buffer", mark=True)
    import trio

    _atimed(trio.lowlevel, "wait_readable", "wait_readable")
    _atimed(trio.lowlevel, "wait_writable", "wait_writable")
    handle = connection.ServerConnection.handle

    async def timed_handle(self, req):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return await handle(self, req)
        finally:
            MARK["handle.start"] = (t - _t0[0]) * 1e3
            MARK["reply.end"] = (time.perf_counter() - _t0[0]) * 1e3
            print(_report(f"node op 0x{req.op:02x} {req.payload_len} B"), file=sys.stderr, flush=True)
            _t0[0] = time.perf_counter()

    connection.ServerConnection.handle = timed_handle
    # the request's time origin: the first byte of its header (the receive before the handler)
    serve = session.serve_connection
    _t0[0] = time.perf_counter()

    async def timed_serve(stream, *a, **k):  # type: ignore[no-untyped-def]
        _t0[0] = time.perf_counter()
        return await serve(stream, *a, **k)

    session.serve_connection = timed_serve
    import hydra_trio.hydra.server as hserver

    if hasattr(hserver, "serve_connection"):
        hserver.serve_connection = timed_serve
    return main(argv)


def main() -> None:
    if sys.argv[1:2] == ["--node"]:
        sys.exit(node_main(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-type", default="f32")
    a = ap.parse_args()

    import httpx
    import trio

    import hydra_trio.transport.tls_bulk as cc  # the client's plain-TCP loops are called from here
    from bench.kv_transfer import MB, grown_blob, prefill, put_bytes, slot_size
    from hydra_trio.hydra.client import HydraClient
    from hydra_trio.testing.spawn import free_port, wait_healthy

    per_token = 0.0
    with tempfile.TemporaryDirectory() as d:
        logf = open(Path(d) / "node.log", "w+")
        port = free_port()
        n_ctx = int(a.mb * MB / 23000) + 4096  # bytes per token of smollm2 f32 ~ 23 KB; refined below
        scale = -(-n_ctx // 8192)
        rope = ["--rope-scaling", "linear", "--rope-scale", str(scale)] if scale > 1 else []
        node = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--node",
                "run",
                "--port",
                str(port),
                "--log-level",
                "WARNING",
                "-m",
                a.model,
                "-np",
                "1",
                "-c",
                str(n_ctx),
                *rope,
                "-ctk",
                a.kv_type,
                "-ctv",
                a.kv_type,
            ],
            cwd=ROOT,
            stderr=logf,
        )
        try:
            wait_healthy(port, node, timeout=300)
            base = f"http://127.0.0.1:{port}"
            words = httpx.post(base + "/tokenize", json={"content": __doc__ * 4}).json()["tokens"]
            prompt = words * (n_ctx // len(words) + 1)
            prefill(base, prompt[:128])
            n1, s1 = slot_size(port)
            prefill(base, prompt[:256])
            n2, s2 = slot_size(port)
            per_token = (s2 - s1) / (n2 - n1)

            async def seed_get() -> bytes:
                async with HydraClient("127.0.0.1", port, timeout=600) as c:
                    return (await c.state_get_bytes(0))[1]

            seed = trio.run(seed_get)
            n_tokens = round((a.mb * MB - (s1 - per_token * n1)) / per_token)
            grown = grown_blob(seed, n_tokens, prompt)
            trio.run(put_bytes, port, grown)
            size = len(grown)
            del grown
            print(f"slot 0: {n_tokens} tokens, blob {size / MB:.1f} MB", flush=True)
            buf = bytearray(size + (1 << 20))

            recv = cc.recv_into_view
            send = cc.send_view
            ct: dict[str, float] = collections.defaultdict(float)

            async def timed_recv(*x, **k):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return await recv(*x, **k)
                finally:
                    ct["client.recv_into_view"] += (time.perf_counter() - t) * 1e3

            async def timed_send(*x, **k):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return await send(*x, **k)
                finally:
                    ct["client.send_view"] += (time.perf_counter() - t) * 1e3

            cc.recv_into_view, cc.send_view = timed_recv, timed_send
            for mod, name in ((os, "writev"), (os, "readv")):

                def wrap(fn, label):  # type: ignore[no-untyped-def]
                    def w(*x, **k):  # type: ignore[no-untyped-def]
                        t = time.perf_counter()
                        try:
                            return fn(*x, **k)
                        finally:
                            ct["client." + label] += (time.perf_counter() - t) * 1e3
                            ct["client.n_" + label] += 1

                    return w

                setattr(mod, name, wrap(getattr(mod, name), name))
            for name in ("wait_readable", "wait_writable"):

                def awrap(fn, label):  # type: ignore[no-untyped-def]
                    async def w(*x, **k):  # type: ignore[no-untyped-def]
                        t = time.perf_counter()
                        try:
                            return await fn(*x, **k)
                        finally:
                            ct["client." + label] += (time.perf_counter() - t) * 1e3
                            ct["client.n_" + label] += 1

                    return w

                setattr(trio.lowlevel, name, awrap(getattr(trio.lowlevel, name), name))

            async def rounds() -> None:
                async with HydraClient("127.0.0.1", port, timeout=600) as c:
                    for r in range(a.runs + 1):
                        t = time.perf_counter()
                        _meta, view = await c.state_get_into(0, buf)
                        dt = (time.perf_counter() - t) * 1e3
                        print(
                            f"round {r} client GET {len(view) / MB:.1f} MB: {dt:.1f} ms "
                            f"({len(view) / MB / dt * 1e3:.0f} MB/s) "
                            + " ".join(f"{k}={v:.1f}" for k, v in ct.items()),
                            flush=True,
                        )
                        ct.clear()
                        blob = memoryview(buf)[: len(view)]
                        del view
                        await trio.to_thread.run_sync(
                            lambda: httpx.post(f"{base}/slots/0?action=erase").raise_for_status()
                        )
                        t = time.perf_counter()
                        await c.state_put(0, blob)
                        dt = (time.perf_counter() - t) * 1e3
                        print(
                            f"round {r} client PUT: {dt:.1f} ms ({len(blob) / MB / dt * 1e3:.0f} MB/s) "
                            + " ".join(f"{k}={v:.1f}" for k, v in ct.items()),
                            flush=True,
                        )
                        ct.clear()
                        del blob

            trio.run(rounds)
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(60)
            logf.seek(0)
            for line in logf.read().splitlines():
                if line.startswith("node op 0x30") or line.startswith("node op 0x31"):
                    print(line)


if __name__ == "__main__":
    main()
