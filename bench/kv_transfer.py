"""KV state transfer against a raw loopback socket, same run: STATE_GET / STATE_PUT MB/s, plain and TLS.

    .venv/bin/python bench/kv_transfer.py [--max-mb 256] [--runs 3] [--model smollm2-135m] [--kv-type f32] [--prefill]
    .venv/bin/python bench/kv_transfer.py --max-mb 1024          # up to 1 GB

Starts one node (``-np 1``, a context long enough for the biggest blob,
KV cache type ``--kv-type``: f32 doubles the bytes per token; TLS on its
port with a ``trustme`` certificate) and fills slot 0 to blobs of 1, 4, 16,
64, 256, 1024 MB up to ``--max-mb``.  How: a real prefill of 256 tokens,
its blob taken with STATE_GET, its cells repeated to the size's token count
(positions 0..n-1, the KV rows of the real cells over again) and put back
with STATE_PUT: the node checks and llama.cpp restores it as any blob, in
seconds where a prefill of 22k tokens takes most of an hour on 2 cores.
``--prefill`` evaluates a real prompt of token ids instead (each size
extends the previous prompt, so only the new tokens are evaluated).  For
each size and each transport (plain TCP, TLS), ``--runs`` rounds, after
one warm-up round, each round in this order:

* raw GET: a peer process sends the same number of bytes from a buffer over a
  kept loopback socket, the bench receives them with ``recv_into`` into its
  buffer (the same socket kind: plain, or TLS with the ssl module; ``TCP_NODELAY``
  on both ends, as on trio's sockets: without it a TLS round trip of a few MB
  sometimes waited 40 ms on Nagle and delayed ACKs, and the reference swung 10x);
* Hydra STATE_GET of slot 0 through `HydraClient` over a kept connection,
  the payload received into the same kind of buffer (``state_get_into``);
* raw PUT: the bench sends the bytes, the peer receives them into its buffer
  and answers one byte;
* Hydra STATE_PUT of the blob just read into slot 0 (emptied first with
  ``POST /slots/0?action=erase``, so the restore needs no backup of the old
  state), timed until the reply.

Prints a progress line per case, then a table of medians: MB/s, × the raw
socket of the same transport, and for TLS also × the raw plain socket; the
node's peak RSS during the Hydra transfer above its RSS before it
(``VmHWM`` after resetting it through ``/proc/PID/clear_refs``), as a
multiple of the blob size: for the first transfer of a size, which makes
the transfer pool's buffer (plain STATE_PUT: the one that fills the slot;
with ``--prefill``: the warm-up round), and the median of the later ones
(the pool's buffer is in RSS before them).  On a machine shared with other
work, run it at a higher priority (``nice -n -10``, as root) for a quieter run.
"""

from __future__ import annotations

import argparse
import signal
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.combined import certificates  # noqa: E402
from hydra_trio.hydra.client import HydraClient  # noqa: E402
from hydra_trio.testing.spawn import spawn, wait_healthy  # noqa: E402
from hydra_trio.transport.tls import client_context  # noqa: E402

MB = 1_000_000

# The raw peer: one kept connection (plain or TLS); "G" + u64 n: send n bytes; "P" + u64 n: receive n, answer b"k".
PEER = textwrap.dedent(r"""
    import socket, ssl, struct, sys
    size, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    buf = memoryview(bytearray(size))  # touched once here: the pages are in before any timing
    ls = socket.create_server(("127.0.0.1", 0))
    print(ls.getsockname()[1], flush=True)
    ctx = None
    if cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
    while True:
        conn, _ = ls.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as trio's sockets (the node's, the client's)
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
        while True:
            head = b""
            while len(head) < 9:
                more = conn.recv(9 - len(head))
                if not more:
                    break
                head += more
            if len(head) < 9:
                break
            op, n = head[:1], struct.unpack("<Q", head[1:])[0]
            if op == b"G":
                conn.sendall(buf[:n])
            else:
                got = 0
                while got < n:
                    got += conn.recv_into(buf[got:n], n - got)
                conn.sendall(b"k")
        conn.close()
""")


