"""Tool calling, the request side: tool checks, the formats, prompt rendering and grammars.

Sans-I/O.  The reply side (parsing, reply shapes) is :mod:`hydra_trio.openai.tools`, which
re-exports these names; the formats and the grammar approach are described there.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..validation import strict as msg
from ..validation.strict import MessageError
from .json_schema import MAX_SCHEMA_NODES, Document, SchemaError, schema_to_gbnf

FORMATS = ("generic", "hermes", "llama3", "mistral")
GENERIC_INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with "
    "`response` reply to the user's request"
)
"""llama-server's generic-format system instruction (``common_chat_params_init_generic``)."""

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


# --------------------------------------------------------------------------- request side
@attrs.frozen
class Tool:
    """One function the model may call: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@attrs.frozen
class ToolSpec:
    """What a request asks about tools.

    Attributes:
        tools: the functions offered.
        choice: ``auto``, ``none``, ``required`` or ``function`` (``name`` must be called).
        name: the function ``tool_choice`` names, or None.
        parallel: more than one call per reply is allowed (``parallel_tool_calls``; false by
            default, as llama-server, where OpenAI's default is true).
        legacy: the request used ``functions`` / ``function_call``: the reply carries
            ``message.function_call`` (one call) instead of ``tool_calls``.
    """

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = False
    legacy: bool = False

    @property
    def active(self) -> bool:
        """Tools are offered and may be called."""
        return bool(self.tools) and self.choice != "none"

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools a call may name (only the named one for a named choice)."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.name)
        return self.tools


def _tool(field: str, raw: Any, *, legacy: bool) -> Tool:
    if legacy:
        fn, where = raw, field
    else:
        if not isinstance(raw, dict):
            raise MessageError(f"{field}: expected an object, got {msg.type_name(raw)}")
        if raw.get("type", "function") != "function":
            raise MessageError(f"{field}.type: only 'function' tools are supported, got {raw.get('type')!r}")
        fn, where = raw.get("function"), f"{field}.function"
    if not isinstance(fn, dict):
        raise MessageError(f"{where}: expected an object, got {msg.type_name(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise MessageError(f"{where}.name: expected a non-empty string, got {msg.type_name(name)}")
    if not _NAME.fullmatch(name):
        raise MessageError(f"{where}.name: {name[:80]!r} must be 1 to 64 letters, digits, '_', '-', '.' or ':'")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise MessageError(f"{where}.description: expected a string, got {msg.type_name(desc)}")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise MessageError(f"{where}.parameters: expected a JSON schema object, got {msg.type_name(params)}")
    return Tool(name, desc or "", params)


def _check_schemas(tools: Sequence[Tool], field: str, legacy: bool) -> None:
    """The tools' ``parameters`` become one grammar (a call of any of them), as the reply's grammar
    will: a keyword no grammar enforces, or the converter's limits passed by the tools together (their
    subschemas, the grammar's size), is a MessageError naming the tool's field, before any of the
    request's work; the work done here is bounded by those limits, however many tools there are."""
    label = "{}[{}].parameters" if legacy else "{}[{}].function.parameters"
    try:
        schema_to_gbnf(_calls(tools, "arguments", where=[label.format(field, i) for i in range(len(tools))]))
    except SchemaError as exc:
        text = str(exc)
        raise MessageError(text if text.startswith(field) else f"{field}: {text}") from None


def parse_tool_spec(raw: dict[str, Any]) -> ToolSpec | None:
    """The tool fields of a chat request body (``tools``, ``tool_choice``, ``parallel_tool_calls``,
    legacy ``functions`` / ``function_call``), checked; None when it offers no tools.

    Raises MessageError naming the field: ``tools`` not a list, a tool without a name,
    a schema that cannot become a grammar, a ``tool_choice`` naming no offered tool, both
    ``tools`` and ``functions``.
    """
    tools_raw, functions_raw = raw.get("tools"), raw.get("functions")
    if tools_raw is not None and functions_raw is not None:
        raise MessageError("functions: give tools or the legacy functions, not both")
    legacy = functions_raw is not None
    field = "functions" if legacy else "tools"
    items = functions_raw if legacy else tools_raw
    choice_raw = raw.get("function_call") if legacy else raw.get("tool_choice")
    choice_field = "function_call" if legacy else "tool_choice"
    if legacy and raw.get("tool_choice") is not None:
        raise MessageError("tool_choice: use function_call with functions")
    if not legacy and raw.get("function_call") is not None:
        raise MessageError("function_call: needs functions (with tools, use tool_choice)")
    if items is None:
        if choice_raw not in (None, "none", "auto"):
            raise MessageError(f"{choice_field}: {choice_raw!r} needs {field}")
        return None
    if not isinstance(items, list):
        raise MessageError(f"{field}: expected a list, got {msg.type_name(items)}")
    if len(items) * 3 > MAX_SCHEMA_NODES:  # a call is 3 subschemas at least: its object, its name, its arguments
        raise MessageError(
            f"{field}: {len(items)} tools; the grammar of a call holds at most {MAX_SCHEMA_NODES // 3} "
            f"(3 subschemas each at least, {MAX_SCHEMA_NODES} in all: MAX_SCHEMA_NODES)"
        )
    tools = tuple(_tool(f"{field}[{i}]", t, legacy=legacy) for i, t in enumerate(items))
    names: set[str] = set()
    for t in tools:
        if t.name in names:
            raise MessageError(f"{field}: the name {t.name!r} is given twice")
        names.add(t.name)
    if tools:
        _check_schemas(tools, field, legacy)
    parallel = raw.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise MessageError(f"parallel_tool_calls: expected a boolean, got {msg.type_name(parallel)}")
    choice, name = "auto", None
    if choice_raw is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice_raw, str):
        allowed = ("auto", "none") if legacy else ("auto", "none", "required")
        if choice_raw not in allowed:
            raise MessageError(
                f"{choice_field}: expected one of {', '.join(allowed)} or a named function, got {choice_raw[:40]!r}"
            )
        choice = choice_raw
    elif isinstance(choice_raw, dict):
        if legacy:
            name = choice_raw.get("name")
        else:
            if choice_raw.get("type") != "function":
                raise MessageError(f"{choice_field}.type: expected 'function'")
            fn = choice_raw.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise MessageError(
                f"{choice_field}: expected the function's name"
                + ("" if legacy else ' as {"type": "function", "function": {"name": ...}}')
            )
        if name not in names:
            raise MessageError(f"{choice_field}: no tool is named {name[:80]!r}")
        choice = "function"
    else:
        raise MessageError(f"{choice_field}: expected a string or an object, got {msg.type_name(choice_raw)}")
    if choice in ("required", "function") and not tools:
        raise MessageError(f"{choice_field}: {choice!r} needs at least one tool")
    return ToolSpec(tools, choice, name, bool(parallel) and not legacy, legacy)


