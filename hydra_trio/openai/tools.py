"""Tool calling (OpenAI ``tools``): request checks, prompt rendering, grammars and output parsing.

Sans-I/O: no engine, no sockets.  Text goes in, tool calls come out.

Formats (:func:`detect_format`), detected from the chat template's text as
llama-server detected them before its automatic parser (llama.cpp
``common/chat.cpp``):

- ``hermes``: the template mentions ``<tool_call>`` (Hermes 2/3, Qwen 2.5/3):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
- ``mistral``: the template mentions ``[TOOL_CALLS]`` (Mistral Nemo and friends):
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}]``.
- ``llama3``: the template has an ``ipython`` header (Llama 3.1/3.2/3.3):
  a bare ``{"name": ..., "parameters": {...}}`` object.
- ``generic``: any other template.  The reply is one JSON object:
  ``{"tool_call": {"name", "arguments"}}``, ``{"tool_calls": [...]}``
  (with ``parallel_tool_calls``) or ``{"response": "text"}``; the tools and
  this reply format are described in a system message (llama-server's generic
  tool prompt, its minja polyfills for templates that know no tools).

Grammars (:func:`tool_grammar`): each tool's ``parameters`` JSON schema becomes
GBNF through the node's bounded converter (:mod:`hydra_trio.openai.json_schema`, the
one ``json_schema`` uses), wrapped in the format's markers.  ``required`` and a named function constrain the whole
reply; ``auto`` uses a lazy grammar that wakes at the format's marker (``<tool_call>``,
``[TOOL_CALLS]``, ``{"name": "``) for the native formats, and the whole-reply
grammar (call or ``response``) for ``generic``, as llama-server did.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from .tool_prompt import (  # noqa: F401  (the request side, re-exported: one module for callers)
    FORMATS,
    GENERIC_INSTRUCTION,
    Tool,
    ToolGrammar,
    ToolSpec,
    after_thinking,
    arguments_object,
    check_messages,
    detect_format,
    parse_tool_spec,
    render_messages,
    template_supports_tools,
    tool_grammar,
)
from .tool_stream import CallStream
from .tool_stream import decode_at as _decode_at


# --------------------------------------------------------------------------- output parsing
@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class CallStart:
    """A tool call begins: OpenAI's first streamed delta of a call (``arguments`` empty)."""

    index: int
    id: str
    name: str


@attrs.frozen
class CallArguments:
    """A fragment of call ``index``'s ``arguments`` JSON string."""

    index: int
    text: str


Event = ContentDelta | CallStart | CallArguments


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """``call_`` and 24 random letters and digits (OpenAI's shape)."""
    alphabet = string.ascii_letters + string.digits
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


_LLAMA3_HEADS = (("{", '"name"', ":"), ("{", '"type"', ":", '"function"', ",", '"name"', ":"))
_WS = " \t\r\n"


def _heads_state(s: str, heads: Iterable[Sequence[str]]) -> str:
    """``"match"`` when ``s`` starts with one of the token sequences ``heads`` (whitespace allowed
    between tokens), ``"maybe"`` when ``s`` is a prefix of such a start, else ``"no"``."""
    best = "no"
    for head in heads:
        i = 0
        state = "match"
        for k, tok in enumerate(head):
            if k:
                while i < len(s) and s[i] in _WS:
                    i += 1
            rest = s[i : i + len(tok)]
            if rest == tok:
                i += len(tok)
                continue
            state = "maybe" if tok.startswith(rest) and i + len(rest) == len(s) else "no"
            break
        if state == "match":
            return "match"
        if state == "maybe":
            best = "maybe"
    return best


_RESPONSE_HEAD = ("{", '"response"', ":", '"')
_CALL_HEAD = ("{", '"tool_call"', ":", "{")
_CALLS_HEAD = ("{", '"tool_calls"', ":", "[", "{")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _head_end(s: str, head: Sequence[str]) -> int:
    """Where ``s``'s match of the token sequence ``head`` ends (whitespace allowed between
    tokens); -1 when ``s`` is a proper prefix of a match, 0 when it does not match."""
    i = 0
    for k, tok in enumerate(head):
        if k:
            while i < len(s) and s[i] in _WS:
                i += 1
        rest = s[i : i + len(tok)]
        if rest != tok:
            return -1 if tok.startswith(rest) and i + len(rest) == len(s) else 0
        i += len(tok)
    return i


