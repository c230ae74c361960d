"""OpenAI request bodies as frozen attrs classes, structured by cattrs.

Type checks are strict (``"5"`` is not a number, ``1`` is not a string), and
every error names the field, e.g. ``max_tokens: expected a number, got str``,
so that an HTTP 400 tells the client exactly what to fix.  Numeric fields are
read as llama-server reads them (:mod:`hydra_trio.openai.field_limits`: a float
truncated for an integer field, a boolean as 1 or 0, soft limits clamped, hard
limits refused).

Every field OpenAI marks nullable accepts ``null`` and then means its
default; llama-server's extensions likewise.  A field that this server
knows but does not act on is never silently ignored: a value other than its
neutral one is a 400 naming the field (:data:`UNSUPPORTED`).  Keys nobody
defines are ignored, as llama-server does.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs
from cattrs.gen import override

from ..engine.settings import INT32_MAX, UINT32_MAX, ParameterError, SamplingParams, check_stop, parse_samplers
from ..validation import strict as msg
from ..validation.strict import MessageError
from . import field_limits
from .media import MediaPart, MultimodalPrompt, parse_content, parse_multimodal_prompt
from .tool_prompt import ToolSpec, check_messages, parse_tool_spec

DEFAULT_TOP_LOGPROBS = 20
"""Alternatives per token for a chat request with ``logprobs: true`` and no ``top_logprobs`` (llama-server's
``oaicompat_chat_params_parse``, ``tools/server/server-common.cpp``)."""
REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")  # hydra_trio.openai.reasoning.FORMATS
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""``reasoning_effort`` levels: OpenAI's, and llama-server's ``--reasoning-effort`` ones (``max``)."""
MAX_MESSAGES = 10000
"""Most ``messages`` in one chat body (400 beyond)."""
MAX_CONTENT_PARTS = 1024
"""Most content parts in one message (400 beyond)."""
LOGIT_BIAS_MAX = 100.0
MAX_RESPONSE_FIELDS = 256
"""Most ``response_fields`` paths, each at most this many characters (every reply and stream chunk is
filtered with them; a reply has far fewer fields)."""


# attrs converters: ``null`` means the field's default (named functions, so type checkers see the fields' types)
def _null_false(v: bool | None) -> bool:
    return False if v is None else v


def _null_true(v: bool | None) -> bool:
    return True if v is None else v


def _null_0(v: int | None) -> int:
    return 0 if v is None else v


def _null_1(v: int | None) -> int:
    return 1 if v is None else v


def _null_minus_1(v: int | None) -> int:
    return -1 if v is None else v


def _null_minus_1_0(v: float | None) -> float:
    return -1.0 if v is None else v


def _null_0_9(v: float | None) -> float:
    return 0.9 if v is None else v


@attrs.frozen
class StreamOptions:
    include_usage: bool | None = attrs.field(default=False, converter=_null_false)


@attrs.frozen
class ChatMessage:
    """One chat message; ``tool_calls`` (assistant), ``tool_call_id`` (role ``tool``) and the
    legacy ``function_call`` are checked by :func:`hydra_trio.openai.tools.check_messages`."""

    role: str
    content: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's thinking, given to the template (llama-server)
    tool_calls: tuple[Any, ...] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    media: tuple[MediaPart, ...] = ()
    """The media parts of a content list (:func:`~hydra_trio.openai.media.parse_content`), in order;
    ``content`` holds the media marker once for each."""


# Fields of the OpenAI API and of llama-server that hydra-trio does not act on:
# name -> the neutral values that are accepted (they ask for nothing).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI chat (tools, functions: hydra_trio.openai.tools)
    "store": (False,),
    "metadata": ({},),
    "modalities": (("text",),),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "verbosity": (),
    # OpenAI completions
    "suffix": ("",),
    # llama-server options not wired here (its defaults, as GET /props of llama-server shows them, are neutral)
    "post_sampling_probs": (False,),
    "lora": ((),),
    "image_data": ((),),
    "n_indent": (0,),
    "return_progress": (False,),
    "backend_sampling": (False,),
    "grammar_lazy": (False,),
    "grammar_triggers": ((),),
    "preserved_tokens": ((),),
    "verbose": (False,),
}


