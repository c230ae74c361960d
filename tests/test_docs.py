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
        out += sorted(
            p
            for p in (ROOT / d).rglob("*")
            if p.suffix in (".py", ".sh", ".md", ".toml", ".yml") and "__pycache__" not in p.parts
        )
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


@pytest.mark.parametrize(
    "text",
    [
        "see ../shared/hydra-protocol.md",
        "(hydra-protocol.md §2)",
        "as DESIGN.md says",
        "issue 14 §3",
        "Issue 22: costs",
        "fixed in #34",
        "the issue's crasher",
        "as the C++ engine does",
        "the C++ llama-engine's",
        "0.13 ms on the project's VM",
        "rows marked **[fix]**",
    ],
)
def test_the_rules_catch_each_kind(text: str, tmp_path: Path) -> None:
    """Each kind of citation is caught (so the two tests above can fail)."""
    p = tmp_path / "x.py"
    p.write_text(f"# {text}\n")
    rules = {**EVERYWHERE, "wire": WIRE_REFERENCE}
    hits = [what for what, rx in rules.items() if rx.search(p.read_text())]
    assert hits, text


@pytest.mark.parametrize(
    "text",
    [
        "docs/hydra-protocol.md §2",
        "color: #e5e7eb",
        "llama-server's C++ conversion",
        "docs/protocol-notes.md",
        "[§2](#2-framing)",
        "docs/hydra-protocol.md",
    ],
)
def test_the_rules_leave_citations_of_the_repository(text: str) -> None:
    hits = [what for what, rx in {**EVERYWHERE, "wire": WIRE_REFERENCE}.items() if rx.search(text)]
    assert not hits, (text, hits)


# --------------------------------------------------------------------------- the pages and their links
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives ``page``'s headings (Python-Markdown's toc slugs), outside code fences."""
    from markdown.extensions.toc import slugify

    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(slugify(m.group(1).replace("`", ""), "-"))
    return out


def _broken_links(page: Path) -> list[str]:
    out, fence = [], False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                out.append(f"{page.relative_to(ROOT)}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                out.append(f"{page.relative_to(ROOT)}:{n}: {target}: no such heading")
    return out


def test_every_relative_link_resolves() -> None:
    """README's and docs/'s links name a file that exists and, with ``#``, a heading of it."""
    bad = [b for p in _doc_files() for b in _broken_links(p)]
    assert not bad, "\n".join(bad)


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = ROOT / "docs" / "_probe_broken_link.md"
    try:
        page.write_text("# Probe\n\n[x](cli.md#no-such-heading) [y](no-such-page.md) [z](cli.md#kv-cache-types)\n")
        assert [b.split(": ")[1] for b in _broken_links(page)] == ["cli.md#no-such-heading", "no-such-page.md"]
    finally:
        page.unlink()


def test_the_readme_is_a_first_page() -> None:
    """README is what a newcomer reads first: the set-up's two commands (``.ci/run`` runs the second),
    talking to a node, the main options, and links into docs/ for the reference."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 400
    assert "./dev.sh run     #" in readme and "./dev.sh test    #" in readme
    assert "<!-- flag table" not in readme  # the reference lives in docs/
    linked = {Path(t).name for t in _LINK.findall(readme) if t.startswith("docs/")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"} <= linked


def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (mkdocs.yml: nav, link and anchor validation as warnings): a broken link or
    anchor, a page missing from the nav, a nav entry without its page all fail the build."""
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "cli" / "index.html").exists()
