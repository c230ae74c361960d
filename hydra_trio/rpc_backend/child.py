"""The ggml-RPC server child: llama.cpp's own ggml-RPC server, in a process of its own.

Run it as ``python -m hydra_trio.rpc_backend.child --endpoint 127.0.0.1:PORT
[--cache-dir DIR] [--threads N] [--device cpu] [--parent-pid PID]``; it
serves until killed (or until its parent dies).  hydra-trio does not
reimplement the server (docs/hydra-protocol.md §4): it is
``ggml_backend_rpc_start_server`` from the ``libggml-rpc`` that
llama-cpp-python builds with ``GGML_RPC=ON``, reached through the ctypes layer
of :mod:`hydra_trio.engine.llama.ggml_backend`.

Its output is two streams the parent re-logs
(:class:`~hydra_trio.rpc_backend.supervisor.ChildSupervisor`): stdout carries
chatter (its start line, llama.cpp's banner and per-connection lines, ggml's
DEBUG/INFO log), stderr problems (ggml's WARN/ERROR log, aborts, tracebacks).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time
from pathlib import Path

from ..engine.llama.ggml_backend import cpu_device, libs


def serve_forever(endpoint: str, cache_dir: str | None, n_threads: int, devices: list[str]) -> None:
    """Run ``ggml_backend_rpc_start_server`` on ``endpoint`` (``host:port``); blocks forever.

    ``devices``: names, ``cpu`` for the CPU device.  ``cache_dir``: where the
    server caches tensors by hash (SET_TENSOR_HASH), None for no cache.

    Raises:
        SystemExit: a device name this ggml does not know.
    """
    _, _, rpc = libs()
    devs = [cpu_device() if name == "cpu" else _device_by_name(name) for name in devices]
    arr = (ctypes.c_void_p * len(devs))(*devs)
    rpc.ggml_backend_rpc_start_server(
        endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads, len(devs), arr
    )


def _device_by_name(name: str) -> int:
    base, ggml, _ = libs()
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if base.ggml_backend_dev_name(dev).decode().lower() == name.lower():
            return dev
    raise SystemExit(f"no local ggml device named {name!r}")


def _die_with_parent(parent_pid: int | None) -> None:
    """Exit when the parent node dies (an aborted or OOM-killed node leaves no orphan).

    A watcher thread polls ``getppid()`` every second.  (``PR_SET_PDEATHSIG``
    would fire when the parent *thread* that spawned us exits, and trio spawns
    children from worker threads that retire after a few idle seconds.)
    """
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """The child's command line (see the module's docstring)."""
    ap = argparse.ArgumentParser(prog="python -m hydra_trio.rpc_backend.child", description="ggml-RPC server child")
    ap.add_argument("--endpoint", required=True, help="host:port to listen on (loopback)")
    ap.add_argument("--cache-dir", default=None, help="tensor cache directory (SET_TENSOR_HASH)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", action="append", default=None, help="device to expose (repeatable; default: cpu)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process dies")
    a = ap.parse_args(argv)
    _die_with_parent(a.parent_pid)
    if a.cache_dir:
        Path(a.cache_dir).mkdir(parents=True, exist_ok=True)
    _split_log_streams()
    print(f"ggml-RPC server on {a.endpoint}", flush=True)
    serve_forever(a.endpoint, a.cache_dir, a.threads, a.device or ["cpu"])


_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _split_log_streams() -> None:
    """Child only: ggml's DEBUG/INFO/CONT log goes to stdout, WARN/ERROR to stderr (ggml's own
    logger writes everything to stderr), and C's stdout is line-buffered so llama.cpp's banner
    reaches the parent at once instead of at its first ``fflush``."""
    base, _, _ = libs()

    @_LogCallback
    def write(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if text:
            # enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
            os.write(2 if level in (3, 4) else 1, text)

    _split_log_streams.cb = write  # type: ignore[attr-defined]  # must outlive its registration
    base.ggml_log_set.argtypes = [_LogCallback, ctypes.c_void_p]
    base.ggml_log_set.restype = None
    base.ggml_log_set(write, None)
    try:
        libc = ctypes.CDLL(None)
        c_stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.setvbuf(c_stdout, None, 1, 0)  # _IOLBF
    except (OSError, ValueError, AttributeError):  # not glibc: the banner arrives at the first fflush
        pass


if __name__ == "__main__":
    main()
