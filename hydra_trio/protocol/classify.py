"""First-byte classification of a connection (docs/hydra-protocol.md §1). Sans-I/O.

The front door peeks one byte with ``MSG_PEEK`` and calls :func:`classify`;
the byte stays in the stream for the protocol's own handler.
"""

from __future__ import annotations

import enum


class Protocol(enum.Enum):
    """The protocols that share the engine's port."""

    HTTP = "http"
    HYDRA = "hydra"
    GGML_RPC = "ggml_rpc"
    TLS = "tls"
    UNKNOWN = "unknown"


HYDRA_FIRST_BYTE = 0x59  # magic 0x4859, little-endian: bytes 59 48
GGML_RPC_HELLO = 0x0E  # RPC_CMD_HELLO, the first command of every ggml-RPC session
TLS_HANDSHAKE = 0x16  # TLS record type "handshake" (ClientHello)
# First letters of the HTTP methods (GET, POST, PUT, DELETE, HEAD, OPTIONS,
# PATCH, CONNECT, TRACE). 'Y' (0x59) is not among them.
HTTP_FIRST_BYTES = frozenset(b"GPDHOCT")


def classify(first: bytes) -> Protocol:
    """Classify a connection by its first byte.

    Args:
        first: the peeked bytes (only ``first[0]`` is used); empty means the
            peer closed before sending anything.

    Returns:
        The protocol, or ``Protocol.UNKNOWN`` for anything else (the front
        door closes those: a byte that names no protocol is never taken for
        Hydra, docs/hydra-protocol.md §1).
    """
    if not first:
        return Protocol.UNKNOWN
    b = first[0]
    if b == HYDRA_FIRST_BYTE:
        return Protocol.HYDRA
    if b == GGML_RPC_HELLO:
        return Protocol.GGML_RPC
    if b == TLS_HANDSHAKE:
        return Protocol.TLS
    if b in HTTP_FIRST_BYTES:
        return Protocol.HTTP
    return Protocol.UNKNOWN
