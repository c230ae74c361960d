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
import cattrs

from ..engine.slots import SamplingParams


class RequestError(ValueError):
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
        if self.n != 1:
            raise RequestError("n: only n = 1 is supported")
        for name in ("max_tokens", "max_completion_tokens"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise RequestError(f"{name}: must be >= 0, got {v}")
        if self.n_predict is not None and self.n_predict < -1:
            raise RequestError(f"n_predict: must be >= -1, got {self.n_predict}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise RequestError(f"temperature: must be in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise RequestError(f"top_p: must be in [0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty is not None and self.repeat_penalty <= 0:
            raise RequestError(f"repeat_penalty: must be > 0, got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not -2.0 <= v <= 2.0:
                raise RequestError(f"{name}: must be in [-2, 2], got {v}")
        if self.id_slot < -1:
            raise RequestError(f"id_slot: must be >= -1, got {self.id_slot}")
        if len(self.stop) > 16:
            raise RequestError("stop: at most 16 stop strings")

    @property
    def n_predict_effective(self) -> int:
        """Tokens to generate: ``max_completion_tokens``, ``max_tokens``, ``n_predict``, else -1."""
        for v in (self.max_completion_tokens, self.max_tokens, self.n_predict):
            if v is not None:
                return v
        return -1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> SamplingParams:
        d = SamplingParams()
        return SamplingParams(
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_k=d.top_k if self.top_k is None else self.top_k,
            top_p=d.top_p if self.top_p is None else self.top_p,
            min_p=d.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
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


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _strict_int(v: Any, _t: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {_type_name(v)}")
    return v


def _strict_float(v: Any, _t: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {_type_name(v)}")
    return float(v)


def _strict_str(v: Any, _t: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {_type_name(v)}")
    return v


def _strict_bool(v: Any, _t: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected a boolean, got {_type_name(v)}")
    return v


def _stop(v: Any, _t: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise TypeError("expected a string or a list of strings")


def _content(v: Any, _t: Any) -> str | None:
    """OpenAI content: a string, null, or a list of parts whose text parts are joined."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise TypeError(f"[{i}]: only parts of type 'text' with a string 'text' are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise TypeError(f"expected a string, a list of content parts or null, got {_type_name(v)}")


def _prompt(v: Any, _t: Any) -> str | tuple[int, ...]:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if len(v) == 1 and isinstance(v[0], str):
            return v[0]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return tuple(v)
    raise TypeError("expected a string, a list with one string, or a list of token ids")


converter = cattrs.Converter(detailed_validation=True)
for _t, _hook in ((int, _strict_int), (float, _strict_float), (str, _strict_str), (bool, _strict_bool)):
    converter.register_structure_hook(_t, _hook)


def _exact(hook_type: Any, hook: Any) -> None:
    # generic aliases (tuple[str, ...]) and unions need a predicate hook
    converter.register_structure_hook_func(lambda t: t == hook_type, hook)


_exact(tuple[str, ...], _stop)
_exact(str | None, lambda v, t: None if v is None else _strict_str(v, t))
_exact(str | tuple[int, ...], _prompt)
converter.register_structure_hook(
    ChatMessage,
    lambda v, t: _structure_message(v),
)
for _opt, _h in ((int, _strict_int), (float, _strict_float), (bool, _strict_bool)):
    _exact(_opt | None, (lambda h: lambda v, t: None if v is None else h(v, t))(_h))


def _structure_message(v: Any) -> ChatMessage:
    if not isinstance(v, dict):
        raise TypeError(f"expected an object, got {_type_name(v)}")
    role = v.get("role")
    if not isinstance(role, str):
        raise TypeError("role: missing or not a string")
    try:
        content = _content(v.get("content"), None)
    except TypeError as exc:
        raise TypeError(f"content{'' if str(exc).startswith('[') else ': '}{exc}") from None
    name = v.get("name")
    if name is not None and not isinstance(name, str):
        raise TypeError("name: expected a string")
    return ChatMessage(role=role, content=content, name=name)


def _format_error(exc: BaseException) -> str:
    """Flatten a cattrs error tree into ``path: reason`` lines."""
    out: list[str] = []

    def walk(e: BaseException, path: str) -> None:
        if isinstance(e, cattrs.ClassValidationError | cattrs.IterableValidationError):
            for sub, note in e.group_exceptions():
                name = getattr(note, "name", None)
                idx = getattr(note, "index", None)
                sub_path = f"{path}.{name}" if name is not None else f"{path}[{idx}]"
                walk(sub, sub_path)
            return
        if isinstance(e, KeyError):
            out.append(f"{path.lstrip('.')}: required")
            return
        msg = str(e)
        sep = "" if msg.startswith("[") or msg.startswith(".") else ": "
        out.append(f"{path.lstrip('.')}{sep}{msg}")

    walk(exc, "")
    return "; ".join(out) or str(exc)


def parse_body(raw: bytes, cls: type[Any]) -> Any:
    """Parse a JSON body into ``cls`` and run its checks.

    Raises:
        RequestError: invalid UTF-8 or JSON, not an object, a field of the
            wrong type or out of range; the message names the field.
    """
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise RequestError("invalid JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(f"the body must be a JSON object, got {_type_name(data)}")
    known = {f.name for f in attrs.fields(cls)}
    try:
        obj = converter.structure({k: v for k, v in data.items() if k in known}, cls)
    except Exception as exc:
        raise RequestError(_format_error(exc)) from None
    obj.check()
    return obj
