"""llama-server's flag set, read from ``common/arg.cpp`` of the llama.cpp vendored in the llama-cpp-python
sdist this project builds (dev.sh keeps the sdist under ``~/.cache/hydra-trio/sdist``; downloaded with pip
from the package registry when it is missing).

Each option is an ``add_opt(common_arg({names}, [{negative names}], ...))``; ``.set_examples({...})`` lists
the tools it applies to (none: every tool, ``LLAMA_EXAMPLE_COMMON``), ``.set_excludes({...})`` the tools it
does not, ``.set_preset_only()`` marks one that is not a command-line flag.  llama-server takes the options
whose examples include ``LLAMA_EXAMPLE_SERVER`` or ``LLAMA_EXAMPLE_COMMON`` and which do not exclude the
server (``common_params_parser_init``'s ``add_opt``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from hydra_trio.testing.spawn import ROOT

VERSION = next(
    line.split("=", 1)[1].strip()
    for line in (ROOT / "dev.sh").read_text().splitlines()
    if line.startswith("LLAMA_CPP_PYTHON_VERSION=")
)
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hydra-trio" / "sdist"


def sdist() -> Path:
    """The llama-cpp-python sdist dev.sh builds from (downloaded with pip when missing)."""
    path = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(CACHE),
                f"llama-cpp-python=={VERSION}",
            ],
            check=True,
        )
    return path


def arg_cpp_text() -> str:
    """``vendor/llama.cpp/common/arg.cpp`` of the sdist."""
    with tarfile.open(sdist()) as tar:
        member = tar.extractfile(f"llama_cpp_python-{VERSION}/vendor/llama.cpp/common/arg.cpp")
        assert member is not None
        return member.read().decode("utf-8")


def _strip(src: str) -> str:
    """``src`` without comments; string literals kept, character literals blanked (they may hold brackets)."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            i = src.find("\n", i)
            i = n if i < 0 else i
        elif src.startswith("/*", i):
            i = src.index("*/", i) + 2
        elif src[i] in "\"'":
            quote, j = src[i], i + 1
            while src[j] != quote:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i : j + 1] if quote == '"' else "' '")
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def _call_body(src: str, start: int) -> str:
    """The text from ``start`` (just inside ``add_opt(common_arg(``) to the matching close of ``add_opt(``."""
    depth, j, in_str = 2, start, False
    while depth:
        c = src[j]
        if in_str:
            if c == "\\":
                j += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        j += 1
    return src[start:j]


def server_flags(text: str | None = None) -> dict[str, set[str]]:
    """Every spelling llama-server accepts -> ``{"env": {...}}`` (the environment variables of its option)."""
    src = _strip(arg_cpp_text() if text is None else text)
    flags: dict[str, set[str]] = {}
    for m in re.finditer(r"add_opt\(common_arg\(", src):
        block = _call_body(src, m.end())
        body, lists = block.lstrip(), []
        while body.startswith("{"):
            end = body.index("}")
            lists.append(re.findall(r'"([^"]*)"', body[1:end]))
            body = body[end + 1 :].lstrip().lstrip(",").lstrip()
        examples = re.search(r"\.set_examples\(\{([^}]*)\}\)", block)
        excludes = re.search(r"\.set_excludes\(\{([^}]*)\}\)", block)
        ex = {x.strip() for x in examples.group(1).split(",")} if examples else {"LLAMA_EXAMPLE_COMMON"}
        exc = {x.strip() for x in excludes.group(1).split(",")} if excludes else set()
        if ".set_preset_only()" in block or "LLAMA_EXAMPLE_SERVER" in exc:
            continue
        if not ex & {"LLAMA_EXAMPLE_SERVER", "LLAMA_EXAMPLE_COMMON"}:
            continue
        env = re.search(r'\.set_env\("([^"]*)"\)', block)
        for name in (n for names in lists for n in names):
            flags.setdefault(name, set()).update({env.group(1)} if env else set())
    return flags