def check_messages(messages: Sequence[Any]) -> None:
    """Tool fields of chat messages: an assistant's ``tool_calls`` (or legacy ``function_call``),
    a ``tool`` message's ``tool_call_id``.  Raises MessageError naming ``messages[i]....``."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise MessageError(f"{where}.tool_calls: only assistant messages carry tool calls")
            for j, call in enumerate(m.tool_calls):
                w = f"{where}.tool_calls[{j}]"
                if not isinstance(call, dict):
                    raise MessageError(f"{w}: expected an object, got {msg.type_name(call)}")
                if call.get("type", "function") != "function":
                    raise MessageError(f"{w}.type: expected 'function'")
                _check_call_function(call.get("function"), f"{w}.function")
                if call.get("id") is not None and not isinstance(call["id"], str):
                    raise MessageError(f"{w}.id: expected a string")
        if m.function_call is not None:
            if m.role != "assistant":
                raise MessageError(f"{where}.function_call: only assistant messages carry a function call")
            _check_call_function(m.function_call, f"{where}.function_call")
        if m.role == "tool" and m.tool_call_id is None:
            raise MessageError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
        if m.role == "function" and not m.name:
            raise MessageError(f"{where}.name: a function message needs the function's name")


def _check_call_function(fn: Any, where: str) -> None:
    if not isinstance(fn, dict):
        raise MessageError(f"{where}: expected an object with name and arguments")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise MessageError(f"{where}.name: expected a non-empty string")
    args = fn.get("arguments", "{}")
    if not isinstance(args, (str, dict)):
        raise MessageError(f"{where}.arguments: expected a JSON string")
    # past the depth limit: TooDeep (read only when the brackets could nest that deep: a text is parsed once, to render)
    if (
        isinstance(args, str)
        and args.count("[") + args.count("{") > msg.MAX_JSON_DEPTH
        and msg.json_depth(args) > msg.MAX_JSON_DEPTH
    ):
        arguments_object(args, f"{where}.arguments")


# --------------------------------------------------------------------------- formats and rendering
def detect_format(template_source: str) -> str:
    """The tool-call format of a chat template's text (this module's docstring)."""
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|start_header_id|>ipython<|end_header_id|>" in template_source:
        return "llama3"
    return "generic"


def template_supports_tools(kind: str, source: str) -> bool:
    """The template renders ``tools`` itself: Jinja text that mentions them (llama.cpp's test)."""
    return kind == "jinja" and "tools" in source


def arguments_object(args: Any, where: str = "arguments") -> Any:
    """A call's ``arguments`` as the template sees them: the JSON value of a text that holds JSON (at most
    :data:`~hydra_trio.validation.strict.MAX_JSON_DEPTH` levels deep, else
    :class:`~hydra_trio.validation.strict.TooDeep`
    naming ``where``), else the text itself."""
    if isinstance(args, str):
        try:
            return msg.loads(args, where)
        except msg.TooDeep:
            raise
        except msg.MessageError:
            return args
    return args


def _mistral_id(call_id: str) -> str:
    """Mistral templates insist on 9 letters or digits: other ids are mapped to such, stably."""
    if len(call_id) == 9 and call_id.isalnum() and call_id.isascii():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    alphabet = string.ascii_letters + string.digits
    return "".join(alphabet[b % len(alphabet)] for b in digest[:9])


def render_messages(
    messages: Sequence[Any], spec: ToolSpec | None, fmt: str, native: bool, max_chars: int | None = None
) -> list[dict[str, Any]]:
    """Chat messages as the template receives them.

    ``max_chars``: the most characters the JSON written here may have in all (the text tool calls,
    tool results and the tool list become; None: no limit), else
    :class:`~hydra_trio.validation.strict.TooLong`: pretty-printed JSON grows with the depth of what it
    writes, and no prompt longer than a slot's context is of use.

    ``native``: the template renders tools and tool calls itself: assistant
    ``tool_calls`` keep their shape (arguments as objects, as templates ``tojson``
    them; ``content: null`` as ""), ``tool`` messages keep ``tool_call_id``.
    Otherwise (minja's polyfills, as llama-server): tool calls become the assistant's
    JSON content ``{"tool_calls": [...]}``, tool results a user message
    ``{"tool_response": {...}}``.  In the ``generic`` format with active tools, a system
    message describes the tools and the JSON reply format.
    """
    names_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    written = 0

    def dumps(value: Any) -> str:
        nonlocal written
        text = msg.dumps_within(value, None if max_chars is None else max_chars - written, indent=2, ensure_ascii=False)
        written += len(text)
        return text

    for m in messages:
        calls = m.tool_calls
        if calls is None and m.function_call is not None:  # legacy: one call, no id
            calls = ({"id": f"call_{len(names_by_id)}", "type": "function", "function": m.function_call},)
        role = "tool" if m.role == "function" else m.role
        d: dict[str, Any] = {"role": role, "content": m.content or ""}
        if m.name is not None:
            d["name"] = m.name
        if getattr(m, "reasoning_content", None) is not None:  # an assistant turn's thinking, for the template
            d["reasoning_content"] = m.reasoning_content
        if calls:
            norm: list[dict[str, Any]] = []
            for c in calls:
                fn = c["function"]
                cid = c.get("id") or f"call_{len(names_by_id)}"
                names_by_id[cid] = fn["name"]
                if fmt == "mistral":
                    cid = _mistral_id(cid)
                norm.append(
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": arguments_object(fn.get("arguments", {}))},
                    }
                )
            if native:
                d["tool_calls"] = norm
            else:
                body: dict[str, Any] = {
                    "tool_calls": [
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"], "id": c["id"]}
                        for c in norm
                    ]
                }
                if m.content:
                    body["content"] = m.content
                d["content"] = dumps(body)
        if role == "tool":
            cid = m.tool_call_id or ""
            name = m.name or names_by_id.get(cid, "")
            if native:
                d["tool_call_id"] = _mistral_id(cid) if fmt == "mistral" and cid else cid
                if name:
                    d["name"] = name
            else:
                resp: dict[str, Any] = {"tool": name, "content": m.content or ""}
                if cid:
                    resp["tool_call_id"] = cid
                d = {"role": "user", "content": dumps({"tool_response": resp})}
        out.append(d)
    if spec is not None and spec.active and fmt == "generic":
        text = GENERIC_INSTRUCTION
        if not native:
            tools = [t.as_openai() for t in spec.offered]
            example = {
                "tool_calls" if spec.parallel else "tool_call": (
                    [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]
                    if spec.parallel
                    else {"name": "tool_name", "arguments": {"arg1": "some_value"}}
                )
            }
            text = (
                "You can call any of the following tools to satisfy the user's requests: "
                + dumps(tools)
                + "\n\nExample tool call syntax:\n\n"
                + json.dumps(example, indent=2)
                + "\n\n"
                + text
            )
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + text) if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# --------------------------------------------------------------------------- grammars
@attrs.frozen
class ToolGrammar:
    """GBNF for a tool request; ``lazy``: constrain only from the first match of one of
    ``triggers`` (ECMAScript regexes, llama.cpp's ``llama_sampler_init_grammar_lazy_patterns``:
    the grammar sees the text from the match, or from its first non-empty group, on)."""

    gbnf: str
    lazy: bool = False
    triggers: tuple[str, ...] = ()


