"""TCP listeners for the front door, with llama-server's ``--reuse-port``."""

from __future__ import annotations

import logging
import socket

import trio

log = logging.getLogger("hydra_trio")


async def open_tcp_listeners(port: int, host: str, reuse_port: bool = False) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners(port, host=host)``; with ``reuse_port`` each socket also has
    ``SO_REUSEPORT``, so other processes (with it too) may listen on the same port and the kernel shares
    the connections out among them, as llama-server's ``--reuse-port`` does (``tools/server/server-http.cpp``
    of the llama.cpp that llama-cpp-python 0.3.36 vendors; where the system has no ``SO_REUSEPORT`` it
    warns and listens without it, as llama-server).

    Raises:
        OSError: the port cannot be bound (nothing stays open).
    """
    if not reuse_port or not hasattr(socket, "SO_REUSEPORT"):
        if reuse_port:
            log.warning("--reuse-port: SO_REUSEPORT is not supported here; listening without it")
        return await trio.open_tcp_listeners(port, host=host)
    addrs = await trio.socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    try:
        for family, kind, proto, _name, sockaddr in addrs:
            sock = trio.socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                sock.listen(socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners
