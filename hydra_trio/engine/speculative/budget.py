"""How many drafted tokens are worth verifying: a cost model of the target's decode and each slot's
observed acceptance (hydra-trio's own; llama-server verifies every draft whole).

Verifying a draft of ``L`` tokens makes the target's batch ``L`` rows longer.  On a GPU the extra rows
cost next to nothing; on a CPU each one costs a good share of a whole token, and more the longer the context
(each row attends to all of it): ``bench/verify_cost.py`` on 2 cores with SmolLM2-135M measured a row at
0.53 of a one-row step with 256 tokens in the context, 0.81 with 2,048 and 1.06 with 6,144, so a long draft
that is rejected early is slower than no draft.  :class:`DraftBudget` keeps, per slot and per draft
position ``d``, the chance ``a_d`` that the drafted token there is accepted given the ones before it were
(accepted over verified tokens at that position, recent drafts weighing more, each shrunk towards the
estimate one position shallower, the first towards a prior), and cuts each draft to the length ``L`` that
makes the most tokens per unit of decode cost, ``(1 + a_0 + a_0·a_1 + ... + a_0···a_(L-1)) / (1 + r × (L + 1))``
with ``r`` the cost of one more row over the cost of a step (``--spec-budget-row-cost``; ``auto`` on a CPU:
:data:`CPU_ROW_COST` plus :data:`CPU_ROW_COST_PER_KTOKEN` for each 1,000 tokens of the slot's context) — 0
when no draft pays.  With flash attention off the same bench measured both sides growing with the context
(a one-row step by 0.54 of itself per 1,000 tokens, a row by 0.17 of a step at an empty context, from 0.74:
:data:`CPU_NO_FA`), so a row's share falls as the context grows (0.69 at 256 tokens, 0.51 at 2,048 and
0.42 at 6,144) and every step, a one-row one included, is faster there than with flash attention on.

Keeping the positions apart matters on copied text: a draft's first token is often
rejected (the text leaves the copy), but once it is accepted the rest nearly always are, which one
acceptance for every position would average away, keeping long drafts short.  A position never verified
takes the deepest estimate, and every :data:`EXPLORE` steps a draft one token longer than the cut is
verified (a one-token draft when no draft pays), so the estimates follow the text.

The cost ratio is a setting, not a timing: a draft's length then depends only on the tokens, so the same
request gives the same batches, and the same greedy text, on every run.
"""

from __future__ import annotations

CPU_ROW_COST = 0.5
"""``--spec-budget-row-cost auto`` when the model's layers run on the CPU: a row's cost at an empty
context (see the module docstring)."""

CPU_ROW_COST_PER_KTOKEN = 0.09
"""With ``auto`` on the CPU, what each 1,000 tokens of the slot's context add to a row's cost."""

CPU_NO_FA = (0.74, 0.17, 0.54)
"""``auto`` on the CPU with flash attention off: a row's cost at an empty context, what each 1,000 tokens
of the slot's context add to it, and what they add to a one-row step's (all in one-row steps at an empty
context; see the module docstring)."""

EXPLORE = 8
"""A slot held to no draft verifies a one-token draft every this many steps."""

DECAY = 0.97
"""Each new observation weighs 1, the earlier ones this much less each time."""

PRIOR_A, PRIOR_N = 0.6, 2.0
"""The acceptance a slot starts with at a draft's first position, and how many observations a prior is worth."""

PRIOR_DEEP = 0.85
"""The least a deeper position's prior is (else the estimate one position shallower): a drafted token
that follows accepted ones is more often accepted than the first (the text goes on as the draft's source
did)."""