def _call_schema(tool: Tool, args_key: str, with_id: bool = False, where: str = "#") -> dict[str, Any]:
    """The call object's schema: ``name``, the arguments (the tool's ``parameters``, a document of
    its own: its ``$ref``s resolve inside it; ``where`` names it in errors), and for ``with_id`` a
    9-character ``id``."""
    props: dict[str, Any] = {"name": {"const": tool.name}, args_key: Document(tool.parameters, where)}
    required = ["name", args_key]
    if with_id:
        props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        required.append("id")
    return {"type": "object", "properties": props, "required": required}


def _calls(
    tools: Sequence[Tool], args_key: str, with_id: bool = False, where: Sequence[str] | None = None
) -> dict[str, Any]:
    calls = [_call_schema(t, args_key, with_id, where[i] if where else "#") for i, t in enumerate(tools)]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _schema_grammar(
    tools: Sequence[Tool], args_key: str, *, with_id: bool = False, wrap: Callable[[str], str] | None = None
) -> str:
    """GBNF for one call object of any of ``tools`` (:func:`hydra_trio.openai.json_schema.schema_to_gbnf`):
    the root rule is the call, or ``wrap(call rule)``.  Raises SchemaError (a limit, a keyword no
    grammar enforces)."""
    return schema_to_gbnf(_calls(tools, args_key, with_id), wrap=wrap)