def _check_unsupported(raw: dict[str, Any]) -> None:
    """400 for a known-but-unsupported field set to anything but a neutral value (or null)."""
    for name, neutral in UNSUPPORTED.items():
        if name not in raw or raw[name] is None:
            continue
        v = raw[name]
        key = tuple(v) if isinstance(v, list) else v
        if any(type(key) is type(n) and key == n for n in neutral):
            continue
        raise MessageError(f"{name}: not supported by this server (send null or leave it out)")


@attrs.frozen
class _GenerationFields:
    """Fields shared by chat and text completions (OpenAI + llama-server extensions)."""

    model: str | None = None
    stream: bool | None = attrs.field(default=False, converter=_null_false)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n_predict: int | None = None  # llama-server
    n: int | None = None  # OpenAI; llama-server reads it after n_cmpl (N_CMPL_NAMES)
    n_cmpl: int | None = None  # llama-server
    best_of: int | None = attrs.field(default=1, converter=_null_1)
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # llama-server
    min_p: float | None = None  # llama-server
    seed: int | None = None
    repeat_penalty: float | None = None  # llama-server
    repeat_last_n: int | None = None  # llama-server
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # llama-server's other samplers (names, defaults and bounds: engine.settings.SamplingParams)
    min_keep: int | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None  # < 1: the default, as llama-server
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    # OpenAI's {"id": bias}, llama-server's [[id or text, bias or false], ...] and {"text": bias}; a text
    # stands for every token of its tokenization (resolved by api.jobs, which has the vocabulary)
    logit_bias: tuple[tuple[int | str, float], ...] = ()
    samplers: tuple[str, ...] | None = None  # llama-server: the chain's order (canonical names)
    adaptive_target: float | None = attrs.field(default=-1.0, converter=_null_minus_1_0)  # llama-server: < 0 off
    adaptive_decay: float | None = attrs.field(default=0.9, converter=_null_0_9)
    t_max_predict_ms: int | None = attrs.field(default=0, converter=_null_0)  # llama-server: 0 = no limit
    return_tokens: bool | None = attrs.field(default=False, converter=_null_false)  # llama-server: /completion "tokens"
    timings_per_token: bool | None = attrs.field(default=False, converter=_null_false)  # llama-server
    response_fields: tuple[str, ...] | None = None  # llama-server: /completion's field filter
    user: str | None = None  # accepted: it only identifies the end user to the API provider
    service_tier: str | None = None
    response_format: dict[str, Any] | None = None
    grammar: str | None = attrs.field(default=None, converter=lambda v: v or None)  # llama-server; "" = none
    json_schema: dict[str, Any] | None = None  # llama-server
    n_probs: int | None = None  # llama-server: top logprobs per token
    id_slot: int | None = attrs.field(default=-1, converter=_null_minus_1)  # llama-server: any integer (Engine.submit)
    cache_prompt: bool | None = attrs.field(default=True, converter=_null_true)  # llama-server
    ignore_eos: bool | None = attrs.field(default=False, converter=_null_false)  # llama-server
    n_keep: int | None = (
        None  # llama-server: context shift keeps these prompt tokens (-1: all); null: the node's --keep
    )
    n_discard: int | None = attrs.field(default=0, converter=_null_0)  # llama-server: 0 = half of those after n_keep
    n_cache_reuse: int | None = None  # llama-server: null: the node's --cache-reuse
    raw: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def check(self) -> None:
        """Every field against its bounds (:mod:`hydra_trio.engine.settings`); raises MessageError naming it.

        Of fields that are one setting under several names (:data:`N_PREDICT_NAMES`, :data:`N_CMPL_NAMES`,
        the log-probability fields) only the one that is read is checked against its bounds, as llama-server
        reads only that one; every field's type is checked.
        """
        n_name, n_cmpl = _first_set(self, N_CMPL_NAMES) or ("n", 1)
        if n_cmpl < 1:
            raise MessageError(f"{n_name}: must be at least 1, got {n_cmpl}")
        if n_cmpl != 1:
            raise MessageError(f"{n_name}: only one completion per request is supported ({n_name} = 1)")
        if self.best_of != 1:
            raise MessageError("best_of: only best_of = 1 is supported")
        if self.service_tier not in (None, "auto", "default"):
            raise MessageError(f"service_tier: {self.service_tier!r} is not offered (auto or default)")
        _check_unsupported(self.raw)
        try:
            # -1 (the node's -n) too, under every name (GET /props shows max_tokens: -1)
            if (budget := _first_set(self, N_PREDICT_NAMES)) is not None:
                field_limits.check_hard(*budget)
            check_stop(self.stop)
            fields = self.response_fields or ()
            if len(fields) > MAX_RESPONSE_FIELDS or any(len(f) > MAX_RESPONSE_FIELDS for f in fields):
                raise MessageError(
                    f"response_fields: at most {MAX_RESPONSE_FIELDS} paths of at most "
                    f"{MAX_RESPONSE_FIELDS} characters (MAX_RESPONSE_FIELDS)"
                )
            if self.dry_sequence_breakers is not None and not self.dry_sequence_breakers:
                raise MessageError("dry_sequence_breakers: must be a non-empty array of strings")
            for name in _HARD_FIELDS:  # soft-limited fields were clamped when the body was read
                field_limits.check_hard(name, getattr(self, name))
            self.sampling(SamplingParams())  # the sampler fields' own validators (the penalties' finiteness)
        except ValueError as exc:
            raise MessageError(str(exc)) from None
        self.constraint()  # a malformed response_format, or a combination llama-server refuses
        if self.ignore_eos and self.constrained:
            raise MessageError(
                "ignore_eos: cannot be combined with grammar, json_schema or response_format "
                "(a finished grammar allows only end of generation)"
            )

    def n_predict_effective(self, default: int = -1) -> int:
        """The token budget (the engine's ``CompletionJob.n_predict``), as llama-server resolves it: the first of
        :data:`N_PREDICT_NAMES` that is set and not null (the others are not read); -1 or none set: ``default``
        (the node's ``-n``).  0 is llama-server's "evaluate the prompt": one token is sampled from the prompt's
        logits and returned, never decoded into the slot's cache."""
        got = _first_set(self, N_PREDICT_NAMES)
        return default if got is None or got[1] == -1 else got[1]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def constrained(self) -> bool:
        """The output must follow a grammar (``grammar``, ``json_schema`` or a JSON ``response_format``)."""
        return self.constraint() is not None

    def constraint(self) -> tuple[str, str | dict[str, Any]] | None:
        """The output constraint in effect: ``("grammar", GBNF)``, ``("json_schema" or "response_format",
        schema)`` (``{}``: any JSON object), or None.

        On the completion endpoints as llama-server's ``json_schema`` field reads them
        (``tools/server/server-schema.cpp``): a ``grammar`` wins over a ``json_schema``; ``response_format``,
        which llama-server does not read there, applies only without either.

        Raises MessageError for a malformed ``response_format``.
        """
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        schema = self.json_response_schema()
        return None if schema is None else ("response_format", schema)

    def json_response_schema(self) -> dict[str, Any] | None:
        """``response_format`` as a JSON schema: ``{}`` for any JSON object, None for plain text.

        OpenAI's ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema":
        {"schema": ...}}``; llama-server's ``{"type": "json_object", "schema": ...}``.  As llama-server's
        ``oaicompat_chat_params_parse`` (``tools/server/server-common.cpp``): no ``type`` (or ``""``) is
        plain text, and a missing or null ``schema`` (or ``json_schema``) means any JSON object.

        Raises MessageError for another type or a malformed object.
        """
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind in (None, "", "text"):
            return None
        if kind == "json_object":
            schema = rf.get("schema")
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if spec is not None and not isinstance(spec, dict):
                raise MessageError("response_format.json_schema: expected an object with a 'schema'")
            schema = (spec or {}).get("schema")
        else:
            raise MessageError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")
        if schema is None:
            return {}
        if not isinstance(schema, dict):
            raise MessageError("response_format: the schema must be a JSON object")
        return schema

    def sampling(self, d: SamplingParams) -> SamplingParams:
        """The request's sampler settings; fields it leaves out (or sends as null) come from ``d``
        (the engine's defaults).  ``dry_base`` below 1 means the default, as in llama-server.

        Raises ParameterError naming the field (a value out of its bounds).
        """
        values = {}
        for name in _SAMPLING_FIELDS:
            v = getattr(self, name)
            values[name] = getattr(d, name) if v is None else v
        if self.dry_base is not None and self.dry_base < 1.0:
            values["dry_base"] = d.dry_base
        if self.seed == UINT32_MAX:  # llama.cpp's LLAMA_DEFAULT_SEED (a request's -1): random, shown as -1
            values["seed"] = None
        return SamplingParams(**values)

    def n_probs_field(self) -> tuple[str, int] | None:
        """The field that sets the alternatives per token, and its value (None: none set)."""
        return _first_set(self, ("n_probs",))

    @property
    def top_logprobs_n(self) -> int:
        """Alternatives per token the reply carries: 0 (none) for a value of 0 or less, at most
        :data:`~hydra_trio.openai.field_limits.N_PROBS_MAX`."""
        got = self.n_probs_field()
        return field_limits.n_probs(None if got is None else got[1])

    @property
    def wants_logprobs(self) -> bool:
        """The reply carries log-probabilities: llama-server's rule, ``n_probs`` > 0."""
        return self.top_logprobs_n > 0


