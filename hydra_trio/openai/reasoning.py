"""Thinking split out of a chat reply, sans-I/O: text pieces in, ``(reasoning, content)`` deltas out.

llama-server's ``--reasoning-format`` / request field ``reasoning_format``
(``common_reasoning_format`` in ``common/common.h`` of llama.cpp, the version
llama-cpp-python 0.3.36 vendors):

``none``
    Nothing is parsed: the whole reply is content, markers included.
``deepseek``
    A thinking block at the start of the reply goes to ``reasoning_content``;
    ``content`` is what follows its end marker, free of markers.
``deepseek-legacy``
    ``content`` keeps the reply as generated, tags included (the open marker
    the prompt wrote too), and ``reasoning_content`` is filled as for
    ``deepseek``.
``auto``
    ``deepseek`` when the chat template thinks (its source names one of the
    markers below, or the rendered prompt ends inside a thinking block), else
    ``none``: a template without thinking never loses text to the parser.

Markers (start, end) known, as llama.cpp's chat parsers know them
(``common/chat-diff-analyzer.cpp``, ``common/parsers/*.cpp``):
``<think>``/``</think>`` (DeepSeek R1, Qwen3, QwQ, SmolLM3, GLM, Kimi K2
Thinking, ...), ``<seed:think>``/``</seed:think>`` (ByteDance Seed-OSS),
``[THINK]``/``[/THINK]`` (Mistral Magistral / Ministral reasoning),
``<|START_THINKING|>``/``<|END_THINKING|>`` (Cohere Command R7B / Cohere2MoE),
``<mm:think>``/``</mm:think>`` (MiniMax M3).  Not parsed: gpt-oss's Harmony
channels (``<|channel|>analysis<|message|>``) and templates whose thinking has no
pair of markers; their text stays in content.

Rules, as llama.cpp's parsers apply them:

* thinking is recognised only at the start of the reply (after whitespace),
  or from the first byte when the template opened it inside the prompt
  (:func:`opened_in_prompt`: the rendered prompt ends with a start marker,
  whitespace aside; llama-server parses ``generation_prompt + reply``);
* the reasoning text is trimmed of surrounding whitespace, and whitespace-only
  reasoning is none; whitespace right after the end marker is dropped;
* a reply that ends inside the thinking (cut by ``max_tokens``) is all
  reasoning, its content empty;
* a reply without thinking is all content, untouched.

Streaming: :meth:`ReasoningParser.feed` holds back what could still be the
start of a marker (or whitespace that trimming may drop) until the next piece
decides it, so for any way of cutting the same text into pieces the
concatenated deltas equal the whole-text parse (:func:`parse`); ``finish``
releases what is held.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")
"""llama-server's reasoning formats (``common_reasoning_format_from_name``)."""

MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<mm:think>", "</mm:think>"),
)
"""Thinking markers ``(start, end)`` the parser knows (see the module docstring)."""

_WS = " \t\r\n"


@attrs.frozen
class ReasoningDelta:
    """What one piece of generated text adds: ``reasoning`` (to ``reasoning_content``) and
    ``content`` (to ``content``); ``thinking`` is true when the piece belonged to the
    thinking block (its markers included), for counting reasoning tokens."""

    reasoning: str = ""
    content: str = ""
    thinking: bool = False

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def check_format(name: str) -> str:
    """``name`` when it is one of :data:`FORMATS`; raises ValueError naming the choices otherwise."""
    if name not in FORMATS:
        raise ValueError(f"reasoning_format: {name!r} is not one of {', '.join(FORMATS)}")
    return name


def template_thinks(template_source: str) -> bool:
    """The chat template names a thinking marker (``auto`` then parses thinking)."""
    return any(start in template_source or end in template_source for start, end in MARKERS)


def template_markers(template_source: str) -> tuple[str, str] | None:
    """The marker pair a chat template thinks with (the first of :data:`MARKERS` it names), None when it
    names none."""
    return next((pair for pair in MARKERS if pair[0] in template_source or pair[1] in template_source), None)


def opened_in_prompt(prompt: str, markers: Iterable[tuple[str, str]] = MARKERS) -> tuple[str, str] | None:
    """The marker pair whose start ends ``prompt`` (trailing whitespace aside): the template opened
    the thinking block, so the reply starts inside it.  None otherwise."""
    tail = prompt.rstrip(_WS)
    for pair in markers:
        if tail.endswith(pair[0]):
            return pair
    return None


def resolve_format(name: str, template_source: str, prompt: str) -> str:
    """The effective format: ``auto`` becomes ``deepseek`` when the template thinks (or the prompt
    opened a thinking block), else ``none``; the others are kept."""
    if name != "auto":
        return name
    return "deepseek" if template_thinks(template_source) or opened_in_prompt(prompt) else "none"


