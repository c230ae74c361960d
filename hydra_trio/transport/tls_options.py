"""The TLS options of the project's own clients (``hydra-trio hydra ...``, ``hydra-trio watch``): one set of
flags, one rule for what they mean."""

from __future__ import annotations

import argparse
import ssl

from .tls import client_context


def add_tls_options(p: argparse.ArgumentParser, tls_help: str) -> None:
    """``--tls`` (``tls_help`` says what it connects with), ``--tls-ca FILE``, ``--tls-cert FILE``,
    ``--tls-key FILE`` on ``p``."""
    p.add_argument("--tls", action="store_true", help=tls_help)
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="PEM CA bundle the node's certificate must chain to (default: the system's)",
    )
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM client certificate, for mutual TLS")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM key of --tls-cert")


def check_tls_options(args: argparse.Namespace) -> None:
    """Raises ValueError for TLS files given without ``--tls``."""
    if not args.tls and (args.tls_ca or args.tls_cert or args.tls_key):
        raise ValueError("--tls-ca/--tls-cert/--tls-key need --tls")


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client context of :func:`add_tls_options`' flags; None: plain.  Raises ValueError for TLS files
    without ``--tls`` (:func:`check_tls_options`), OSError / ValueError for files that cannot be read."""
    check_tls_options(args)
    return client_context(args.tls_ca, args.tls_cert, args.tls_key) if args.tls else None
