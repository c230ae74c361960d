"""What a front end reads of the served model: :class:`ModelView`.

The service, the OpenAI shapes and the front ends render prompts, count and decode tokens, check a
grammar and report the model's facts; they never touch llama.cpp's handles (the model, context and
vocabulary pointers), which only the engine thread uses.  :class:`~hydra_trio.engine.llama.model.LoadedModel`
is a :class:`ModelView`; :attr:`Engine.model_view <hydra_trio.engine.engine.Engine.model_view>` returns the
one that serves, typed as the view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .llama.media import MediaTokens
    from .llama.model import ChatTemplate
    from .llama.tokenize import SpecialTokens


class ModelView(Protocol):
    """The served model as the front ends see it: its chat template, tokenizer, vocabulary facts and
    grammar check (all safe from any thread: they read the vocabulary and the template only)."""

    n_vocab: int
    """Tokens in the vocabulary."""
    bos_id: int
    """The beginning-of-sequence token (-1: none)."""
    eos_id: int
    """The end-of-sequence token (-1: none)."""
    chat_template: ChatTemplate
    """The chat template chosen at load (``--chat-template``, ``--jinja``, the GGUF's own)."""
    tensor_placement: dict[str, int]
    """Tensors placed on each buffer type by ``-ot`` / ``-cmoe`` overrides (``/props``)."""

    @property
    def special_tokens(self) -> SpecialTokens: ...

    def tokenize(
        self, text: str, *, add_special: bool, parse_special: bool = True, limit: int | None = None
    ) -> list[int]:
        """``text``'s tokens (llama.cpp's tokenizer); ``limit``: stop past that many (PromptTooLong)."""
        ...

    def detokenize(self, tokens: tuple[int, ...] | list[int]) -> str:
        """The text ``tokens`` render to (special tokens empty)."""
        ...

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes one token renders to; with ``special`` a special token's own text."""
        ...

    def token_text(self, token: int) -> str:
        """The vocabulary's text of ``token``."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict],
        kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        max_chars: int | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[str, list[str]]:
        """The rendered chat prompt and the template's extra stop strings (``add_generation_prompt`` false:
        no assistant turn opened after the last message)."""
        ...

    def chat_prompt_tokens(self, prompt: str, limit: int | None = None) -> list[int]:
        """A rendered chat prompt's tokens, as llama-server tokenizes it."""
        ...

    @property
    def modalities(self) -> dict[str, bool]:
        """``{"vision": bool, "video": bool, "audio": bool}``: what the projector (``--mmproj``) takes; all False
        without one."""
        ...

    def tokenize_with_media(
        self, text: str, media: Sequence[Any], *, add_special: bool = True, parse_special: bool = True
    ) -> MediaTokens:
        """``text`` with one ``<__media__>`` marker per item of ``media`` (each with ``data: bytes``, ``id: str``)
        as text tokens with the media chunks in place; the job takes ``tokens`` as its ``prompt_tokens`` and
        ``chunks`` as its ``media_chunks``.  Any thread; CPU work (decoding and resizing images): call it off
        the event loop.  Raises InvalidRequest (no projector, media mtmd refuses)."""
        ...

    def check_grammar(self, grammar: str) -> None:
        """Raise GrammarError unless llama.cpp accepts the GBNF ``grammar`` over this vocabulary."""
        ...

    def facts(self) -> dict[str, Any]:
        """llama-server's model facts (``/v1/models``' ``meta``, ``/props``' ``model_ftype``)."""
        ...
