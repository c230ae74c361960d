"""The expert modes: SOLO, COMBINED (the MoE experts on a ggml-RPC peer) and PIPELINE
(:mod:`.combined`)."""
