"""Sans-I/O Hydra protocol code: bytes in, events out; no sockets, no trio."""
