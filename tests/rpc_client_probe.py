"""A stock llama.cpp client, in its own process: greedy text from SmolLM2 with its layers on a ggml-RPC device.

    python tests/rpc_client_probe.py HOST:PORT|local PROMPT N

Uses only llama-cpp-python's low-level C API (no hydra-trio engine code), so
the test checks that a plain llama.cpp client can use a hydra-trio node as
its RPC backend.  Prints one JSON line: {"text", "devices"}.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp

from hydra_trio.engine import ggml_rpc
from hydra_trio.models.presets import resolve_model


def main() -> None:
    where, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llama_cpp.llama_backend_init()
    dev = ggml_rpc.cpu_device() if where == "local" else ggml_rpc.add_peer(where)[0]
    devices = (ctypes.c_void_p * 2)(dev, None)
    mp = llama_cpp.llama_model_default_params()
    mp.devices = ctypes.cast(devices, ctypes.c_void_p)
    mp.n_gpu_layers = 999
    path, _ = resolve_model("smollm2-135m")
    t0 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
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
    print(json.dumps({"text": out.decode("utf-8", "replace"), "devices": [ggml_rpc.device_name(dev)], "load_s": load_s}))


if __name__ == "__main__":
    main()
