"""The command line as data: every flag of ``hydra-trio run`` is a :class:`Flag` in one of four classes.

* ``wired``: llama-server's flag with llama-server's meaning (``common/arg.cpp`` of the vendored
  llama.cpp is the reference for names, value syntax and environment variable);
* ``accepted``: llama-server's flag, accepted and without effect here because the node always behaves
  that way or the flag does not apply; the start-up log says so once for each one given;
* ``refused``: llama-server's flag for a feature this node does not have: exit 2 at parse time, naming
  the flag and the reason;
* ``own``: hydra-trio's flags and those of the cluster's llama-server fork, which llama-server does not have.

The flag table of docs/cli.md (``python -m hydra_trio.cli.table``) and the coverage test over the vendored
``common/arg.cpp`` (``tests/test_cli_flags.py``) are made from these lists.
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from .._version import __version__
from ._types import FALSEY, TRUTHY

WIRED, ACCEPTED, REFUSED, OWN = "wired", "accepted", "refused", "own"
KINDS = (WIRED, ACCEPTED, REFUSED, OWN)


@attrs.frozen
class Flag:
    """One flag (all its spellings).

    Attributes:
        names: the option strings, llama-server's order (short forms first).
        kind: one of :data:`KINDS`.
        note: what it does (wired, own) or why it is accepted without effect / refused.
        neg: the negative spellings (``--no-x``), for flags that take no value.
        value: the metavar for a flag that takes a value; None for a switch.
        type: argparse ``type=`` for the value.
        default: the value when the flag is not given (None: "not given").
        dest: the namespace attribute (default: argparse's, from the first long name).
        action: argparse ``action=`` for a wired/own flag (``append``, ``store_true``, ..., or an Action class,
            which gets the negative spellings too).
        env: llama-server's environment variable (``LLAMA_ARG_*``); an explicit flag wins over it.
        group: llama-server's argument group: ``common``, ``sampling``, ``server``, ``speculative``,
            or ``hydra`` for hydra-trio's own flags and those of the cluster's llama-server fork.
        lands: where a wired flag lands (a settings field), for the flag table.
    """

    names: tuple[str, ...]
    kind: str
    note: str = ""
    neg: tuple[str, ...] = ()
    value: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    dest: str | None = None
    action: str | builtins.type[argparse.Action] | None = None
    env: str | None = None
    group: str = "common"
    lands: str = ""
    extra: dict[str, Any] = attrs.field(factory=dict)

    @property
    def name(self) -> str:
        """The flag's canonical spelling: its first ``--long`` name."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    @property
    def all_names(self) -> tuple[str, ...]:
        return self.names + self.neg

    @property
    def key(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")


def version_text() -> str:
    """``hydra-trio --version``: this package's version and llama-cpp-python's (read without loading llama.cpp)."""
    import importlib.metadata  # here, not with the module: some 40 modules a node does not need

    try:
        llama = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        llama = "not installed"
    from ..engine.llama.ggml_backend import build_backends

    backends = ", ".join(build_backends()) or "none"
    return f"hydra-trio {__version__} (llama-cpp-python {llama}, backends {backends}, Python {sys.version.split()[0]})"


class Version(argparse.Action):
    """``--version``: print :func:`version_text` and exit 0, as argparse's ``version`` action; the text is
    made when the flag is given, not when the parser is built (a node does not read package metadata)."""

    def __init__(
        self,
        option_strings: list[str],
        dest: str = argparse.SUPPRESS,
        default: Any = argparse.SUPPRESS,
        help: str | None = None,
    ) -> None:  # argparse's
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(version_text())
        parser.exit()


class _Refuse(argparse.Action):
    """A refused flag: exit 2 at once, naming the flag and the reason."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kw: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string}: not supported by hydra-trio: {self.reason}")


class _Accept(argparse.Action):
    """An accepted flag: keeps its (checked) value and remembers that it was given, for the start-up note."""

    def __init__(self, option_strings: list[str], dest: str, const: Any = None, **kw: Any) -> None:
        super().__init__(option_strings, dest, const=const, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = getattr(namespace, "_accepted_given", None) or []
        if option_string not in given:
            given = [*given, option_string]
        namespace._accepted_given = given


def add_flags(parser: argparse.ArgumentParser | Any, flags: Iterable[Flag]) -> None:
    """Register ``flags`` on ``parser`` (an ArgumentParser or one of its groups)."""
    for f in flags:
        dest = f.key
        if f.action == "help":
            parser.add_argument(*f.names, action="help", help=f.note)
            continue
        if f.action == "version":
            parser.add_argument(*f.names, action=Version, help=f.note)
            continue
        if f.kind == REFUSED:
            parser.add_argument(
                *f.all_names,
                dest=f"_refused_{dest}",
                action=_Refuse,
                reason=f.note,
                default=argparse.SUPPRESS,
                nargs=None if f.value else 0,
                metavar=f.value,
                help=f"refused: {f.note}",
            )
            continue
        if f.kind == ACCEPTED:
            nargs = None if f.value else 0
            parser.add_argument(
                *f.names,
                dest=dest,
                action=_Accept,
                nargs=nargs,
                const=True,
                type=f.type,  # type: ignore[arg-type]  # None: no conversion
                metavar=f.value,
                default=f.default,
                help=f"accepted, no effect: {f.note}",
            )
            if f.neg:
                parser.add_argument(
                    *f.neg, dest=dest, action=_Accept, nargs=0, const=False, default=f.default, help=argparse.SUPPRESS
                )
            continue
        helptext = f.note.replace("%", "%%")
        if f.default is not None and "(default" not in f.note:
            helptext += " (default: %(default)s)"
        if f.value is None and f.action is None:  # a switch, with its negative spellings (extra default None: unset)
            default = f.extra.get("default", f.default if f.default is not None else False)
            parser.add_argument(*f.names, dest=dest, action="store_const", const=True, default=default, help=helptext)
            if f.neg:
                parser.add_argument(*f.neg, dest=dest, action="store_const", const=False, help=argparse.SUPPRESS)
            continue
        default = False if f.action == "store_true" and f.default is None else f.default
        kw: dict[str, Any] = {"dest": dest, "default": default, "help": helptext, **f.extra}
        if f.action is not None:
            kw["action"] = f.action
        if f.action not in ("store_true", "store_false", "version", "help"):
            kw["metavar"] = f.value
            if f.type is not None:
                kw["type"] = f.type
        parser.add_argument(*f.names, **kw)
        if f.neg and not isinstance(f.action, str):  # an Action class takes the negative spellings too
            parser.add_argument(*f.neg, **{**kw, "help": argparse.SUPPRESS})


def apply_environment(parser: argparse.ArgumentParser, flags: Iterable[Flag], environ: dict[str, str]) -> None:
    """llama-server's ``LLAMA_ARG_*`` environment variables as the flags' defaults (an explicit flag wins).

    A switch with negative spellings is also turned off by ``LLAMA_ARG_NO_…`` (as llama-server).  A value
    the flag's type refuses, or a refused flag's variable, is a parse error naming the variable (exit 2).
    """
    defaults: dict[str, Any] = {}
    for f in flags:
        if f.env is None:
            continue
        raw = environ.get(f.env)
        neg_env = f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if f.neg else None
        if neg_env and neg_env in environ:
            raw = "0"
        if raw is None:
            continue
        where = neg_env if neg_env and neg_env in environ else f.env
        if f.kind == REFUSED:
            parser.error(f"environment variable {where} ({f.name}): not supported by hydra-trio: {f.note}")
        try:
            if f.value is None:
                if raw in TRUTHY:
                    value: Any = True
                elif raw in FALSEY:
                    value = False
                else:
                    raise argparse.ArgumentTypeError(f"expected one of {', '.join(TRUTHY + FALSEY)}, got {raw!r}")
                if not f.neg and not value:
                    continue  # llama-server: a switch's variable only switches it on
            else:
                value = f.type(raw) if f.type is not None else raw
                if f.action == "append":
                    value = [value]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"environment variable {where} ({f.name}): {exc}")
        defaults[f.key] = value
        if f.kind == ACCEPTED:
            defaults.setdefault("_accepted_given", [])
            defaults["_accepted_given"] = [*defaults["_accepted_given"], f"{f.name} (from {where})"]
    if defaults:
        parser.set_defaults(**defaults)


def normalize_argv(argv: list[str], known: set[str]) -> list[str]:
    """llama-server reads ``--ctx_size`` as ``--ctx-size``: a ``--long_name`` whose dashed spelling is a
    known flag is rewritten (values are left alone)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg:
            name, sep, rest = arg.partition("=")
            dashed = name.replace("_", "-")
            if dashed in known and name not in known:
                arg = dashed + sep + rest
        out.append(arg)
    return out


def check_unique(flags: Iterable[Flag]) -> None:
    """Raise ValueError when two flags share a spelling (a mistake in the lists, caught by the tests)."""
    seen: dict[str, Flag] = {}
    for f in flags:
        for n in f.all_names:
            if n in seen:
                raise ValueError(f"{n} is in two flags: {seen[n].names} and {f.names}")
            seen[n] = f


def accepted_notes(flags: Iterable[Flag], args: argparse.Namespace) -> list[str]:
    """One line for each accepted flag given (on the command line or in the environment)."""
    by_name = {n: f for f in flags for n in f.all_names}
    notes = []
    for given in getattr(args, "_accepted_given", None) or []:
        f = by_name.get(given.split(" ")[0])
        if f is not None:
            notes.append(f"{given}: accepted, no effect here: {f.note}")
    return notes


def given_environment(flags: Iterable[Flag], environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``LLAMA_ARG_*`` variables set in ``environ`` that name a flag (for the start-up log)."""
    environ = os.environ if environ is None else environ
    names = []
    for f in flags:
        for env in filter(None, (f.env, f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if f.env and f.neg else None)):
            if env in environ:
                names.append(env)
    return names
