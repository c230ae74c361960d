"""The engine's counters: :class:`EngineStats`, what ``/metrics`` and the node's stats read.

The engine thread adds to them (the scheduler, the tasks, the expert modes); any thread reads them.
"""

from __future__ import annotations

import attrs

__all__ = ["EngineStats"]


@attrs.define
class EngineStats:
    """Counters behind ``/metrics`` (llama-server's metric names)."""

    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    """Prompt tokens a request found in its slot's cache (or the prompt cache) and did not evaluate."""
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_tokens_max: int = 0
    """The most tokens a slot has held (prompt + generated) after a decode step."""
    requests_deferred: int = 0
    requests_total: int = 0
    mode_switches: int = 0
    combined_fallbacks: int = 0
    peer_losses: int = 0
    tasks: dict[str, int] = attrs.Factory(dict)
    """Engine tasks run (:mod:`~hydra_trio.engine.tasks`), by kind (``hydra_trio:engine_tasks_total{type}``)."""
    spec_draft_tokens: int = 0
    """Speculative decoding: tokens drafted, drafted tokens the target accepted, verification steps, and
    accepted tokens by draft position (llama-server's ``spec_decode_num_*_total``)."""
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0
    spec_accepted_per_pos: list[int] = attrs.Factory(list)
    control: dict[str, int] = attrs.Factory(lambda: {"applied": 0, "refused_busy": 0, "failed": 0})
    """Exclusive tasks (the serialized control channel) by result (``hydra_trio:control_changes_total{result}``)."""
