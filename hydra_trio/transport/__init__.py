"""Transport: the front door (one port, first-byte classification), TLS, access rules, socket helpers and the ggml-RPC
TLS tunnel."""
