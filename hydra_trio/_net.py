"""Small socket helpers the product and its tests share."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may take it
    before the caller binds it, so a caller that starts a server on it must handle that)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
