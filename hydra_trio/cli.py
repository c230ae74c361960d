"""``hydra-trio`` command line (llama-server style flags)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import trio
from pathlib import Path

from .cli_client import add_client_commands
from .presets import DEFAULT_ALIAS, PRESETS, PresetError, resolve_model

log = logging.getLogger("hydra_trio")


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="serve a GGUF model (OpenAI API, Hydra protocol and ggml-RPC on one port)",
        description="Load a GGUF model and serve it on one TCP port. Flags follow llama-server.",
    )
    aliases = ", ".join(f"{a} (package {p.package})" for a, p in PRESETS.items())
    p.add_argument(
        "-m", "--model", default=DEFAULT_ALIAS, metavar="PATH|ALIAS",
        help=f"GGUF file or preset alias; presets: {aliases} (default: {DEFAULT_ALIAS})",
    )
    p.add_argument("-a", "--alias", default=None, help="model id in API replies (default: the preset alias or file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="TCP port for HTTP, Hydra and ggml-RPC (default: 8080; 0 = any free port)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="number of slots (default: 4)")
    p.add_argument(
        "-c", "--ctx-size", type=int, default=8192,
        help="total context in tokens, split evenly over the slots as llama-server does (default: 8192)",
    )
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="most tokens per decode step (default: 512)")
    p.add_argument("--max-connections", type=int, default=1024, help="connections served at once (default: 1024)")
    p.add_argument(
        "--classify-timeout", type=float, default=5.0,
        help="seconds a new connection has to send its first byte (default: 5)",
    )
    p.add_argument(
        "-to", "--timeout", type=float, default=30.0, metavar="SECONDS",
        help="HTTP: seconds of silence allowed while a request body arrives (408 after); a request that has "
             "arrived runs as long as it needs (default: 30)",
    )
    p.add_argument(
        "--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
        help="HTTP: seconds an idle connection is kept, and the time a client has to send a request's headers (default: 5)",
    )
    p.add_argument(
        "--cors-origin", action="append", default=None, metavar="ORIGIN",
        help="HTTP: an origin allowed by CORS, repeatable (default: any origin, as llama-server)",
    )
    p.add_argument("--no-model", action="store_true",
                   help="run a compute-only node: ggml-RPC backend, Hydra INFO and HTTP /health, /version, /slots")
    p.add_argument("--rpc-engine", default=None, metavar="HOST:PORT",
                   help="COMBINED mode: once the model serves, place its MoE expert tensors on this ggml-RPC peer "
                        "(another hydra-trio node, e.g. one run with --no-model) and switch to COMBINED")
    p.add_argument("--combined-pattern", default=r"ffn_(up|down|gate)_exps", metavar="REGEX",
                   help="tensors that live on the peer in COMBINED mode (default: ffn_(up|down|gate)_exps)")
    p.add_argument("--no-rpc-backend", action="store_true", help="do not lend this node's compute over ggml-RPC")
    p.add_argument("--rpc-device", action="append", default=None, metavar="NAME",
                   help="local ggml device to expose over ggml-RPC, repeatable (default: cpu)")
    p.add_argument("--rpc-cache-dir", default=os.path.expanduser("~/.cache/hydra-trio/rpc-cache"),
                   help="tensor cache of the ggml-RPC backend, so repeated uploads are skipped "
                        "(default: ~/.cache/hydra-trio/rpc-cache; '' disables it)")
    p.add_argument("--rpc-threads", type=int, default=None, help="CPU threads of the ggml-RPC backend (default: all cores)")
    p.add_argument("--rpc-max-waiting", type=int, default=8, metavar="N",
                   help="ggml-RPC clients that may wait while the backend serves another; more are closed (default: 8)")
    p.add_argument("--rpc-wait-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long a ggml-RPC client may wait for its turn (default: 30)")
    p.add_argument("--rpc-handshake-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="time for a ggml-RPC client's HELLO to arrive whole, and for the backend to answer it (default: 5)")
    p.add_argument("--rpc-stall-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a begun ggml-RPC message may go this long without a byte; idle time between messages "
                        "is unlimited (default: 30)")
    p.add_argument("--rpc-restart-wait", type=float, default=15.0, metavar="SECONDS",
                   help="how long a ggml-RPC client is held while the backend restarts (default: 15)")
    p.add_argument("--rpc-max-message-size", type=int, default=16 << 30, metavar="BYTES",
                   help="largest ggml-RPC message accepted (default: 16 GiB)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, let requests in flight finish for up to this long (default: 10; 0 = stop at once)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default: INFO)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hydra-trio", description="A trio-based engine node for Hydra LLM clusters.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    add_client_commands(sub)  # info, state get/put/meta, mode: Hydra protocol client commands
    return parser


async def _run(args: argparse.Namespace) -> int:
    from .engine.batch import EngineConfig
    from .frontdoor import FrontDoorSettings
    from .http.settings import HttpSettings
    from .server import Server, ServerConfig, serve

    from .protocol.messages import MessageError, parse_peer
    from .rpc_backend import RpcBackendSettings

    if args.rpc_engine is not None:
        try:
            parse_peer(args.rpc_engine, field="--rpc-engine")
        except MessageError as exc:
            log.error("%s", exc)
            return 2

    engine = None
    if not args.no_model:
        try:
            path, alias = resolve_model(args.model)
        except PresetError as exc:
            log.error("%s", exc)
            return 2
        engine = EngineConfig(
            model_path=path,
            model_alias=args.alias or alias,
            n_parallel=args.parallel,
            n_ctx=args.ctx_size,
            n_batch=args.batch_size,
            n_threads=args.threads,
            peer=args.rpc_engine,
            combined_pattern=args.combined_pattern,
        )
        log.info("model %s (%s), %d slots, n_ctx %d", alias, path, args.parallel, args.ctx_size)
    else:
        log.info("compute-only node: no model")
    rpc = None
    if not args.no_rpc_backend:
        rpc = RpcBackendSettings(
            devices=tuple(args.rpc_device or ["cpu"]),
            cache_dir=Path(args.rpc_cache_dir) if args.rpc_cache_dir else None,
            threads=args.rpc_threads,
            max_waiting=args.rpc_max_waiting,
            wait_timeout=args.rpc_wait_timeout,
            handshake_timeout=args.rpc_handshake_timeout,
            stall_timeout=args.rpc_stall_timeout,
            restart_wait=args.rpc_restart_wait,
            max_message_size=args.rpc_max_message_size,
        )
    elif args.no_model:
        log.error("--no-model with --no-rpc-backend leaves nothing to serve")
        return 2
    for name in ("parallel", "ctx_size", "batch_size", "max_connections"):
        if getattr(args, name) < 1:
            log.error("--%s must be >= 1", name.replace("_", "-"))
            return 2
    config = ServerConfig(
        host=args.host,
        port=args.port,
        engine=engine,
        frontdoor=FrontDoorSettings(max_connections=args.max_connections, classify_timeout=args.classify_timeout),
        http=HttpSettings(keep_alive_timeout=args.keep_alive_timeout, body_timeout=args.timeout,
                          cors_origins=tuple(args.cors_origin or ["*"])),
        rpc_backend=rpc,
    )
    async with trio.open_nursery() as nursery:

        server: Server | None = None

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                first = True
                async for signum in signals:
                    if first and server is not None and args.shutdown_grace > 0:
                        log.info("%s received: no new connections; requests in flight get %.0f s to finish "
                                 "(send it again to stop at once)", signal.Signals(signum).name, args.shutdown_grace)
                        first = False
                        nursery.start_soon(server.shutdown, args.shutdown_grace)
                        continue
                    log.info("%s received: shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(stop_on_signal)
        try:
            server = await nursery.start(serve, config)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
            nursery.cancel_scope.cancel()
            return 1
        await server.stopped.wait()
        nursery.cancel_scope.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = getattr(args, "func", None)
    if func is not None:  # a client command
        return func(args)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return trio.run(_run, args)
    except Exception as exc:  # e.g. ModelLoadError: say it plainly, exit non-zero
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        log.error("fatal: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
