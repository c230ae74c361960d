"""Turn OpenAI request bodies into engine jobs (for every front end, through :mod:`.completions`): the prompt
rendered and tokenized, the sampling fields, the grammar, the node's defaults for what a body leaves out."""

from __future__ import annotations

from typing import Any

import attrs

from ..engine import BudgetSpec, CompletionJob, Engine, GrammarError, ModelView, PromptTooLong
from ..engine.settings import GenerationDefaults
from ..openai import tools as _tools
from ..openai.json_schema import SchemaError, schema_to_gbnf
from ..openai.media import MultimodalPrompt, check_markers, load_media, load_multimodal_data
from ..openai.prefill import (
    continuation,
    continued_tail,
    generation_prompt,
    reasoning_markers,
    requested_continuation,
)
from ..openai.reasoning import MARKERS, ThinkingSetup, opened_in_prompt, template_markers
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..openai.tools import ChatTools
from ..protocol.media import MediaItem, MediaPrompt
from ..validation.strict import MessageError, TooLong
from . import node


def chat_prompt(e: Engine, body: ChatCompletionRequest) -> tuple[str, list[str]]:
    """The chat rendered by the template in effect: ``(prompt text, the template's extra stop strings)``
    (what ``POST /apply-template`` answers, and what :func:`chat_job` tokenizes); each media part is the media
    marker in it, once read and checked as a chat completion reads it (:func:`chat_media`).
    Raises ChatTemplateError (the template failed; an InvalidRequest), and :func:`chat_media`'s errors."""
    chat_media(e, body)
    r = _render(e, body)
    return r.prompt, r.stop


def chat_media(e: Engine, body: ChatCompletionRequest) -> tuple[MediaItem, ...]:
    """The chat's media items, in order, read as llama-server reads them before it renders the template
    (:func:`~hydra_trio.openai.media.load_media` with the node's ``EngineConfig.media`` and its
    ``modalities.video``).  Raises MediaNotSupported (a kind the node's projector does not take, or no
    projector) or InvalidRequest."""
    parts = body.media_parts
    return load_media(parts, e.config.media, node.modalities(e)["video"]) if parts else ()


def _media_job(
    e: Engine, m: ModelView, prompt: str, items: tuple[MediaItem, ...]
) -> tuple[list[int], MediaPrompt, tuple[Any, ...]]:
    """A media prompt tokenized by the model's projector (:meth:`~hydra_trio.engine.ModelView.tokenize_with_media`:
    text tokens with each media chunk's cells in place), its :class:`~hydra_trio.protocol.media.MediaPrompt`
    and its media chunks (the job's ``media_chunks``).  Raises InvalidRequest (markers and items do not pair;
    media the projector refuses), PromptTooLong (more tokens than a slot holds)."""
    check_markers(prompt, len(items))
    mt = m.tokenize_with_media(prompt, items, add_special=True, parse_special=True)
    n_ctx = e.n_ctx_slot
    if n_ctx and len(mt.tokens) > n_ctx:
        raise PromptTooLong(
            f"the prompt has {len(mt.tokens)} tokens with its media; a slot's context holds {n_ctx} "
            "(--ctx-size / --parallel)"
        )
    return list(mt.tokens), MediaPrompt(prompt, items), mt.chunks


@attrs.frozen
class _Rendered:
    """A chat rendered: the prompt, the template's extra stop strings, the tool-call format, and the
    continued message's text the reply's parser reads first (None: no message continued)."""

    prompt: str
    stop: list[str]
    fmt: str
    prefill: str | None = None


