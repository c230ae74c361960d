"""A tool call's ``arguments`` streamed as the model writes them, sans-I/O (text in, fragments out).

OpenAI and llama-server stream a call as a head (``index``, ``id``, ``type``,
``function.name``, ``arguments: ""``) and then fragments of ``arguments``
whose concatenation is the whole JSON text.  :class:`CallStream` reads a call
object (``{"name": "f", "arguments": {...}}``, ``parameters`` for Llama 3, a
leading ``"type": "function"`` or ``"id"`` allowed) from the parser's buffer:
once the name and the start of the arguments object have come, the call is
*committed* (a head is sent) and the arguments follow, minified (whitespace
outside strings dropped, a raw control character inside a string escaped).

A fragment is sent only when what has been sent can still be closed into valid
JSON (:class:`ArgsStreamer`: a key is held until its value starts, a number or
literal until it ends, an escape until it is whole), so a reply cut inside the
arguments (``max_tokens``) or broken there gets valid JSON: the open string and
containers are closed (llama.cpp heals partial JSON the same way,
``common/json-partial.cpp``).  Objects that do not start that way (arguments
before the name, arguments given as a JSON string, a wrapped
``{"function": {...}}``) are not streamed: the parser reads them whole.

Everything decided depends only on the text, never on how it was cut into
pieces, so any chunking gives the same fragments' concatenation and the same
calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_WS = " \t\r\n"
_LITERAL = frozenset("0123456789+-.eEtrufalsn")
_ESCAPES = frozenset('"\\/bfnrtu')
_DECODER = json.JSONDecoder()


def decode_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value that starts at ``text[i]`` and the index after it; None when none is whole there."""
    try:
        return _DECODER.raw_decode(text, i)
    except ValueError:
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class ArgsStreamer:
    """A JSON object, character by character, out as minified text in healable pieces.

    :meth:`advance` reads ``buf`` from :attr:`pos` and returns what can be sent; :attr:`done` once
    the object closed (``pos`` just after it), :attr:`error` when the text stopped being JSON (``pos``
    at the offending character); :meth:`heal` is what closes what was sent (an open string, open
    containers) after a cut or an error.
    """

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.done = False
        self.error = False
        self._stack: list[str] = []  # "{" / "["
        self._mode = "value"
        self._held = ""  # structure not yet sent: ',' and '"key":'
        self._tok = ""  # a literal or an escape being read

    def advance(self, buf: str) -> str:
        out: list[str] = []
        while self.pos < len(buf) and not (self.done or self.error):
            if not self._step(buf[self.pos], out):
                self.error = True
                break
            self.pos += 1
        return "".join(out)

    def heal(self) -> str:
        """The text that closes what was sent (a literal that is whole is sent first)."""
        if self.done:
            return ""
        out = ""
        if self._mode == "lit" and _valid(self._tok):
            out += self._held + self._tok
        elif self._mode in ("str", "str_esc"):
            out += '"'
        return out + "".join("}" if c == "{" else "]" for c in reversed(self._stack))

    def _open(self, c: str, out: list[str]) -> None:
        out.append(self._held + c)
        self._held = ""
        self._stack.append(c)
        self._mode = "key_or_end" if c == "{" else "value_or_end"

    def _close(self, c: str, out: list[str]) -> bool:
        if not self._stack or self._stack[-1] != ("{" if c == "}" else "["):
            return False
        self._stack.pop()
        out.append(c)
        self._held = ""
        self._mode = "after"
        if not self._stack:
            self.done = True
        return True

    def _step(self, c: str, out: list[str]) -> bool:  # one state machine
        mode = self._mode
        if mode == "str":
            if c == "\\":
                self._tok, self._mode = c, "str_esc"
            elif c == '"':
                out.append(c)
                self._mode = "after"
            else:
                out.append(json.dumps(c)[1:-1] if c < " " else c)
            return True
        if mode == "str_esc":
            self._tok += c
            if len(self._tok) == 2 and c not in _ESCAPES:
                return False
            if self._tok[1] == "u" and len(self._tok) > 2 and c not in "0123456789abcdefABCDEF":
                return False
            if len(self._tok) == (6 if self._tok[1] == "u" else 2):
                out.append(self._tok)
                self._tok, self._mode = "", "str"
            return True
        if mode == "key":
            self._held += c
            if c == "\\":
                self._mode = "key_esc"
            elif c == '"':
                self._mode = "colon"
            elif c < " ":
                return False
            return True
        if mode == "key_esc":
            self._held += c
            self._mode = "key"
            return True
        if mode == "lit":
            if c in _LITERAL:
                self._tok += c
                return True
            if not _valid(self._tok):
                return False
            out.append(self._held + self._tok)
            self._held, self._tok, self._mode = "", "", "after"
            mode = "after"  # and this character ends it
        if c in _WS:
            return True
        if mode in ("value", "value_or_end"):
            if mode == "value_or_end" and c == "]":
                return self._close(c, out)
            if not self._stack and c != "{":
                return False  # arguments are an object
            if c in "{[":
                self._open(c, out)
            elif c == '"':
                out.append(self._held + c)
                self._held, self._mode = "", "str"
            elif c in _LITERAL:
                self._tok, self._mode = c, "lit"
            else:
                return False
            return True
        if mode in ("key_or_end", "key_start"):
            if mode == "key_or_end" and c == "}":
                return self._close(c, out)
            if c != '"':
                return False
            self._held += c
            self._mode = "key"
            return True
        if mode == "colon":
            if c != ":":
                return False
            self._held += c
            self._mode = "value"
            return True
        # after a value
        if c == ",":
            self._held = ","
            self._mode = "key_start" if self._stack[-1] == "{" else "value"
            return True
        if c in "}]":
            return self._close(c, out)
        return False


