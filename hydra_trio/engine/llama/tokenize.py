"""Tokenization in linear time, with an early stop at a token limit.

llama.cpp's ``llama_tokenize`` splits the text at special tokens first
(``tokenizer_st_partition`` in ``src/llama-vocab.cpp``) and, for every match,
walks its fragment list from the start (``std::distance`` / ``std::next``):
the cost grows with the square of the special tokens in one call (a chat of
10,000 messages: 2.3 s; 20,000: four times that).  Here the text is cut into
chunks at points where llama.cpp's partition is known to cut anyway, and each
chunk is tokenized by llama.cpp on its own: the same tokens, in time that
grows with the text.

Where llama.cpp cuts for sure: special tokens are matched longest text first
(``cache_special_tokens`` sorted by text length), each over the text the
longer ones left.  So in a stretch of text where no longer special token
occurs, the leftmost non-overlapping occurrences of the longest special token
that does occur (when no other of the same length occurs there) are exactly
its matches, and the end of each match (after the whitespace an RSTRIP token
eats) is the start of a new fragment.  A fragment after a special token is
tokenized as it would be at the start of a text (llama.cpp's SPM and UGM
space prefix follows a special token as it follows the start).  The stretches
between matches are cut again with the shorter tokens, a few levels deep.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp

from ...errors import Cancelled, InvalidRequest
from ..bridge import thread_local_set

_work = threading.local()


@contextlib.contextmanager
def stop_when(event: threading.Event) -> Iterator[None]:
    """Within the block, tokenizing on this thread raises :class:`~hydra_trio.errors.Cancelled` at the next
    chunk once ``event`` is set (the HTTP app sets it when the client goes away while its prompt is
    prepared, so no worker thread goes on for a client that left)."""
    with thread_local_set(_work, "stop", event):
        yield


def raise_if_stopped(what: str = "its prompt was tokenized") -> None:
    """Raise :class:`~hydra_trio.errors.Cancelled` when this thread's :func:`stop_when` event is set (long
    loops over a request's data call it now and then)."""
    stop = getattr(_work, "stop", None)
    if stop is not None and stop.is_set():
        raise Cancelled(f"the client went away while {what}")


CHUNK_BYTES = 2048
"""Target size of one ``llama_tokenize`` call's text."""
_MAX_LEVELS = 8
_SPACE = b" \t\n\v\f\r"
_PARTITIONED = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
_PARSED_ONLY = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN


class PromptTooLong(InvalidRequest):
    """The text has at least as many tokens as the limit (a slot's context)."""


