"""llama-server's native reply shapes (``POST /completion``; a task's ``params`` for ``/slots`` and ``/props``,
:func:`task_params`; ``GET /v1/models``, :func:`models_reply`), sans-I/O: engine events in, JSON objects out.

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
``data: {...}`` server-sent event per delta of text (``{"index", "content", "tokens", "stop": false,
"id_slot", "tokens_predicted", "tokens_evaluated"}``, with ``completion_probabilities`` for
its tokens and, with ``timings_per_token``, ``timings`` so far), then the whole reply with
empty ``content`` and ``tokens`` and no ``completion_probabilities``; no ``[DONE]``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..engine import CompletionJob, Engine, Finished, SlotAssigned, TextDelta
from ..engine.settings import SAMPLER_ORDER
from .replies import sse
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


def task_params(
    job: CompletionJob, *, n_keep: int = 0, reasoning_format: str = "none", spec_types: str = "none"
) -> dict[str, Any]:
    """A request's parameters as llama-server's ``task_params::to_json(only_metrics=true)`` writes them
    (``tools/server/server-task.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors): a slot's
    ``params`` in ``/slots``, ``default_generation_settings.params`` in ``/props``::

        {sampler settings (SamplingParams.to_json), "adaptive_target", "adaptive_decay", "max_tokens",
         "n_predict", "n_keep", "n_discard", "ignore_eos", "stream", "n_probs", "chat_format",
         "reasoning_format", "reasoning_in_content", "generation_prompt", "samplers", "speculative.types",
         "timings_per_token", "post_sampling_probs", "backend_sampling", "lora"}

    ``n_keep``: the node's (``--keep``) for a job that sets none; ``reasoning_format``: the node's
    (``--reasoning-format``) for a job that is not a chat reply (a chat reply's is the one it is parsed
    with).  ``chat_format`` is ``Content-only`` (no llama.cpp chat parser reads the reply here),
    ``generation_prompt`` empty, ``speculative.types`` the node's (``spec_types``: ``--spec-type``'s list as
    llama-server joins it, ``none`` first) and ``lora`` empty (no adapters)."""
    fmt = job.reasoning_format or reasoning_format
    return {
        **job.sampling.to_json(),
        "adaptive_target": float(job.adaptive_target),
        "adaptive_decay": float(job.adaptive_decay),
        "max_tokens": job.n_predict,
        "n_predict": job.n_predict,
        "n_keep": job.n_keep if job.n_keep is not None else n_keep,
        "n_discard": job.n_discard,
        "ignore_eos": job.ignore_eos,
        "stream": job.stream,
        "n_probs": job.n_probs,
        "chat_format": "Content-only",
        "reasoning_format": fmt,
        "reasoning_in_content": job.stream and fmt == "deepseek-legacy",
        "generation_prompt": "",
        "samplers": list(job.samplers if job.samplers is not None else SAMPLER_ORDER),
        "speculative.types": spec_types,
        "timings_per_token": job.timings_per_token,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }


def generation_settings(body: CompletionRequest, job: CompletionJob, stream: bool) -> dict[str, Any]:
    """``generation_settings``: the request's parameters in effect (``task_params::to_json``: :func:`task_params`
    and the fields it writes beyond them)."""
    return {
        **task_params(job),
        "stop": list(job.stop),
        "stream": stream,
        # a banned token's -inf is null, as llama-server's JSON writes it
        "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in job.logit_bias],
        "grammar": job.grammar or "",
        "timings_per_token": body.timings_per_token,
        "t_max_predict_ms": job.t_max_predict_ms,
        "cache_prompt": job.cache_prompt,
        "id_slot": job.id_slot,
    }


class NativeCompletion:
    """Builds the llama-server native objects of one ``/completion`` request.

    ``piece(token)`` gives a token's bytes (for ``completion_probabilities``);
    ``prompt_text`` is the prompt as text, special tokens included;
    ``settings`` is :func:`generation_settings`.  Feed the engine's events in
    order: :meth:`assigned`, :meth:`add` per delta (returns the stream event),
    then :meth:`final`; or, as every :class:`~hydra_trio.openai.replies.CompletionReply`, streamed
    (:meth:`stream_delta`, :meth:`stream_tail`) or whole (:meth:`add`, :meth:`whole`).
    """

    def __init__(
        self,
        *,
        model: str,
        return_tokens: bool,
        n_probs: int,
        response_fields: Sequence[str] | None,
        timings_per_token: bool,
        piece: Callable[[int], bytes],
        prompt_text: str,
        settings: dict[str, Any],
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
        return [
            {**self._token_json(tok, lp), "top_logprobs": [self._token_json(t, v) for t, v in top]}
            for tok, lp, top in zip(ev.tokens, ev.logprobs, tops, strict=True)
        ]

    def add(self, ev: TextDelta, assigned: SlotAssigned | None = None) -> dict[str, Any] | None:
        """Record a delta (``assigned``: the slot the request runs on, once known); its stream event (None
        when it carries neither text nor tokens)."""
        if assigned is not None and self.id_slot < 0:
            self.assigned(assigned)
        if self.t_first is None:
            self.t_first = self.clock()
        self.texts.append(ev.text)
        self.tokens += ev.tokens
        probs = self._probs(ev)
        self.probs += probs
        if not ev.text and not ev.tokens:
            return None
        chunk: dict[str, Any] = {
            "index": 0,
            "content": ev.text,
            "tokens": list(ev.tokens),
            "stop": False,
            "id_slot": self.id_slot,
            "tokens_predicted": len(self.tokens),
            "tokens_evaluated": self.n_prompt,
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
            "cache_n": self.cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": 1e3 * n / predicted_ms if predicted_ms > 0 else 0.0,
        }

    def stream_head(self) -> str:
        """Nothing: llama-server's stream starts with the first delta."""
        return ""

    def stream_delta(self, delta: TextDelta, assigned: SlotAssigned | None = None) -> str:
        """The event for one engine delta (``""`` when it carries neither text nor tokens)."""
        chunk = self.add(delta, assigned)
        return sse(chunk) if chunk is not None else ""

    def stream_tail(self, f: Finished) -> str:
        """The stream's last event: the whole reply without the text and tokens already sent (no ``[DONE]``)."""
        return sse(self.final(f, stream=True))

    def whole(self, f: Finished) -> dict[str, Any]:
        """The whole reply."""
        return self.final(f, stream=False)

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