def _ecma_escape(word: str) -> str:
    return re.sub(r"([.^$|()\[\]{}*+?\\/-])", r"\\\1", word)


def tool_grammar(spec: ToolSpec, fmt: str) -> ToolGrammar | None:
    """The grammar that makes the reply a valid call (``required``, named) or lets it be one
    (``auto``: lazy, or the generic call-or-response object); None for ``none``.
    Raises SchemaError when the tools together are over a limit of the converter (each alone was
    checked by :func:`parse_tool_spec`)."""
    if not spec.active:
        return None
    tools = spec.offered
    forced = spec.choice in ("required", "function")
    many = spec.parallel
    if fmt == "generic":
        calls = _calls(tools, "arguments")
        call_obj = (
            {
                "type": "object",
                "properties": {"tool_calls": {"type": "array", "items": calls, "minItems": 1}},
                "required": ["tool_calls"],
            }
            if many
            else {"type": "object", "properties": {"tool_call": calls}, "required": ["tool_call"]}
        )
        schema = (
            call_obj
            if forced
            else {
                "anyOf": [
                    call_obj,
                    {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]},
                ]
            }
        )
        return ToolGrammar(schema_to_gbnf(schema))
    if fmt == "hermes":

        def hermes(call: str) -> str:
            one = f'"<tool_call>\\n" space {call} space "\\n</tool_call>"'
            return f"{one} (space {one})*" if many else one

        gbnf = _schema_grammar(tools, "arguments", wrap=hermes)
        trig = ("<tool_call>",)
    elif fmt == "mistral":

        def mistral(call: str) -> str:
            more = f' (space "," space {call})*' if many else ""
            return f'"[TOOL_CALLS]" "[" space {call}{more} space "]"'

        gbnf = _schema_grammar(tools, "arguments", with_id=True, wrap=mistral)
        trig = ("[TOOL_CALLS]",)
    elif fmt == "llama3":
        gbnf = _schema_grammar(tools, "parameters")
        return ToolGrammar(gbnf, not forced, () if forced else (r'^\s*(\{ ?"name" ?: ?")[\s\S]*$',))
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if forced:
        return ToolGrammar(gbnf)
    return ToolGrammar(gbnf, True, tuple(_ecma_escape(w) for w in trig))


def _gbnf_class_char(c: str) -> str:
    return c if c.isalnum() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def after_thinking(gbnf: str, end_marker: str) -> str:
    """``gbnf`` for a reply that starts inside a thinking block the prompt opened (a thinking template):
    thinking text without ``end_marker``, the marker, whitespace, then what ``gbnf`` allows — so that a
    grammar that forces a tool call (``required``, a named function) does not force it into the thinking,
    where the reply's split would file it as reasoning (llama-server's tool grammars leave the thinking
    block free too).  The thinking text may not hold the marker, nor (a simplification of "any text without
    it") repeat its first character or end with a proper prefix of it."""
    calls = re.sub(r"^root(\s*::=)", r"tool-call-root\1", gbnf, count=1, flags=re.M)
    first = _gbnf_class_char(end_marker[0])
    alts = [f"[^{first}]"] + [
        f"{json.dumps(end_marker[:i])} [^{_gbnf_class_char(end_marker[i])}{first}]" for i in range(1, len(end_marker))
    ]
    return (
        f"root ::= thinking-text {json.dumps(end_marker)} [ \\t\\n]* tool-call-root\n"
        f"thinking-text ::= ({' | '.join(alts)})*\n{calls}"
    )
