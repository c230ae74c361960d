"""TLS on the one port: contexts, the unwrapping of a ``0x16`` connection, and who is on the other end.

The front door (:mod:`hydra_trio.transport.frontdoor`) classifies a connection by its
first byte; ``0x16`` is a TLS handshake record.  With a server context
(``--tls-cert``/``--tls-key``) such a connection is wrapped in a
:class:`trio.SSLStream` (server side), the handshake is done and the first
bytes *inside* TLS are read and classified as for a plain connection.  Inside
TLS there is no ``MSG_PEEK``, so the handler gets a :class:`TlsStream`: the
SSL stream with the bytes already read pushed back in front.

Who is on the other end, for any stream the front door hands over:
:func:`connection_info` gives a :class:`ConnectionInfo` (peer address, TLS
or not, the verified client certificate's subject under mutual TLS).  This is
what allow-lists and logs read.

Policy: with ``--tls-required`` only loopback peers may speak plain
(:func:`plain_allowed`); the others are closed and counted.

Borrowed behaviour: the handshake over an already-accepted stream is
``trio.SSLStream(..., server_side=True)``; hypercorn's own trio server
serves an ``SSLStream`` (it calls ``do_handshake``,
``selected_alpn_protocol`` and ``transport_stream.socket``), which
:class:`TlsStream` provides.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import attrs
import trio

from .access import Peer, is_loopback, normalize_address

log = logging.getLogger("hydra_trio.tls")

MAX_LEADING_EMPTY_LINES = 8  # as for plain connections (RFC 9112 §2.2)


@attrs.frozen
class TlsSettings:
    """Server-side TLS of a node (``hydra-trio run`` flags).

    Attributes:
        cert: PEM certificate chain of the node (``--tls-cert``).
        key: PEM private key of the node (``--tls-key``).
        client_ca: PEM CA bundle; when set, clients must present a certificate it
            signed (mutual TLS, ``--tls-client-ca``).
        required: only loopback peers may connect without TLS (``--tls-required``).
    """

    cert: Path
    key: Path
    client_ca: Path | None = None
    required: bool = False


@attrs.frozen
class ConnectionInfo:
    """Who is on the other end of one connection (read by logs and allow-lists).

    Attributes:
        peer: ``host:port`` of the remote end (``?`` once the socket has no peer).
        host: the remote address alone (IPv6 without brackets), or None.
        tls: the connection is TLS (the front door unwrapped it).
        tls_subject: the verified client certificate's subject, RFC 4514 style
            (``CN=node-a,O=example``), or None (no TLS, or no client certificate).
        tls_version: e.g. ``TLSv1.3``, or None.
    """

    peer: str
    host: str | None = None
    tls: bool = False
    tls_subject: str | None = None
    tls_version: str | None = None


def server_context(settings: TlsSettings) -> ssl.SSLContext:
    """The server-side context: TLS 1.2 or later, the node's certificate, client certificates when asked.

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: a file is not a valid PEM certificate/key, or they do not match.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.cert, settings.key)
    if settings.client_ca is not None:
        ctx.load_verify_locations(settings.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> ssl.SSLContext:
    """A client context: verifies the server against ``ca`` (None: the system's CAs), hostname checked;
    ``cert``/``key`` are presented for mutual TLS.

    Raises:
        ValueError: ``key`` without ``cert``.
        OSError, ssl.SSLError: a file cannot be read or is not valid PEM.
    """
    if key is not None and cert is None:
        raise ValueError("a TLS client key needs its certificate (--tls-cert)")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca is not None else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def subject_text(cert: dict[str, Any] | None) -> str | None:
    """``CN=a,O=b`` from :meth:`ssl.SSLSocket.getpeercert`'s ``subject`` (RDNs in certificate order); None without
    one."""
    if not cert or "subject" not in cert:
        return None
    return ",".join(f"{_SHORT.get(k, k)}={v}" for rdn in cert["subject"] for k, v in rdn)


_SHORT = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
    "domainComponent": "DC",
    "emailAddress": "emailAddress",
}


def plain_allowed(host: str | None, required: bool) -> bool:
    """Whether a peer at ``host`` may speak plain (not TLS): always without ``--tls-required``;
    with it, only loopback (``127.0.0.0/8``, ``::1``, and IPv4-mapped ``::ffff:127.x.y.z``)."""
    return not required or is_loopback(host)


def socket_info(stream: trio.SocketStream) -> ConnectionInfo:
    """The :class:`ConnectionInfo` of a plain socket stream."""
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return ConnectionInfo(peer="?")
    shown = f"[{host}]" if ":" in host else host
    return ConnectionInfo(peer=f"{shown}:{port}", host=host)


