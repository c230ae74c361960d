"""The node's log format (``hydra-trio run --log-format text|json``).

Both formats carry the same fields: the time, the level, the logger's name,
the message, and where a log call has them (passed with ``extra=``) the
request fields :data:`REQUEST_FIELDS`: ``trace_id`` (the Hydra trace id, the
OpenAI reply id), ``slot`` (slot id), ``op`` (the Hydra opcode, the HTTP
method and path, the control change), ``ms`` (milliseconds the request or
change took).

* ``text``: ``TIME LEVEL logger: message`` then `` key=value`` for each
  request field present, on one line: control characters in the message and
  the fields (CR, LF, ESC, C1, U+2028/2029: a client's path or trace id can
  carry them) are written escaped, ``\\n``, ``\\x1b``, so no client can add a
  line of its own or drive the operator's terminal (CWE-117, OWASP Logging
  Cheat Sheet); a traceback stays below the line, as it is.
* ``json``: one JSON object per line with ``ts`` (ISO 8601, UTC), ``level``,
  ``logger``, ``msg``, the request fields present, and ``exc_info`` with the
  traceback when there is one (python-json-logger's ``JsonFormatter``).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

__all__ = ["LOG_FORMATS", "REQUEST_FIELDS", "TextFormatter", "configure_logging", "json_formatter"]

LOG_FORMATS = ("text", "json")
REQUEST_FIELDS = ("trace_id", "slot", "op", "ms")


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with each control character (C0, DEL, C1, U+2028, U+2029) as its Python escape (``\\n``, ``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL logger: message`` plus `` key=value`` for each of :data:`REQUEST_FIELDS` the record has,
    one line per record (control characters escaped, :func:`escape_controls`), the traceback below it."""

    def __init__(self, timestamps: bool = True) -> None:
        super().__init__(("%(asctime)s " if timestamps else "") + "%(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # logging's name
        extras = "".join(f" {k}={getattr(record, k)}" for k in REQUEST_FIELDS if getattr(record, k, None) is not None)
        return escape_controls(super().formatMessage(record) + extras)


def json_formatter() -> logging.Formatter:
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg``, then every ``extra=`` field
    (python-json-logger, imported here: a node logging text does not load it)."""
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        timestamp="ts",
        rename_fields={"levelname": "level", "name": "logger", "message": "msg"},
    )


def configure_logging(
    level: str = "INFO",
    fmt: str = "text",
    stream: TextIO | None = None,
    *,
    file: str | None = None,
    timestamps: bool = True,
    disabled: bool = False,
) -> None:
    """Send every logger's records to ``stream`` (stderr) at ``level`` in format ``fmt`` (``text`` or ``json``).

    Replaces the root logger's handlers, as ``logging.basicConfig(force=True)``.  llama-server's log flags:
    ``file`` also writes every line to that file (``--log-file``, appended), ``timestamps=False`` leaves the
    time out of text lines (``--no-log-timestamps``), ``disabled`` writes nothing (``--log-disable``).

    Raises:
        ValueError: ``fmt`` is not one of :data:`LOG_FORMATS`, or ``level`` not a level name.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    handlers: list[logging.Handler] = []
    if not disabled:
        handlers.append(logging.StreamHandler(stream if stream is not None else sys.stderr))
        if file is not None:
            handlers.append(logging.FileHandler(file, encoding="utf-8"))
    else:
        handlers.append(logging.NullHandler())
    for handler in handlers:
        handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter(timestamps=timestamps))
    logging.basicConfig(level=level, handlers=handlers, force=True)
