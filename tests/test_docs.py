"""The documentation stands alone: comments, docstrings and docs cite only what the repository holds.

A citation of a file outside the repository (the sibling folder of design notes, a wire reference that is not
``docs/hydra-protocol.md``, a design document the repository never had), of a ticket number, or of another
implementation by a nickname leaves the reader with nothing to open: the rule has to be stated in place, or
a file in the repository cited.  Checked on every source and documentation file the repository tracks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("hydra_trio", "tests", "fuzz", "bench", "examples")
CODE_FILES = ("dev.sh", ".ci/run", "pyproject.toml")


def _code_files() -> list[Path]:
    out = [ROOT / f for f in CODE_FILES if (ROOT / f).exists()]
    for d in CODE_DIRS:
        out += sorted(p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".md", ".toml", ".yml")
                      and "__pycache__" not in p.parts)
    return [p for p in out if p != Path(__file__).resolve()]  # this file spells out the examples it refuses


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# What no file may say.
EVERYWHERE = {
    "a file outside the repository": re.compile(r"\.\./shared|/work/shared|(?<![\w/.])DESIGN[.]md"),
    "a ticket number": re.compile(r"\bissues? ?#?\d+|(?<![\w&/#'\"(])#\d+\b|\bthe issue\b", re.I),
    "another implementation by a nickname": re.compile(r"\bC\+\+ (llama-)?engine|the project'?s VM", re.I),
    "a [fix] marker of the reference": re.compile(r"\[fix\]"),
}
# Outside docs/, the wire reference is cited by its path in the repository.
WIRE_REFERENCE = re.compile(r"(?<!docs/)(?<![\w-])hydra-protocol[.]md")


def _violations(path: Path, rules: dict[str, re.Pattern[str]]) -> list[str]:
    out = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for what, rx in rules.items():
            if rx.search(line):
                out.append(f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()[:120]}")
    return out


def test_code_cites_only_the_repository() -> None:
    """Comments, docstrings and strings of the package, tests, fuzzer, benches, examples and scripts."""
    bad = []
    for p in _code_files():
        bad += _violations(p, {**EVERYWHERE, "the wire reference outside docs/": WIRE_REFERENCE})
    assert not bad, "\n".join(bad)


def test_docs_cite_only_the_repository() -> None:
    bad = []
    for p in _doc_files():
        rules = dict(EVERYWHERE)
        if p.parent != ROOT / "docs":
            rules["the wire reference outside docs/"] = WIRE_REFERENCE
        bad += _violations(p, rules)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("text", [
    "see ../shared/hydra-protocol.md", "(hydra-protocol.md §2)", "as DESIGN.md says", "issue 14 §3",
    "Issue 22: costs", "fixed in #34", "the issue's crasher", "as the C++ engine does", "the C++ llama-engine's",
    "0.13 ms on the project's VM", "rows marked **[fix]**",
])
def test_the_rules_catch_each_kind(text: str, tmp_path: Path) -> None:
    """Each kind of citation is caught (so the two tests above can fail)."""
    p = tmp_path / "x.py"
    p.write_text(f"# {text}\n")
    rules = {**EVERYWHERE, "wire": WIRE_REFERENCE}
    hits = [what for what, rx in rules.items() if rx.search(p.read_text())]
    assert hits, text


@pytest.mark.parametrize("text", [
    "docs/hydra-protocol.md §2", "color: #e5e7eb",
    "llama-server's C++ conversion", "docs/protocol-notes.md", "[§2](#2-framing)", "docs/hydra-protocol.md",
])
def test_the_rules_leave_citations_of_the_repository(text: str) -> None:
    hits = [what for what, rx in {**EVERYWHERE, "wire": WIRE_REFERENCE}.items() if rx.search(text)]
    assert not hits, (text, hits)
