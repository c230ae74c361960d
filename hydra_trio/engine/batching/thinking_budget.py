"""The thinking budget: after N tokens inside a thinking block, force its end marker.

llama-server's ``--reasoning-budget N`` / request ``thinking_budget_tokens``
(``common/reasoning-budget.cpp`` of the llama.cpp that llama-cpp-python 0.3.36
vendors, the ``reasoning-budget`` sampler): once the reply has spent ``N``
tokens inside its thinking block, the next tokens are forced to
``reasoning_budget_message`` (if any) followed by the end marker (``</think>``),
and the model goes on with the answer.  A character cut across tokens is
finished first (llama-server's ``WAITING_UTF8``).

Sans-I/O: the scheduler asks :attr:`ThinkingBudget.forced` before sampling and
tells :meth:`ThinkingBudget.accept` every token with its bytes.  Unlike
llama-server, which matches the markers as token sequences, the markers are
matched on the generated *bytes*, so a marker the model spells with other tokens
than the tokenizer's (``".\\n</"`` + ``"think>"``) still counts; and, like this
node's thinking parser (:mod:`hydra_trio.openai.reasoning`), a block is recognised
only at the start of the reply (whitespace aside) or when the prompt opened it.
"""

from __future__ import annotations

import codecs

import attrs

# states, as llama-server's common_reasoning_budget_state
IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = "idle", "counting", "waiting_utf8", "forcing", "done"
_WS = b" \t\r\n"


@attrs.frozen
class BudgetSpec:
    """A request's thinking budget.

    Attributes:
        budget: thinking tokens allowed (>= 0); the forced end follows the ``budget``-th.
        start: the start marker's bytes (``b"<think>"``).
        end: the end marker's bytes (``b"</think>"``): a block that closes by itself is left alone.
        forced: the tokens forced once the budget is spent (the message's, then the end marker's).
        opened: the prompt opened the block (the template wrote ``<think>``): counting starts at once.
    """

    budget: int
    start: bytes
    end: bytes
    forced: tuple[int, ...]
    opened: bool = False


class ThinkingBudget:
    """One reply's budget state (see the module docstring).  ``state`` is one of ``idle`` (before
    the block), ``counting``, ``waiting_utf8``, ``forcing``, ``done``."""

    def __init__(self, spec: BudgetSpec) -> None:
        if spec.budget < 0 or not spec.forced:
            raise ValueError("a thinking budget is >= 0 tokens and forces at least one token")
        self.spec = spec
        self.state = IDLE
        self.remaining = spec.budget
        self._head = b""  # idle: the reply so far (is it the start marker?)
        self._tail = b""  # counting: the block's last bytes (is the end marker there?)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # is a character unfinished?
        self._pos = 0  # forcing: the next forced token
        self.n_forced = 0  # forced tokens so far
        if spec.opened:
            self._open()

    @property
    def forced(self) -> int | None:
        """The token the next step must take, or None (sample as usual)."""
        return self.spec.forced[self._pos] if self.state == FORCING else None

    def give_up(self) -> None:
        """Stop forcing (the request's grammar refuses the forced token): the reply goes on unforced."""
        self.state = DONE

    def _open(self) -> None:
        self.state, self.remaining = COUNTING, self.spec.budget
        if self.remaining <= 0:
            self.state, self._pos = FORCING, 0

    def accept(self, token: int, piece: bytes) -> None:
        """The reply took ``token``, which renders to ``piece``."""
        if self.state == IDLE:
            self._head += piece
            body = self._head.lstrip(_WS)
            start = self.spec.start
            if body.startswith(start):
                self._tail = body[len(start) :]
                self._open()
                if self.state == COUNTING and self.spec.end in self._tail:
                    self.state = DONE
            elif body and not start.startswith(body):
                self.state = DONE  # the reply does not start with thinking
            return
        if self.state in (COUNTING, WAITING_UTF8):
            self._tail = (self._tail + piece)[-(len(self.spec.end) + len(piece)) :]
            if self.spec.end in self._tail:
                self.state = DONE  # the block ended by itself
                return
            self._utf8.decode(piece)
            if self.state == COUNTING:
                self.remaining -= 1
                if self.remaining > 0:
                    return
            if not self._utf8.getstate()[0]:  # no bytes of an unfinished character held
                self.state, self._pos = FORCING, 0
            else:
                self.state = WAITING_UTF8
            return
        if self.state == FORCING:
            self.n_forced += 1
            self._pos += 1
            if self._pos >= len(self.spec.forced):
                self.state = DONE
