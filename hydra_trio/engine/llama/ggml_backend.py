"""ggml-RPC through ctypes: the libraries, the local CPU device and peer devices.

hydra-trio does not reimplement ggml or its wire protocol (docs/hydra-protocol.md
§4): a peer is registered with ``ggml_backend_rpc_add_server``, whose device
then goes into ``llama_model_params.devices`` like any local device; the
server this node lends is ``ggml_backend_rpc_start_server``, run in a child
process by :mod:`hydra_trio.rpc_backend.child`.  The libraries are those
llama-cpp-python builds with ``GGML_RPC=ON``.
"""

from __future__ import annotations

import ctypes
import os
import re
from functools import cache
from pathlib import Path

GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1
GGML_BACKEND_DEVICE_TYPE_IGPU = 2
GGML_BACKEND_DEVICE_TYPE_ACCEL = 3  # enum ggml_backend_dev_type (ggml-backend.h)

# llama-cpp-python is built from its sdist in a temporary folder, and ggml's messages
# (GGML_ASSERT / GGML_ABORT: "<__FILE__>:<line>: ...") carry that build path, e.g.
# /tmp/pip-wheel-gut8puip/llama-cpp-python_3f89.../vendor/llama.cpp/ggml/src/ggml.c
_BUILD_PATH = re.compile(r"(?:[A-Za-z]:)?[^\s:'\"]*?[/\\]vendor[/\\]llama\.cpp[/\\]")


def clean_build_paths(text: str) -> str:
    """``text`` with llama-cpp-python's build-time source paths shortened to ``llama.cpp/...``
    (``/tmp/pip-wheel-x/llama-cpp-python_y/vendor/llama.cpp/ggml/src/ggml.c:12`` →
    ``llama.cpp/ggml/src/ggml.c:12``): they name a folder that no longer exists.  A line without ``vendor``
    is returned as it is, without the search (a model's load logs thousands of lines)."""
    return _BUILD_PATH.sub("llama.cpp/", text) if "vendor" in text else text


@cache
def _lib_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama_cpp is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


_BACKEND_NAMES = {
    "cpu": "CPU",
    "rpc": "RPC",
    "cuda": "CUDA",
    "metal": "Metal",
    "vulkan": "Vulkan",
    "hip": "HIP",
    "sycl": "SYCL",
    "opencl": "OpenCL",
    "blas": "BLAS",
    "cann": "CANN",
    "musa": "MUSA",
}


def build_backends() -> list[str]:
    """The ggml backends llama-cpp-python was built with (CPU, RPC, CUDA, ...), from its ``libggml-*.so``
    files: no library is loaded (``hydra-trio --version`` reads it).  Empty when llama_cpp is missing."""
    try:
        files = {p.name.split(".so", 1)[0] for p in _lib_dir().glob("libggml-*.so*")}
    except RuntimeError:
        return []
    names = sorted(f.removeprefix("libggml-") for f in files if f not in ("libggml-base",))
    return [_BACKEND_NAMES.get(n, n) for n in names]


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
    base.ggml_backend_buft_name.argtypes = [vp]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_dev_type.argtypes = [vp]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_backend_reg.argtypes = [vp]
    base.ggml_backend_dev_backend_reg.restype = vp
    base.ggml_backend_reg_name.argtypes = [vp]
    base.ggml_backend_reg_name.restype = ctypes.c_char_p
    base.ggml_backend_reg_dev_count.argtypes = [vp]
    base.ggml_backend_reg_dev_count.restype = sz
    base.ggml_backend_reg_dev_get.argtypes = [vp, sz]
    base.ggml_backend_reg_dev_get.restype = vp
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = vp
    rpc.ggml_backend_rpc_get_device_memory.argtypes = [
        ctypes.c_char_p,
        ctypes.c_uint32,
        ctypes.POINTER(sz),
        ctypes.POINTER(sz),
    ]
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


def local_devices() -> list[tuple[str, int, int]]:
    """``(name, free bytes, total bytes)`` of every ggml device this build registers (llama-server's
    ``--list-devices``; ggml-RPC peers added later are not listed)."""
    _, ggml, _ = libs()
    devs = [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]
    return [(device_name(d), *device_memory(d)) for d in devs if not device_name(d).startswith("RPC")]


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


def all_devices() -> list[int]:
    """Every registered ggml device (``ggml_backend_dev_t`` as ints), ggml-RPC peers added so far included."""
    _, ggml, _ = libs()
    return [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]


def device_type(dev: int) -> int:
    """``ggml_backend_dev_type``: ``GGML_BACKEND_DEVICE_TYPE_CPU``, ``_GPU``, ``_IGPU`` or ``_ACCEL``."""
    base, _, _ = libs()
    return base.ggml_backend_dev_type(dev)


def is_rpc_device(dev: int) -> bool:
    """True for a ggml-RPC peer's device (its backend registry is named ``RPC``)."""
    base, _, _ = libs()
    return base.ggml_backend_reg_name(base.ggml_backend_dev_backend_reg(dev)) == b"RPC"


def buffer_type_name(buft: int) -> str:
    """``ggml_backend_buft_name``: ``CPU``, ``CUDA0``, ``RPC0[host:port]``, ..."""
    base, _, _ = libs()
    return base.ggml_backend_buft_name(buft).decode()


