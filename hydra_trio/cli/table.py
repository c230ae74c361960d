"""The flag table of docs/cli.md, made from the flag lists (``python -m hydra_trio.cli.table`` prints it).

``tests/test_cli_flags.py`` checks that docs/cli.md holds exactly this text between its markers."""

from __future__ import annotations

import sys

from ._flags import ACCEPTED, OWN, REFUSED, WIRED
from .flags import GROUPS, RUN_FLAGS

BEGIN = "<!-- flag table: python -m hydra_trio.cli.table -->"
END = "<!-- end of flag table -->"

_KIND_TEXT = {WIRED: "wired", ACCEPTED: "accepted, no effect", REFUSED: "refused (exit 2)", OWN: "hydra-trio"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The table, one row per flag, in llama-server's groups, between :data:`BEGIN` and :data:`END`."""
    lines = [BEGIN]
    for group, title in GROUPS.items():
        flags = [f for f in RUN_FLAGS if f.group == group]
        counts = ", ".join(
            f"{sum(f.kind == k for f in flags)} {_KIND_TEXT[k]}"
            for k in (WIRED, ACCEPTED, REFUSED, OWN)
            if any(f.kind == k for f in flags)
        )
        lines += ["", f"**{title}** ({counts})", "", "| flag | class | what it does here, or why |", "|---|---|---|"]
        for f in flags:
            names = ", ".join(f"`{n}`" for n in f.all_names)
            if f.value:
                names += f" `{f.value}`"
            env = f" (env `{f.env}`)" if f.env else ""
            lines.append(f"| {_cell(names)}{env} | {_KIND_TEXT[f.kind]} | {_cell(f.note)} |")
    lines += ["", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