def _render(e: Engine, body: ChatCompletionRequest) -> _Rendered:
    """The chat rendered.  Tools reach the template when it renders them itself (its text mentions
    ``tools``), else the generic tool prompt describes them (:func:`~.tools.render_messages`).  A final
    message is continued as llama-server continues it (:mod:`hydra_trio.openai.prefill`)."""
    # the SOLO model holds the configured template; a COMBINED model has the same vocabulary
    m = e.model_view
    assert m is not None
    tmpl = m.chat_template
    fmt = _tools.detect_format(tmpl.source if tmpl.kind == "jinja" else "")
    native = _tools.template_supports_tools(tmpl.kind, tmpl.source)
    spec = body.tool_spec
    cont, agp = continuation(body.raw, e.config.prefill_assistant)
    # no prompt longer than this can fit a slot (each token stands for at most max_token_bytes + 1 bytes):
    # rendering stops there, so JSON pretty-printed over deep values (its text grows with the depth) is
    # refused as the tokenizer refuses a long prompt, before it is built whole
    n_ctx = e.n_ctx_slot
    max_chars = (m.special_tokens.max_token_bytes + 1) * n_ctx if n_ctx else None
    try:
        messages = _tools.render_messages(body.messages, spec, fmt, native, max_chars)
        offered = [t.as_openai() for t in spec.tools] if spec is not None and spec.active and native else None
        kwargs = thinking_kwargs(e, body)
        if cont is None or tmpl.kind != "jinja":  # llama.cpp's built-in templates render every message
            prompt, stop = m.apply_chat_template(
                messages, kwargs, tools=offered, max_chars=max_chars, add_generation_prompt=agp
            )
            return _Rendered(prompt, stop, fmt)
        head = messages[:-1]
        base, stop = m.apply_chat_template(
            head, kwargs, tools=offered, max_chars=max_chars, add_generation_prompt=False
        )
        opened, _ = m.apply_chat_template(head, kwargs, tools=offered, max_chars=max_chars)
        markers = reasoning_markers(
            lambda probe: m.apply_chat_template(probe, kwargs, add_generation_prompt=False)[0],
            template_markers(tmpl.source),
        )
        tail, prefill = continued_tail(generation_prompt(base, opened), cont, markers)
        return _Rendered(base + tail, stop, fmt, prefill)
    except TooLong:
        raise PromptTooLong(
            f"the prompt is longer than {max_chars} characters, at least {n_ctx} tokens; a slot's "
            f"context holds {n_ctx} (--ctx-size / --parallel)"
        ) from None


def chat_job(
    e: Engine, body: ChatCompletionRequest, *, n_predict: int | None = None, id_slot: int | None = None
) -> tuple[CompletionJob, ThinkingSetup, ChatTools | None]:
    """The job for a chat: the chat rendered with the chat template in effect (``--chat-template``, else the
    GGUF's, else chatml) and tokenized (BOS added as llama-server adds it); how the reply's text is split into
    thinking and content; how its tool calls are read (None: no tools offered).

    ``n_predict`` / ``id_slot`` override the body's (the Hydra ops set them).  ``required`` and a named
    function constrain the reply with a grammar, ``auto`` with a lazy one
    (:func:`~hydra_trio.openai.tools.tool_grammar`).

    Raises ChatTemplateError (the template failed; an InvalidRequest) or MessageError.
    """
    m = e.model_view
    assert m is not None
    items = chat_media(e, body)
    rendered = _render(e, body)
    prompt, extra_stop, fmt = rendered.prompt, rendered.stop, rendered.fmt
    media, chunks = None, ()
    if items:
        tokens, media, chunks = _media_job(e, m, prompt, items)
    else:  # a prompt that cannot fit is refused while tokenizing (or before, from its length alone)
        tokens = m.chat_prompt_tokens(prompt, limit=e.n_ctx_slot or None)
    stop = list(body.stop) + [s for s in extra_stop if s not in body.stop]
    job = attrs.evolve(_job(e, body, tokens, stop, n_predict, id_slot), media=media, media_chunks=chunks)
    pure = e.config.skip_chat_parsing  # --skip-chat-parsing: the whole reply is content, tool calls unparsed
    thinking = ThinkingSetup.for_prompt(
        "none" if pure else body.reasoning_format or e.config.reasoning_format,
        m.chat_template.source,
        prompt,
        rendered.prefill,
        prefill_in_stream=requested_continuation(body.raw) is None,
    )
    job = attrs.evolve(job, reasoning_format=thinking.fmt, reasoning_budget=budget_spec(e, body, prompt))
    spec = body.tool_spec
    if spec is None or not spec.active or pure:
        return job, thinking, None
    try:
        g = _tools.tool_grammar(spec, fmt)
    except SchemaError as exc:  # checked together when the body was read; a format's wrapping adds a little
        raise MessageError(f"tools: {exc}"[:1000]) from None
    if g is not None and not g.lazy and thinking.prompt_open is not None:  # the reply starts in thinking
        g = attrs.evolve(g, gbnf=_tools.after_thinking(g.gbnf, thinking.prompt_open[1]))
    if g is not None:
        try:
            m.check_grammar(g.gbnf)
        except GrammarError as exc:
            raise MessageError(f"tools: {exc}") from None
        job = attrs.evolve(job, grammar=g.gbnf, grammar_lazy=g.lazy, grammar_triggers=g.triggers)
    return job, thinking, ChatTools(spec, fmt)