N_PREDICT_NAMES = ("n_predict", "max_completion_tokens", "max_tokens")
"""The token budget's names, in the order llama-server reads them (``n_predict`` and its aliases,
``tools/server/server-schema.cpp``): the first that is set and not null is the budget, the others are not
read (Core's prefill sends a client's ``max_tokens`` with ``n_predict: 0``)."""
N_CMPL_NAMES = ("n_cmpl", "n")
"""Completions per request: llama-server's ``n_cmpl``, then its alias ``n`` (OpenAI's)."""


_HARD_FIELDS = (
    "n_keep",
    "n_discard",
    "n_cache_reuse",
    "t_max_predict_ms",
    "repeat_last_n",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "min_keep",
    "adaptive_decay",
)
"""The hard-limited fields (:mod:`~hydra_trio.openai.field_limits`) that are one name each; the token budget's
names are checked where they are resolved (only the one read)."""


def _first_set(body: Any, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """``(name, value)`` of the first of ``names`` that ``body`` sets to something other than null: how
    llama-server reads a field and its aliases (``field::eval``, ``tools/server/server-schema.cpp``)."""
    for name in names:
        v = getattr(body, name)
        if v is not None:
            return name, v
    return None


_SAMPLING_FIELDS = tuple(f.name for f in attrs.fields(SamplingParams))
assert set(_SAMPLING_FIELDS) <= set(attrs.fields_dict(_GenerationFields)), "every sampler field is a request field"


@attrs.frozen
class ChatCompletionRequest(_GenerationFields):
    """``POST /v1/chat/completions`` (OpenAI), with llama-server's extensions."""

    messages: tuple[ChatMessage, ...] = ()
    logprobs: bool | None = attrs.field(default=False, converter=_null_false)
    top_logprobs: int | None = None
    tools: tuple[Any, ...] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # only means something with tools
    # thinking (llama-server): null means the node's --reasoning-format / --chat-template-kwargs / --reasoning-budget
    reasoning_format: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget_tokens: int | None = None
    reasoning_budget_tokens: int | None = None
    reasoning_budget_message: str | None = None
    reasoning_effort: str | None = None  # OpenAI: none (no thinking) or a level for the template
    # tools, tool_choice, parallel_tool_calls, functions, function_call, checked (hydra_trio.openai.tools)
    tool_spec: ToolSpec | None = attrs.field(default=None, init=False, eq=False, repr=False)

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise MessageError("messages: at least one message is required")
        if len(self.messages) > MAX_MESSAGES:
            raise MessageError(f"messages: at most {MAX_MESSAGES} messages (MAX_MESSAGES), got {len(self.messages)}")
        self.check_thinking()
        spec = parse_tool_spec(self.raw)
        check_messages(self.messages)
        if spec is not None and spec.active and self.constrained:
            raise MessageError(
                "tools: cannot be combined with grammar, json_schema or response_format "
                "(the tool calls have their own grammar)"
            )
        object.__setattr__(self, "tool_spec", spec)
        if self.top_logprobs is not None and not self.logprobs:  # its bounds: _GenerationFields.check
            raise MessageError("top_logprobs: needs logprobs: true")

    def check_thinking(self) -> None:
        """``reasoning_format`` one of llama-server's; a budget -1 (the node's), 0 (no thinking) or N tokens;
        ``reasoning_effort`` one of :data:`REASONING_EFFORTS`;
        ``chat_template_kwargs.enable_thinking`` a boolean (llama-server's rule)."""
        if self.reasoning_format is not None and self.reasoning_format not in REASONING_FORMATS:
            raise MessageError(
                f"reasoning_format: {self.reasoning_format!r} is not one of {', '.join(REASONING_FORMATS)}"
            )
        if (budget := _first_set(self, ("reasoning_budget_tokens", "thinking_budget_tokens"))) is not None:
            try:
                field_limits.check_hard(*budget)
            except ParameterError as exc:
                raise MessageError(str(exc)) from None
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise MessageError(
                f"reasoning_effort: {self.reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}"
            )
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise MessageError(
                "chat_template_kwargs.enable_thinking: expected a boolean, "
                f"got {msg.type_name(kwargs['enable_thinking'])}"
            )

    @property
    def media_parts(self) -> tuple[MediaPart, ...]:
        """Every message's media parts in order, each naming where it is (``messages[i].content[j]``)."""
        return tuple(
            attrs.evolve(p, where=f"messages[{i}].{p.where}") for i, m in enumerate(self.messages) for p in m.media
        )

    @property
    def thinking_budget(self) -> int | None:
        """The request's thinking budget as llama-server's ``oaicompat_chat_params_parse`` reads it
        (``tools/server/server-common.cpp``): ``reasoning_budget_tokens``, else ``thinking_budget_tokens``
        (the first not null; the other is not read); -1 or neither: None, the node's."""
        got = _first_set(self, ("reasoning_budget_tokens", "thinking_budget_tokens"))
        return None if got is None or got[1] == -1 else got[1]

    def constraint(self) -> tuple[str, str | dict[str, Any]] | None:
        """The output constraint in effect (see :meth:`_GenerationFields.constraint`), as llama-server's
        ``oaicompat_chat_params_parse`` resolves a chat body (``tools/server/server-common.cpp``): a
        ``json_schema`` with a non-empty ``grammar`` is refused; a JSON ``response_format`` gives the schema
        (``json_object`` without its own ``schema`` keeps a non-empty ``json_schema``), then ``json_schema``;
        any schema wins over ``grammar``.

        Raises MessageError for a malformed ``response_format`` or ``json_schema`` with ``grammar``.
        """
        if self.json_schema is not None and self.grammar is not None:
            raise MessageError("grammar: cannot be combined with json_schema in a chat request (give one of them)")
        field, schema = "json_schema", self.json_schema
        rf = self.json_response_schema()
        if rf is not None:
            rf_type = (self.response_format or {}).get("type")
            if rf_type == "json_schema" or "schema" in (self.response_format or {}) or not schema:
                field, schema = "response_format", rf
        if schema is not None:
            return field, schema
        return None if self.grammar is None else ("grammar", self.grammar)

    def n_probs_field(self) -> tuple[str, int] | None:
        """As llama-server's ``oaicompat_chat_params_parse`` (``tools/server/server-common.cpp``):
        with ``logprobs: true``, ``top_logprobs`` (20 when null or left out) and ``n_probs`` is not read;
        otherwise ``n_probs``."""
        if self.logprobs:
            return "top_logprobs", DEFAULT_TOP_LOGPROBS if self.top_logprobs is None else self.top_logprobs
        return _first_set(self, ("n_probs",))

    @property
    def wants_logprobs(self) -> bool:
        """``logprobs: true`` (OpenAI's: with ``top_logprobs: 0`` too), or ``n_probs`` > 0 (llama-server's)."""
        return bool(self.logprobs) or self.top_logprobs_n > 0


@attrs.frozen
class CompletionRequest(_GenerationFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids (and strings), or llama-server's
    prompt object with media (:class:`~hydra_trio.openai.media.MultimodalPrompt`)."""

    prompt: str | tuple[int | str, ...] | MultimodalPrompt | None = None
    logprobs: int | None = None
    echo: bool | None = attrs.field(default=False, converter=_null_false)

    def check(self) -> None:
        super().check()
        if self.prompt is not None and not self.prompt:
            raise MessageError("prompt: must not be empty (null starts a new document)")
        if self.echo and self.wants_logprobs:
            raise MessageError("echo: cannot be combined with logprobs (prompt logprobs are not computed)")

    def n_probs_field(self) -> tuple[str, int] | None:
        """llama-server's ``n_probs``, then its alias ``logprobs`` (``tools/server/server-schema.cpp``):
        ``logprobs`` is not read when ``n_probs`` is set."""
        return _first_set(self, ("n_probs", "logprobs"))

    @property
    def wants_logprobs(self) -> bool:
        """OpenAI's ``logprobs`` when it is the field read and not negative (with 0 too: the sampled tokens'
        log-probabilities, no alternatives), else ``n_probs`` > 0 (llama-server's)."""
        got = self.n_probs_field()
        return got is not None and (got[1] > 0 or (got[0] == "logprobs" and got[1] == 0))


@attrs.frozen
class TokenizeRequest:
    """``POST /tokenize`` (llama-server's): ``content`` text to tokenize (absent: no tokens);
    ``add_special`` adds BOS when the model wants one (default false); ``parse_special``
    turns special-token text such as ``<|im_start|>`` into those tokens (default true);
    ``with_pieces`` answers ``[{"id", "piece"}]`` instead of bare ids (default false)."""

    content: str = ""
    add_special: bool | None = attrs.field(default=False, converter=_null_false)
    parse_special: bool | None = attrs.field(default=True, converter=_null_true)
    with_pieces: bool | None = attrs.field(default=False, converter=_null_false)

    def check(self) -> None:
        pass


@attrs.frozen
class DetokenizeRequest:
    """``POST /detokenize`` (llama-server's): ``tokens``, token ids (absent: empty text).
    Ids are checked against the vocabulary by the handler (400 outside it)."""

    tokens: tuple[int, ...] = ()

    def check(self) -> None:
        pass


@attrs.frozen
class SlotFileRequest:
    """``POST /slots/{id}?action=save|restore`` (llama-server's): ``filename``, a file name in the
    node's slot save path.  The name's own rules are checked by the handler
    (:func:`hydra_trio.service.slot_files.check_filename`)."""

    filename: str

    def check(self) -> None:
        pass


# --------------------------------------------------------------------------- converter
# This module's own strict converter (hydra_trio.validation.strict) with strict
# primitives; these classes allow unknown keys, as OpenAI servers do.


def _stop(v: Any, _t: Any) -> tuple[str, ...]:
    """A stop string or a list of them; empty strings are dropped (they stop nothing: llama-server's
    ``stop`` field)."""
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise msg.TypeMismatch(f"expected a string or a list of strings, got {msg.type_name(v)}")


def _str_list(v: Any, _t: Any) -> tuple[str, ...] | None:
    """A JSON array of strings (llama-server's ``dry_sequence_breakers``), or null."""
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise msg.TypeMismatch(f"expected a list of strings, got {msg.type_name(v)}")


def _parts(v: list[Any]) -> tuple[str, tuple[MediaPart, ...]]:
    if len(v) > MAX_CONTENT_PARTS:
        raise msg.TypeMismatch(f"at most {MAX_CONTENT_PARTS} content parts (MAX_CONTENT_PARTS), got {len(v)}")
    return parse_content(v)


def _content(v: Any, _t: Any) -> str | None:
    """OpenAI content: a string, null, or a list of parts (text and media:
    :func:`~hydra_trio.openai.media.parse_content`), as one text."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        return _parts(v)[0]
    raise msg.TypeMismatch(f"expected a string, a list of content parts or null, got {msg.type_name(v)}")


def _prompt(v: Any, _t: Any) -> str | tuple[int | str, ...] | MultimodalPrompt | None:
    """One prompt, as llama-server takes it: a string, a list of token ids, or a list mixing token ids
    and strings (each string tokenized in place; only a leading one gets BOS), or an object
    ``{"prompt_string", "multimodal_data"}`` (:func:`~hydra_trio.openai.media.parse_multimodal_prompt`); a list
    holding one string or object is that one.  Several prompts in one request (a list of strings or of lists) are
    refused: a request makes one completion here."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict):
        return parse_multimodal_prompt(v)
    if isinstance(v, list):
        if len(v) == 1 and isinstance(v[0], (str, dict)):
            return _prompt(v[0], _t)
        ok = all(isinstance(t, str) or (isinstance(t, int) and not isinstance(t, bool)) for t in v)
        if ok and (not v or any(isinstance(t, int) for t in v)):
            return tuple(v)
        if ok or all(isinstance(t, (str, list, dict)) for t in v):
            raise msg.TypeMismatch("several prompts in one request are not supported: send one prompt per request")
    raise msg.TypeMismatch("expected a string, a list of token ids, or a list of token ids and strings")


_INT_KEY = re.compile(r"[-+]?[0-9]{1,20}", re.ASCII)


def _bias_value(where: str, bias: Any) -> float:
    """A bias: a number in -100..100, or ``false`` (llama-server: the token is never produced, -inf)."""
    if bias is False:
        return -math.inf
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise msg.TypeMismatch(f"{where}: expected a number or false, got {msg.type_name(bias)}")
    b = float(bias)
    if not math.isfinite(b) or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
        raise msg.TypeMismatch(f"{where}: the bias must be between -100 and 100 (or false), got {bias}")
    return b


def _logit_bias(v: Any, _t: Any) -> tuple[tuple[int | str, float], ...]:
    """OpenAI's ``{"<token id>": bias}``, and llama-server's other forms: an object whose key is a
    text (``{"Hello": -5}``), or an array of ``[token id or text, bias]`` pairs; a bias may be
    ``false`` (never produce the token).  A text stands for every token of its tokenization (no
    BOS, special-token text not parsed), as llama-server; ids are checked against the vocabulary
    and texts tokenized when the job is built (:mod:`hydra_trio.service.jobs`)."""
    if v is None:
        return ()
    out: list[tuple[int | str, float]] = []
    if isinstance(v, dict):
        for key, bias in v.items():
            # an integer key is a token id (llama-server: strtol over the whole key), anything else a text
            k: int | str = int(key) if _INT_KEY.fullmatch(key) else key
            if isinstance(k, str) and not k:
                raise msg.TypeMismatch("an empty key is neither a token id nor a text")
            if isinstance(k, int) and not 0 <= k <= INT32_MAX:
                raise msg.TypeMismatch(f"key {key[:20]!r}: token id {k} is outside 0..{INT32_MAX}")
            out.append((k, _bias_value(key[:20], bias)))
        return tuple(out)
    if isinstance(v, list):
        for i, pair in enumerate(v):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise msg.TypeMismatch(f"[{i}]: expected a [token id or text, bias] pair")
            tok, bias = pair
            if isinstance(tok, bool) or not isinstance(tok, (int, str)) or tok == "":
                raise msg.TypeMismatch(f"[{i}][0]: expected a token id or a non-empty text, got {msg.type_name(tok)}")
            if isinstance(tok, int) and tok < 0:
                raise msg.TypeMismatch(f"[{i}][0]: token id {tok} is negative")
            out.append((tok, _bias_value(f"[{i}][1]", bias)))
        return tuple(out)
    raise msg.TypeMismatch(f"expected an object or an array of [token, bias] pairs, got {msg.type_name(v)}")


def _samplers(v: Any, _t: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    try:
        return parse_samplers(v)
    except ParameterError as exc:
        raise msg.TypeMismatch(str(exc).removeprefix("samplers: ")) from None


def _object_or_null(v: Any, _t: Any) -> dict[str, Any] | None:
    if v is None or isinstance(v, dict):
        return v
    raise msg.TypeMismatch(f"expected an object or null, got {msg.type_name(v)}")


def _tools(v: Any, _t: Any) -> tuple[Any, ...] | None:
    if v is None:
        return None
    if isinstance(v, list):
        return tuple(v)
    raise msg.TypeMismatch(f"expected a list or null, got {msg.type_name(v)}")


def _tool_choice(v: Any, _t: Any) -> str | dict[str, Any] | None:
    if v is None or isinstance(v, (str, dict)):
        return v
    raise msg.TypeMismatch(f"expected a string, an object or null, got {msg.type_name(v)}")


def _number(name: str) -> Any:
    """The structure hook of numeric field ``name``: :func:`~hydra_trio.openai.field_limits.read_number`."""
    return override(struct_hook=lambda v, _t: field_limits.read_number(name, v))


CONVERTER = msg.StrictConverter()
"""The OpenAI bodies' converter; each body class of this layer registers on it (:mod:`.embeddings` too)."""

_COMMON = dict(
    **{n: _number(n) for n in attrs.fields_dict(_GenerationFields) if n in field_limits.FIELDS},
    stop=override(struct_hook=_stop),
    logit_bias=override(struct_hook=_logit_bias),
    response_format=override(struct_hook=_object_or_null),
    json_schema=override(struct_hook=_object_or_null),
    dry_sequence_breakers=override(struct_hook=_str_list),
    response_fields=override(struct_hook=_str_list),
    samplers=override(struct_hook=_samplers),
)
CONVERTER.register(
    ChatMessage,
    forbid_extra=False,
    content=override(struct_hook=_content),
    tool_calls=override(struct_hook=_tools),
    function_call=override(struct_hook=_object_or_null),
    media=override(omit=True),
)
_message_hook = CONVERTER.cattrs.get_structure_hook(ChatMessage)


def _message(v: Any, t: Any) -> ChatMessage:
    """A chat message, with its content list's media parts in ``media``."""
    m = _message_hook(v, t)
    content = v.get("content")
    return attrs.evolve(m, media=_parts(content)[1]) if isinstance(content, list) else m


CONVERTER.cattrs.register_structure_hook(ChatMessage, _message)
CONVERTER.register(StreamOptions, forbid_extra=False)
CONVERTER.register(
    ChatCompletionRequest,
    forbid_extra=False,
    keep_raw=True,
    tools=override(struct_hook=_tools),
    tool_choice=override(struct_hook=_tool_choice),
    chat_template_kwargs=override(struct_hook=_object_or_null),
    top_logprobs=_number("top_logprobs"),
    thinking_budget_tokens=_number("thinking_budget_tokens"),
    reasoning_budget_tokens=_number("reasoning_budget_tokens"),
    **_COMMON,
)
CONVERTER.register(
    CompletionRequest,
    forbid_extra=False,
    keep_raw=True,
    prompt=override(struct_hook=_prompt),
    logprobs=_number("logprobs"),
    **_COMMON,
)
CONVERTER.register(TokenizeRequest, forbid_extra=False)
CONVERTER.register(DetokenizeRequest, forbid_extra=False)
CONVERTER.register(SlotFileRequest, forbid_extra=False)


def parse_body(raw: bytes, cls: type[Any]) -> Any:
    """Parse a JSON body into ``cls`` and run its checks.

    Raises:
        MessageError: invalid UTF-8 or JSON (NaN and Infinity included), not
            an object, a field of the wrong type or out of range; the message
            names the field.
    """
    try:
        data = msg.loads(raw)
    except msg.NotUnicode:
        raise  # it names the field already
    except MessageError as exc:
        raise MessageError(f"invalid JSON body: {str(exc).removeprefix('payload is not valid JSON: ')}") from None
    return structure_body(data, cls)


def structure_body(data: Any, cls: type[Any]) -> Any:
    """Structure an already-decoded JSON value into ``cls``; same errors as :func:`parse_body`."""
    if not isinstance(data, dict):
        raise MessageError(f"the body must be a JSON object, got {msg.type_name(data)}")
    obj = CONVERTER.structure(data, cls)
    obj.check()
    return obj
