"""What a chat template can render: ``/props``' ``chat_template_caps``, llama-server's map of them.

llama-server (``common/jinja/caps.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors) runs the
template on probe conversations and watches which inputs it reads.  This node renders the same probes and
looks for each probe's marker in the prompt, which answers the same question for every template that
writes what it reads::

    supports_string_content       a user message's string content shows (false: the template fails on it)
    supports_typed_content        content as a list of ``{"type": "text", "text"}`` parts shows
    supports_system_role          a system message's content shows
    supports_tools                a tool definition offered in ``tools`` shows
    supports_tool_calls           an assistant message's ``tool_calls`` show
    supports_parallel_tool_calls  both of two tool calls in one message show
    supports_object_arguments     a tool call's ``arguments`` given as an object show
    supports_preserve_reasoning   an earlier assistant turn's ``reasoning_content`` shows (llama-server's own test)
    supports_reasoning_effort     the template's text reads ``reasoning_effort``

A built-in template (llama.cpp's by name) renders no variables: tools, tool calls and reasoning false.
Each template's map is worked out once (a few renders of a few short messages) and kept with it.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..engine import ChatTemplate

_CACHE: weakref.WeakKeyDictionary[ChatTemplate, dict[str, bool]] = weakref.WeakKeyDictionary()

_USER = {"role": "user", "content": "User message"}
_TOOL_DEF = {
    "type": "function",
    "function": {
        "name": "probe_tool_definition",
        "description": "Tool description",
        "parameters": {
            "type": "object",
            "properties": {"arg": {"type": "string", "description": "Arg description"}},
            "required": ["arg"],
        },
    },
}


def _call(name: str, arguments: Any, n: int = 1) -> dict[str, Any]:
    return {"id": f"call0000{n}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_turns(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-server's probe conversation: a user turn, an assistant turn with ``calls``, the tool's
    answer, the assistant's reply and another user turn."""
    return [
        _USER,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        _USER,
    ]


def _shows(
    tmpl: ChatTemplate,
    marker: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> bool:
    """``marker`` is in the prompt ``tmpl`` renders from ``messages`` (False when rendering fails)."""
    try:
        return marker in tmpl(messages, kwargs, tools)[0]
    except Exception:  # a template that fails on a probe lacks that capability
        return False


def _probe(tmpl: ChatTemplate) -> dict[str, bool]:
    caps = {
        "supports_string_content": _shows(tmpl, "STRING_MARKER", [{"role": "user", "content": "STRING_MARKER"}]),
        "supports_system_role": _shows(tmpl, "SYSTEM_MARKER", [{"role": "system", "content": "SYSTEM_MARKER"}, _USER]),
        "supports_typed_content": False,
        "supports_tools": False,
        "supports_tool_calls": False,
        "supports_parallel_tool_calls": False,
        "supports_object_arguments": False,
        "supports_preserve_reasoning": False,
        "supports_reasoning_effort": False,
    }
    if tmpl.kind != "jinja":
        return caps
    caps["supports_typed_content"] = _shows(
        tmpl, "TYPED_MARKER", [{"role": "user", "content": [{"type": "text", "text": "TYPED_MARKER"}]}]
    )
    caps["supports_tools"] = _shows(tmpl, "probe_tool_definition", [_USER], [_TOOL_DEF])
    as_object = _tool_turns([_call("probe_tool_call", {"arg": "ARG_MARKER"})])
    caps["supports_object_arguments"] = _shows(tmpl, "ARG_MARKER", as_object, [_TOOL_DEF])
    args: Any = {"arg": "value"} if caps["supports_object_arguments"] else '{"arg": "value"}'
    caps["supports_tool_calls"] = _shows(
        tmpl, "probe_tool_call", _tool_turns([_call("probe_tool_call", args)]), [_TOOL_DEF]
    )
    caps["supports_parallel_tool_calls"] = _shows(
        tmpl,
        "probe_second_call",
        _tool_turns([_call("probe_first_call", args), _call("probe_second_call", args, 2)]),
        [_TOOL_DEF],
    )
    caps["supports_preserve_reasoning"] = _shows(
        tmpl,
        "<REASONING_CONTENT_PLACEHOLDER>",
        [
            _USER,
            {
                "role": "assistant",
                "content": "Assistant message",
                "reasoning_content": "<REASONING_CONTENT_PLACEHOLDER>",
            },
            _USER,
            {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
            _USER,
        ],
        kwargs={"enable_thinking": True},
    )
    caps["supports_reasoning_effort"] = "reasoning_effort" in tmpl.source
    return caps


def template_caps(tmpl: ChatTemplate) -> dict[str, bool]:
    """``chat_template_caps`` of ``tmpl`` (the module docstring), worked out on the first call for it:
    call it off the event loop (a worker thread) when it may be the first."""
    caps = _CACHE.get(tmpl)
    if caps is None:
        caps = _CACHE[tmpl] = _probe(tmpl)
    return dict(caps)


def known(tmpl: ChatTemplate) -> bool:
    """``tmpl``'s map has been worked out (:func:`template_caps` returns at once)."""
    return tmpl in _CACHE