class RawPeer:
    """The raw loopback peer process and one kept connection to it (plain or TLS)."""

    def __init__(self, size: int, tls: tuple[str, str, ssl.SSLContext] | None) -> None:
        cert, key = (tls[0], tls[1]) if tls else ("", "")
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(size), cert, key], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle stall behind the 9-byte command
        self.sock = tls[2].wrap_socket(sock, server_hostname="127.0.0.1") if tls else sock

    def get(self, into: memoryview, n: int) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(b"G" + struct.pack("<Q", n))
        got = 0
        while got < n:
            got += self.sock.recv_into(into[got:n], n - got)
        return time.perf_counter() - t0

    def put(self, data: memoryview) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(b"P" + struct.pack("<Q", len(data)))
        self.sock.sendall(data)
        assert self.sock.recv(1) == b"k"
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """The node's peak RSS during a block above its RSS before it, in bytes (VmHWM reset by clear_refs)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.extra = 0

    def __enter__(self) -> PeakRss:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        self.before = _status_kb(self.pid, "VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        self.extra = max(0, _status_kb(self.pid, "VmHWM") * 1024 - self.before)


async def hydra_get(c: HydraClient, into: bytearray) -> tuple[float, int]:
    """Seconds for one STATE_GET of slot 0 into ``into``; the blob's size."""
    t0 = time.perf_counter()
    getter = getattr(c, "state_get_into", None)
    if getter is not None:
        _meta, view = await getter(0, into)
        n = len(view)
    else:  # a client without state_get_into: the chunks copied into the buffer
        n = 0
        async with c.state_get(0) as rs:
            async for chunk in rs:
                into[n : n + len(chunk)] = chunk
                n += len(chunk)
    return time.perf_counter() - t0, n


async def hydra_put(c: HydraClient, blob: memoryview) -> float:
    t0 = time.perf_counter()
    meta = await c.state_put(0, blob)
    assert meta["restored"], meta
    return time.perf_counter() - t0


def prefill(base: str, tokens: list[int]) -> None:
    """Slot 0 holds exactly ``tokens`` afterwards (a prefill-only completion; the cached prefix is kept)."""
    r = httpx.post(
        base + "/completion", json={"prompt": tokens, "n_predict": 0, "id_slot": 0, "cache_prompt": True}, timeout=3600
    )
    r.raise_for_status()