@attrs.frozen
class ThinkingSetup:
    """How one chat reply is parsed: the effective format (never ``auto``) and the marker pair the
    prompt opened (None: the reply starts outside thinking)."""

    fmt: str = "none"
    prompt_open: tuple[str, str] | None = None
    opened_text: str | None = None  # the prompt's tail from the open marker on
    prefill: str = ""  # a continued message's text: read before the reply, part of the message
    prefill_in_stream: bool = False  # ... and of the first streamed delta (see hydra_trio.openai.prefill)

    @classmethod
    def for_prompt(
        cls, fmt: str, template_source: str, prompt: str, prefill: str | None = None, prefill_in_stream: bool = False
    ) -> ThinkingSetup:
        """The setup for a reply to ``prompt`` rendered by the template ``template_source``
        (``auto`` resolved by :func:`resolve_format`).  ``prefill``: the prompt ends with a continued message
        (:mod:`hydra_trio.openai.prefill`) whose text, from its thinking start marker on, is this; the parser
        reads it first instead of looking for a thinking block the prompt opened, and ``prefill_in_stream``
        puts what it adds in the first streamed delta."""
        fmt = resolve_format(check_format(fmt), template_source, prompt)
        if prefill is not None:
            return cls(fmt, prefill=prefill, prefill_in_stream=prefill_in_stream)
        pair = opened_in_prompt(prompt) if fmt != "none" else None
        return cls(fmt, pair, prompt[prompt.rstrip(_WS).rfind(pair[0]) :] if pair else None)

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.fmt, self.prompt_open, opened_text=self.opened_text)


# parser phases
_START, _THINK, _AFTER, _CONTENT = "start", "think", "after", "content"


