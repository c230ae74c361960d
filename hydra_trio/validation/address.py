"""``host:port`` addresses of peers and nodes (sans-I/O)."""

from __future__ import annotations

import argparse
import re

from .strict import MessageError

_HOST_RE = re.compile(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.%A-Za-z_\-]+\]")


def parse_peer(peer: str, *, field: str = "peer") -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)`` (an IPv6 host in brackets,
    returned without them). Port must be decimal 1-65535. Raises
    MessageError naming ``field`` otherwise."""
    host, sep, port_s = peer.rpartition(":")
    if not sep or not host or not _HOST_RE.fullmatch(host):
        raise MessageError(f"{field}: expected 'host:port', got {peer!r}")
    if not (port_s.isascii() and port_s.isdigit()) or not 1 <= int(port_s) <= 65535:
        raise MessageError(f"{field}: port must be 1-65535, got {port_s!r}")
    if host.startswith("["):
        host = host[1:-1]
    return host, int(port_s)


def address_argument(s: str) -> str:
    """argparse type of a ``HOST:PORT`` argument (``hydra-trio info|state|mode|watch``): checked as
    :func:`parse_peer` checks it, returned unchanged; raises argparse.ArgumentTypeError naming the problem."""
    try:
        parse_peer(s, field="address")
    except MessageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return s
