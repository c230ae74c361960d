"""OpenAI reply objects for one completion or chat request, whole or streamed: ids, choices, logprobs in
OpenAI's two shapes, usage, and a chat reply's text through the thinking split (:mod:`.reasoning`) and the
tool-call parser (:mod:`.tools`).  Sans-I/O: a front end feeds it the engine's deltas and sends what it
returns, a stream as server-sent events (:func:`sse`): the first chunk, one event per engine delta, then the
final chunk, the usage chunk and ``data: [DONE]`` (:meth:`ResponseContext.stream_tail`).

Every reply object of a completion (this module's :class:`ResponseContext`, llama-server's native
:class:`~hydra_trio.openai.native.NativeCompletion`) is a :class:`CompletionReply`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..engine import Finished, SlotAssigned, TextDelta
from . import tools as api_tools
from .reasoning import ChatReplyText, ReasoningDelta, ThinkingSetup

if TYPE_CHECKING:
    from .tools import ChatTools


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`` with one encoder for every call
(``json.dumps`` with options builds a new encoder each time: once per streamed token)."""

DONE = "data: [DONE]\n\n"
"""The OpenAI stream's last event."""


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <compact JSON>`` and a blank line."""
    return f"data: {_encode(obj)}\n\n"


class CompletionReply(Protocol):
    """The reply of one completion request, fed the engine's events in order and giving what is sent.

    Streamed: :meth:`stream_head`, then :meth:`stream_delta` per delta, then :meth:`stream_tail` (each
    returns server-sent events, ``""`` for none).  Whole: :meth:`add` per delta, then :meth:`whole`."""

    def stream_head(self) -> str: ...

    def stream_delta(self, delta: TextDelta, assigned: SlotAssigned | None) -> str: ...

    def stream_tail(self, f: Finished) -> str: ...

    def add(self, delta: TextDelta, assigned: SlotAssigned | None = None) -> Any: ...

    def whole(self, f: Finished) -> Any: ...


def _usage(f: Finished, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning_tokens`` (a chat reply's) goes in ``completion_tokens_details``."""
    usage: dict[str, Any] = {
        "prompt_tokens": f.n_prompt,
        "completion_tokens": f.predicted_n,
        "total_tokens": f.n_prompt + f.predicted_n,
        "prompt_tokens_details": {"cached_tokens": f.cache_n},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class ResponseContext:
    """Builds OpenAI response objects for one request (same id and created time throughout).

    Log-probabilities come in OpenAI's two shapes: chat ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs"}]}``, completions ``{"tokens",
    "token_logprobs", "top_logprobs", "text_offset"}``; a streamed chunk
    carries those of its own tokens, a whole reply those of every generated
    token (one entry per completion token).

    A chat reply's text goes through the thinking parser (``thinking``, the job's
    :class:`~hydra_trio.openai.reasoning.ThinkingSetup`; :class:`~hydra_trio.openai.reasoning.ChatReplyText`).
    """

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        include_usage: bool,
        logprobs: bool = False,
        piece: Callable[[int], bytes] = lambda t: b"",
        echo: str = "",
        id: str | None = None,
        thinking: ThinkingSetup | None = None,
        tools: ChatTools | None = None,
    ) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.piece = piece
        self.echo = echo
        self.id = id or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts: list[str] = [echo] if echo else []
        self.n_chars = len(echo)
        self.entries: list[dict[str, Any]] = []  # chat shape, one per token
        self.offsets: list[int] = []
        self.reply = ChatReplyText(thinking) if chat else None
        self.split = ReasoningDelta()  # what the last delta added to a chat message
        # tool calls (api/tools.py): a chat reply's content is parsed into content and calls
        self.tools = tools
        self.tool_parser = api_tools.ToolCallParser(tools.format) if tools is not None else None
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._head: str | None = None  # chunk_json's envelope up to the delta

    def chat_chunks(
        self, split: ReasoningDelta, logprobs: dict[str, Any] | None, has_tokens: bool, end: bool = False
    ) -> list[dict[str, Any]]:
        """Stream chunks for what a delta added to a chat reply (``split``: its thinking and content;
        ``end``: the reply ended): ``delta.reasoning_content``, then ``delta.content`` and, with tools,
        ``delta.tool_calls`` as the tool-call parser finds them (:func:`hydra_trio.openai.tools.stream_delta`).
        A delta's logprobs ride on its first chunk (an empty delta when its text is held back)."""
        return [self.chunk(d, None, lp) for d, lp in self.chat_deltas(split, logprobs, has_tokens, end)]

    def chat_deltas(
        self, split: ReasoningDelta, logprobs: dict[str, Any] | None, has_tokens: bool, end: bool = False
    ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """:meth:`chat_chunks` as ``(delta, logprobs)`` pairs, one per chunk, before the envelope
        (for :meth:`chunk_json`)."""
        p, tools = self.tool_parser, self.tools
        if p is None or tools is None:
            return [(ChatReplyText.delta(split), logprobs)] if split or (logprobs is not None and has_tokens) else []
        deltas: list[dict[str, Any]] = [{"reasoning_content": split.reasoning}] if split.reasoning else []
        events = p.feed(split.content) if split.content else []
        if end:
            events += p.finish()
        shape = api_tools.legacy_delta if tools.spec.legacy else api_tools.stream_delta
        deltas += [d for d in (shape(x) for x in events) if d is not None]
        if logprobs is not None and has_tokens and not deltas:
            deltas = [{}]
        return [(d, logprobs if i == 0 else None) for i, d in enumerate(deltas)]

    def chunk_json(self, delta: Any, logprobs: dict[str, Any] | None = None) -> str:
        """The compact JSON (no spaces, non-ASCII as is) of ``self.chunk(delta, None, logprobs)``, built
        from the request's fixed head and the delta's own JSON: a stream's per-token chunk without a
        dict and a whole-object encoding for each."""
        if self._head is None:
            self._head = (
                f'{{"id":{_encode(self.id)},"object":{_encode(self._object)},"created":{self.created},'
                f'"model":{_encode(self.model)},"choices":[{{"index":0,"{"delta" if self.chat else "text"}":'
            )
        return f'{self._head}{_encode(delta)},"logprobs":{_encode(logprobs)},"finish_reason":null}}]}}'

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` (``function_call`` for legacy functions) when the reply stopped with calls."""
        if self.tool_parser is None or self.tools is None:
            return reason
        return api_tools.finish_reason(reason, self.tool_parser.calls, self.tools.spec.legacy, self.tool_parser.cut)

    def add(self, ev: TextDelta, assigned: SlotAssigned | None = None) -> dict[str, Any] | None:
        """Record a delta; returns the logprobs object for its own tokens (None when not asked).
        A chat reply's split of it is in :attr:`split`; ``assigned`` is not needed here."""
        start = len(self.entries)
        if ev.eog:  # listed in a whole reply's log-probabilities only (TextDelta.eog)
            self.split = ReasoningDelta()
        else:
            self.texts.append(ev.text)
            if self.reply is not None:
                self.split = self.reply.add(ev.text, len(ev.tokens))
        if self.logprobs:
            tops = ev.top_logprobs or ((),) * len(ev.tokens)
            for tok, lp, top in zip(ev.tokens, ev.logprobs, tops, strict=True):
                entry = self._entry(tok, lp)
                entry["top_logprobs"] = [self._entry(t, v) for t, v in top]
                self.entries.append(entry)
                self.offsets.append(self.n_chars)
        self.n_chars += len(ev.text)
        return self._logprobs_object(start) if self.logprobs else None

    def usage(self, f: Finished) -> dict[str, Any]:
        return _usage(f, self.reply.reasoning_tokens if self.reply is not None else None)

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.piece(token)  # llama-server's fields, its order (``completion_token_output::to_json``)
        return {"id": token, "token": raw.decode("utf-8", "replace"), "bytes": list(raw), "logprob": logprob}

    def _logprobs_object(self, start: int = 0) -> dict[str, Any]:
        entries = self.entries[start:]
        if self.chat:
            return {"content": entries, "refusal": None}
        return {
            "tokens": [x["token"] for x in entries],
            "token_logprobs": [x["logprob"] for x in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in x["top_logprobs"]} for x in entries],
            "text_offset": self.offsets[start:],
        }

    def chunk(self, delta: Any, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    # ------------------------------------------------------------------ streamed
    def stream_head(self) -> str:
        """The stream's first event: a chat's ``{"role": "assistant", "content": ""}`` delta, a completion's
        echoed prompt (``echo``), else none."""
        if self.chat:
            return sse(self.chunk({"role": "assistant", "content": ""}, None))
        return sse(self.chunk(self.echo, None)) if self.echo else ""

    def stream_delta(self, delta: TextDelta, assigned: SlotAssigned | None = None) -> str:
        """The events for one engine delta (``""`` when it adds none): a chat's thinking, then its content and
        tool calls as the parsers let them go (they hold some back); a completion's text and logprobs.
        The end-of-generation token's delta adds none (llama-server's OpenAI streams do not list it)."""
        if delta.eog:
            self.add(delta)
            return ""
        if self.reply is not None:
            lp = self.add(delta)  # first: it sets self.split
            pairs = self.chat_deltas(self.split, lp, bool(delta.tokens))
            return "".join(f"data: {self.chunk_json(d, lp)}\n\n" for d, lp in pairs)
        if delta.text or (self.logprobs and delta.tokens):
            return f"data: {self.chunk_json(delta.text, self.add(delta))}\n\n"
        return ""

    def stream_tail(self, f: Finished) -> str:
        """The stream's end: what the parsers held back, the final chunk (its ``finish_reason``, ``id_slot`` and
        ``timings``), the usage chunk (``stream_options.include_usage``: no choices) and ``[DONE]``."""
        tail = ""
        if self.reply is not None:
            for d, lp in self.chat_deltas(self.reply.finish(), None, False, end=True):
                tail += f"data: {self.chunk_json(d, lp)}\n\n"
        final = self.chunk({} if self.chat else "", self.finish_reason(f.finish_reason))
        final["id_slot"] = f.id_slot
        final["timings"] = f.timings()
        tail += sse(final)
        if self.include_usage:
            usage = self.chunk(None, None)
            usage["choices"] = []
            usage["usage"] = self.usage(f)
            tail += sse(usage)
        return tail + DONE

    # ------------------------------------------------------------------ whole
    def whole(self, f: Finished) -> dict[str, Any]:
        """The whole reply (:meth:`final_body`)."""
        return self.final_body(f)

    def final_body(self, f: Finished) -> dict[str, Any]:
        text = "".join(self.texts)
        logprobs = self._logprobs_object() if self.logprobs else None
        if self.chat:
            assert self.reply is not None
            message: dict[str, Any] = self.reply.message()
            if self.tool_parser is not None and self.tools is not None:  # the content may hold tool calls
                self.tool_parser.feed(message["content"])
                self.tool_parser.finish()
                message = {
                    **api_tools.message(*self.tool_parser.result(), legacy=self.tools.spec.legacy),
                    **({"reasoning_content": message["reasoning_content"]} if "reasoning_content" in message else {}),
                }
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason(f.finish_reason),
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": f.finish_reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(f),
            "id_slot": f.id_slot,
            "timings": f.timings(),
        }
