"""Turn OpenAI request bodies into engine jobs (shared by HTTP and the Hydra protocol)."""

from __future__ import annotations

from .engine.batch import Engine
from .engine.slots import CompletionJob
from .http.schemas import ChatCompletionRequest, CompletionRequest, RequestError


def job_from_chat(
    e: Engine, body: ChatCompletionRequest, *, n_predict: int | None = None, id_slot: int | None = None
) -> CompletionJob:
    """Render the chat with the GGUF's template and tokenize it.

    ``n_predict`` / ``id_slot`` override the body's (the Hydra ops set them).
    Raises ValueError (the template failed) or RequestError.
    """
    m = e.model
    assert m is not None
    messages = [
        {k: v for k, v in (("role", x.role), ("content", x.content or ""), ("name", x.name)) if v is not None}
        for x in body.messages
    ]
    prompt, extra_stop = m.apply_chat_template(messages)
    tokens = m.tokenize(prompt, add_special=False, parse_special=True)
    stop = list(body.stop) + [s for s in extra_stop if s not in body.stop]
    return _job(e, body, tokens, stop, n_predict, id_slot)


def job_from_completion(e: Engine, body: CompletionRequest) -> CompletionJob:
    """Tokenize a text prompt (adding BOS when the model wants it) or check a token-id prompt."""
    m = e.model
    assert m is not None
    if isinstance(body.prompt, str):
        tokens = m.tokenize(body.prompt, add_special=True, parse_special=True)
    else:
        bad = [t for t in body.prompt if not 0 <= t < m.n_vocab]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} is out of the vocabulary (0..{m.n_vocab - 1})")
        tokens = list(body.prompt)
    return _job(e, body, tokens, list(body.stop), None, None)


def _job(
    e: Engine,
    body: ChatCompletionRequest | CompletionRequest,
    tokens: list[int],
    stop: list[str],
    n_predict: int | None,
    id_slot: int | None,
) -> CompletionJob:
    return CompletionJob(
        prompt_tokens=tuple(tokens),
        n_predict=body.n_predict_effective(e.default_n_predict) if n_predict is None else n_predict,
        sampling=body.sampling(e.defaults),
        stop=tuple(stop),
        id_slot=body.id_slot if id_slot is None else id_slot,
        cache_prompt=body.cache_prompt,
        ignore_eos=body.ignore_eos,
    )
