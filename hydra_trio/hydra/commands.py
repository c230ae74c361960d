"""``hydra-trio`` client subcommands: talk to an engine over the Hydra binary
protocol (docs/hydra-protocol.md §2, §3) with `hydra_trio.hydra.client.HydraClient`.

    hydra-trio info HOST:PORT
    hydra-trio state get  HOST:PORT SLOT FILE
    hydra-trio state put  HOST:PORT SLOT FILE
    hydra-trio state meta HOST:PORT SLOT
    hydra-trio mode HOST:PORT solo|combined [--peer HOST:PORT] [--wait SECONDS]

Every subcommand takes ``--timeout SECONDS`` (default 30, per send/receive
without progress), ``--trace-id ID`` and ``--token TOKEN`` (the node's
``--hydra-token``; default ``$HYDRA_TRIO_TOKEN``). Replies' meta JSON goes to stdout
(pretty-printed); progress lines go to stderr.

Exit codes: 0 success; 3 (``mode``) the node stays in another mode than the
one asked for; 1 an error reply (stderr: ``error: <STATUS>:
<message>`` then the meta JSON), a timeout, a dropped connection or a local
file error; 2 the connection could not be opened (refused, unreachable,
unknown host) or bad arguments (argparse).

Wiring: call `add_client_commands` on the ``hydra-trio`` subparsers; each
subcommand sets ``args.func`` (takes the Namespace, runs `trio.run`
itself, returns the exit code). ``python -m hydra_trio.hydra.commands ...``
runs the same commands standalone (`main`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..transport.tls_options import add_tls_options, tls_context
from ..validation.address import address_argument

__all__ = ["add_client_commands", "build_parser", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONNECT = 2


def _slot(s: str) -> int:
    try:
        n = int(s, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"slot must be a decimal integer, got {s!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"slot must be >= 0, got {n}")
    return n


def _seconds(*, zero_ok: bool) -> Callable[[str], float]:
    """argparse type: a finite number of seconds, > 0 (or >= 0 when ``zero_ok``)."""
    bound = ">= 0" if zero_ok else "> 0"

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {s!r}") from None
        if not (math.isfinite(v) and (v >= 0 if zero_ok else v > 0)):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {s!r}")
        return v

    return parse


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False)


async def _one_request(args: argparse.Namespace, method: str, *method_args: Any) -> dict[str, Any]:
    """Connect to ``args.address`` (``args.timeout`` seconds per wait), run
    ``HydraClient.<method>(client, *method_args, trace_id=args.trace_id)``, close; its meta.

    The client is imported here, when a command runs: the ``hydra-trio`` parser (a node's
    included) adds these commands without loading the client and its connection."""
    from .client import HydraClient

    async with HydraClient.from_address(
        args.address, timeout=args.timeout, token=args.token, ssl_context=tls_context(args)
    ) as c:
        meta: dict[str, Any] = await getattr(HydraClient, method)(c, *method_args, trace_id=args.trace_id)
    return meta


# --------------------------------------------------------------------------
# Command implementations (async)
# --------------------------------------------------------------------------


async def info_command(args: argparse.Namespace) -> int:
    """``info HOST:PORT``: print the INFO meta."""
    print(_dump(await _one_request(args, "info")))
    return EXIT_OK


async def state_get_command(args: argparse.Namespace) -> int:
    """``state get HOST:PORT SLOT FILE``: stream the slot's KV state to FILE
    (written atomically); print the meta, then ``wrote N bytes to FILE`` on
    stderr."""
    meta = await _one_request(args, "state_get_to_file", args.slot, args.file)
    size = os.stat(args.file).st_size
    print(_dump(meta))
    print(f"wrote {size} bytes to {args.file}", file=sys.stderr)
    return EXIT_OK


async def state_put_command(args: argparse.Namespace) -> int:
    """``state put HOST:PORT SLOT FILE``: stream FILE as the slot's KV state;
    print the reply meta, then ``sent N bytes from FILE`` on stderr."""
    size = os.stat(args.file).st_size  # fail before connecting on a missing file
    meta = await _one_request(args, "state_put_from_file", args.slot, args.file)
    print(_dump(meta))
    print(f"sent {size} bytes from {args.file}", file=sys.stderr)
    return EXIT_OK


async def state_meta_command(args: argparse.Namespace) -> int:
    """``state meta HOST:PORT SLOT``: print STATE_META."""
    print(_dump(await _one_request(args, "state_meta", args.slot)))
    return EXIT_OK


EXIT_FALLBACK = 3


MODE_RETRY_INTERVAL = 0.5  # seconds between two SET_EXPERT_MODE tries while the peer starts


def _peer_not_answering(meta: dict[str, Any]) -> bool:
    """A fallback whose reason is a peer that does not answer (yet): worth another try."""
    return meta.get("mode") == "solo" and "does not answer" in str(meta.get("fallback_reason") or "")


async def mode_command(args: argparse.Namespace) -> int:
    """``mode HOST:PORT solo|combined [--peer H:P] [--wait SECONDS]``: SET_EXPERT_MODE; print
    the meta (its ``mode`` is the mode actually in effect, ``success`` whether it is the one asked for).

    While the node falls back because the peer does not answer ggml-RPC yet (a peer
    still starting), the request is sent again every 0.5 s for up to ``--wait``
    seconds (0: one try).  Exit code 3 when the node answered OK but stays in
    another mode than the one asked for (``fallback_reason`` says why, on stderr too).
    """
    deadline = trio.current_time() + args.wait
    tries = 0
    while True:
        tries += 1
        meta = await _one_request(args, "set_expert_mode", args.mode, args.peer)
        if meta.get("mode") == args.mode or not _peer_not_answering(meta):
            break
        if trio.current_time() + MODE_RETRY_INTERVAL > deadline:
            break
        if tries == 1:
            print(f"waiting up to {args.wait:g} s for the peer: {meta.get('fallback_reason')}", file=sys.stderr)
        await trio.sleep(MODE_RETRY_INTERVAL)
    print(_dump(meta))
    if meta.get("mode") != args.mode:
        print(
            f"warning: asked for {args.mode}, the node is in {meta.get('mode')}: {meta.get('fallback_reason')}",
            file=sys.stderr,
        )
        return EXIT_FALLBACK
    return EXIT_OK


async def swap_command(args: argparse.Namespace) -> int:
    """``swap HOST:PORT KEY``: SWAP_QUANT of the whole model to quant KEY; print the meta."""
    print(_dump(await _one_request(args, "swap_quant", args.key, args.tensor_pattern)))
    return EXIT_OK


# --------------------------------------------------------------------------
# Sync entry points (what args.func is)
# --------------------------------------------------------------------------


def run_command(fn: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace) -> int:
    """Run one async command with `trio.run` and map errors to exit codes."""
    from .client import HydraConnectError, HydraError

    try:
        return trio.run(fn, args)
    except HydraConnectError as exc:
        print(f"error: {exc} (is a hydra-trio engine listening there?)", file=sys.stderr)
        return EXIT_CONNECT
    except HydraError as exc:
        print(f"error: {exc.status_name}: {exc.message}", file=sys.stderr)
        if exc.meta:
            print(_dump(exc.meta), file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError) as exc:  # local file errors, arguments the client refuses (a key too long)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _sync(fn: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def func(args: argparse.Namespace) -> int:
        return run_command(fn, args)

    func.__name__ = fn.__name__.removesuffix("_command")
    func.__doc__ = fn.__doc__
    return func


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--timeout",
        type=_seconds(zero_ok=False),
        default=30.0,
        metavar="SECONDS",
        help="give up after this many seconds without progress (default: 30)",
    )
    p.add_argument("--trace-id", default=None, help="trace id sent with the request (default: random)")
    p.add_argument(
        "--token",
        default=os.environ.get("HYDRA_TRIO_TOKEN") or None,
        metavar="TOKEN",
        help="the node's --hydra-token, sent first on the connection (default: $HYDRA_TRIO_TOKEN)",
    )
    add_tls_options(p, "connect with TLS (the node runs with --tls-cert)")
    return p


_POSITIONALS: dict[str, dict[str, Any]] = {
    "address": {"type": address_argument, "metavar": "HOST:PORT"},
    "slot": {"type": _slot, "metavar": "SLOT"},
    "file": {"metavar": "FILE"},
}


def _command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    fn: Callable[[argparse.Namespace], Awaitable[int]],
    positionals: tuple[str, ...],
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A leaf subcommand: ``--timeout`` / ``--trace-id``, the named
    positionals (`_POSITIONALS`), ``func`` running ``fn`` (`_sync`) and a
    ``log_level`` default of WARNING."""
    p = subparsers.add_parser(name, parents=[_common()], help=help, description=description)
    for arg in positionals:
        p.add_argument(arg, **_POSITIONALS[arg])
    p.set_defaults(func=_sync(fn), log_level="WARNING")
    return p