def buffer_types() -> dict[str, int]:
    """``name -> ggml_backend_buffer_type_t`` of every registered device's default buffer type: the names
    llama-server's ``-ot PATTERN=BUFT`` accepts (``parse_tensor_buffer_overrides`` in common/arg.cpp)."""
    base, _, _ = libs()
    out: dict[str, int] = {}
    for dev in all_devices():
        buft = base.ggml_backend_dev_buffer_type(dev)
        if buft:
            out[buffer_type_name(buft)] = buft
    return out


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


@cache
def _gguf() -> ctypes.CDLL:
    """libggml-base with the ``gguf_*`` header reader's signatures."""
    base, _, _ = libs()
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    base.gguf_init_from_file.restype = vp
    base.gguf_free.argtypes = [vp]
    base.gguf_get_n_tensors.argtypes = [vp]
    base.gguf_get_n_tensors.restype = i64
    base.gguf_get_tensor_name.argtypes = [vp, i64]
    base.gguf_get_tensor_name.restype = ctypes.c_char_p
    base.gguf_get_tensor_size.argtypes = [vp, i64]
    base.gguf_get_tensor_size.restype = ctypes.c_size_t
    base.gguf_find_key.argtypes = [vp, ctypes.c_char_p]
    base.gguf_find_key.restype = i64
    base.gguf_get_kv_type.argtypes = [vp, i64]
    base.gguf_get_kv_type.restype = ctypes.c_int
    base.gguf_get_val_str.argtypes = [vp, i64]
    base.gguf_get_val_str.restype = ctypes.c_char_p
    base.gguf_get_val_u32.argtypes = [vp, i64]
    base.gguf_get_val_u32.restype = ctypes.c_uint32
    base.gguf_get_val_i32.argtypes = [vp, i64]
    base.gguf_get_val_i32.restype = ctypes.c_int32
    base.gguf_get_n_kv.argtypes = [vp]
    base.gguf_get_n_kv.restype = i64
    base.gguf_get_key.argtypes = [vp, i64]
    base.gguf_get_key.restype = ctypes.c_char_p
    base.gguf_get_arr_type.argtypes = [vp, i64]
    base.gguf_get_arr_type.restype = ctypes.c_int
    base.gguf_get_arr_n.argtypes = [vp, i64]
    base.gguf_get_arr_n.restype = ctypes.c_size_t
    base.gguf_get_arr_data.argtypes = [vp, i64]
    base.gguf_get_arr_data.restype = vp
    base.gguf_get_val_data.argtypes = [vp, i64]
    base.gguf_get_val_data.restype = vp
    return base


_GGUF_INTS = {0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32}
_GGUF_INTS |= {5: ctypes.c_int32, 10: ctypes.c_uint64, 11: ctypes.c_int64}
"""GGUF value types that are integers (``enum gguf_type`` in ``ggml/include/gguf.h``) -> their ctypes."""


class GgufHeader:
    """A GGUF file's header, read with ggml's own ``gguf_*`` reader (the Python ``gguf`` reader parses
    every metadata array and takes seconds): tensor names and sizes, ``{arch}.block_count``, the architecture's
    integer keys.

    Raises OSError when the file is not a readable GGUF.
    """

    def __init__(self, path: Path) -> None:
        g = _gguf()
        ctx = g.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
        if not ctx:
            raise OSError(f"cannot read the GGUF header of {path}")
        try:
            self.tensors: list[tuple[str, int]] = [
                (g.gguf_get_tensor_name(ctx, i).decode(), g.gguf_get_tensor_size(ctx, i))
                for i in range(g.gguf_get_n_tensors(ctx))
            ]
            """``(name, bytes)`` of every tensor, in file order."""
            self.block_count: int | None = None
            """``{general.architecture}.block_count``: the model's layers (None when absent)."""
            arch_id = g.gguf_find_key(ctx, b"general.architecture")
            if arch_id >= 0 and g.gguf_get_kv_type(ctx, arch_id) == 8:  # GGUF_TYPE_STRING
                key = g.gguf_find_key(ctx, g.gguf_get_val_str(ctx, arch_id) + b".block_count")
                kind = g.gguf_get_kv_type(ctx, key) if key >= 0 else -1
                if kind == 4:  # GGUF_TYPE_UINT32
                    self.block_count = g.gguf_get_val_u32(ctx, key)
                elif kind == 5:  # GGUF_TYPE_INT32
                    self.block_count = g.gguf_get_val_i32(ctx, key)
            self.arch = g.gguf_get_val_str(ctx, arch_id).decode() if self.block_count is not None else ""
            """``general.architecture`` (``""`` when the header has no layer count)."""
            self.numbers: dict[str, int | tuple[int, ...]] = {}
            """The ``{arch}.*`` keys whose value is an integer or an array of integers (``llama.block_count``,
            ``llama.attention.head_count_kv``, ...), by key."""
            for i in range(g.gguf_get_n_kv(ctx) if self.arch else 0):
                name = g.gguf_get_key(ctx, i).decode()
                if not name.startswith(self.arch + "."):
                    continue
                kind = g.gguf_get_kv_type(ctx, i)
                if kind in _GGUF_INTS:
                    self.numbers[name] = int(
                        ctypes.cast(g.gguf_get_val_data(ctx, i), ctypes.POINTER(_GGUF_INTS[kind]))[0]
                    )
                elif kind == 9 and (item := _GGUF_INTS.get(g.gguf_get_arr_type(ctx, i))) is not None:  # an array
                    data = ctypes.cast(g.gguf_get_arr_data(ctx, i), ctypes.POINTER(item))
                    self.numbers[name] = tuple(int(data[j]) for j in range(g.gguf_get_arr_n(ctx, i)))
        finally:
            g.gguf_free(ctx)
