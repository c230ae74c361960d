"""The ggml-RPC backend this node lends to peers: llama.cpp's RPC server in a supervised child
(:mod:`.supervisor`, :mod:`.child`), the front door's validating pump to it (:mod:`.pump`) and its settings
(:mod:`.backend`).  The codec and validator are :mod:`hydra_trio.protocol.ggml_rpc`; the ggml backend API
through ctypes is :mod:`hydra_trio.engine.llama.ggml_backend`."""
