"""Continuing the chat's final message (an assistant "prefill"), as llama-server does it.

llama-server's rules (``oaicompat_chat_params_parse`` in ``tools/server/server-common.cpp`` and
``common_chat_templates_apply_jinja`` / ``peg_generator::generate_parser`` in ``common/chat.cpp`` and
``common/chat-auto-parser-generator.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors):

* ``continue_final_message`` in the body: ``true`` (``auto``), ``"content"`` or ``"reasoning_content"``;
  any other value is no continuation.  ``add_generation_prompt`` (a boolean, default true; another type
  counts as the default) must then be false, else 400
  ``Cannot set both add_generation_prompt and continue_final_message to true.``
* Without it, ``--prefill-assistant`` (on by default) continues a final ``assistant`` message: two
  assistant messages at the end are refused (``Cannot have 2 or more assistant messages at the end of the
  list.``) and ``add_generation_prompt`` is set false.
* A continued message with ``tool_calls`` is refused (``Cannot continue an assistant message that contains
  tool calls.``).
* ``auto`` continues the reasoning when the message has ``reasoning_content`` and no content, else the
  content.
* A Jinja template renders every message but the last, with no generation prompt; then comes the
  generation prompt (what ``add_generation_prompt`` adds to those messages); when the template thinks, it is
  cut before the text the template writes in front of a reasoning (:func:`reasoning_markers`, e.g.
  ``<think>`` and a newline), which follows with the message's ``reasoning_content`` and (continuing the
  content) the text the template writes after a reasoning; then (continuing the content) the message's
  text: its ``content``, or its text parts joined by a blank line.  A built-in template (llama.cpp's,
  ``--chat-template NAME``) renders every message as it is, with no generation prompt.
* The reply: the continued text is part of the whole message (``message.content`` starts with it; the
  thinking parser reads it first).  Streamed, it leads the first delta, unless the body asked for the
  continuation itself (``continue_final_message``: llama-server's ``is_continuation``, whose parser
  state starts from it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..validation.strict import MessageError

CONTENT, REASONING = "content", "reasoning"


@attrs.frozen
class Continuation:
    """The final message continued.

    Attributes:
        mode: :data:`CONTENT` or :data:`REASONING` (``auto`` resolved).
        content: the message's text (``content``, or its text parts joined by a blank line).
        reasoning: its ``reasoning_content`` ("" without one).
    """

    mode: str
    content: str
    reasoning: str


def requested_continuation(raw: Mapping[str, Any]) -> str | None:
    """The body's ``continue_final_message`` as ``common_chat_continuation_parse`` reads it: "auto",
    "content", "reasoning" or None (absent, or no continuation)."""
    value = raw.get("continue_final_message")
    if value is True:
        return "auto"
    if value == "reasoning_content":
        return REASONING
    if value == "content":
        return CONTENT
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # ``common_chat_msg::render_content``: text parts, "\n\n" between
        return "\n\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def continuation(raw: Mapping[str, Any], prefill_assistant: bool) -> tuple[Continuation | None, bool]:
    """``(the continuation or None, add_generation_prompt)`` for a chat body ``raw`` (its JSON object,
    messages already checked); ``prefill_assistant``: ``--prefill-assistant``.

    Raises MessageError with llama-server's messages for the refusals above."""
    messages: Sequence[Any] = raw.get("messages") or ()
    agp = raw.get("add_generation_prompt", True)
    agp = agp if isinstance(agp, bool) else True
    mode = requested_continuation(raw)
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if mode is None and prefill_assistant and roles and roles[-1] == "assistant":
        if len(roles) >= 2 and roles[-2] == "assistant":
            raise MessageError("Cannot have 2 or more assistant messages at the end of the list.")
        mode, agp = "auto", False
    if mode is None:
        return None, agp
    if agp:
        raise MessageError("Cannot set both add_generation_prompt and continue_final_message to true.")
    if not messages:
        return None, agp
    last = messages[-1]
    if roles[-1] == "assistant" and last.get("tool_calls"):
        raise MessageError("Cannot continue an assistant message that contains tool calls.")
    content = _text(last.get("content"))
    reasoning = last.get("reasoning_content") if isinstance(last.get("reasoning_content"), str) else ""
    if mode == "auto":
        mode = REASONING if reasoning and not content else CONTENT
    return Continuation(mode, content, reasoning or ""), agp


def generation_prompt(without: str, with_: str) -> str:
    """What ``add_generation_prompt`` adds: ``with_`` past its longest common prefix with ``without``
    (``common_chat_template_generation_prompt``)."""
    n = 0
    for a, b in zip(without, with_, strict=False):
        if a != b:
            break
        n += 1
    return with_[n:]


_PROBE_REASONING, _PROBE_CONTENT = "hydra-probe-reasoning-7f3a", "hydra-probe-content-7f3a"


def reasoning_markers(
    render: Callable[[list[dict[str, Any]]], str], pair: tuple[str, str] | None
) -> tuple[str, str] | None:
    r"""The text a template writes before and after an assistant message's ``reasoning_content``, found as
    llama.cpp's differential template analysis finds it (``common/chat-diff-analyzer.cpp``): the template
    renders one assistant turn with and without a probe reasoning, and the difference, split at the probe,
    gives the two (e.g. ``"<think>\n"`` and ``"\n</think>\n\n"``).  ``render``: the template over
    messages, no generation prompt; ``pair``: the template's marker pair (None: it does not think, and
    neither is looked for).  A template that writes no reasoning, or fails on the probe: ``pair``."""
    if pair is None:
        return None
    user = {"role": "user", "content": "u"}
    try:
        with_ = render([user, {"role": "assistant", "content": _PROBE_CONTENT, "reasoning_content": _PROBE_REASONING}])
        without = render([user, {"role": "assistant", "content": _PROBE_CONTENT}])
    except Exception:  # the template's own refusal (raise_exception, a jinja2 error): the plain markers
        return pair
    head = len(with_) - len(generation_prompt(without, with_))  # the common prefix
    tail = 0
    while tail < len(with_) - head and tail < len(without) - head and with_[-1 - tail] == without[-1 - tail]:
        tail += 1
    inserted = with_[head : len(with_) - tail]
    if _PROBE_REASONING not in inserted:
        return pair
    start, end = inserted.split(_PROBE_REASONING, 1)
    return (start, end) if pair[0] in start and pair[1] in end else pair


def continued_tail(gen: str, c: Continuation, markers: tuple[str, str] | None) -> tuple[str, str]:
    """``(what follows the other messages in the prompt, the reply's prefilled text)`` for the generation
    prompt ``gen`` and the template's thinking markers (None: it does not think).  The prefilled text is
    what the thinking parser reads before the reply: from the start marker on (or the content alone)."""
    prefill = ""
    if markers is not None:
        start, end = markers
        cut = gen.find(start)
        gen = gen[:cut] if cut >= 0 else gen
        prefill = start + c.reasoning + (end if c.mode == CONTENT else "")
    if c.mode == CONTENT:
        prefill += c.content
    return gen + prefill, prefill
