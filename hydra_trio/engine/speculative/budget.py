"""How many drafted tokens are worth verifying: a cost model of the target's decode and each slot's
observed acceptance (hydra-trio's own; llama-server verifies every draft whole).

Verifying a draft of ``L`` tokens makes the target's batch ``L`` rows longer.  On a GPU the extra rows
cost next to nothing; on a CPU each one costs a good share of a whole token (measured on 2 cores with
SmolLM2-135M: 11 ms for one row, then about 3.8 ms for each more, a ratio of 0.35), so a long draft that is
rejected early is slower than no draft.  :class:`DraftBudget` keeps, per slot, the chance ``a`` that a
drafted token is accepted given the ones before it were (accepted drafted tokens over accepted ones plus
rejections, with a prior, recent drafts weighing more), and cuts each draft to the length ``L`` that makes
the most tokens per unit of decode cost, ``(1 + a + a² + ... + a^L) / (1 + r × (L + 1))`` with ``r`` the
cost of one more row over the cost of a step (``--spec-budget-row-cost``) — 0 when no draft pays.  A slot
whose drafts do not pay is still given a one-token draft every :data:`EXPLORE` steps, so its estimate
follows the text.

The cost ratio is a setting, not a timing: a draft's length then depends only on the tokens, so the same
request gives the same batches, and the same greedy text, on every run.
"""

from __future__ import annotations

CPU_ROW_COST = 0.35
"""``--spec-budget-row-cost auto`` when the model's layers run on the CPU (see the module docstring)."""

EXPLORE = 8
"""A slot held to no draft verifies a one-token draft every this many steps."""

DECAY = 0.97
"""Each new observation weighs 1, the earlier ones this much less each time."""

PRIOR_A, PRIOR_N = 0.6, 2.0
"""The acceptance a slot starts with, and how many observations it is worth."""


class DraftBudget:
    """Every slot's acceptance and the draft length it is worth (engine thread only)."""

    def __init__(self, n_seq: int, row_cost: float) -> None:
        """Args: n_seq: the node's slots; row_cost: ``r`` of the module docstring (> 0)."""
        self.row_cost = row_cost
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

    def cap(self, id_slot: int, n_max: int) -> int:
        """The draft length worth verifying on the slot now, at most ``n_max``."""
        if n_max <= 0:
            return 0
        c0, c1 = 1.0, self.row_cost
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
