"""llama-server's native reply shapes (``POST /completion``), sans-I/O: engine events in, JSON objects out.

The shapes are llama-server's at the version this package runs
(``tools/server/server-task.cpp``: ``server_task_result_cmpl_final`` /
``_partial::to_json_non_oaicompat``, ``task_params::to_json``,
``completion_token_output::probs_vector_to_json``; ``server-common.cpp``:
``json_get_nested_values``).

A whole reply::

    {"index": 0, "content", "tokens": [ids] (return_tokens, else []), "id_slot", "stop": true,
     "model", "tokens_predicted", "tokens_evaluated", "generation_settings", "prompt",
     "has_new_line", "truncated", "stop_type": "eos"|"limit"|"word"|"none", "stopping_word",
     "tokens_cached", "timings", "completion_probabilities" (n_probs > 0)}

filtered by ``response_fields`` when the request names any.  A stream sends one
``data: {...}`` event per delta of text (``{"index", "content", "tokens", "stop": false,
"id_slot", "tokens_predicted", "tokens_evaluated"}``, with ``completion_probabilities`` for
its tokens and, with ``timings_per_token``, ``timings`` so far), then the whole reply with
empty ``content`` and ``tokens`` and no ``completion_probabilities``; no ``[DONE]``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..engine.requests import CompletionJob, Finished, SlotAssigned, TextDelta
from ..engine.settings import SAMPLER_ORDER
from .schemas import CompletionRequest

STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "n_tokens_limit": "limit"}
"""The engine's ``Finished.stop_reason`` -> llama-server's ``stop_type``."""


def stop_type(f: Finished) -> str:
    """llama-server's ``stop_type`` for how a request ended."""
    return STOP_TYPES.get(f.stop_reason, "none")


def valid_utf8_prefix(raw: bytes) -> str:
    """``raw`` without a UTF-8 character cut off at its end, as text (llama-server's ``validate_utf8``)."""
    for cut in range(len(raw), max(-1, len(raw) - 4), -1):
        try:
            return raw[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", "replace")


def select_fields(paths: Sequence[str], obj: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``response_fields``: only the named fields, a path with ``/`` reaching into
    nested objects and kept under the whole path as its key; a missing field is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def generation_settings(body: CompletionRequest, job: CompletionJob, stream: bool) -> dict[str, Any]:
    """``generation_settings``: the request's parameters in effect (``task_params::to_json``)."""
    return {
        **job.sampling.to_json(),
        "adaptive_target": job.adaptive_target,
        "adaptive_decay": job.adaptive_decay,
        "stop": list(job.stop),
        "max_tokens": job.n_predict,
        "n_predict": job.n_predict,
        "n_keep": job.n_keep if job.n_keep is not None else 0,
        "n_discard": job.n_discard,
        "ignore_eos": job.ignore_eos,
        "stream": stream,
        # a banned token's -inf is null, as llama-server's JSON writes it
        "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in job.logit_bias],
        "n_probs": job.n_probs,
        "grammar": job.grammar or "",
        "samplers": list(job.samplers if job.samplers is not None else SAMPLER_ORDER),
        "timings_per_token": body.timings_per_token,
        "post_sampling_probs": False,
        "t_max_predict_ms": job.t_max_predict_ms,
        "cache_prompt": job.cache_prompt,
        "id_slot": job.id_slot,
        "lora": [],
    }


class NativeCompletion:
    """Builds the llama-server native objects of one ``/completion`` request.

    ``piece(token)`` gives a token's bytes (for ``completion_probabilities``);
    ``prompt_text`` is the prompt as text, special tokens included;
    ``settings`` is :func:`generation_settings`.  Feed the engine's events in
    order: :meth:`assigned`, :meth:`add` per delta (returns the stream event),
    then :meth:`final`.
    """

    def __init__(
        self, *, model: str, return_tokens: bool, n_probs: int, response_fields: Sequence[str] | None,
        timings_per_token: bool, piece: Callable[[int], bytes], prompt_text: str, settings: dict[str, Any],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.return_tokens = return_tokens
        self.n_probs = n_probs
        self.response_fields = tuple(response_fields or ())
        self.timings_per_token = timings_per_token
        self.piece = piece
        self.prompt_text = prompt_text
        self.settings = settings
        self.clock = clock
        self.texts: list[str] = []
        self.tokens: list[int] = []
        self.probs: list[dict[str, Any]] = []
        self.id_slot = -1
        self.n_prompt = 0
        self.cache_n = 0
        self.t_start = clock()
        self.t_first: float | None = None

    def assigned(self, ev: SlotAssigned) -> None:
        self.id_slot, self.n_prompt, self.cache_n = ev.id_slot, ev.n_prompt, ev.cache_n

    def _token_json(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.piece(token)
        return {"id": token, "token": valid_utf8_prefix(raw), "bytes": list(raw), "logprob": logprob}

    def _probs(self, ev: TextDelta) -> list[dict[str, Any]]:
        if self.n_probs <= 0:
            return []
        tops: Iterable[Any] = ev.top_logprobs or ((),) * len(ev.tokens)
        return [{**self._token_json(tok, lp), "top_logprobs": [self._token_json(t, v) for t, v in top]}
                for tok, lp, top in zip(ev.tokens, ev.logprobs, tops, strict=True)]

    def add(self, ev: TextDelta) -> dict[str, Any] | None:
        """Record a delta; its stream event (None when it carries neither text nor tokens)."""
        if self.t_first is None:
            self.t_first = self.clock()
        self.texts.append(ev.text)
        self.tokens += ev.tokens
        probs = self._probs(ev)
        self.probs += probs
        if not ev.text and not ev.tokens:
            return None
        chunk: dict[str, Any] = {
            "index": 0, "content": ev.text, "tokens": list(ev.tokens), "stop": False, "id_slot": self.id_slot,
            "tokens_predicted": len(self.tokens), "tokens_evaluated": self.n_prompt,
        }
        if self.timings_per_token:
            chunk["timings"] = self._timings_so_far()
        if probs:
            chunk["completion_probabilities"] = probs
        return chunk

    def _timings_so_far(self) -> dict[str, Any]:
        """Timings at this point, measured here (the engine reports its own only at the end)."""
        now = self.clock()
        first = self.t_first if self.t_first is not None else now
        prompt_n = self.n_prompt - self.cache_n
        prompt_ms = (first - self.t_start) * 1e3
        predicted_ms = (now - first) * 1e3
        n = len(self.tokens)
        return {
            "cache_n": self.cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": 1e3 * n / predicted_ms if predicted_ms > 0 else 0.0,
        }

    def final(self, f: Finished, *, stream: bool) -> dict[str, Any]:
        """The whole reply (``stream``: the last event, without the text and tokens already sent)."""
        content = "".join(self.texts)
        body: dict[str, Any] = {
            "index": 0,
            "content": "" if stream else content,
            "tokens": list(self.tokens) if self.return_tokens and not stream else [],
            "id_slot": f.id_slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": f.predicted_n,
            "tokens_evaluated": f.n_prompt,
            "generation_settings": self.settings,
            "prompt": self.prompt_text,
            "has_new_line": "\n" in content,
            "truncated": f.truncated or f.stop_reason == "n_tokens_limit",
            "stop_type": stop_type(f),
            "stopping_word": f.stopping_word,
            "tokens_cached": f.n_past,
            "timings": f.timings(),
        }
        if not stream and self.probs:
            body["completion_probabilities"] = self.probs
        return select_fields(self.response_fields, body) if self.response_fields else body
