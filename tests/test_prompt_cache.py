"""The host-RAM prompt cache (``--cache-ram``): more conversations than slots, each finding its prefix again.

Real servers and real SmolLM2 (``-np 1``: every conversation takes the one
slot from the previous one).  A restored turn must give, token for token, the
same greedy text as the same turn on a node where each conversation kept its
own slot, and evaluate only the follow-up; the byte budget holds, the least
recently used entry goes first; a restore llama.cpp refuses falls back to
evaluation (the same text as evaluating the whole prompt).

Why the control is a slot that kept its conversation and not a whole-prompt
evaluation: llama.cpp's CPU kernels can round a token's KV computed alone (a
generated token) differently in the last bits from the same token computed
in a prompt batch, and greedy decoding of SmolLM2 flips at near-ties on that
(seen on one of three conversations); a restore puts back the very bytes the
slot held, so it must match a slot that never lost them exactly.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

import attrs
import httpx
import pytest

from hydra_trio import EngineConfig, ServerConfig
from hydra_trio.engine.batching.prompt_cache import MIN_TOKENS
from hydra_trio.engine.tasks import EngineTask
from hydra_trio.models.presets import resolve_model

from .conftest import embedded_node, wait_for

WORDS = (
    ["ship", "boat", "raft", "barge", "yacht", "canoe"],
    ["lamp", "torch", "candle", "lantern", "beacon", "flare"],
    ["oak", "pine", "birch", "maple", "cedar", "willow"],
)


def document(user: int, tag: str) -> str:
    """About 250 tokens of one user's own text (the three users share only the chat template's start, less
    than :data:`MIN_TOKENS`)."""
    words = WORDS[user]
    return (
        f"{words[0].capitalize()} notes [{tag}]: "
        + " ".join(f"the {words[i % 6]} number {i} is kept near the harbour wall" for i in range(20))
        + " Summarize them."
    )


class Chat:
    """One user's conversation, resent whole every turn (as chat clients do)."""

    def __init__(self, user: int, tag: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "user", "content": document(user, tag)}]

    def turn(self, c: httpx.Client, **kw: Any) -> dict:
        r = c.post("/v1/chat/completions", json={"messages": self.messages, "max_tokens": 12, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        reply = r.json()
        self.messages = self.messages + [reply["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        return reply


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def cache_info(c: httpx.Client) -> dict:
    slots = c.get("/slots").json()
    assert all(s["prompt_cache"] == slots[0]["prompt_cache"] for s in slots)
    return slots[0]["prompt_cache"]


def metric(c: httpx.Client, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def three_users_two_turns(c: httpx.Client, tag: str) -> list[list[dict]]:
    """Turn 1 evaluates each whole prompt (``cache_prompt`` false: the same computation on any node, from an
    empty sequence), turn 2 resends each conversation with a follow-up."""
    chats = [Chat(u, tag) for u in range(3)]
    first = [chat.turn(c, cache_prompt=False) for chat in chats]
    return [first, [chat.turn(c) for chat in chats]]


def test_returning_conversations_are_restored_with_the_same_text_as_a_slot_that_kept_them(spawn) -> None:
    tag = uuid.uuid4().hex[:8]
    node = spawn("-np", "1", "-c", "2048", "--no-rpc-backend")  # --cache-ram: llama-server's 8192 MiB
    # the control: a slot for each conversation (2048 tokens each, as on the node), so none is ever evicted,
    # and --cache-ram 0: no prompt cache
    kept = spawn("-np", "3", "-c", "6144", "--no-rpc-backend", "--cache-ram", "0")
    node.wait_ready()
    kept.wait_ready()
    with httpx.Client(base_url=node.base, timeout=300) as c, httpx.Client(base_url=kept.base, timeout=300) as k:
        info = cache_info(c)
        assert info["enabled"] is True and info["limit_bytes"] == 8192 << 20 and info["entries"] == 0
        assert cache_info(k) == {"enabled": False, "entries": 0, "bytes": 0, "limit_bytes": 0, "hits": 0, "misses": 0}
        turns = three_users_two_turns(c, tag)
        control = three_users_two_turns(k, tag)
        for user in range(3):
            first, back, own = turns[0][user], turns[1][user], control[1][user]
            assert text(first) == text(control[0][user])
            # the returning turn found its conversation in host RAM: all of its previous prompt and reply but
            # the last token, as much as the control's own slot kept, so only the follow-up was evaluated
            assert cached(back) >= first["usage"]["prompt_tokens"], (user, back["usage"])
            assert cached(back) == cached(own) and back["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
            assert back["timings"]["prompt_n"] == back["usage"]["prompt_tokens"] - cached(back) < 40
            # token for token the same greedy text: the restored KV is the bytes the slot held
            assert text(back) == text(own) and text(back), user
        assert metric(c, "hydra_trio:prompt_cache_hits_total") == 3
        # --cache-ram 0: nothing kept, nothing looked up
        assert metric(k, "hydra_trio:prompt_cache_hits_total") == metric(k, "hydra_trio:prompt_cache_saves_total") == 0
        assert cache_info(k)["entries"] == 0 and metric(k, "hydra_trio:prompt_cache_limit_bytes") == 0
        # --cache-idle-slots (on): once idle, the slot's own conversation is kept too
        info = wait_for(lambda: (i := cache_info(c))["entries"] == 3 and i, what="the idle slot kept")
        assert info["hits"] == 3 and 0 < info["bytes"] == metric(c, "hydra_trio:prompt_cache_bytes")
        assert metric(c, "hydra_trio:prompt_cache_entries") == 3


def test_the_budget_holds_and_the_least_recently_used_entry_goes_first(spawn) -> None:
    budget_mib = 14  # two first turns' states (about 6.5 MB each) fit, three do not
    tag = uuid.uuid4().hex[:8]
    node = spawn("-np", "1", "-c", "2048", "--no-rpc-backend", "--cache-ram", str(budget_mib), "--no-cache-idle-slots")
    node.wait_ready()
    budget = budget_mib << 20
    with httpx.Client(base_url=node.base, timeout=300) as c:
        a, b, cc = (Chat(u, tag) for u in range(3))
        a.turn(c)
        assert cache_info(c)["entries"] == 0  # --no-cache-idle-slots: nothing kept while the slot holds it
        b.turn(c)  # A leaves the slot: kept
        one = cache_info(c)
        assert one["entries"] == 1 and 2 * one["bytes"] <= budget < 3 * one["bytes"], one  # the sizes this test needs
        cc.turn(c)  # B leaves the slot: kept; [A, B]
        assert cache_info(c)["entries"] == 2 and cache_info(c)["bytes"] <= budget
        back_a = a.turn(c)  # A restored (now the most recent); keeping C evicts B, the least recently used
        assert cached(back_a) > 200
        info = cache_info(c)
        assert info["entries"] == 2 and info["bytes"] <= budget and info["hits"] == 1
        assert metric(c, "hydra_trio:prompt_cache_evictions_total", reason="lru") == 1
        assert info["misses"] == 3  # the three first turns: the slot gave less than they needed, no entry helped
        back_b = b.turn(c)  # B was evicted: evaluated again
        assert cached(back_b) < MIN_TOKENS and cache_info(c)["misses"] == 4
        back_c = cc.turn(c)  # C is still there
        assert cached(back_c) > 200 and cache_info(c)["hits"] == 2
        assert cache_info(c)["bytes"] <= budget == metric(c, "hydra_trio:prompt_cache_limit_bytes")


@pytest.fixture(scope="module")
def embedded() -> Any:
    path, _ = resolve_model("smollm2-135m")
    config = ServerConfig(
        port=0,
        rpc_backend=None,
        engine=EngineConfig(
            model_path=path, model_alias="prompt-cache", n_parallel=1, n_ctx=2048, cache_idle_slots=False
        ),
    )
    with embedded_node(config) as server:
        yield server


@attrs.frozen
class Apply(EngineTask):
    """A test's own engine-thread work: ``fn(engine)``."""

    kind: ClassVar[str] = "test_apply"
    fn: Any

    def run(self, engine: Any) -> Any:
        return self.fn(engine)


def on_engine(server: Any, fn: Any) -> Any:
    import trio

    return trio.from_thread.run(server.engine.run_task, Apply(fn), trio_token=server.engine._trio_token)


def test_a_restore_llama_cpp_refuses_falls_back_to_evaluating_the_prompt(embedded: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    pc = embedded.engine.prompt_cache
    with httpx.Client(base_url=f"http://127.0.0.1:{embedded.port}", timeout=300) as c:
        a, b = Chat(0, tag), Chat(1, tag)
        a.turn(c)
        b.turn(c)  # A's state is kept
        assert cache_info(c)["entries"] == 1
        control = c.post(
            "/v1/chat/completions",
            json={"messages": a.messages, "max_tokens": 12, "temperature": 0, "cache_prompt": False, "id_slot": 0},
        )
        assert control.status_code == 200 and cached(control.json()) == 0
        b.turn(c)  # B back in the slot, restored; A's conversation is kept

        def truncate(engine: Any) -> int:  # the test hook: every entry loses its second half
            for entry in engine.prompt_cache.entries:
                del entry.data[len(entry.data) // 2 :]
            return len(engine.prompt_cache.entries)

        assert on_engine(embedded, truncate) >= 2
        failures = pc.restore_failures
        back = a.turn(c)
        assert pc.restore_failures == failures + 1 and pc.evicted["restore_failed"] == 1
        assert cached(back) == 0 and text(back) == text(control.json())  # evaluated whole: the same text
        kinds = [e["type"] for e in embedded.engine.events.recent(frozenset({"prompt_cache"}))]
        assert "prompt_cache.restore_failed" in kinds and "prompt_cache.saved" in kinds
        assert metric(c, "hydra_trio:prompt_cache_restore_failures_total") == failures + 1
        # the node serves on, and the cache works again: B's state, kept when A took the slot after the damage
        assert cached(b.turn(c)) > 200 and pc.restore_failures == failures + 1
        assert cached(a.turn(c)) > 200


def test_erase_and_a_new_context_drop_the_entries(embedded: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    with httpx.Client(base_url=f"http://127.0.0.1:{embedded.port}", timeout=300) as c:
        a, b = Chat(0, tag), Chat(1, tag)
        a.turn(c)
        b.turn(c)
        n = cache_info(c)["entries"]
        a.turn(c)  # restored; B kept
        assert cache_info(c)["entries"] == n + 1
        assert c.post("/slots/0?action=erase").status_code == 200  # A's conversation is forgotten, B's stays
        assert cache_info(c)["entries"] == n
        back = a.turn(c)
        assert cached(back) == 0
        # a new context (CONFIGURE n_ctx): every entry goes
        on_engine(embedded, lambda e: e.models.reconfigure(n_ctx=2048 + 256))
        assert cache_info(c)["entries"] == 0 and embedded.engine.prompt_cache.evicted["reload"] >= 1
        assert cached(b.turn(c)) < MIN_TOKENS
        on_engine(embedded, lambda e: e.models.reconfigure(n_ctx=2048))
