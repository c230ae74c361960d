"""ggml-RPC through ctypes: the real ggml-RPC server (in a child process) and peer devices.

hydra-trio does not reimplement ggml or its wire protocol (hydra-protocol.md
§4): the server is ``ggml_backend_rpc_start_server`` from the
``libggml-rpc`` that llama-cpp-python builds with ``GGML_RPC=ON``; a peer is
registered with ``ggml_backend_rpc_add_server``, whose device then goes into
``llama_model_params.devices`` like any local device.

Run the server child with ``python -m hydra_trio.engine.ggml_rpc --endpoint
127.0.0.1:PORT [--cache-dir DIR] [--threads N] [--device cpu]``; it serves
until killed.  Its output is two streams the parent re-logs
(:class:`hydra_trio.ggml_rpc.backend.RpcBackend`): stdout carries chatter
(its start line, llama.cpp's banner and per-connection lines, ggml's
DEBUG/INFO log), stderr problems (ggml's WARN/ERROR log, aborts, tracebacks).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
import threading
import time
from functools import cache
from pathlib import Path

GGML_BACKEND_DEVICE_TYPE_CPU = 0

# llama-cpp-python is built from its sdist in a temporary folder, and ggml's messages
# (GGML_ASSERT / GGML_ABORT: "<__FILE__>:<line>: ...") carry that build path, e.g.
# /tmp/pip-wheel-gut8puip/llama-cpp-python_3f89.../vendor/llama.cpp/ggml/src/ggml.c
_BUILD_PATH = re.compile(r"(?:[A-Za-z]:)?[^\s:'\"]*?[/\\]vendor[/\\]llama\.cpp[/\\]")


def clean_build_paths(text: str) -> str:
    """``text`` with llama-cpp-python's build-time source paths shortened to ``llama.cpp/...``
    (``/tmp/pip-wheel-x/llama-cpp-python_y/vendor/llama.cpp/ggml/src/ggml.c:12`` →
    ``llama.cpp/ggml/src/ggml.c:12``): they name a folder that no longer exists."""
    return _BUILD_PATH.sub("llama.cpp/", text)


@cache
def _lib_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama_cpp is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


@cache
def libs() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    """``(libggml-base, libggml, libggml-rpc)`` with the signatures used here.

    Raises:
        RuntimeError: llama-cpp-python was built without ``GGML_RPC=ON``.
    """
    d = _lib_dir()

    def load(name: str) -> ctypes.CDLL:
        # the wheel ships libX.so and libX.so.0 as two separate files: load the
        # soname one, which libllama already uses, or ggml's globals (backend
        # registry, abort callback) would exist twice in the process
        for candidate in (d / f"{name}.so.0", d / f"{name}.so"):
            if candidate.exists():
                return ctypes.CDLL(str(candidate), mode=getattr(os, "RTLD_GLOBAL", 0))
        raise RuntimeError(f"{d / name}.so is missing: llama-cpp-python was built without -DGGML_RPC=ON (see dev.sh)")

    base = load("libggml-base")
    ggml = load("libggml")
    rpc = load("libggml-rpc")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    ggml.ggml_backend_dev_count.restype = sz
    ggml.ggml_backend_dev_get.argtypes = [sz]
    ggml.ggml_backend_dev_get.restype = vp
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = vp
    ggml.ggml_backend_load_all.restype = None
    base.ggml_backend_dev_name.argtypes = [vp]
    base.ggml_backend_dev_name.restype = ctypes.c_char_p
    base.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_buffer_type.argtypes = [vp]
    base.ggml_backend_dev_buffer_type.restype = vp
    base.ggml_backend_reg_dev_count.argtypes = [vp]
    base.ggml_backend_reg_dev_count.restype = sz
    base.ggml_backend_reg_dev_get.argtypes = [vp, sz]
    base.ggml_backend_reg_dev_get.restype = vp
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = vp
    rpc.ggml_backend_rpc_get_device_memory.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.POINTER(sz), ctypes.POINTER(sz)]
    rpc.ggml_backend_rpc_get_device_memory.restype = None
    return base, ggml, rpc


@cache
def type_traits(n_types: int) -> dict[int, tuple[int, int]]:
    """``type id -> (ggml_blck_size, ggml_type_size)`` of this ggml for ids ``0..n_types-1`` (bytes;
    blck_size 0: a removed type).  ``n_types`` must not exceed ``GGML_TYPE_COUNT``: ggml indexes a
    table with it."""
    base, _, _ = libs()
    base.ggml_blck_size.argtypes = [ctypes.c_int]
    base.ggml_blck_size.restype = ctypes.c_int64
    base.ggml_type_size.argtypes = [ctypes.c_int]
    base.ggml_type_size.restype = ctypes.c_size_t
    return {t: (base.ggml_blck_size(t), base.ggml_type_size(t)) for t in range(n_types)}


def cpu_device() -> int:
    """The local CPU device (``ggml_backend_dev_t`` as an int)."""
    _, ggml, _ = libs()
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise RuntimeError("no CPU backend device")
    return dev


def device_name(dev: int) -> str:
    base, _, _ = libs()
    return base.ggml_backend_dev_name(dev).decode()


def device_memory(dev: int) -> tuple[int, int]:
    """``(free, total)`` bytes of a device (for an RPC device: asks the peer)."""
    base, _, _ = libs()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def add_peer(endpoint: str) -> list[int]:
    """Register a ggml-RPC peer (``host:port``); returns its devices.

    ggml connects lazily: an unreachable peer shows up when its device is
    used (memory query, model load), not here.
    """
    base, _, rpc = libs()
    reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
    if not reg:
        raise RuntimeError(f"ggml-RPC: could not register peer {endpoint}")
    return [base.ggml_backend_reg_dev_get(reg, i) for i in range(base.ggml_backend_reg_dev_count(reg))]


def serve_forever(endpoint: str, cache_dir: str | None, n_threads: int, devices: list[str]) -> None:
    """Run ``ggml_backend_rpc_start_server`` (blocks forever). ``devices``: names, ``cpu`` for the CPU."""
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

    A watcher thread polls ``getppid()``.  (``PR_SET_PDEATHSIG`` would fire
    when the parent *thread* that spawned us exits, and trio spawns children
    from worker threads that retire after a few idle seconds.)
    """
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hydra_trio.engine.ggml_rpc", description="ggml-RPC server child")
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