def grown_blob(blob: bytes, n: int, tokens: list[int]) -> bytes:
    """A one-stream blob of ``n`` cells made from a real one: positions 0..n-1, the real cells' KV rows
    repeated, ``tokens[:n]`` as its token list (hydra_trio.engine.kv.state's layout, llama.cpp's
    llama_kv_cache::state_write_meta / state_write_data), checksum resealed."""
    from hydra_trio.engine.kv.state import KV_ONE_STREAM, blob_checksum, parse_header

    h = parse_header(blob)
    assert h.kv_format == KV_ONE_STREAM, "a one-stream blob"
    kv = memoryview(blob)[h.tokens_at + 4 * h.n_tokens :]
    (cells,) = struct.unpack_from("<I", kv, 0)
    _pos, n_seq, seq = struct.unpack_from("<iIi", kv, 4)
    assert cells and n_seq == 1 and len(kv) > 4 + 12 * cells, "cells of one sequence, without cell extensions"
    off = 4 + 12 * cells

    def tile(data: memoryview, unit: int) -> bytes:
        return (bytes(data) * -(-n // cells))[: n * unit]

    parts = [struct.pack("<I", n), b"".join(struct.pack("<iIi", i, 1, seq) for i in range(n))]
    v_trans, n_layer = struct.unpack_from("<II", kv, off)
    parts.append(bytes(kv[off : off + 8]))
    off += 8
    for _ in range(n_layer if v_trans else 2 * n_layer):  # K rows of each layer (then V rows unless transposed)
        _type, row = struct.unpack_from("<iQ", kv, off)
        parts += [bytes(kv[off : off + 12]), tile(kv[off + 12 : off + 12 + cells * row], row)]
        off += 12 + cells * row
    if v_trans:  # V transposed: per layer, each embedding element's values over the cells
        for _ in range(n_layer):
            _type, el, n_embd = struct.unpack_from("<iII", kv, off)
            parts.append(bytes(kv[off : off + 12]))
            off += 12
            for _ in range(n_embd):
                parts.append(tile(kv[off : off + cells * el], el))
                off += cells * el
    assert off == len(kv), "the whole KV state was read"
    body = b"".join(parts)
    out = bytearray(blob[: h.tokens_at]) + struct.pack(f"<{n}I", *tokens[:n]) + body
    struct.pack_into("<I", out, 8, n)
    struct.pack_into("<Q", out, 44, len(body))
    struct.pack_into("<Q", out, 52, blob_checksum(out))
    return bytes(out)


def slot_size(port: int) -> tuple[int, int]:
    async def go() -> tuple[int, int]:
        async with HydraClient("127.0.0.1", port) as c:
            m = await c.state_meta(0)
            return m["n_past"], m["state_size"]

    return trio.run(go)


async def _get_bytes(port: int) -> bytes:
    async with HydraClient("127.0.0.1", port, timeout=600) as c:
        return (await c.state_get_bytes(0))[1]


async def put_bytes(port: int, blob: bytes) -> None:
    """STATE_PUT ``blob`` (a whole KV state blob, bytes) into slot 0 of the node on ``port`` (127.0.0.1)."""
    async with HydraClient("127.0.0.1", port, timeout=600) as c:
        await c.state_put(0, blob)


def sizes_mb(max_mb: int) -> list[int]:
    out, s = [], 1
    while s <= max_mb:
        out.append(s)
        s *= 4
    if out[-1] != max_mb:
        out.append(max_mb)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-mb", type=int, default=256, help="the biggest blob, MB (default 256; 1024 for 1 GB)")
    ap.add_argument("--runs", type=int, default=3, help="rounds per size and transport (after one warm-up)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-type", default="f32", help="-ctk / -ctv of the node (default f32)")
    ap.add_argument("--no-tls", action="store_true", help="plain TCP only")
    ap.add_argument(
        "--n-ctx-train",
        type=int,
        default=8192,
        help="the model's training context (SmolLM2: 8192): a longer -c gets linear RoPE scaling",
    )
    ap.add_argument("--prefill", action="store_true", help="fill the slot with a real prompt (slow for big sizes)")
    a = ap.parse_args()
    sizes = sizes_mb(a.max_mb)
    with tempfile.TemporaryDirectory() as d:
        tls_flags, ca_pem = certificates(d)
        cert, key = tls_flags[1], tls_flags[3]  # ["--tls-cert", CERT, "--tls-key", KEY]
        cctx = client_context(ca_pem)

        # bytes per token of this model and KV type, from a small node
        probe, pport = spawn(
            "--log-level", "WARNING", "-m", a.model, "-np", "1", "-c", "1024", "-ctk", a.kv_type, "-ctv", a.kv_type
        )
        try:
            wait_healthy(pport, probe, timeout=300)
            words = httpx.post(f"http://127.0.0.1:{pport}/tokenize", json={"content": __doc__}).json()["tokens"]
            prefill(f"http://127.0.0.1:{pport}", words[:64])
            n1, s1 = slot_size(pport)
            prefill(f"http://127.0.0.1:{pport}", words[:128])
            n2, s2 = slot_size(pport)
        finally:
            probe.send_signal(signal.SIGTERM)
            probe.wait(60)
        per_token = (s2 - s1) / (n2 - n1)
        n_ctx = int(sizes[-1] * MB / per_token) + 256
        print(f"{a.model}, KV {a.kv_type}: {per_token:.0f} bytes per token; -c {n_ctx} for {sizes[-1]} MB", flush=True)

        # a slot holds at most the training context; RoPE scaling lets it hold more (the KV bytes are what count)
        scale = -(-n_ctx // a.n_ctx_train)
        rope = ["--rope-scaling", "linear", "--rope-scale", str(scale)] if scale > 1 else []
        node, port = spawn(
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
            *tls_flags,
        )
        peers: dict[str, RawPeer] = {}
        results: dict[tuple[int, str, str], dict[str, Any]] = {}
        try:
            wait_healthy(port, node, timeout=300)
            base = f"http://127.0.0.1:{port}"
            cap = int(sizes[-1] * MB * 1.05) + (1 << 20)
            peers["plain"] = RawPeer(cap, None)
            if not a.no_tls:
                peers["tls"] = RawPeer(cap, (cert, key, cctx))
            # the bench's receive buffers (Hydra's, the raw socket's), touched once as the raw peer's
            views = (memoryview(bytearray(cap)), memoryview(bytearray(cap)))
            prompt = words * (n_ctx // len(words) + 1)
            seed = b""
            if not a.prefill:
                prefill(base, prompt[:256])
                seed = trio.run(_get_bytes, port)
            for size in sizes:
                n_tokens = max(8, round((size * MB - (s1 - per_token * n1)) / per_token))
                t0 = time.perf_counter()
                fill_rss = None
                if a.prefill:
                    prefill(base, prompt[:n_tokens])
                else:
                    grown = grown_blob(seed, n_tokens, prompt)
                    with PeakRss(node.pid) as fill:  # the first STATE_PUT of this size: it makes the pool's buffer
                        trio.run(put_bytes, port, grown)
                    fill_rss = fill.extra / len(grown)
                    del grown
                how = "prefill" if a.prefill else "blob built and put"
                print(f"slot 0 holds {n_tokens} tokens ({time.perf_counter() - t0:.1f} s: {how})", flush=True)
                for transport, peer in peers.items():
                    res = _measure(port, node.pid, transport, cctx, peer, views, a.runs, base)
                    results[size, transport, "GET"], results[size, transport, "PUT"] = res
                    if fill_rss is not None and transport == "plain":
                        results[size, transport, "PUT"]["rss_first"] = fill_rss
                    for d_ in ("GET", "PUT"):
                        r = results[size, transport, d_]
                        print(
                            f"  {r['mb']:8.1f} MB {transport:5} STATE_{d_}: {r['hydra']:7.1f} MB/s | raw "
                            f"{r['raw']:7.1f} MB/s | x raw {r['hydra'] / r['raw']:.2f} | peak RSS "
                            f"+{r['rss_first']:.2f}x blob first, +{r['rss']:.2f}x later",
                            flush=True,
                        )
        finally:
            for p in peers.values():
                p.close()
            node.send_signal(signal.SIGTERM)
            node.wait(60)
    _table(results, peers)


def _measure(
    port: int,
    pid: int,
    transport: str,
    cctx: ssl.SSLContext,
    peer: RawPeer,
    views: tuple[memoryview, memoryview],
    runs: int,
    base: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Medians over ``runs`` rounds (after a warm-up) of raw and Hydra GET and PUT: MB/s and peak RSS."""
    raw_get: list[float] = []
    raw_put: list[float] = []
    h_get: list[float] = []
    h_put: list[float] = []
    rss_get: list[float] = []
    rss_put: list[float] = []
    first: dict[str, float] = {}
    n = 0

    async def rounds() -> None:
        nonlocal n
        async with HydraClient("127.0.0.1", port, timeout=600, ssl_context=cctx if transport == "tls" else None) as c:
            for r in range(runs + 1):
                with PeakRss(pid) as rg:
                    dt_get, n = await hydra_get(c, views[0].obj)  # type: ignore[arg-type]
                rg_raw = peer.get(views[1], n)
                blob = views[0][:n]
                await trio.to_thread.run_sync(lambda: httpx.post(f"{base}/slots/0?action=erase").raise_for_status())
                with PeakRss(pid) as rp:
                    dt_put = await hydra_put(c, blob)
                rp_raw = peer.put(blob)
                if not r:  # round 0 warms up; its RSS is the first transfer's (the pool's buffer made)
                    first.update(GET=rg.extra / n, PUT=rp.extra / n)
                else:
                    h_get.append(dt_get)
                    raw_get.append(rg_raw)
                    h_put.append(dt_put)
                    raw_put.append(rp_raw)
                    rss_get.append(rg.extra / n)
                    rss_put.append(rp.extra / n)

    trio.run(rounds)
    mb = n / MB

    def row(h: list[float], raw: list[float], rss: list[float], op: str) -> dict[str, Any]:
        return {
            "mb": mb,
            "hydra": mb / statistics.median(h),
            "raw": mb / statistics.median(raw),
            "rss": statistics.median(rss),
            "rss_first": first[op],
        }

    return row(h_get, raw_get, rss_get, "GET"), row(h_put, raw_put, rss_put, "PUT")


def _table(results: dict[tuple[int, str, str], dict[str, Any]], peers: dict[str, RawPeer]) -> None:
    print()
    print(
        "| blob MB | transport | op | Hydra MB/s | raw socket MB/s | × raw (same transport) | × raw plain "
        "| peak RSS above before, × blob: first / later |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (size, transport, op), r in results.items():
        plain = results[size, "plain", op]["raw"]
        print(
            f"| {r['mb']:.1f} | {transport} | STATE_{op} | {r['hydra']:.0f} | {r['raw']:.0f} | "
            f"{r['hydra'] / r['raw']:.2f} | {r['hydra'] / plain:.2f} | {r['rss_first']:.2f} / {r['rss']:.2f} |"
        )


if __name__ == "__main__":
    main()
