"""The access flags of ``run`` (docs/operations.md "Security"): all open when none is given."""

from __future__ import annotations

import argparse

from ..transport.access import AccessSettings, AllowList, read_key_file
from . import _types as t
from ._flags import OWN, Flag


def A(names: tuple[str, ...], note: str, **kw) -> Flag:  # a table row: hydra-trio's own flag
    return Flag(names, OWN, note, group="hydra", **kw)


FLAGS: list[Flag] = [
    A(
        ("--metrics-auth",),
        "HTTP: with --api-key, /metrics needs the key, as in llama-server (default: on); "
        "--no-metrics-auth serves /metrics without one, for a Prometheus that sends no credentials",
        neg=("--no-metrics-auth",),
        default=True,
    ),
    A(
        ("--control-allow",),
        "Hydra: only peers in these networks may run CONFIGURE, SET_EXPERT_MODE, STATE_PUT, "
        "SWAP_QUANT, PIPELINE_ATTACH (repeatable; others get BAD_REQUEST 'refused')",
        value="CIDR",
        type=t.cidr,
        action="append",
        default=[],
    ),
    A(
        ("--hydra-token",),
        'Hydra: a connection that sends CONFIGURE {"auth": TOKEN} may run those ops from any '
        "address (alone, without --control-allow: only such connections may)",
        value="TOKEN",
        type=t.secret,
    ),
    A(
        ("--hydra-token-file",),
        "read --hydra-token from the first non-empty line of FILE (keeps it out of the process list)",
        value="FILE",
    ),
    A(
        ("--rpc-allow",),
        "ggml-RPC: only peers in these networks may connect (repeatable; others are closed before a byte is read)",
        value="CIDR",
        type=t.cidr,
        action="append",
        default=[],
    ),
    A(
        ("--allow-subject",),
        "a TLS client whose verified certificate subject (as logged, e.g. 'O=acme,CN=head-1') "
        "is SUBJECT passes --control-allow and --rpc-allow whatever its address (repeatable; with --tls-client-ca). "
        "Given alone it restricts both to these subjects",
        value="SUBJECT",
        action="append",
        default=[],
    ),
]


def _hydra_token(args: argparse.Namespace) -> str | None:
    """``--hydra-token``, or the first key of ``--hydra-token-file`` (both: ValueError)."""
    if args.hydra_token_file is None:
        return args.hydra_token
    if args.hydra_token is not None:
        raise ValueError("--hydra-token and --hydra-token-file: give one")
    return read_key_file(args.hydra_token_file)[0]


def access_settings(args: argparse.Namespace) -> AccessSettings:
    """The :class:`AccessSettings` of parsed ``run`` flags.  Raises ValueError for an unreadable or empty key file."""
    keys = [key for group in args.api_key or [] for key in group]
    for path in args.api_key_file or []:
        keys += read_key_file(path)
    return AccessSettings(
        api_keys=tuple(keys),
        metrics_auth=args.metrics_auth,
        control_allow=AllowList.parse(args.control_allow, "--control-allow", args.allow_subject)
        if args.control_allow or args.allow_subject
        else None,
        hydra_token=_hydra_token(args),
        rpc_allow=AllowList.parse(args.rpc_allow, "--rpc-allow", args.allow_subject)
        if args.rpc_allow or args.allow_subject
        else None,
    )