def _clean(text: str) -> str:
    """Lone surrogates (a JSON ``\\ud83d`` without its pair) become ``?``: the reply must encode as UTF-8."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _hex(s: str) -> int:
    try:
        return int(s, 16) if len(s) == 4 else -1
    except ValueError:
        return -1


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_from(obj: Any, args_keys: Sequence[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call object, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "function" and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):
                parsed = arguments_object(args)
                args = parsed if isinstance(parsed, dict) else args
            if not isinstance(args, dict):
                return None
            return name, json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return name, "{}"


@attrs.frozen
class ChatTools:
    """How a chat request's tools are handled: the request's :class:`~.tool_prompt.ToolSpec` and the
    template's tool-call ``format`` (:func:`detect_format`); the reply is parsed with
    :class:`ToolCallParser` ``(format)`` when ``spec.active``."""

    spec: ToolSpec
    format: str


class ToolCallParser:
    """Splits a reply into content and tool calls, incrementally.

    ``feed(text)`` and ``finish()`` return :data:`Event` lists; the result does not depend
    on how the reply is cut into pieces (a decision is only taken once the text that
    decides it has arrived, and text that might still open a call is held back).
    Content is trimmed of surrounding whitespace, as llama-server trims it.

    A call object that starts ``{"name": "f", "arguments": {`` is streamed
    (:mod:`.tool_stream`): its :class:`CallStart` as soon as that head has come, then its
    arguments in :class:`CallArguments` fragments as the model writes them (minified, each
    fragment closable into valid JSON; a reply cut inside them gets them closed).  Another
    shape of call is read whole, its arguments compact JSON in one fragment.
    """

    def __init__(self, fmt: str, *, ids: Iterable[str] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self._buf = ""
        self._pos = 0
        self._ids = iter(ids) if ids is not None else None
        self._started = False  # some content was sent (leading whitespace is dropped)
        self._ws = ""  # whitespace held back: sent only when more content follows
        self._skip_semicolons = False
        self._mode = "start"  # generic: start, response (inside its string), tail, text
        self._active: CallStream | None = None  # the call object being streamed
        self._whole_at = -1  # the object at this position is read whole (it cannot be streamed)
        self._after = ""  # what follows a streamed call: "tag" (hermes), "list" / "sep" (a list of calls),
        self._outer = False  # ... and whether a generic {"tool_call(s)": ...} object closes after it
        self._mark = -1  # where a list of calls began (it is content if it holds none)
        self._mark_whole = -1  # ... and the object read whole then
        self._n_at_mark = 0
        self._fallback: tuple[int, str, str, bool] = (-1, "", "start", False)
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.cut = False  # the reply ended inside a call's arguments (a stop string, max_tokens)

    # ------------------------------------------------------------ public
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        return self._scan(final=True)

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """After :meth:`finish`: ``(content or None when empty, calls)``."""
        text = "".join(self.content)
        return (text or None), list(self.calls)

    # ------------------------------------------------------------ internals
    def _content(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        text = _clean(text)
        if not self._started:
            text = text.lstrip(_WS)
            if not text:
                return
            self._started = True
        body = text.rstrip(_WS)
        tail = text[len(body) :]
        if body:
            piece = self._ws + body
            self._ws = ""
            self.content.append(piece)
            out.append(ContentDelta(piece))
        self._ws += tail

    def _call(self, name: str, args: str, out: list[Event]) -> None:
        self._begin(name, out)
        self._args(_clean(args), out)

    def _begin(self, name: str, out: list[Event]) -> None:
        cid = next(self._ids) if self._ids is not None else new_call_id()
        out.append(CallStart(len(self.calls), cid, _clean(name)))
        self.calls.append(ToolCall(cid, _clean(name), ""))

    def _args(self, text: str, out: list[Event]) -> None:
        if text:
            last = self.calls[-1]
            self.calls[-1] = attrs.evolve(last, arguments=last.arguments + text)
            out.append(CallArguments(len(self.calls) - 1, text))

    def _scan(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        step = {"hermes": self._hermes, "mistral": self._mistral, "llama3": self._llama3, "generic": self._generic}[
            self.fmt
        ]
        while self._pos < len(self._buf) or self._active is not None or (final and self._after):
            if self._active is not None:
                if not self._stream(final, out):
                    break
            elif self._after:
                if not self._after_call(final, out):
                    break
            elif not step(final, out):
                break
        return out

    def _open_call(self, at: int, keys: Sequence[str], after: str = "", whole: int | None = None) -> bool:
        """Start streaming the call object at ``at``, unless the object at ``whole`` (default ``at``: the
        one read whole should this one not stream) was found not streamable; then False."""
        whole = at if whole is None else whole
        if whole == self._whole_at:
            return False
        self._fallback = (whole, self._after, self._mode, self._outer)
        self._active, self._after = CallStream(at, keys), after
        return True

    def _stream(self, final: bool, out: list[Event]) -> bool:
        cs = self._active
        assert cs is not None
        status, events = cs.advance(self._buf, final)
        self.cut = self.cut or cs.cut
        for kind, text in events:
            (self._begin if kind == "start" else self._args)(text, out)
        if status == "more":
            return False
        self._active = None
        if status == "no":  # read it whole instead
            self._whole_at, self._after, self._mode, self._outer = self._fallback
            return True
        self._pos = cs.end
        if self._after == "" and self.fmt == "llama3":
            self._skip_semicolons = True
        if self._after == "" and self._outer:
            self._after = "outer"
        return True

    def _after_call(self, final: bool, out: list[Event]) -> bool:  # one small state machine
        """What follows a streamed call: hermes's ``</tool_call>``; in a list of calls, ``,`` and the next
        call or ``]``; the end of a generic ``{"tool_calls": [...]}`` object (its ``content``, if any)."""
        buf, after = self._buf, self._after
        k = _skip_ws(buf, self._pos)
        if k >= len(buf):
            if final:
                self._after = self._outer_done()
            return False
        if after == "tag":
            j = buf.find("</tool_call>", k)
            if j < 0 and not final:
                return False
            j = j if j >= 0 else len(buf)
            self._content(buf[k:j], out)  # not whitespace: text the model wrote inside the block
            self._pos, self._after = min(len(buf), j + len("</tool_call>")), ""
            return True
        if after == "sep":
            self._pos = k + 1
            if buf[k] == ",":
                self._after = "list"
            elif buf[k] == "]":
                self._after = self._outer_done()
            else:
                self._pos, self._after = k, self._outer_done(keep=True)
            return True
        if after == "list":
            if buf[k] == "{" and self._open_call(k, ("arguments", "parameters"), "sep"):
                return True
            got = _decode_at(buf, k)  # an item that cannot be streamed: whole
            if got is None and not final:
                return False
            call = _call_from(got[0], ("arguments", "parameters")) if got is not None else None
            if got is None or call is None:  # not a call: the list ends here, the rest is text
                if len(self.calls) == self._n_at_mark:  # no call in it: all of it, read again whole
                    k, self._whole_at = self._mark, self._mark_whole
                self._pos, self._after, self._outer = k, "", False
                return True
            self._call(*call, out)
            self._pos, self._after = got[1], "sep"
            return True
        # "outer": the rest of a generic {"tool_call(s)": ...} object
        self._after = ""
        if buf[k] == "}":
            self._pos = k + 1
        elif buf[k] == ",":
            got = _decode_at("{" + buf[k + 1 :], 0)
            if got is None and not final:
                return False
            if got is not None:
                if isinstance(got[0].get("content"), str):
                    self._content(got[0]["content"], out)
                self._pos = k + got[1]
        self._outer = False
        return True

    def _outer_done(self, keep: bool = False) -> str:
        """After a list of calls: the generic object's end, if it is one."""
        if self._outer and not keep:
            self._outer = False
            return "outer"
        self._outer = False
        return ""

    def _plain(self, marker: str, final: bool, out: list[Event]) -> int | None:
        """Send content up to ``marker``; its index, or None (the rest was sent or is held back)."""
        buf, pos = self._buf, self._pos
        i = buf.find(marker, pos)
        if i >= 0:
            self._content(buf[pos:i], out)
            self._pos = i
            return i
        keep = 0 if final else _partial_marker(buf[pos:], marker)
        end = len(buf) - keep
        self._content(buf[pos:end], out)
        self._pos = end
        return None

    def _hermes(self, final: bool, out: list[Event]) -> bool:
        start, end_tag = "<tool_call>", "</tool_call>"
        i = self._plain(start, final, out)
        if i is None:
            return False
        buf = self._buf
        k = _skip_ws(buf, i + len(start))
        if k < len(buf) and buf[k] == "{" and self._open_call(k, ("arguments", "parameters"), "tag"):
            return True
        if k >= len(buf) and not final:
            return False
        j = buf.find(end_tag, i + len(start))
        if j < 0 and not final:
            return False
        inner = buf[i + len(start) : j if j >= 0 else len(buf)]
        stop = j + len(end_tag) if j >= 0 else len(buf)
        call = self._json_call(inner.strip(), ("arguments", "parameters"))
        if call is None:
            self._content(buf[i:stop], out)
        else:
            self._call(*call, out)
        self._pos = stop
        return True

    def _mistral(self, final: bool, out: list[Event]) -> bool:
        marker = "[TOOL_CALLS]"
        i = self._plain(marker, final, out)
        if i is None:
            return False
        buf = self._buf
        k = _skip_ws(buf, i + len(marker))
        if k < len(buf) and buf[k] == "{" and self._open_call(k, ("arguments", "parameters")):
            return True
        if k < len(buf) and buf[k] == "[" and k != self._whole_at:
            first = _skip_ws(buf, k + 1)
            if first >= len(buf) and not final:
                return False
            if first < len(buf) and buf[first] == "{":  # a list of calls, each streamed
                self._mark, self._mark_whole, self._n_at_mark = i, k, len(self.calls)
                self._pos, self._after = first, "list"
                return True
            self._whole_at = k
        got = _decode_at(buf, k) if k < len(buf) else None
        if got is None:
            if not final:
                return False
            self._content(buf[i:], out)
            self._pos = len(buf)
            return True
        obj, end = got
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from(x, ("arguments", "parameters")) for x in items]
        if not items or any(c is None for c in calls):
            self._content(buf[i:end], out)
        else:
            for c in calls:
                assert c is not None
                self._call(*c, out)
        self._pos = end
        return True

    def _llama3(self, final: bool, out: list[Event]) -> bool:
        buf = self._buf
        while self._skip_semicolons and self._pos < len(buf):  # "{...}; {...}": the separator is no content
            if buf[self._pos] != ";":
                self._skip_semicolons = False
            else:
                self._pos += 1
        pos = self._pos
        if pos >= len(buf):
            return False
        i = buf.find("{", pos)
        while i >= 0:
            state = _heads_state(buf[i:], _LLAMA3_HEADS)
            if state == "match":
                break
            if state == "maybe" and not final:
                self._content(buf[pos:i], out)
                self._pos = i
                return False
            i = buf.find("{", i + 1)
        if i < 0:
            self._content(buf[pos:], out)
            self._pos = len(buf)
            return False
        self._content(buf[pos:i], out)
        self._pos = i
        if self._open_call(i, ("parameters", "arguments")):
            return True
        got = _decode_at(buf, i)
        if got is None:
            if not final:
                return False
            self._content("{", out)  # not JSON after all: the brace is text
            self._pos = i + 1
            return True
        obj, end = got
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            self._content(buf[i:end], out)
        else:
            self._call(*call, out)
            self._skip_semicolons = True
        self._pos = end
        return True

    def _generic(self, final: bool, out: list[Event]) -> bool:
        """The generic JSON reply.  ``{"response": "...`` streams the string's characters as
        content as they come (the object's closing ``}`` is dropped; anything else after the
        string is text); ``{"tool_call"...}`` / ``{"tool_calls"...}`` wait for the whole object;
        a reply that is no such object is plain text."""
        buf, pos = self._buf, self._pos
        if self._mode == "text":
            self._content(buf[pos:], out)
            self._pos = len(buf)
            return False
        if self._mode == "response":
            return self._response_string(final, out)
        if self._mode == "tail":
            k = pos
            while k < len(buf) and buf[k] in _WS:
                k += 1
            if k == len(buf):
                if final:
                    self._pos = k
                return final
            self._pos = k + 1 if buf[k] == "}" else k
            self._mode = "text"
            return True
        k = 0
        while k < len(buf) and buf[k] in _WS:
            k += 1
        if k == len(buf):
            if final:
                self._pos = len(buf)
            return final
        if buf[k] == "{":
            heads = [_head_end(buf[k:], h) for h in (_RESPONSE_HEAD, _CALL_HEAD, _CALLS_HEAD)]
            if -1 in heads and not any(h > 0 for h in heads) and not final:
                return False
            if heads[0] > 0:
                self._pos, self._mode = k + heads[0], "response"
                return True
            if heads[1] > 0 and self._open_call(k + heads[1] - 1, ("arguments", "parameters"), whole=k):
                self._mode, self._outer = "text", True  # {"tool_call": {...}}: the call streamed
                return True
            if heads[2] > 0 and k != self._whole_at:  # {"tool_calls": [{...}, ...]}: each streamed
                self._mode, self._outer = "text", True
                self._mark, self._mark_whole, self._n_at_mark = k, k, len(self.calls)
                self._pos, self._after = k + heads[2] - 1, "list"
                return True
            got = _decode_at(buf, k)
            if got is None and not final:
                return False
            if got is not None:
                obj, end = got
                if self._generic_object(obj, out):
                    self._pos, self._mode = end, "text"
                    return True
        self._mode = "text"  # not the JSON reply format: plain text
        return True

    def _response_string(self, final: bool, out: list[Event]) -> bool:
        """Decode the ``response`` string from ``_pos`` as far as whole characters have come."""
        text, self._pos, closed = _response_chars(self._buf, self._pos, final)
        self._content(text, out)
        if closed:
            self._mode = "tail"
        return closed

    def _generic_object(self, obj: Any, out: list[Event]) -> bool:
        got = _generic_reply(obj)
        if got is None:
            return False
        for c in got[0]:
            self._call(*c, out)
        self._content(got[1], out)
        return True

    @staticmethod
    def _json_call(text: str, keys: Sequence[str]) -> tuple[str, str] | None:
        got = _decode_at(text, 0) if text else None
        if got is None or text[got[1] :].strip():
            return None
        return _call_from(got[0], keys)