def models_reply(e: Engine | None, created: int) -> dict[str, Any]:
    """``GET /v1/models`` (and ``/models``), llama-server's shape (``get_res_models`` and
    ``get_res_model_info`` in ``tools/server/server-context.cpp``) with the node's keys::

        {"object": "list",
         "data": [{"id": alias, "aliases": [], "tags": [], "object": "model", "created", "owned_by",
                   "status": {"value": "loaded"|"loading"},
                   "meta": {"model_path", "model_hash", and once loaded "vocab_type", "n_vocab", "n_ctx"
                            (tokens per slot), "n_ctx_train", "n_embd", "n_params", "size", "ftype"}}],
         "models": [{"name", "model", "modified_at": "", "size": "", "digest": "", "type": "model",
                     "description": "", "tags": [""], "capabilities": ["completion"] (with a projector
                     ``--mmproj``: ["completion", "multimodal"], as llama-server), "parameters": "",
                     "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                 "parameter_size": "", "quantization_level": ""}}]}

    ``created``: Unix seconds (the node's start); ``data`` and ``models`` are empty on a node without a
    model (``e`` None, or no identity yet)."""
    data: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    if e is not None and e.identity is not None:
        alias = e.identity.model_alias
        meta: dict[str, Any] = {"model_path": e.identity.model_path, "model_hash": e.identity.model_hash}
        m = e.model_view
        if e.ready and m is not None:
            facts = m.facts()
            meta.update(
                vocab_type=facts["vocab_type"],
                n_vocab=facts["n_vocab"],
                n_ctx=e.n_ctx_slot,
                n_ctx_train=facts["n_ctx_train"],
                n_embd=facts["n_embd"],
                n_params=facts["n_params"],
                size=facts["size"],
                ftype=facts["ftype"],
            )
        data.append(
            {
                "id": alias,
                "aliases": [],
                "tags": [],
                "object": "model",
                "created": created,
                "owned_by": "hydra-trio",
                "status": {"value": "loaded" if e.ready else "loading"},
                "meta": meta,
            }
        )
        listed.append(
            {
                "name": alias,
                "model": alias,
                "modified_at": "",
                "size": "",
                "digest": "",
                "type": "model",
                "description": "",
                "tags": [""],
                "capabilities": ["completion", "multimodal"] if e.config.media.mmproj is not None else ["completion"],
                "parameters": "",
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "",
                    "families": [""],
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
        )
    return {"models": listed, "object": "list", "data": data}