def add_client_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``info``, ``state {get,put,meta}`` and ``mode`` to ``subparsers``
    (the ``add_subparsers()`` object of the ``hydra-trio`` parser). Each
    leaf parser sets ``func`` (Namespace -> exit code, runs trio itself) and
    a ``log_level`` default of WARNING."""
    _command(
        subparsers,
        "info",
        info_command,
        ("address",),
        help="print an engine's INFO meta (Hydra protocol)",
        description="Send INFO (0x41) and print the reply meta as JSON.",
    )
    state = subparsers.add_parser(
        "state",
        help="get / put / inspect a slot's KV state (Hydra protocol)",
        description="Slot KV state transfer over the Hydra protocol (STATE_GET / STATE_PUT / STATE_META).",
    )
    ssub = state.add_subparsers(dest="state_command", required=True, metavar="{get,put,meta}")
    _command(
        ssub,
        "get",
        state_get_command,
        ("address", "slot", "file"),
        help="save a slot's KV state to a file",
        description="STATE_GET (0x30): stream the slot's KV state into FILE (temp file + rename).",
    )
    _command(
        ssub,
        "put",
        state_put_command,
        ("address", "slot", "file"),
        help="restore a slot's KV state from a file",
        description="STATE_PUT (0x31): stream FILE as the slot's KV state.",
    )
    _command(
        ssub,
        "meta",
        state_meta_command,
        ("address", "slot"),
        help="print a slot's state meta",
        description="STATE_META (0x32): print n_past, state_size, is_processing, model identity.",
    )
    e = _command(
        subparsers,
        "mode",
        mode_command,
        ("address",),
        help="switch expert mode (solo / combined)",
        description="SET_EXPERT_MODE (0x44). Exit 1 with BUSY while slots are processing.",
    )
    e.add_argument("mode", choices=["solo", "combined"])
    e.add_argument(
        "--peer", type=address_argument, default=None, metavar="HOST:PORT", help="peer engine for combined mode"
    )
    sw = _command(
        subparsers,
        "swap",
        swap_command,
        ("address",),
        help="swap the served model to another of the node's quants (SWAP_QUANT)",
        description="SWAP_QUANT (0x45): load the node's quant KEY (run --quant KEY=...), keep the slots' KV "
        "caches when both files have the same KV identity, free the old model. Exit 1 with BUSY "
        "while slots are processing.",
    )
    sw.add_argument("key", metavar="KEY", help="the quant's key (INFO's quants)")
    sw.add_argument(
        "--tensor-pattern",
        default="",
        metavar="REGEX",
        help="tensors to swap (default: all of them; a pattern that leaves some out is not supported)",
    )
    e.add_argument(
        "--wait",
        type=_seconds(zero_ok=True),
        default=30.0,
        metavar="SECONDS",
        help="while the node falls back to solo because the peer does not answer (yet), ask again every "
        "0.5 s for up to this long (default: 30; 0 = ask once)",
    )


def build_parser() -> argparse.ArgumentParser:
    """A parser with only the client commands (for ``python -m``)."""
    parser = argparse.ArgumentParser(prog="hydra-trio", description="Hydra protocol client commands.")
    add_client_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` with `build_parser` and run the command."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
