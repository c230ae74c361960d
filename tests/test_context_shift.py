"""llama-server's context shift (``--context-shift``, ``--keep``), cache reuse (``--cache-reuse``) and
slot selection by prompt similarity (``-sps``), on embedded nodes with their own EngineConfig.

Real SmolLM2, real sockets, greedy sampling; every request is sent after the
previous one answered, so no assertion depends on timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio

from hydra_trio import EngineConfig, ServerConfig, serve
from hydra_trio.engine.batching.scheduler import SHARE_MIN_TOKENS
from hydra_trio.models.presets import resolve_model

N_CTX_SLOT = 256


@contextlib.asynccontextmanager
async def node(**engine: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """An embedded node serving SmolLM2 with ``EngineConfig(**engine)``; yields an HTTP client and the server."""
    path, _ = resolve_model("smollm2-135m")
    config = ServerConfig(port=0, engine=EngineConfig(model_path=path, model_alias="smollm2", n_threads=2, **engine))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, config)
        with trio.fail_after(300):
            await server.engine.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as client:
            yield client, server
        nursery.cancel_scope.cancel()


async def complete(client: httpx.AsyncClient, prompt: str | list[int], **kw: Any) -> dict[str, Any]:
    r = await client.post("/v1/completions", json={"prompt": prompt, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


async def tokens(client: httpx.AsyncClient, text: str) -> list[int]:
    r = await client.post("/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


STORY = "Once upon a time, in a village by the sea, there lived an old fisherman who"


async def test_context_shift_generates_past_the_slots_context() -> None:
    async with node(n_parallel=1, n_ctx=N_CTX_SLOT, context_shift=True) as (client, server):
        assert server.engine.n_ctx_slot == N_CTX_SLOT
        n_prompt = len(await tokens(client, STORY))
        want = N_CTX_SLOT + 100  # more than the whole context, let alone what the prompt leaves
        reply = await complete(client, STORY, max_tokens=want, ignore_eos=True)
        usage = reply["usage"]
        assert usage["prompt_tokens"] == n_prompt
        assert usage["completion_tokens"] == want > N_CTX_SLOT - n_prompt
        assert reply["choices"][0]["finish_reason"] == "length"
        # the slot's KV cache never held more than its context
        n_past = (await client.get("/slots")).json()[0]["n_past"]
        assert 0 < n_past < N_CTX_SLOT
        # n_keep -1 (keep the whole prompt) and an explicit n_discard: still no error
        reply = await complete(client, STORY, max_tokens=want, ignore_eos=True, n_keep=-1, n_discard=8)
        assert reply["usage"]["completion_tokens"] == want
        # a prompt that does not fit is still refused (llama-server: "exceeds the available context size")
        long_prompt = list(range(1000, 1000 + N_CTX_SLOT))
        r = await client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
        assert r.status_code == 400 and "context" in r.text
        # bad per-request values are 400s naming the field
        r = await client.post("/v1/completions", json={"prompt": STORY, "max_tokens": 1, "n_keep": -2})
        assert r.status_code == 400 and "n_keep" in r.text
        r = await client.post("/v1/completions", json={"prompt": STORY, "max_tokens": 1, "n_discard": -1})
        assert r.status_code == 400 and "n_discard" in r.text
        props = (await client.get("/props")).json()
        assert props["default_generation_settings"]["params"]["n_keep"] == 0


async def test_without_context_shift_a_full_slot_stops_with_length() -> None:
    async with node(n_parallel=1, n_ctx=N_CTX_SLOT) as (client, server):
        assert server.engine.config.context_shift is False  # llama-server's default at this version
        n_prompt = len(await tokens(client, STORY))
        reply = await complete(client, STORY, max_tokens=N_CTX_SLOT + 100, ignore_eos=True)
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == N_CTX_SLOT - n_prompt


# three parts: A + B + C, then A + C; C is longer than n_cache_reuse.  The fresh, reused and plain runs below are
# not the same arithmetic (the reused run's C was moved into place by a RoPE shift of its keys; the fresh run's
# prompt goes through ggml's flash attention as one batch of over 64 tokens, which takes its tiled kernel), so
# they are compared over a stretch the model answers with a wide margin: over the 7 tokens of " 1871.\n" the
# likeliest token leads the runner-up by 0.44 or more in probability, in all three runs, on an AVX2-only and an
# AVX-512 build (the shift moves such leads by up to 0.2; "how many steps does the keeper climb?" had leads of
# 0.06 to 0.13 in its first 12 tokens)
PART_A = "Notes on the harbour.\n"
PART_B = (
    "The ferry to the island leaves at nine in the morning and returns at six in the evening, "
    "except on Sundays when it does not run at all.\n"
)
PART_C = (
    "The lighthouse on the rock at the end of the bay was built in 1871. Its keeper climbs one hundred "
    "and twelve steps every night to light the lamp, and he counts them as his father did.\n"
    "Question: when was the lighthouse built?\nAnswer: It was built in"
)
N_REUSE = 16
ANSWER_TOKENS = 7  # " 1871.\n"


async def test_cache_reuse_shifts_a_later_chunk_into_place() -> None:
    # without the host-RAM prompt cache: it would restore the earlier A+C turn whole, which is not what this checks
    async with node(n_parallel=1, n_ctx=1024, n_cache_reuse=N_REUSE, cache_ram_mib=0) as (client, _):
        a, abc, ac = [await tokens(client, t) for t in (PART_A, PART_A + PART_B + PART_C, PART_A + PART_C)]
        prefix = next(i for i, (x, y) in enumerate(zip(abc, ac, strict=False)) if x != y)  # the plain common prefix
        assert prefix >= len(a) - 1 and len(ac) - prefix > N_REUSE
        # the answer without any cache (cache_prompt false evaluates the whole prompt)
        fresh = await complete(client, ac, max_tokens=ANSWER_TOKENS, cache_prompt=False)
        assert fresh["choices"][0]["text"] == " 1871.\n"
        await complete(client, abc, max_tokens=1)
        reused = await complete(client, ac, max_tokens=ANSWER_TOKENS)
        cached = reused["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused["timings"]["cache_n"] == cached
        # more than the common prefix was reused: C moved into place (all of the prompt but the
        # last token, which is evaluated again for its logits)
        assert cached > prefix + N_REUSE
        assert cached == len(ac) - 1
        assert reused["choices"][0]["text"] == fresh["choices"][0]["text"]
        # a request can switch it off: only the prefix is reused then
        await complete(client, abc, max_tokens=1)
        plain = await complete(client, ac, max_tokens=ANSWER_TOKENS, n_cache_reuse=0)
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix
        assert plain["choices"][0]["text"] == fresh["choices"][0]["text"]


# two users whose prompts share nothing; short enough that no prefix is copied between slots
USER_X = "Alice writes: my garden has roses, tulips and a small pond with three goldfish. What should I plant next?"
USER_Y = "Bob asks: which train goes from the central station to the airport after midnight on weekdays?"


async def _turns(client: httpx.AsyncClient, order: str) -> list[tuple[int, int, int]]:
    """Send the users' prompts in ``order`` ("XYYX"), each turn extending that user's previous prompt
    with its reply; ``(id_slot, cached_tokens, tokens the user's previous turn left in its slot)`` per turn."""
    prompt = {"X": USER_X, "Y": USER_Y}
    held = {"X": 0, "Y": 0}
    out = []
    for user in order:
        reply = await complete(client, prompt[user], max_tokens=8)
        assert reply["usage"]["prompt_tokens"] < SHARE_MIN_TOKENS  # no cross-slot copy
        out.append((reply["id_slot"], reply["usage"]["prompt_tokens_details"]["cached_tokens"], held[user]))
        held[user] = reply["usage"]["prompt_tokens"]
        prompt[user] += reply["choices"][0]["text"] + " Thanks. And then?"
    return out


async def test_each_user_returns_to_the_slot_holding_their_prompt() -> None:
    async with node(n_parallel=2, n_ctx=1024) as (client, server):
        assert server.engine.config.slot_prompt_similarity == 0.1  # llama-server's default
        turns = await _turns(client, "XYXYYX")
        slot_x, slot_y = turns[0][0], turns[1][0]
        assert slot_x != slot_y
        for (id_slot, cached, held), user in zip(turns, "XYXYYX", strict=False):
            assert id_slot == (slot_x if user == "X" else slot_y)
            # the previous turn's whole prompt is cached (and the reply tokens it appended, when
            # they tokenize the same way in the new prompt)
            assert cached >= held
        assert all(cached > 0 for _, cached, _ in turns[2:])


async def test_similarity_zero_picks_the_least_recently_used_slot() -> None:
    async with node(n_parallel=2, n_ctx=1024, slot_prompt_similarity=0.0) as (client, _):
        turns = await _turns(client, "XYYX")
        (sx, _, _), (sy, _, _), (sy2, cached_y2, _), (sx2, cached_x2, _) = turns
        assert sx != sy
        # Y's second turn goes to the slot used longest ago, X's: it holds nothing of Y's prompt
        assert sy2 == sx and cached_y2 == 0
        # and X's second turn to the other one, which holds Y's first turn
        assert sx2 == sy and cached_x2 == 0
