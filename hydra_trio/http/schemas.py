"""OpenAI request bodies as frozen attrs classes, structured by cattrs.

Type checks are strict (``"5"`` is not an int, ``true`` is not a number), and
every error names the field, e.g. ``max_tokens: expected an integer, got str``,
so that an HTTP 400 tells the client exactly what to fix.  Unknown keys are
ignored, as OpenAI-compatible servers do (clients send ``user``, ``tools``...).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from cattrs.gen import override

from ..engine.settings import SamplingParams, check_n_predict, check_stop
from ..protocol import messages as msg

RequestError = msg.MessageError
"""An invalid request body; the message names the field (HTTP 400)."""


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class ChatMessage:
    role: str
    content: str | None = None
    name: str | None = None


@attrs.frozen
class _GenerationFields:
    """Fields shared by chat and text completions (OpenAI + llama-server extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n_predict: int | None = None  # llama-server
    n: int = 1
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
    id_slot: int = -1  # llama-server
    cache_prompt: bool = True  # llama-server
    ignore_eos: bool = False  # llama-server

    def check(self) -> None:
        """Every field against its bounds (:mod:`hydra_trio.engine.settings`); raises RequestError naming it."""
        if self.n != 1:
            raise RequestError("n: only n = 1 is supported")
        try:
            check_n_predict("max_tokens", self.max_tokens, lo=0)
            check_n_predict("max_completion_tokens", self.max_completion_tokens, lo=0)
            check_n_predict("n_predict", self.n_predict)
            check_stop(self.stop)
            self.sampling(SamplingParams())  # the sampler fields' own validators
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if self.id_slot < -1:
            raise RequestError(f"id_slot: must be >= -1, got {self.id_slot}")

    def n_predict_effective(self, default: int = -1) -> int:
        """Tokens to generate: ``max_completion_tokens``, ``max_tokens``, ``n_predict``, else ``default``."""
        for v in (self.max_completion_tokens, self.max_tokens, self.n_predict):
            if v is not None:
                return v
        return default

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, d: SamplingParams) -> SamplingParams:
        """The request's sampler settings; fields it leaves out come from ``d`` (the engine's defaults)."""
        return SamplingParams(
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_k=d.top_k if self.top_k is None else self.top_k,
            top_p=d.top_p if self.top_p is None else self.top_p,
            min_p=d.min_p if self.min_p is None else self.min_p,
            seed=d.seed if self.seed is None else self.seed,
            repeat_penalty=d.repeat_penalty if self.repeat_penalty is None else self.repeat_penalty,
            repeat_last_n=d.repeat_last_n if self.repeat_last_n is None else self.repeat_last_n,
            presence_penalty=d.presence_penalty if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=d.frequency_penalty if self.frequency_penalty is None else self.frequency_penalty,
        )


@attrs.frozen
class ChatCompletionRequest(_GenerationFields):
    """``POST /v1/chat/completions`` (OpenAI), with llama-server's extensions."""

    messages: tuple[ChatMessage, ...] = ()

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise RequestError("messages: at least one message is required")


@attrs.frozen
class CompletionRequest(_GenerationFields):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | tuple[int, ...] = ""

    def check(self) -> None:
        super().check()
        if not self.prompt:
            raise RequestError("prompt: must not be empty")


# --------------------------------------------------------------------------- converter
# The one cattrs converter (hydra_trio.protocol.messages) with strict
# primitives; these classes allow unknown keys, as OpenAI servers do.


def _stop(v: Any, _t: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise msg.TypeMismatch(f"expected a string or a list of strings, got {msg.type_name(v)}")


def _content(v: Any, _t: Any) -> str | None:
    """OpenAI content: a string, null, or a list of parts whose text parts are joined."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise msg.TypeMismatch(f"part {i}: only parts of type 'text' with a string 'text' are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise msg.TypeMismatch(f"expected a string, a list of content parts or null, got {msg.type_name(v)}")


def _prompt(v: Any, _t: Any) -> str | tuple[int, ...]:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if len(v) == 1 and isinstance(v[0], str):
            return v[0]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return tuple(v)
    raise msg.TypeMismatch("expected a string, a list with one string, or a list of token ids")


msg.register(ChatMessage, forbid_extra=False, content=override(struct_hook=_content))
msg.register(StreamOptions, forbid_extra=False)
msg.register(ChatCompletionRequest, forbid_extra=False, stop=override(struct_hook=_stop))
msg.register(CompletionRequest, forbid_extra=False, stop=override(struct_hook=_stop), prompt=override(struct_hook=_prompt))


def parse_body(raw: bytes, cls: type[Any]) -> Any:
    """Parse a JSON body into ``cls`` and run its checks.

    Raises:
        RequestError: invalid UTF-8 or JSON, not an object, a field of the
            wrong type or out of range; the message names the field.
    """
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise RequestError(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise RequestError("invalid JSON body: nested too deeply") from None
    return structure_body(data, cls)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def structure_body(data: Any, cls: type[Any]) -> Any:
    """Structure an already-decoded JSON value into ``cls``; same errors as :func:`parse_body`."""
    if not isinstance(data, dict):
        raise RequestError(f"the body must be a JSON object, got {msg.type_name(data)}")
    obj = msg.structure(data, cls)
    obj.check()
    return obj
