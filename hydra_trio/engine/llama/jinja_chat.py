"""A Jinja chat template's renderer, as llama-cpp-python 0.3.36's ``Jinja2ChatFormatter`` renders it.

The same environment (jinja2's ``ImmutableSandboxedEnvironment``, ``trim_blocks``
and ``lstrip_blocks``, the ``loopcontrols`` extension and a pass-through for
HuggingFace's ``{% generation %}`` tag, ``tojson`` as Transformers renders it)
and the same variables (``messages``, ``bos_token``, ``eos_token``,
``raise_exception``, ``add_generation_prompt``, ``functions``, ``function_call``,
``tools``, ``tool_choice``, ``strftime_now``, then the caller's): the behaviour of
``llama_cpp/llama_chat_format.py``, written here because that module imports
``llama_cpp.llama`` and numpy (15 MiB of resident memory a node does not
otherwise need, :mod:`.bindings`); ``tests/test_memory.py`` renders
templates with both and compares.
"""

from __future__ import annotations

import contextvars
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ...validation.strict import TooLong, dumps_within


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Pass-through for HuggingFace's ``{% generation %}`` chat-template tag."""

    tags = {"generation"}  # noqa: RUF012  (jinja2.ext.Extension declares tags an instance attribute)

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_MAX_CHARS: contextvars.ContextVar[int | None] = contextvars.ContextVar("max_chars", default=None)
"""The limit of the rendering in progress on this thread (:meth:`JinjaChatFormatter.__call__`)."""


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return dumps_within(
        x, _MAX_CHARS.get(), ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(f: str) -> str:
    return datetime.now().strftime(f)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


class JinjaChatFormatter:
    """``formatter(messages=[...], tools=..., **variables) -> prompt`` for one Jinja template text.

    Raises jinja2.TemplateSyntaxError (and the other errors of jinja2's
    ``from_string``) when the text does not compile; rendering raises ValueError
    for the template's ``raise_exception(...)`` and jinja2's errors for the rest.
    """

    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True) -> None:
        self.template = template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.add_generation_prompt = add_generation_prompt
        environment = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        self._template = environment.from_string(template)

    def __call__(
        self,
        *,
        messages: list[dict[str, Any]],
        functions: list[dict[str, Any]] | None = None,
        function_call: Any = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> str:
        """The prompt: the template rendered with ``messages`` and the variables above."""
        return self.render(
            None,
            messages=messages,
            functions=functions,
            function_call=function_call,
            tools=tools,
            tool_choice=tool_choice,
            **kwargs,
        )

    def render(
        self,
        max_chars: int | None,
        /,
        *,
        messages: list[dict[str, Any]],
        functions: list[dict[str, Any]] | None = None,
        function_call: Any = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        add_generation_prompt: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """:meth:`__call__` (``add_generation_prompt`` None: the formatter's own), raising
        :class:`~hydra_trio.validation.strict.TooLong` as soon as the prompt
        would be longer than ``max_chars`` characters (None: no limit).  The text is rendered piece by
        piece (jinja2's ``generate``) and ``tojson`` stops at the limit too, so a template that
        pretty-prints a deep value (whose text grows with its depth) builds nothing much longer."""
        token = _MAX_CHARS.set(max_chars)
        try:
            pieces, n = [], 0
            for piece in self._template.generate(
                messages=messages,
                eos_token=self.eos_token,
                bos_token=self.bos_token,
                raise_exception=_raise_exception,
                add_generation_prompt=self.add_generation_prompt
                if add_generation_prompt is None
                else add_generation_prompt,
                functions=functions,
                function_call=function_call,
                tools=tools,
                tool_choice=tool_choice,
                strftime_now=_strftime_now,
                **kwargs,
            ):
                n += len(piece)
                if max_chars is not None and n > max_chars:
                    raise TooLong(f"the prompt would be longer than {max_chars} characters")
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _MAX_CHARS.reset(token)


def capability_variables(variables: dict[str, Any]) -> dict[str, Any]:
    """``variables`` (the node's and the request's template kwargs) with the variables llama-server derives
    from two of them (``common/chat.cpp``, ``jinja::caps_apply_*`` in ``common/jinja/caps.cpp``):
    ``preserve_reasoning`` (true unless given: llama-server sets it by default, ``--no-reasoning-preserve``
    clears it) sets ``preserve_thinking`` and its opposites ``clear_thinking``, ``truncate_history_thinking``,
    ``drop_thinking``; a non-empty ``reasoning_effort`` sets ``reasoning_strength`` too.  A variable given
    by name wins over a derived one, as llama-server applies the kwargs after them."""
    out = {"preserve_reasoning": True, **variables}
    derived: dict[str, Any] = {}
    if isinstance(out["preserve_reasoning"], bool):
        keep = out["preserve_reasoning"]
        derived.update(
            preserve_thinking=keep, clear_thinking=not keep, truncate_history_thinking=not keep, drop_thinking=not keep
        )
    effort = out.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        derived["reasoning_strength"] = effort
    return {**derived, **out}