def connection_info(stream: Any) -> ConnectionInfo:
    """Who is on the other end of a stream the front door handed over (plain or :class:`TlsStream`)."""
    info = getattr(stream, "info", None)
    if isinstance(info, ConnectionInfo):
        return info
    return socket_info(stream)


def peer_of(stream: Any) -> Peer:
    """The :class:`~hydra_trio.transport.access.Peer` the allow-lists see for a stream the front door handed
    over: its address (IPv4-mapped IPv6 as IPv4) and, under mutual TLS, the verified client
    certificate's subject as its identity."""
    info = connection_info(stream)
    try:
        address = normalize_address(info.host) if info.host is not None else None
    except ValueError:
        address = None
    return Peer(address, info.tls_subject)


class TlsStream(trio.abc.Stream):
    """An unwrapped TLS connection whose first bytes were already read, handed to a protocol handler.

    ``receive_some`` returns the pushed-back bytes first, then what the SSL
    stream brings.  Sending goes to the SSL stream.  :meth:`unread` puts bytes
    back in front (a handler that had to look ahead).  There is no
    ``send_eof`` (TLS streams are not half-closable in trio) and no
    ``socket``: the bytes on the socket are ciphertext.

    For hypercorn's ``TCPServer`` it looks like a handshaken ``SSLStream``:
    ``do_handshake`` (done already), ``selected_alpn_protocol``,
    ``transport_stream``.
    """

    def __init__(self, ssl_stream: trio.SSLStream[trio.SocketStream], first: bytes, info: ConnectionInfo) -> None:
        self.ssl_stream = ssl_stream
        self.info = info
        self._pushback = bytearray(first)

    @property
    def transport_stream(self) -> trio.SocketStream:
        """The TCP stream under TLS (ciphertext)."""
        return self.ssl_stream.transport_stream

    async def do_handshake(self) -> None:
        """Already done by the front door (a checkpoint)."""
        await self.ssl_stream.do_handshake()

    def selected_alpn_protocol(self) -> str:
        """The ALPN protocol the client chose, ``http/1.1`` when none (the node offers no HTTP/2)."""
        return self.ssl_stream.selected_alpn_protocol() or "http/1.1"

    def peek(self) -> bytes:
        """The pushed-back bytes still to be received (not consumed)."""
        return bytes(self._pushback)

    def take_pushback(self) -> bytes:
        """The pushed-back bytes still to be received, consumed (a reader that goes on without this stream)."""
        data = bytes(self._pushback)
        self._pushback.clear()
        return data

    def unread(self, data: bytes) -> None:
        """Put ``data`` back in front of the bytes still to be received."""
        self._pushback[:0] = data

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._pushback:
            await trio.lowlevel.checkpoint()
            n = len(self._pushback) if max_bytes is None else min(max_bytes, len(self._pushback))
            data = bytes(self._pushback[:n])
            del self._pushback[:n]
            return data
        return bytes(await self.ssl_stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.ssl_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.ssl_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close without the TLS close_notify wait (a peer that went away must not hold the close)."""
        await trio.aclose_forcefully(self.ssl_stream)


class HandshakeFailed(Exception):
    """The TLS handshake failed (bad record, untrusted certificate, truncated); the reason is the message."""


async def unwrap(stream: trio.SocketStream, context: ssl.SSLContext) -> TlsStream | None:
    """Server side: do the TLS handshake on ``stream`` and read the first bytes inside.

    Empty lines before the first byte are dropped (at most 8, as for plain
    connections).  The caller bounds the time (the classify timeout).

    Returns:
        The :class:`TlsStream` with the first bytes pushed back, or None when the
        peer closed after the handshake without sending anything.

    Raises:
        HandshakeFailed: the handshake failed (the reason from OpenSSL).
    """
    base = socket_info(stream)
    ssl_stream = trio.SSLStream(stream, context, server_side=True)
    try:
        await ssl_stream.do_handshake()
    except trio.BrokenResourceError as exc:
        raise HandshakeFailed(str(exc.__cause__ or exc) or type(exc.__cause__ or exc).__name__) from None
    info = ConnectionInfo(
        peer=base.peer,
        host=base.host,
        tls=True,
        tls_subject=subject_text(ssl_stream.getpeercert()),
        tls_version=ssl_stream.version(),
    )
    first = b""
    for _ in range(MAX_LEADING_EMPTY_LINES * 2 + 1):
        try:
            data = await ssl_stream.receive_some(4096)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            return None
        first = bytes(data).lstrip(b"\r\n")
        if first:
            break
    else:
        return None
    return TlsStream(ssl_stream, first, info)
