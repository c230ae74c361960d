"""The node's log format (``hydra-trio run --log-format text|json``).

Both formats carry the same fields: the time, the level, the logger's name,
the message, and where a log call has them (passed with ``extra=``) the
request fields :data:`REQUEST_FIELDS`: ``trace_id`` (the Hydra trace id, the
OpenAI reply id), ``slot`` (slot id), ``op`` (the Hydra opcode, the HTTP
method and path, the control change), ``ms`` (milliseconds the request or
change took).

* ``text``: ``TIME LEVEL logger: message`` then `` key=value`` for each
  request field present.
* ``json``: one JSON object per line with ``ts`` (ISO 8601, UTC), ``level``,
  ``logger``, ``msg``, the request fields present, and ``exc_info`` with the
  traceback when there is one (python-json-logger's ``JsonFormatter``).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

__all__ = ["LOG_FORMATS", "REQUEST_FIELDS", "TextFormatter", "configure_logging", "json_formatter"]

LOG_FORMATS = ("text", "json")
REQUEST_FIELDS = ("trace_id", "slot", "op", "ms")


class TextFormatter(logging.Formatter):
    """``TIME LEVEL logger: message`` plus `` key=value`` for each of :data:`REQUEST_FIELDS` the record has."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = "".join(f" {k}={getattr(record, k)}" for k in REQUEST_FIELDS if getattr(record, k, None) is not None)
        if not extras:
            return text
        head, sep, tail = text.partition("\n")  # a traceback stays below the line
        return head + extras + sep + tail


def json_formatter() -> logging.Formatter:
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg``, then every ``extra=`` field."""
    return JsonFormatter(
        "{levelname}{name}{message}", style="{", timestamp="ts",
        rename_fields={"levelname": "level", "name": "logger", "message": "msg"},
    )


def configure_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) at ``level`` in format ``fmt`` (``text`` or ``json``).

    Replaces the root logger's handlers, as ``logging.basicConfig(force=True)``.

    Raises:
        ValueError: ``fmt`` is not one of :data:`LOG_FORMATS`, or ``level`` not a level name.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