class SpecialTokens:
    """A vocabulary's special-token texts by length (longest first), as llama.cpp partitions with them,
    and the longest bytes one token stands for (for a lower bound on tokens)."""

    def __init__(self, vocab: Any) -> None:
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        by_len: dict[int, list[tuple[bytes, bool, bool]]] = {}
        longest = 1
        buf = ctypes.create_string_buffer(256)
        for t in range(n):
            attr = llama_cpp.llama_vocab_get_attr(vocab, t)
            text = llama_cpp.llama_vocab_get_text(vocab, t) or b""
            k = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
            longest = max(longest, len(text), abs(k))
            if attr & _PARTITIONED and text:
                by_len.setdefault(len(text), []).append(
                    (text, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP), bool(attr & _PARSED_ONLY))
                )
        self.classes = [by_len[k] for k in sorted(by_len, reverse=True)]
        self.max_token_bytes = longest

    def as_table(self) -> dict[str, Any]:
        """A JSON value of what was read (:meth:`from_table` reads it back): ``{"max_token_bytes": int,
        "classes": [[[text as hex, rstrip, parsed_only], ...], ...]}``."""
        return {
            "max_token_bytes": self.max_token_bytes,
            "classes": [[[text.hex(), rstrip, parsed] for text, rstrip, parsed in c] for c in self.classes],
        }

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> SpecialTokens:
        """The tables :meth:`as_table` wrote.  Raises KeyError, TypeError, ValueError or OverflowError (an
        infinite length) for anything else."""
        self = cls.__new__(cls)
        self.max_token_bytes = int(table["max_token_bytes"])
        self.classes = [
            [(bytes.fromhex(text), bool(rstrip), bool(parsed)) for text, rstrip, parsed in c] for c in table["classes"]
        ]
        if self.max_token_bytes < 1 or any(not c or len({len(t) for t, _, _ in c}) != 1 for c in self.classes):
            raise ValueError("not a special-token table")
        return self

    def min_tokens(self, n_bytes: int) -> int:
        """A lower bound on the tokens of ``n_bytes`` bytes of text (every token stands for at most
        :attr:`max_token_bytes` bytes, plus one for a space prefix)."""
        return n_bytes // (self.max_token_bytes + 1)

    def cuts(self, data: bytes, parse_special: bool) -> list[int]:
        """Offsets into ``data`` where llama.cpp's partition starts a new fragment for sure (sorted)."""
        classes = [[(t, r) for t, r, parsed_only in c if parse_special or not parsed_only] for c in self.classes]
        out: list[int] = []
        self._cut(data, 0, len(data), [c for c in classes if c], 0, out, 0)
        return out

    def _cut(self, data: bytes, start: int, end: int, classes: list, ci: int, out: list[int], level: int) -> None:
        for k in range(ci, len(classes)):
            found = [(t, r) for t, r in classes[k] if data.find(t, start, end) >= 0]
            if not found:
                continue
            if len(found) > 1:
                return  # two of one length: which one llama.cpp takes first is not defined
            text, rstrip = found[0]
            pos = start
            while True:
                m = data.find(text, pos, end)
                if m < 0:
                    break
                if m - pos > CHUNK_BYTES and level < _MAX_LEVELS:
                    self._cut(data, pos, m, classes, k + 1, out, level + 1)
                e = m + len(text)
                if rstrip:
                    while e < end and data[e] in _SPACE:
                        e += 1
                out.append(e)
                pos = e
            if end - pos > CHUNK_BYTES and level < _MAX_LEVELS:
                self._cut(data, pos, end, classes, k + 1, out, level + 1)
            return


def tokenize_bytes(vocab: Any, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
    """One ``llama_tokenize`` call."""
    n_max = len(data) + 8
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:
        n_max = -n
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    return list(buf[:n])


def tokenize_linear(
    vocab: Any,
    special: SpecialTokens,
    data: bytes,
    *,
    add_special: bool,
    parse_special: bool,
    adds_suffix: bool,
    limit: int | None = None,
) -> list[int]:
    """``llama_tokenize(data)``'s tokens, in chunks (this module's docstring).

    ``adds_suffix``: the vocabulary adds EOS / SEP with ``add_special`` (then one call when
    ``add_special``).  ``limit``: raise :class:`PromptTooLong` as soon as the text has that many
    tokens, or when :meth:`SpecialTokens.min_tokens` shows that it will, before tokenizing.
    """
    if limit is not None and special.min_tokens(len(data)) >= limit:
        raise PromptTooLong(
            f"the prompt is {len(data)} bytes, at least {special.min_tokens(len(data))} tokens; "
            f"a slot's context holds {limit} (--ctx-size / --parallel)"
        )
    if len(data) <= CHUNK_BYTES or (add_special and adds_suffix):
        bounds = [0, len(data)]
    else:
        bounds = [0]
        for c in special.cuts(data, parse_special):
            if c - bounds[-1] >= CHUNK_BYTES:
                bounds.append(c)
        if bounds[-1] != len(data):
            bounds.append(len(data))
    out: list[int] = []
    for i in range(len(bounds) - 1):
        raise_if_stopped()
        out += tokenize_bytes(vocab, data[bounds[i] : bounds[i + 1]], add_special and i == 0, parse_special)
        if limit is not None and len(out) >= limit:
            more = "at least " if bounds[i + 1] < len(data) else ""
            raise PromptTooLong(
                f"the prompt has {more}{len(out)} tokens; a slot's context holds {limit} (--ctx-size / --parallel)"
            )
    return out