def _response_chars(buf: str, i: int, final: bool) -> tuple[str, int, bool]:
    """The generic reply's ``response`` string decoded from ``buf[i:]`` as far as whole characters have
    come: ``(text, where the reading stopped, the string closed)`` (the position after its quote)."""
    chars: list[str] = []
    while i < len(buf):
        c = buf[i]
        if c == '"':
            return "".join(chars), i + 1, True
        if c != "\\":
            chars.append(c)
            i += 1
            continue
        n = 6 if buf[i + 1 : i + 2] == "u" else 2
        if n == 6 and 0xD800 <= _hex(buf[i + 2 : i + 6]) < 0xDC00:  # a surrogate pair's high half
            nxt = buf[i + 6 : i + 8]
            if nxt == "\\u":
                n = 12
            elif "\\u".startswith(nxt) and i + 6 + len(nxt) == len(buf) and not final:
                break  # the low half may follow
        esc = buf[i : i + n]
        if len(esc) < n:
            break
        try:
            chars.append(json.loads('"' + esc + '"'))
        except ValueError:
            chars.append(esc)  # not an escape after all: the text as it is
        i += n
    if final:  # cut inside the string: what came is content
        chars.append(buf[i:])
        i = len(buf)
    return "".join(chars), i, False


def _generic_reply(obj: Any) -> tuple[list[tuple[str, str]], str] | None:
    """A whole generic JSON reply: ``(calls, content)``, or None when ``obj`` is not one."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("tool_calls"), list):
        calls = [_call_from(x, ("arguments", "parameters")) for x in obj["tool_calls"]]
        if any(c is None for c in calls):
            return None
        content = obj.get("content")
        return [c for c in calls if c is not None], content if isinstance(content, str) else ""
    if isinstance(obj.get("tool_call"), dict):
        call = _call_from(obj["tool_call"], ("arguments", "parameters"))
        return None if call is None else ([call], "")
    if "response" in obj:
        r = obj["response"]
        return [], r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)
    return None


def parse_reply(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's ``(content or None, tool calls)``."""
    p = ToolCallParser(fmt)
    p.feed(text)
    p.finish()
    return p.result()


