"""Embeddings requests and replies: OpenAI's ``POST /v1/embeddings`` and llama-server's ``POST /embedding(s)``.

Sans-I/O: a body in, the inputs' tokens out (:func:`tokenize_inputs`); the
engine's vectors in, a reply body out (:func:`openai_body`, :func:`native_body`).

Inputs take llama-server's shapes (``tokenize_input_prompts`` in
``tools/server/server-common.cpp``): a string; a list of token ids (one
input); a list whose items are strings, token-id lists or mixed lists of both
(one input each).  A list that holds a number anywhere is one input (mixed
strings and ids, concatenated; only a leading string gets BOS).  Text is
tokenized with the model's special tokens added and parsed, as llama-server.
Unlike llama-server, an empty string or an empty id list is refused (400
naming the item) rather than embedded as a lone BOS.

Replies (``format_embeddings_response_oaicompat`` and
``server_task_result_embd::to_json_non_oaicompat``)::

    OpenAI:  {"model", "object": "list", "usage": {"prompt_tokens", "total_tokens"},
              "data": [{"embedding": [float, ...] | base64 str, "index", "object": "embedding"
                        (, "encoding_format": "base64")}]}
    native:  [{"index", "embedding": [[float, ...]]}]  one vector (pooled) or one per token (pooling none)

``encoding_format: base64`` is each vector's little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import attrs

from ..engine import Embedding, ModelView, float32_bytes, n_embd_out
from ..engine.settings import INT32_MAX
from ..validation import strict as msg
from ..validation.strict import MessageError
from .schemas import CONVERTER

OAI_NONE_POOLING = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
"""llama-server's 400 for ``/v1/embeddings`` on a node with ``--pooling none``."""


@attrs.frozen
class EmbeddingsRequest:
    """An embeddings body; ``input`` (OpenAI) or ``content`` (llama-server's native field).

    ``embd_normalize`` (llama-server's): a pooled vector's normalization, None for the node's
    ``--embd-normalize``.  ``dimensions`` (OpenAI's) is accepted only as the model's own width.
    Keys nobody defines are ignored (``user``, ...).
    """

    input: Any = None
    content: Any = None
    model: str | None = None
    encoding_format: str | None = None
    embd_normalize: int | None = None
    dimensions: int | None = None

    @property
    def field(self) -> str:
        """The field the inputs came in: ``input``, else ``content``."""
        return "input" if self.input is not None else "content"

    @property
    def base64(self) -> bool:
        return self.encoding_format == "base64"

    def check(self) -> None:
        if self.input is None and self.content is None:
            raise MessageError(
                'input: required ("input" or "content" must be provided): a string, a list of '
                "strings, a list of token ids or a list of token-id lists"
            )
        if self.encoding_format not in (None, "float", "base64"):
            raise MessageError(
                f"encoding_format: {self.encoding_format!r} is not supported; "
                "The format to return the embeddings in. Can be either float or base64"
            )
        if self.embd_normalize is not None and not -1 <= self.embd_normalize <= INT32_MAX:
            raise MessageError(
                f"embd_normalize: must be -1 (none), 0 (max absolute, int16), 1 (taxicab), "
                f"2 (Euclidean) or a larger p-norm, got {self.embd_normalize}"
            )


CONVERTER.register(EmbeddingsRequest, forbid_extra=False)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_inputs(value: Any, field: str) -> list[tuple[str, Any]]:
    """The inputs of ``input`` / ``content``, each as ``(name for errors, JSON value)``.

    Raises MessageError naming the field (or the item) for an empty list or an item of another type.
    """
    if isinstance(value, str):
        return [(field, value)]
    if not isinstance(value, list):
        raise MessageError(
            f"{field}: expected a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {msg.type_name(value)}"
        )
    if not value:
        raise MessageError(f"{field}: must not be empty")
    if any(_is_id(x) for x in value):
        return [(field, value)]  # one input: token ids, or ids mixed with strings
    return [(f"{field}[{i}]", item) for i, item in enumerate(value)]


