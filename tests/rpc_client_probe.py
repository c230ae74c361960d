"""A stock llama.cpp client, in its own process: greedy text from a GGUF with its layers on a ggml-RPC device.

    python tests/rpc_client_probe.py HOST:PORT|local MODEL.gguf PROMPT N

Uses only llama-cpp-python: its low-level C API, and ggml's own device and ggml-RPC functions from the
libraries it ships (no hydra-trio code is imported; the JSON line says which hydra_trio modules were
loaded, and the test checks there are none), so the test checks that a plain llama.cpp client can use a
hydra-trio node as its RPC backend.  Prints one JSON line: {"text", "devices", "load_s", "hydra_trio_modules"}.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import llama_cpp

GGML_BACKEND_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type (ggml-backend.h)


def _ggml() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    """``(libggml-base, libggml, libggml-rpc)`` as llama-cpp-python ships them: the soname files libllama
    already loaded (loading the other copy would give ggml's registry twice in the process)."""
    lib = Path(llama_cpp.__file__).parent / "lib"

    def load(name: str) -> ctypes.CDLL:
        path = next(p for p in (lib / f"{name}.so.0", lib / f"{name}.so") if p.exists())
        return ctypes.CDLL(str(path), mode=getattr(os, "RTLD_GLOBAL", 0))

    base, ggml, rpc = load("libggml-base"), load("libggml"), load("libggml-rpc")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], vp
    base.ggml_backend_dev_name.argtypes, base.ggml_backend_dev_name.restype = [vp], ctypes.c_char_p
    base.ggml_backend_reg_dev_count.argtypes, base.ggml_backend_reg_dev_count.restype = [vp], sz
    base.ggml_backend_reg_dev_get.argtypes, base.ggml_backend_reg_dev_get.restype = [vp, sz], vp
    rpc.ggml_backend_rpc_add_server.argtypes, rpc.ggml_backend_rpc_add_server.restype = [ctypes.c_char_p], vp
    return base, ggml, rpc


def main() -> None:
    where, model_path, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    llama_cpp.llama_backend_init()
    base, ggml, rpc = _ggml()
    if where == "local":
        dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    else:
        reg = rpc.ggml_backend_rpc_add_server(where.encode())
        assert reg and base.ggml_backend_reg_dev_count(reg) >= 1, f"ggml-RPC: cannot register {where}"
        dev = base.ggml_backend_reg_dev_get(reg, 0)
    assert dev, "no device"
    devices = (ctypes.c_void_p * 2)(dev, None)
    mp = llama_cpp.llama_model_default_params()
    mp.devices = ctypes.cast(devices, ctypes.c_void_p)
    mp.n_gpu_layers = 999
    t0 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    load_s = time.perf_counter() - t0
    assert model, "load failed"
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 512, 512, 2, 2
    ctx = llama_cpp.llama_init_from_model(model, cp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    buf = (llama_cpp.llama_token * 256)()
    n_tok = llama_cpp.llama_tokenize(vocab, prompt.encode(), len(prompt.encode()), buf, 256, True, True)
    tokens = list(buf[:n_tok])
    smpl = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(smpl, llama_cpp.llama_sampler_init_greedy())
    out = b""
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)  # the batch points into it: keep it alive
    batch = llama_cpp.llama_batch_get_one(arr, len(tokens))
    for _ in range(n):
        rc = llama_cpp.llama_decode(ctx, batch)
        assert rc == 0, f"llama_decode returned {rc}"
        tok = llama_cpp.llama_sampler_sample(smpl, ctx, -1)
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            break
        piece = ctypes.create_string_buffer(64)
        k = llama_cpp.llama_token_to_piece(vocab, tok, piece, 64, 0, False)
        out += piece.raw[:k]
        arr = (llama_cpp.llama_token * 1)(tok)
        batch = llama_cpp.llama_batch_get_one(arr, 1)
    print(
        json.dumps(
            {
                "text": out.decode("utf-8", "replace"),
                "devices": [base.ggml_backend_dev_name(dev).decode()],
                "load_s": load_s,
                "hydra_trio_modules": sorted(m for m in sys.modules if m.startswith("hydra_trio")),
            }
        )
    )


if __name__ == "__main__":
    main()