def stream_delta(ev: Event) -> dict[str, Any]:
    """An event as OpenAI's streamed ``delta``: content, a call's head
    ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}``,
    or an arguments fragment ``{"tool_calls": [{"index", "function": {"arguments"}}]}``."""
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, CallStart):
        return {
            "tool_calls": [
                {"index": ev.index, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            ]
        }
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


def legacy_delta(ev: Event) -> dict[str, Any] | None:
    """An event as a legacy ``function_call`` delta (only the first call; None for others)."""
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if ev.index != 0:
        return None
    if isinstance(ev, CallStart):
        return {"function_call": {"name": ev.name, "arguments": ""}}
    return {"function_call": {"arguments": ev.text}}


def finish_reason(reason: str, calls: Sequence[ToolCall], legacy: bool = False, cut: bool = False) -> str:
    """llama-server: a reply that stopped by itself with calls finishes with ``tool_calls``; not one
    that a stop string ended inside a call's arguments (``cut``: the call is healed, not finished; llama-server
    drops such a call, ``common/chat.cpp`` common_chat_parse, and finishes with ``stop``)."""
    if calls and reason == "stop" and not cut:
        return "function_call" if legacy else "tool_calls"
    return reason


def message(content: str | None, calls: Sequence[ToolCall], legacy: bool = False) -> dict[str, Any]:
    """The reply's ``message`` (``content`` None when empty, as OpenAI)."""
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        if legacy:
            m["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        else:
            m["tool_calls"] = [c.as_openai() for c in calls]
    return m