class ReasoningParser:
    """Incremental thinking splitter for one reply (see the module docstring).

    Args:
        fmt: ``none``, ``deepseek`` or ``deepseek-legacy`` (resolve ``auto`` first:
            :func:`resolve_format`); raises ValueError for another.
        prompt_open: the marker pair the prompt opened (:func:`opened_in_prompt`): the
            reply starts inside thinking.
        markers: the marker pairs recognised at the start of the reply.
        opened_text: what the prompt wrote from the open marker on (e.g. ``"<think>\n"``), put in
            front of ``deepseek-legacy`` content; default: the start marker.
    """

    def __init__(
        self,
        fmt: str = "deepseek",
        prompt_open: tuple[str, str] | None = None,
        markers: Iterable[tuple[str, str]] = MARKERS,
        opened_text: str | None = None,
    ) -> None:
        if fmt not in ("none", "deepseek", "deepseek-legacy"):
            raise ValueError(f"reasoning format {fmt!r}: resolve 'auto' first (resolve_format)")
        self.fmt = fmt
        self.markers = tuple(markers)
        self._buf = ""  # held text, not yet emitted
        self._end = ""  # the end marker of the open thinking block
        self._started = False  # reasoning has emitted non-whitespace (leading whitespace is trimmed)
        self._legacy_prefix = ""
        if fmt == "none":
            self._phase = _CONTENT
        elif prompt_open is not None:
            self._phase, self._end = _THINK, prompt_open[1]
            if fmt == "deepseek-legacy":
                self._legacy_prefix = prompt_open[0] if opened_text is None else opened_text
        else:
            self._phase = _START

    @property
    def in_thinking(self) -> bool:
        """The reply is inside its thinking block now."""
        return self._phase == _THINK

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of generated text; returns what can be emitted now."""
        before = self._phase
        reasoning, content = self._step(text, final=False)
        return self._delta(text, reasoning, content, before)

    def finish(self) -> ReasoningDelta:
        """The reply ended: release what is held (an unfinished thinking block is all reasoning)."""
        before = self._phase
        reasoning, content = self._step("", final=True)
        return self._delta("", reasoning, content, before)

    def _delta(self, raw: str, reasoning: str, content: str, before: str) -> ReasoningDelta:
        thinking = (before == _THINK or self._phase == _THINK) and not content
        if self.fmt == "deepseek-legacy":  # content is the reply as generated; reasoning as deepseek
            content, self._legacy_prefix = self._legacy_prefix + raw, ""
        return ReasoningDelta(reasoning, content, thinking)

    def _step(self, text: str, *, final: bool) -> tuple[str, str]:
        if self._phase == _CONTENT:
            return "", text
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._phase == _START:
                body = buf.lstrip(_WS)
                pair = next((p for p in self.markers if body.startswith(p[0])), None)
                if pair is not None:
                    self._phase, self._end = _THINK, pair[1]
                    self._buf = body[len(pair[0]) :]
                    continue
                if not final and (not body or any(p[0].startswith(body) for p in self.markers)):
                    return "", ""  # whitespace, or possibly a marker still arriving
                self._phase, self._buf = _CONTENT, ""
                content.append(buf)  # no thinking: the reply untouched
                break
            if self._phase == _THINK:
                i = buf.find(self._end)
                if i >= 0:
                    reasoning.append(self._reason(buf[:i], closing=True))
                    self._phase, self._buf = _AFTER, buf[i + len(self._end) :]
                    continue
                if final:
                    reasoning.append(self._reason(buf, closing=True))
                    self._buf = ""
                    break
                keep = _held_suffix(buf, self._end)
                self._buf = buf[len(buf) - keep :]
                reasoning.append(self._reason(buf[: len(buf) - keep], closing=False))  # may hold whitespace
                break
            if self._phase == _AFTER:
                body = buf.lstrip(_WS)
                self._buf = ""
                if body:
                    self._phase = _CONTENT
                    content.append(body)
                break
            content.append(buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def _reason(self, text: str, *, closing: bool) -> str:
        """Reasoning text to emit from ``text`` (the held part excluded): leading whitespace of the
        block is dropped; trailing whitespace is held back (or dropped when ``closing``)."""
        if not self._started:
            text = text.lstrip(_WS)
            if not text:
                return ""
        body = text.rstrip(_WS)
        if closing:
            self._started = self._started or bool(body)
            return body
        if not body:  # only whitespace: hold it all (it is dropped if the block ends here)
            self._buf = text + self._buf
            return ""
        self._started = True
        tail = text[len(body) :]
        self._buf = tail + self._buf
        return body


def _held_suffix(buf: str, marker: str) -> int:
    """How many characters at the end of ``buf`` must be held: the longest suffix that is a proper
    prefix of ``marker`` (a marker that may still be arriving)."""
    n = 0
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            n = k
            break
    return n


@attrs.frozen
class Split:
    """A whole reply split: ``reasoning`` and ``content`` text."""

    reasoning: str
    content: str


def parse(
    text: str,
    fmt: str = "deepseek",
    prompt_open: tuple[str, str] | None = None,
    markers: Iterable[tuple[str, str]] = MARKERS,
) -> Split:
    """The whole-text parse of one reply (same rules as :class:`ReasoningParser`)."""
    p = ReasoningParser(fmt, prompt_open, markers)
    a, b = p.feed(text), p.finish()
    return Split(a.reasoning + b.reasoning, a.content + b.content)


class ChatReplyText:
    """One chat reply's text through its thinking parser, for the OpenAI shapes (HTTP and Hydra alike).

    :meth:`add` each generated piece (with its token count), :meth:`finish` at the end; ``reasoning``
    and ``content`` hold the whole split, ``reasoning_tokens`` the tokens of the thinking block
    (``usage.completion_tokens_details.reasoning_tokens``).
    """

    def __init__(self, setup: ThinkingSetup | None = None) -> None:
        setup = setup or ThinkingSetup()
        self._parser: ReasoningParser | None = setup.parser()
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self.reasoning_tokens = 0
        self._held = ReasoningDelta()  # the continued text, for the first delta
        if setup.prefill:  # llama-server parses generation prompt + reply
            d = self._record(self._parser.feed(setup.prefill))
            if setup.prefill_in_stream:
                self._held = ReasoningDelta(d.reasoning, d.content)

    def add(self, text: str, n_tokens: int) -> ReasoningDelta:
        """A generated piece; returns what it adds to the message (maybe nothing yet)."""
        if self._parser is None:
            raise RuntimeError("the reply is finished")
        d = self._record(self._parser.feed(text))
        if d.thinking:
            self.reasoning_tokens += n_tokens
        return self._with_held(d)

    def finish(self) -> ReasoningDelta:
        """The reply ended: what the parser still held (empty the second time)."""
        if self._parser is None:
            return ReasoningDelta()
        d, self._parser = self._record(self._parser.finish()), None
        return self._with_held(d)

    def _with_held(self, d: ReasoningDelta) -> ReasoningDelta:
        if not self._held:
            return d
        h, self._held = self._held, ReasoningDelta()
        return attrs.evolve(d, reasoning=h.reasoning + d.reasoning, content=h.content + d.content)

    def _record(self, d: ReasoningDelta) -> ReasoningDelta:
        self._reasoning.append(d.reasoning)
        self._content.append(d.content)
        return d

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def message(self) -> dict[str, str]:
        """A whole reply's ``message``: ``role``, ``content`` ("" when there is none) and
        ``reasoning_content`` only when there is some, as llama-server shapes it."""
        self.finish()
        out = {"role": "assistant", "content": self.content}
        if reasoning := self.reasoning:
            out["reasoning_content"] = reasoning
        return out

    @staticmethod
    def delta(d: ReasoningDelta) -> dict[str, str]:
        """A streamed chunk's ``delta``: ``reasoning_content`` and/or ``content`` (``content: ""``
        when the piece added nothing, e.g. a chunk sent for its logprobs)."""
        out: dict[str, str] = {}
        if d.reasoning:
            out["reasoning_content"] = d.reasoning
        if d.content or not out:
            out["content"] = d.content
        return out