class DraftBudget:
    """Every slot's acceptance by drafter and draft position, and the draft length it is worth (engine
    thread only).

    The estimates are kept per slot and per drafter (``key``: the type's name; one draft's tokens come from
    one drafter), across the slot's requests: a new request on a slot halves what the earlier ones taught
    (:meth:`reset`), so that its own drafts soon weigh most.  They depend on the tokens only, so the same
    requests in the same order give the same drafts on every run."""

    def __init__(self, row_cost: float, per_ktoken: float = 0.0, step_per_ktoken: float = 0.0) -> None:
        """Args: row_cost: ``r`` of the module docstring at an empty context (> 0); per_ktoken: what each
        1,000 tokens of a slot's context add to it; step_per_ktoken: what they add to a one-row step's cost
        (1 at an empty context)."""
        self.row_cost = row_cost
        self.per_ktoken = per_ktoken
        self.step_per_ktoken = step_per_ktoken
        # by (slot, drafter): per position, decayed accepted tokens and decayed verified tokens
        self._counts: dict[tuple[int, str], tuple[list[float], list[float]]] = {}
        self._held: dict[tuple[int, str], int] = {}  # steps since the last draft one token past the cap

    def acceptance(self, id_slot: int, key: str = "", depth: int = 0) -> float:
        """The chance that ``key``'s drafted token at ``depth`` (0: the first) on the slot is accepted given
        the ones before it were: what was observed there, shrunk towards the estimate one position
        shallower (the first towards :data:`PRIOR_A`, a deeper one towards at least :data:`PRIOR_DEEP`), so
        that positions never verified yet take the deepest one's."""
        acc, seen = self._counts.get((id_slot, key), ([], []))
        a = PRIOR_A
        for d in range(depth + 1):
            a = _estimate(acc, seen, d, a)
        return a

    def observe_verify(self, id_slot: int, drafted: int, accepted: int, key: str = "") -> None:
        """A draft of ``drafted`` tokens by ``key`` on the slot had its first ``accepted`` accepted: the
        positions up to the first rejected one were verified."""
        acc, seen = self._counts.setdefault((id_slot, key), ([], []))
        n = min(drafted, accepted + 1)
        while len(seen) < n:
            acc.append(0.0)
            seen.append(0.0)
        for d in range(n):
            acc[d] = acc[d] * DECAY + (1.0 if d < accepted else 0.0)
            seen[d] = seen[d] * DECAY + 1.0

    def reset(self, id_slot: int) -> None:
        """A new request on the slot: what the earlier ones taught weighs half."""
        for (slot, _key), (acc, seen) in self._counts.items():
            if slot == id_slot:
                acc[:] = [c * 0.5 for c in acc]
                seen[:] = [c * 0.5 for c in seen]

    def cap(self, id_slot: int, n_max: int, n_past: int = 0, key: str = "") -> int:
        """The length of ``key``'s draft worth verifying on the slot now (``n_past`` tokens in its context),
        at most ``n_max``."""
        if n_max <= 0:
            return 0
        c0, c1 = 1.0 + self.step_per_ktoken * n_past / 1000, self.row_cost + self.per_ktoken * n_past / 1000
        acc, seen = self._counts.get((id_slot, key), ([], []))
        best_l, best = 0, 1.0 / (c0 + c1)
        gain, survive, a = 1.0, 1.0, PRIOR_A
        for length in range(1, n_max + 1):
            a = _estimate(acc, seen, length - 1, a)
            survive *= a
            gain += survive
            rate = gain / (c0 + c1 * (length + 1))
            if rate > best:
                best_l, best = length, rate
            elif survive < 1e-3:
                break
        # every EXPLORE steps a draft one token longer is verified, so that the estimate of the position
        # past the cap follows the text (a slot held to no draft gets a one-token draft)
        held = self._held.get((id_slot, key), 0) + 1
        if held >= EXPLORE and best_l < n_max:
            held, best_l = 0, best_l + 1
        self._held[id_slot, key] = held
        return best_l


def _estimate(acc: list[float], seen: list[float], d: int, shallower: float) -> float:
    """Position ``d``'s acceptance from its counts, shrunk towards its prior (``shallower``: position
    ``d - 1``'s estimate, or :data:`PRIOR_A` for the first)."""
    prior = shallower if d == 0 else max(shallower, PRIOR_DEEP)
    return (acc[d] + PRIOR_N * prior) / (seen[d] + PRIOR_N) if d < len(seen) else prior
