"""llama.cpp through llama-cpp-python's ctypes bindings: loading a model and its context (:mod:`.model`),
where its tensors go (:mod:`.placement`, :mod:`.kv_overrides`), ggml's backends and OpenMP teams
(:mod:`.ggml_backend`, :mod:`.openmp`, :mod:`.bindings`), the chat template (:mod:`.jinja_chat`),
tokenization (:mod:`.tokenize`) and embeddings (:mod:`.embedding`)."""