def input_tokens(m: ModelView, name: str, value: Any) -> list[int]:
    """One input's tokens: a string, or a list of token ids and strings (llama-server's ``tokenize_mixed``).

    Raises MessageError naming ``name`` for an empty input, a float, an object, or an id outside the vocabulary.
    """
    if isinstance(value, str):
        if not value:
            raise MessageError(f"{name}: the input is empty (an empty string has nothing to embed)")
        return m.tokenize(value, add_special=True, parse_special=True)
    if not isinstance(value, list):
        raise MessageError(f"{name}: expected a string or a list of token ids, got {msg.type_name(value)}")
    if not value:
        raise MessageError(f"{name}: the input is empty (no token ids)")
    tokens: list[int] = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            tokens += m.tokenize(x, add_special=i == 0, parse_special=True)
        elif _is_id(x):
            if not 0 <= x < m.n_vocab:
                raise MessageError(f"{name}[{i}]: token id {x} is out of the vocabulary (0..{m.n_vocab - 1})")
            tokens.append(x)
        else:
            raise MessageError(f"{name}[{i}]: expected a token id or a string, got {msg.type_name(x)}")
    if not tokens:
        raise MessageError(f"{name}: the input is empty (no tokens)")
    return tokens


def check_input_count(body: EmbeddingsRequest, max_inputs: int) -> list[tuple[str, Any]]:
    """The inputs of ``body`` (:func:`split_inputs`), at most ``max_inputs`` of them.

    Raises MessageError naming the field and the limit (``--max-embedding-inputs``) for more.
    """
    items = split_inputs(body.input if body.input is not None else body.content, body.field)
    if len(items) > max_inputs:
        raise MessageError(
            f"{body.field}: {len(items)} inputs; at most {max_inputs} fit in one request (--max-embedding-inputs)"
        )
    return items


def tokenize_inputs(
    m: ModelView, body: EmbeddingsRequest, max_tokens: int, why: str, max_inputs: int = INT32_MAX
) -> list[tuple[str, list[int]]]:
    """Every input of ``body`` as ``(name, tokens)``, checked: at most ``max_inputs`` of them
    (:func:`check_input_count`), none empty, none over ``max_tokens``.

    Raises MessageError naming the field or item (``input[2]: ...``).
    """
    if body.dimensions is not None:
        n_embd = n_embd_out(m)
        if body.dimensions != n_embd:
            raise MessageError(
                f"dimensions: this model's embeddings have {n_embd} dimensions; "
                f"other sizes are not supported, got {body.dimensions}"
            )
    out = [(name, input_tokens(m, name, item)) for name, item in check_input_count(body, max_inputs)]
    for name, tokens in out:
        if len(tokens) > max_tokens:
            raise MessageError(f"{name}: the input has {len(tokens)} tokens; at most {max_tokens} fit ({why})")
    return out


def openai_body(results: Sequence[Embedding], model: str, *, base64_floats: bool) -> dict[str, Any]:
    """OpenAI's list object: one ``embedding`` object per input, in order, and the tokens used."""
    data = []
    for i, r in enumerate(results):
        vec = r.vectors[0]
        if base64_floats:
            data.append(
                {
                    "embedding": base64.b64encode(float32_bytes(vec)).decode("ascii"),
                    "index": i,
                    "object": "embedding",
                    "encoding_format": "base64",
                }
            )
        else:
            data.append({"embedding": list(vec), "index": i, "object": "embedding"})
    n = sum(r.n_tokens for r in results)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n}, "data": data}


def native_body(results: Sequence[Embedding]) -> list[dict[str, Any]]:
    """llama-server's native list: ``{"index", "embedding": [vector, ...]}`` per input."""
    return [{"index": i, "embedding": [list(v) for v in r.vectors]} for i, r in enumerate(results)]
