"""Who may use what on the node's one port: allow-lists, secrets compared in constant time, refusal counts.

Shared by the three protocols:

- :class:`AllowList`: CIDR networks (and, for the TLS layer,
  trusted client-certificate subjects) that a connection's peer must match;
  ``None`` where a list is expected means "open to all" (the default, as the
  orchestrator expects).
- :class:`Peer`: who a connection comes from, as the lists see it
  (:func:`hydra_trio.transport.tls.peer_of` makes one from an accepted stream).
- :class:`Secrets`: API keys or Hydra tokens, compared with
  :func:`hmac.compare_digest` against *every* configured secret, so the time
  taken says nothing about which one matched or how much of it.
- :data:`Refusals`: ``(protocol, reason) -> count``, exported by ``/metrics``
  as ``hydra_trio:refused{protocol,reason}``.

IPv4-mapped IPv6 peers (``::ffff:10.1.2.3``, what a dual-stack listener
reports for an IPv4 client) are matched as the IPv4 address they carry, so
``--control-allow 10.0.0.0/8`` means the same on an IPv4 and a ``::`` listener.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path
from typing import TypeAlias

import attrs

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

Refusals: TypeAlias = "collections.Counter[tuple[str, str]]"
"""Refused requests and connections by ``(protocol, reason)``; protocol is ``http``, ``hydra`` or ``ggml_rpc``."""

REFUSAL_REASONS = {
    "http": ("missing_api_key", "invalid_api_key"),
    "hydra": ("not_allowed", "invalid_token"),
    "ggml_rpc": ("not_allowed",),
}
"""Every reason each protocol counts (stable: they label metrics; all are exported from the start, at 0)."""


def new_refusals() -> collections.Counter[tuple[str, str]]:
    """A refusal counter with every known ``(protocol, reason)`` present at 0."""
    return collections.Counter({(p, r): 0 for p, reasons in REFUSAL_REASONS.items() for r in reasons})


def parse_network(text: str) -> IPNetwork:
    """A CIDR (``10.0.0.0/8``, ``fd00::/8``) or a single address (``127.0.0.1`` = ``/32``, ``::1`` = ``/128``).

    Host bits must be zero (``10.0.0.1/8`` is refused: it is most likely a typo
    for ``10.0.0.1/32`` or ``10.0.0.0/8``).  An IPv4-mapped IPv6 network
    (``::ffff:10.0.0.0/104``) is turned into its IPv4 network.

    Raises:
        ValueError: not an address or network, or host bits set (the message says which).
    """
    try:
        net = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a CIDR network or IP address: {exc}") from None
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96:
        mapped = net.network_address.ipv4_mapped
        if mapped is not None:
            return ipaddress.IPv4Network(f"{mapped}/{net.prefixlen - 96}")
    return net


def normalize_address(address: str | IPAddress) -> IPAddress:
    """The address a peer is matched as: IPv4-mapped IPv6 becomes IPv4; an IPv6 zone (``%eth0``) is dropped.

    Raises:
        ValueError: not an IP address.
    """
    if isinstance(address, str):
        address = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id:
            return ipaddress.IPv6Address(int(address))
    return address


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, IPv4-mapped ``::ffff:127.x.y.z``);
    False for None or anything that is not an IP address."""
    if host is None:
        return False
    try:
        return normalize_address(host).is_loopback
    except ValueError:
        return False


@attrs.frozen
class Peer:
    """The remote end of a connection, as the allow-lists see it.

    Attributes:
        address: the peer's IP address (IPv4-mapped IPv6 already turned into
            IPv4); None when the socket has no peer any more.
        identity: a *verified* identity, e.g. the subject of a TLS client
            certificate checked against ``--tls-client-ca``; None
            for plain TCP.  Only the TLS layer may set it.
    """

    address: IPAddress | None
    identity: str | None = None

    def __str__(self) -> str:
        where = str(self.address) if self.address is not None else "?"
        return f"{where} ({self.identity})" if self.identity else where


