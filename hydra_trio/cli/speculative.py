"""llama-server's speculative-decoding flags (``--spec-*``, ``--draft*``, ``-md``, ``-lcs``/``-lcd``, ...) and
hydra-trio's ``--spec-suffix-*``, generated from :data:`hydra_trio.engine.speculative.settings.SPEC_OPTIONS`.

Every flag is checked when the command line is parsed, with the option's own parser (llama-server's value
syntax and messages, ``common/arg.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors): a wrong
value is an argparse error (exit 2).  The values are applied as llama-server applies them: the
``LLAMA_ARG_*`` variables first, then the flags in command-line order (``--spec-type`` adds to the list
each time it is given), into ``args.speculative`` (:func:`spec_settings`), which ``EngineConfig.speculative``
takes.  Refused at parse time, naming why: ``-hfd`` (a download), the ``--spec-type`` names the bindings
cannot serve (:data:`hydra_trio.engine.speculative.reasons.UNSUPPORTED`).  ``draft-simple`` without a draft
model parses, as in llama-server, which then logs that it cannot set it up and serves without speculative
decoding (the engine does the same: :func:`hydra_trio.engine.speculative.build.build_speculative`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..engine import UNSUPPORTED
from ..engine.speculative.settings import (
    SPEC_OPTIONS,
    SpecOption,
    SpecSettings,
    apply_option,
    parse_spec_type,
)
from . import _types as t
from ._flags import OWN, REFUSED, WIRED, Flag

NO_DRAFT_DOWNLOAD = (
    "the node loads a local GGUF file or a preset (hydra-trio models); it downloads nothing at "
    "run time: give the draft model with -md FILE|ALIAS"
)
GIVEN = "_spec_given"
"""The namespace attribute that lists the speculative flags given, ``(spelling, value)`` in command-line order."""


class _Given(argparse.Action):
    """Records ``(option string, value)`` in command-line order (the value is already checked by its type)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = list(getattr(namespace, GIVEN, None) or [])
        given.append((option_string, None if self.nargs == 0 else values))
        setattr(namespace, GIVEN, given)


def _reworded(check: Callable[[str], Any], message: str) -> Callable[[str], Any]:
    """``check`` (a main flag's parser), its error led by llama-server's message for the draft option."""

    def run(text: str) -> Any:
        try:
            return check(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{message} ({exc})") from None

    return run


def _devices(text: str) -> str:
    """``-devd``: llama-server's ``parse_device_list`` names each device (``none``: no offloading); whether
    one exists is known when the draft model loads, as for ``-dev``."""
    for name in text.split(","):
        if not name:
            raise argparse.ArgumentTypeError(f"invalid device: {name}")
    return text


_ALSO: dict[str, Callable[[str], Any]] = {
    # the text SpecSettings keeps as given, checked as the main model's flag checks its own (-C, -Cr, -dev, -ot);
    # whether a device or buffer type exists is known when the draft model loads, as for -dev and -ot
    "draft_cpu_mask": _reworded(t.cpu_mask, "invalid cpumask"),
    "draft_cpu_mask_batch": _reworded(t.cpu_mask, "invalid cpumask"),
    "draft_cpu_range": _reworded(t.cpu_range, "invalid range"),
    "draft_devices": _devices,
    "draft_override_tensor": _reworded(t.tensor_overrides, "invalid value"),
}


def _checker(opt: SpecOption) -> Callable[[str], str]:
    """The argparse type of ``opt``'s value: the text unchanged once :func:`apply_option` (and the main flag's
    parser, for masks, devices, tensor overrides) takes it; ArgumentTypeError with llama-server's message."""
    also = _ALSO.get(opt.field or "")

    def check(text: str) -> str:
        try:
            apply_option(SpecSettings(), opt.names[0], text)
            if opt.field == "types":
                for name in parse_spec_type(text):
                    if name in UNSUPPORTED:
                        raise ValueError(UNSUPPORTED[name])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if also is not None:
            also(text)
        return text

    check.__name__ = opt.names[0].lstrip("-").replace("-", "_")  # argparse's "invalid <type> value" fallback
    return check


def _flag(opt: SpecOption) -> Flag:
    group, kind = ("hydra", OWN) if opt.own else ("speculative", WIRED)
    lands = f"EngineConfig.speculative.{opt.field}" if opt.field else ""
    if opt.field == "draft_hf_repo":
        return Flag(opt.names, REFUSED, NO_DRAFT_DOWNLOAD, value=opt.value, env=opt.env, group=group)
    note = opt.meaning
    if opt.removed:
        lands = "(exit 2)"
        note = f"removed from llama-server, which exits with: the argument has been removed. {opt.removed}"
    elif opt.field is None:  # --spec-default
        lands = "EngineConfig.speculative.types, .ngram_mod_*"
    if opt.field is not None and opt.default is not None and "(default" not in note:
        auto = opt.field in ("draft_n_gpu_layers", "budget_row_cost")  # -1: auto
        note += f" (default: {'auto' if auto else _shown(opt.default)})"
    return Flag(
        opt.names,
        kind,
        note,
        neg=opt.neg,
        value=opt.value,
        env=opt.env,
        group=group,
        lands=lands,
        action=_Given,
        type=None if opt.value is None else _checker(opt),
        extra={"nargs": 0} if opt.value is None else {},
    )


def _shown(value: Any) -> str:
    """A default as the help shows it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "unused"
    return str(value) if value != "" else "unused"


FLAGS: list[Flag] = [_flag(opt) for opt in SPEC_OPTIONS if not opt.own]
"""llama-server's speculative-decoding flags (its ``speculative`` group, with ``-lcs``/``-lcd``, ``-ctkd``/``-ctvd``
and ``--spec-default``)."""
OWN_FLAGS: list[Flag] = [_flag(opt) for opt in SPEC_OPTIONS if opt.own]
"""hydra-trio's ``--spec-suffix-*`` flags (the ``suffix`` type's parameters)."""


def spec_settings(args: argparse.Namespace) -> SpecSettings:
    """The :class:`SpecSettings` of a parsed command line: ``LLAMA_ARG_*`` values first, in llama-server's
    option order, then the flags in command-line order (llama-server's ``common_params_parse_ex``).  The draft
    model stays as given (``engine_config`` resolves it as ``-m``)."""
    settings = SpecSettings()
    for f in FLAGS + OWN_FLAGS:
        value = getattr(args, f.key, None) if f.env and f.kind != REFUSED else None
        if value is None:
            continue
        if f.value is None:  # a switch: its variable turns it on, LLAMA_ARG_NO_... off
            settings = apply_option(settings, f.names[0] if value else f.neg[0])
        else:
            settings = apply_option(settings, f.names[0], value)
    for name, text in getattr(args, GIVEN, None) or ():
        settings = apply_option(settings, name, text)
    return settings
