"""How many drafted tokens are worth verifying: a cost model of the target's decode and each slot's
observed acceptance (hydra-trio's own; llama-server verifies every draft whole).

Verifying a draft of ``L`` tokens makes the target's batch ``L`` rows longer.  On a GPU the extra rows
cost next to nothing; on a CPU each one costs a good share of a whole token, and more the longer the context
(each row attends to all of it): ``bench/verify_cost.py`` on 2 cores with SmolLM2-135M measured a row at
0.53 of a one-row step with 256 tokens in the context, 0.81 with 2,048 and 1.06 with 6,144, so a long draft
that is rejected early is slower than no draft.  :class:`DraftBudget` keeps, per slot, the chance ``a`` that a
drafted token is accepted given the ones before it were (accepted drafted tokens over accepted ones plus
rejections, with a prior, recent drafts weighing more), and cuts each draft to the length ``L`` that makes
the most tokens per unit of decode cost, ``(1 + a + a² + ... + a^L) / (1 + r × (L + 1))`` with ``r`` the
cost of one more row over the cost of a step (``--spec-budget-row-cost``; ``auto`` on a CPU:
:data:`CPU_ROW_COST` plus :data:`CPU_ROW_COST_PER_KTOKEN` for each 1,000 tokens of the slot's context) — 0
when no draft pays.  A slot
whose drafts do not pay is still given a one-token draft every :data:`EXPLORE` steps, so its estimate
follows the text.

The cost ratio is a setting, not a timing: a draft's length then depends only on the tokens, so the same
request gives the same batches, and the same greedy text, on every run.
"""

from __future__ import annotations

CPU_ROW_COST = 0.5
"""``--spec-budget-row-cost auto`` when the model's layers run on the CPU: a row's cost at an empty
context (see the module docstring)."""

CPU_ROW_COST_PER_KTOKEN = 0.09
"""With ``auto`` on the CPU, what each 1,000 tokens of the slot's context add to a row's cost."""

EXPLORE = 8
"""A slot held to no draft verifies a one-token draft every this many steps."""

DECAY = 0.97
"""Each new observation weighs 1, the earlier ones this much less each time."""

PRIOR_A, PRIOR_N = 0.6, 2.0
"""The acceptance a slot starts with, and how many observations it is worth."""


class DraftBudget:
    """Every slot's acceptance and the draft length it is worth (engine thread only)."""

    def __init__(self, n_seq: int, row_cost: float, per_ktoken: float = 0.0) -> None:
        """Args: n_seq: the node's slots; row_cost: ``r`` of the module docstring at an empty context (> 0);
        per_ktoken: what each 1,000 tokens of a slot's context add to it."""
        self.row_cost = row_cost
        self.per_ktoken = per_ktoken
        self._acc = [PRIOR_A * PRIOR_N] * n_seq  # decayed accepted drafted tokens
        self._rej = [(1 - PRIOR_A) * PRIOR_N] * n_seq  # decayed rejections
        self._held = [0] * n_seq  # steps a slot has been held to no draft

    def acceptance(self, id_slot: int) -> float:
        a, r = self._acc[id_slot], self._rej[id_slot]
        return a / (a + r)

    def observe_verify(self, id_slot: int, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens on the slot had its first ``accepted`` accepted."""
        self._acc[id_slot] = self._acc[id_slot] * DECAY**drafted + accepted
        self._rej[id_slot] = self._rej[id_slot] * DECAY**drafted + (1 if accepted < drafted else 0)

    def reset(self, id_slot: int) -> None:
        """A new request on the slot starts from the prior (so a request's drafts do not depend on the
        requests before it)."""
        self._acc[id_slot] = PRIOR_A * PRIOR_N
        self._rej[id_slot] = (1 - PRIOR_A) * PRIOR_N
        self._held[id_slot] = 0

    def cap(self, id_slot: int, n_max: int, n_past: int = 0) -> int:
        """The draft length worth verifying on the slot now (``n_past`` tokens in its context), at most
        ``n_max``."""
        if n_max <= 0:
            return 0
        c0, c1 = 1.0, self.row_cost + self.per_ktoken * n_past / 1000
        a = self.acceptance(id_slot)
        best_l, best = 0, 1.0 / (c0 + c1)
        gain, term = 1.0, 1.0
        for length in range(1, n_max + 1):
            term *= a
            gain += term
            rate = gain / (c0 + c1 * (length + 1))
            if rate > best:
                best_l, best = length, rate
            elif term < 1e-3:
                break
        if best_l == 0:
            self._held[id_slot] += 1
            if self._held[id_slot] >= EXPLORE:
                self._held[id_slot] = 0
                return 1
        else:
            self._held[id_slot] = 0
        return best_l