@attrs.frozen
class AllowList:
    """Networks (and verified identities) allowed to do something; everyone else is refused.

    Attributes:
        networks: CIDR networks (:func:`parse_network`); a peer whose address is
            in any of them is allowed.
        identities: verified peer identities allowed whatever their address
            (exact match on :attr:`Peer.identity`; the hook for TLS client
            certificates; empty until a flag fills it).
        flag: the command-line flag this list came from, for messages.
    """

    networks: tuple[IPNetwork, ...] = ()
    identities: frozenset[str] = frozenset()
    flag: str = ""

    @classmethod
    def parse(cls, cidrs: Iterable[str], flag: str = "", subjects: Iterable[str] = ()) -> AllowList:
        """An allow-list from CIDR strings and TLS client-certificate subjects.  Raises ValueError
        naming the bad entry."""
        return cls(tuple(parse_network(c) for c in cidrs), frozenset(subjects), flag)

    def allows(self, address: str | IPAddress | None, identity: str | None = None) -> bool:
        """Whether a peer at ``address`` (with a verified ``identity``, or None) is allowed.

        An address that is None or not an IP address is not allowed (unless
        its identity is).  IPv4-mapped IPv6 addresses match IPv4 networks.
        """
        if identity is not None and identity in self.identities:
            return True
        if address is None:
            return False
        try:
            ip = normalize_address(address)
        except ValueError:
            return False
        return any(ip.version == net.version and ip in net for net in self.networks)

    def allows_peer(self, peer: Peer) -> bool:
        """:meth:`allows` for a :class:`Peer`."""
        return self.allows(peer.address, peer.identity)

    def __str__(self) -> str:
        return ", ".join([*map(str, self.networks), *sorted(self.identities)]) or "nobody"


def allowed(allow: AllowList | None, peer: Peer) -> bool:
    """``allow`` None (no list given) lets everyone in; otherwise :meth:`AllowList.allows_peer`."""
    return allow is None or allow.allows_peer(peer)


class Secrets:
    """API keys or tokens, checked in constant time.

    Each secret is kept as UTF-8 bytes; :meth:`matches` compares the candidate
    with *every* secret using :func:`hmac.compare_digest` (no early exit), so
    timing reveals neither which secret matched nor a matching prefix.  Only
    the length of the secrets could leak, as compare_digest documents.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        self._secrets = tuple(s.encode("utf-8") for s in secrets)

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def __len__(self) -> int:
        return len(self._secrets)

    def __repr__(self) -> str:  # never the secrets themselves
        return f"<Secrets: {len(self._secrets)}>"

    def matches(self, candidate: str | bytes | None) -> bool:
        """Whether ``candidate`` equals one of the secrets (False for None or when there are none)."""
        if candidate is None:
            return False
        given = candidate.encode("utf-8", "surrogateescape") if isinstance(candidate, str) else bytes(candidate)
        found = False
        for secret in self._secrets:
            found |= hmac.compare_digest(given, secret)
        return found


def read_key_file(path: str | Path) -> list[str]:
    """API keys from a file, one per line, as llama-server's ``--api-key-file``.

    Surrounding whitespace (a Windows ``\\r`` included) is stripped; empty lines
    and lines starting with ``#`` are skipped (llama-server keeps the latter as
    keys; a comment must never become a valid key here).

    Raises:
        ValueError: the file cannot be read, is not UTF-8, or holds no key
            (an empty key file must not leave the API open).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return keys


@attrs.frozen
class AccessSettings:
    """The node's access rules; the defaults leave everything open.

    Attributes:
        api_keys: keys one of which ``Authorization: Bearer KEY`` must carry on
            the HTTP API (``--api-key``, ``--api-key-file``); empty: no key needed.
        metrics_auth: ``/metrics`` needs a key, as every endpoint but llama-server's public ones
            (the default, ``--metrics-auth``); False serves it without one (``--no-metrics-auth``).
        control_allow: peers that may run the Hydra ops that change the node
            (``--control-allow``); None: everyone.
        hydra_token: a token that makes a Hydra connection trusted for those ops
            whatever its address (``--hydra-token``; sent as CONFIGURE ``auth``).
        rpc_allow: peers that may connect over ggml-RPC (``--rpc-allow``); None: everyone.
    """

    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    metrics_auth: bool = True
    control_allow: AllowList | None = None
    hydra_token: str | None = attrs.field(default=None, repr=False)
    rpc_allow: AllowList | None = None