def _valid(literal: str) -> bool:
    try:
        v = json.loads(literal)
    except ValueError:
        return False
    return v is None or isinstance(v, (bool, int, float))


class CallStream:
    """One call object read from the parser's buffer, from its ``{`` at ``start``.

    :meth:`advance` returns ``(status, events)``: status ``"more"`` (wait for text), ``"no"`` (not a
    streamable call: nothing was sent, read the object whole) or ``"done"`` (the call ended at
    :attr:`end`); events are ``("start", name)`` and ``("args", text)``.
    """

    def __init__(self, start: int, args_keys: Sequence[str]) -> None:
        self.start = start
        self.args_keys = tuple(args_keys)
        self.name: str | None = None
        self.args: ArgsStreamer | None = None  # set once committed
        self.end = start
        self._tail = -1  # where the arguments object ended
        self.cut = False  # the reply ended inside the arguments (they were healed closed)

    @property
    def committed(self) -> bool:
        return self.args is not None

    def advance(self, buf: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        events: list[tuple[str, str]] = []
        if self.args is None:
            head = self._head(buf)
            if head == "more" and final:
                head = "no"
            if head != "stream":
                return head, events
            assert self.name is not None and self.args is not None
            events.append(("start", self.name))
        a = self.args
        if not a.done and not a.error:
            text = a.advance(buf)
            if text:
                events.append(("args", text))
            if not (a.done or a.error):
                if not final:
                    return "more", events
                self.cut = True
                healed = a.heal()
                if healed:
                    events.append(("args", healed))
                self.end = len(buf)
                return "done", events
            if a.error:
                healed = a.heal()
                if healed:
                    events.append(("args", healed))
                self.end = a.pos
                return "done", events
        return self._rest(buf, final), events

    def _rest(self, buf: str, final: bool) -> str:
        """After the arguments: the object's other members (``"id"``...) and its ``}``."""
        assert self.args is not None
        e = self.args.pos
        k = _skip_ws(buf, e)
        if k < len(buf) and buf[k] == "}":
            self.end = k + 1
            return "done"
        if k < len(buf) and buf[k] == ",":
            got = decode_at("{" + buf[k + 1 :], 0)
            if got is not None:
                self.end = k + got[1]
                return "done"
        elif k < len(buf):
            self.end = e  # not this object's end: the rest is the format's business
            return "done"
        if final:
            self.end = e
            return "done"
        return "more"

    def _head(self, buf: str) -> str:
        k = self.start + 1
        name: str | None = None
        while True:
            k = _skip_ws(buf, k)
            if k >= len(buf):
                return "more"
            if buf[k] != '"':
                return "no"
            got = decode_at(buf, k)
            if got is None:
                return "more"
            key, k = got
            k = _skip_ws(buf, k)
            if k >= len(buf):
                return "more"
            if buf[k] != ":":
                return "no"
            k = _skip_ws(buf, k + 1)
            if k >= len(buf):
                return "more"
            if key in self.args_keys:
                if not name or buf[k] != "{":
                    return "no"
                self.name, self.args = name, ArgsStreamer(k)
                return "stream"
            if key not in ("name", "type", "id") or buf[k] != '"':
                return "no"
            got = decode_at(buf, k)
            if got is None:
                return "more"
            value, k = got
            if key == "name":
                name = value
            k = _skip_ws(buf, k)
            if k >= len(buf):
                return "more"
            if buf[k] != ",":
                return "no"
            k += 1