def thinking_budget(e: Engine, body: ChatCompletionRequest) -> int:
    """The thinking budget in tokens: the request's (``reasoning_budget_tokens`` /
    ``thinking_budget_tokens``), else ``--reasoning-budget``; -1 unrestricted."""
    return body.thinking_budget if body.thinking_budget is not None else e.config.reasoning_budget


def thinking_kwargs(e: Engine, body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's template variables over the node's (``chat_template_kwargs``, merged as
    llama-server merges them); a thinking budget of 0 (the request's, else ``--reasoning-budget``)
    sets ``enable_thinking`` false, so the template closes or skips the thinking block.

    ``reasoning_effort`` (OpenAI's field) as llama-server's ``oaicompat_chat_params_parse`` maps it:
    ``none`` sets ``enable_thinking`` false (and drops a ``reasoning_effort`` kwarg); another level
    reaches the template as the variable ``reasoning_effort`` (templates such as gpt-oss's read it;
    one that does not, thinks as it would without it).
    """
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort == "none":
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    if thinking_budget(e, body) == 0:
        kwargs["enable_thinking"] = False
    return kwargs


def budget_spec(e: Engine, body: ChatCompletionRequest, prompt: str) -> BudgetSpec | None:
    """The thinking budget the engine enforces for a reply to ``prompt`` (None: unrestricted, or a
    template without thinking markers: llama-server arms its budget sampler only when the template
    has thinking tags).

    The markers are those the prompt opened (:func:`~.reasoning.opened_in_prompt`), else the first
    pair the template names; the forced tokens are ``reasoning_budget_message`` (the request's, else
    ``--reasoning-budget-message``) then the end marker, tokenized with special tokens parsed
    (llama-server's ``reasoning_budget_message`` field handler, ``tools/server/server-schema.cpp``).
    """
    budget = thinking_budget(e, body)
    if budget < 0:
        return None
    m = e.model_view
    assert m is not None
    opened = opened_in_prompt(prompt)
    source = m.chat_template.source
    pair = opened or next((p for p in MARKERS if p[0] in source and p[1] in source), None)
    if pair is None:
        return None
    message = (
        body.reasoning_budget_message
        if body.reasoning_budget_message is not None
        else e.config.reasoning_budget_message
    )
    forced = (m.tokenize(message, add_special=False, parse_special=True) if message else []) + m.tokenize(
        pair[1], add_special=False, parse_special=True
    )
    return BudgetSpec(budget, pair[0].encode(), pair[1].encode(), tuple(forced), opened=opened is not None)


def job_from_completion(e: Engine, body: CompletionRequest) -> CompletionJob:
    """Tokenize a text prompt (adding BOS when the model wants it) or check a token-id prompt.

    llama-server's prompt object ``{"prompt_string", "multimodal_data"}`` gives a job with media
    (:func:`~hydra_trio.openai.media.load_multimodal_data`); without ``multimodal_data`` its
    ``prompt_string`` is the prompt.

    A null prompt generates "as if from the beginning of a new document" (OpenAI):
    the prompt is the model's BOS token (EOS when it has none).  A list mixing
    token ids and strings is tokenized as llama-server's ``tokenize_mixed``:
    each string in place, BOS only for a string that comes first.
    """
    m = e.model_view
    assert m is not None
    prompt = body.prompt
    if isinstance(prompt, MultimodalPrompt):
        if prompt.data is not None:
            assert isinstance(prompt.prompt, str)
            items = load_multimodal_data(prompt, e.config.media)
            if items:
                tokens, media, chunks = _media_job(e, m, prompt.prompt, items)
                return attrs.evolve(
                    _job(e, body, tokens, list(body.stop), None, None), media=media, media_chunks=chunks
                )
        prompt = prompt.prompt
    if prompt is None:
        tokens = [m.bos_id if m.bos_id >= 0 else m.eos_id]
    elif isinstance(prompt, str):
        tokens = m.tokenize(prompt, add_special=True, parse_special=True, limit=e.n_ctx_slot or None)
    else:
        tokens = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                tokens += m.tokenize(part, add_special=i == 0, parse_special=True)
            elif not 0 <= part < m.n_vocab:
                raise MessageError(f"prompt: token id {part} is out of the vocabulary (0..{m.n_vocab - 1})")
            else:
                tokens.append(part)
        if not tokens:
            raise MessageError("prompt: the prompt holds no tokens")
    return _job(e, body, tokens, list(body.stop), None, None)


def job_continue(e: Engine, body: CompletionRequest, *, n_predict: int, id_slot: int) -> CompletionJob:
    """Generate on from what slot ``id_slot`` already holds (DECODE without messages).

    The prompt is the slot's cached tokens, read on the engine thread when the
    job starts; ``body`` gives the sampling fields.
    """
    job = _job(e, body, [], [], n_predict, id_slot)
    return attrs.evolve(job, continue_slot=True, cache_prompt=True)


def _job(
    e: Engine,
    body: ChatCompletionRequest | CompletionRequest,
    tokens: list[int],
    stop: list[str],
    n_predict: int | None,
    id_slot: int | None,
) -> CompletionJob:
    m = e.model_view
    assert m is not None
    defaults = e.request_defaults  # read once: CONFIGURE may swap a new pair in meanwhile (any thread)
    job = CompletionJob(
        prompt_tokens=tuple(tokens),
        n_predict=body.n_predict_effective(defaults.n_predict) if n_predict is None else n_predict,
        sampling=body.sampling(defaults.sampling),
        stop=tuple(stop),
        id_slot=body.id_slot if id_slot is None else id_slot,
        cache_prompt=body.cache_prompt,
        ignore_eos=body.ignore_eos,
        logprobs=body.wants_logprobs,
        n_probs=body.top_logprobs_n,
        logit_bias=logit_bias(m, body.logit_bias),
        grammar=_grammar(m, body),
        n_keep=body.n_keep,
        n_discard=body.n_discard,
        n_cache_reuse=body.n_cache_reuse,
        samplers=body.samplers,
        adaptive_target=body.adaptive_target,
        adaptive_decay=body.adaptive_decay,
        t_max_predict_ms=max(0, body.t_max_predict_ms or 0),
        stream=bool(body.stream),
        timings_per_token=bool(body.timings_per_token),
    )
    return node_defaults(m, body, job, defaults.generation)


def node_defaults(
    m: ModelView, body: ChatCompletionRequest | CompletionRequest, job: CompletionJob, g: GenerationDefaults
) -> CompletionJob:
    """``job`` with the node's defaults (``EngineConfig.generation``: ``--samplers``, ``--ignore-eos``,
    ``-l``, ``--grammar``/``-j``, ``--adaptive-*``, ``-r``, ``--no-cache-prompt``; and ``-sp``) for the fields ``body``
    leaves out or sends as null, as llama-server starts each request from its ``params_base``
    (``tools/server/server-schema.cpp``).  An empty stop list (the chat template's stops included) takes
    ``-r``'s, as llama-server falls back to its antiprompts.  A default yields to the request's own
    opposite: the node's grammar to a request's ``ignore_eos: true``, the node's ``--ignore-eos`` to a
    request's grammar, json_schema or JSON response_format (a finished grammar allows only the end of
    generation; the two defaults together are refused at start).

    Raises MessageError: the node's grammar does not parse for this model's vocabulary.
    """
    sent = {k for k, v in body.raw.items() if v is not None}
    own_ignore_eos = "ignore_eos" in sent and bool(body.ignore_eos)
    changes: dict[str, Any] = {}
    if body.samplers is None and g.samplers is not None:
        changes["samplers"] = g.samplers
    if "ignore_eos" not in sent and g.ignore_eos and not body.constrained:
        changes["ignore_eos"] = True
    if "logit_bias" not in sent and g.logit_bias:
        changes["logit_bias"] = g.logit_bias
    if g.grammar is not None and not body.constrained and not own_ignore_eos:
        try:
            m.check_grammar(g.grammar)
        except GrammarError as exc:
            raise MessageError(f"the node's grammar (--grammar, --json-schema): {exc}") from None
        changes["grammar"] = g.grammar
    for name in ("adaptive_target", "adaptive_decay", "cache_prompt"):
        if name not in sent:
            changes[name] = getattr(g, name)
    if not job.stop and g.stop:
        changes["stop"] = g.stop
    return attrs.evolve(job, special=g.special, **changes)


def logit_bias(m: ModelView, entries: tuple[tuple[int | str, float], ...]) -> tuple[tuple[int, float], ...]:
    """A request's ``logit_bias`` as ``(token id, bias)`` pairs: a text becomes every token of its
    tokenization (no BOS, special-token text not parsed: llama-server's ``common_tokenize(vocab, text,
    false)``).  Raises MessageError for an id outside the vocabulary, and for more pairs than the
    vocabulary has tokens (``n_vocab``: every token once; llama.cpp's logit-bias sampler walks all pairs
    at each token, so the limit keeps that walk within one pass over the vocabulary's size)."""
    too_many = f"logit_bias: more than {m.n_vocab} (token, bias) pairs, the vocabulary's size (n_vocab)"
    if len(entries) > m.n_vocab:  # each entry is one pair or more
        raise MessageError(f"{too_many}: {len(entries)} entries")
    out: list[tuple[int, float]] = []
    for tok, bias in entries:
        if isinstance(tok, str):
            out += [(t, bias) for t in m.tokenize(tok, add_special=False, parse_special=False)]
            if len(out) > m.n_vocab:
                raise MessageError(f"{too_many}, once the texts are tokenized")
        elif tok >= m.n_vocab:
            raise MessageError(f"logit_bias: token id {tok} is out of the vocabulary (0..{m.n_vocab - 1})")
        else:
            out.append((tok, bias))
    return tuple(out)


def _grammar(m: ModelView, body: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The request's output constraint as GBNF, checked by llama.cpp's parser (llama-server's fields:
    ``grammar`` as GBNF, ``json_schema`` / ``response_format`` as a JSON schema converted by
    :func:`hydra_trio.openai.json_schema.schema_to_gbnf`, which refuses what it cannot enforce and
    what is over its limits; an empty schema means any JSON object).

    Raises MessageError naming the field.
    """
    got = body.constraint()  # which of the fields is in effect: the request class's (llama-server's) order
    if got is None:
        return None
    field, value = got
    if isinstance(value, str):
        gbnf = value
    else:
        from llama_cpp.llama_grammar import JSON_GBNF  # here: only a JSON-constrained request needs the module

        try:
            gbnf = JSON_GBNF if value in ({}, {"type": "object"}) else schema_to_gbnf(value)
        except SchemaError as exc:
            raise MessageError(f"{field}: {exc}"[:1000]) from None
    try:
        m.check_grammar(gbnf)
    except GrammarError as exc:
        raise MessageError(f"{field}: {exc}") from None
    return gbnf
