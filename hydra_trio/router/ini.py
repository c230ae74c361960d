"""llama-server's preset INI files, read as llama-server reads them (``parse_ini_from_file`` in
``common/preset.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors).

Python's :mod:`configparser` reads another dialect: keys are lowercased, an inline comment needs a space
before it, an indented line continues the value above, ``:`` also separates a key, ``%`` interpolates and a
key before the first section is an error.  llama-server's grammar, line by line:

* ``[ NAME ]``: a section (a second one of the same name starts it again, empty);
* ``KEY = VALUE``: ``KEY`` is ``[A-Za-z_][A-Za-z0-9_.-]*``, case kept; ``VALUE`` is everything after the
  ``=`` and its spaces up to the first ``;`` or ``#`` or the end of the line, without trailing spaces;
  quotes are part of the value; the last of two equal keys wins;
* ``; ...`` or ``# ...`` (after spaces): a comment; an empty line;
* anything else (an indented key, a line without ``=``) makes the whole file unreadable.

Keys before the first section belong to the section ``default``.
"""

from __future__ import annotations

import re

DEFAULT_SECTION = "default"
"""The section of the keys written before any ``[section]`` (llama-server's ``COMMON_PRESET_DEFAULT_NAME``)."""

_HEADER = re.compile(r"\[[ \t]*([^\]]+)\][ \t]*(?:[;#].*)?")
_KEY_VALUE = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*(.*?)[ \t]*(?:[;#].*)?")
_COMMENT_OR_BLANK = re.compile(r"[ \t]*(?:[;#].*)?")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


class IniError(ValueError):
    """A preset file that llama-server's grammar does not read (the message names the file and the line)."""


def parse_ini(text: str, source: str = "<preset>") -> dict[str, dict[str, str]]:
    """The sections of an INI text: ``{section: {key: value}}`` in file order.

    Raises:
        IniError: a line that is neither a section, a ``key = value``, a comment nor empty.
    """
    sections: dict[str, dict[str, str]] = {}
    current = DEFAULT_SECTION
    for number, line in enumerate(re.split(r"\r\n|\n|\r", text), 1):
        if _COMMENT_OR_BLANK.fullmatch(line):
            continue
        if m := _HEADER.fullmatch(line):
            current = m.group(1)
            sections[current] = {}
        elif m := _KEY_VALUE.fullmatch(line):
            sections.setdefault(current, {})[m.group(1)] = m.group(2)
        else:
            raise IniError(
                f"failed to parse server config file: {source}: line {number} is neither "
                f"'[section]', 'key = value' nor a comment: {line!r}"
            )
    return sections


def canonical_name(section: str) -> str:
    """A section's model name as llama-server lists it: the tag after the last ``:`` in upper case, from its
    last ``-`` or ``.`` on when it has one (``repo:ud-q4_k_xl`` is ``repo:Q4_K_XL``); ``*`` and ``default``
    as they are."""
    if section in ("*", DEFAULT_SECTION) or ":" not in section:
        return section
    head, _, tag = section.rpartition(":")
    m = _TAG.search(tag)
    return f"{head}:{(m.group(1) if m else tag).upper()}"
