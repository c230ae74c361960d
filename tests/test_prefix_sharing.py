"""A prompt prefix held (or being evaluated) in another slot is copied, not evaluated again.

Real server, real SmolLM2: the copied prefix must give the same greedy text
as evaluating the whole prompt, and the timings must show the copy
(``cache_n``: tokens not evaluated for this request).
"""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx

from hydra_trio.engine.batching.scheduler import SHARE_MIN_TOKENS

from .conftest import ServerProcess

SYSTEM = (
    "You answer questions about the lighthouse on the rock at the end of the bay, where the keeper "
    "climbs the stairs every night to light the lamp, counting the steps as his father did. "
) * 12
SYSTEM_TOKENS_AT_LEAST = 300  # SYSTEM is about 440 tokens


def ask(http: httpx.Client, system: str, question: str, **kw: object) -> dict:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 16,
        **kw,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def erase_all(http: httpx.Client) -> None:
    for i in range(len(http.get("/slots").json())):
        assert http.post(f"/slots/{i}?action=erase").status_code == 200


def test_a_copied_prefix_gives_the_same_text_as_the_slots_own_cache(http: httpx.Client) -> None:
    system = f"[{uuid.uuid4().hex}] {SYSTEM}"
    erase_all(http)
    first = ask(http, system, "Who lit the lamp?", id_slot=0)
    assert first["timings"]["cache_n"] == 0  # no slot held any of it
    # slot 0 reuses its own cache for the system prompt and evaluates the new question
    own = ask(http, system, "How many steps are there?", id_slot=0)
    assert own["timings"]["cache_n"] >= SYSTEM_TOKENS_AT_LEAST
    # slot 2 takes the system prompt from slot 0 (by a copy) and evaluates the first question
    donor = ask(http, system, "Who lit the lamp?", id_slot=2)
    assert donor["timings"]["cache_n"] == own["timings"]["cache_n"]
    # slot 1 copies from slot 2 exactly what slot 0 reused of its own: same suffix, same text
    assert http.post("/slots/0?action=erase").status_code == 200
    copied = ask(http, system, "How many steps are there?", id_slot=1)
    assert copied["timings"]["cache_n"] == own["timings"]["cache_n"]
    assert copied["timings"]["prompt_n"] == own["timings"]["prompt_n"]
    assert text(copied) == text(own) and text(own)
    # the same prompt again on slot 3: all of it but the last token is copied
    again = ask(http, system, "How many steps are there?", id_slot=3)
    n_prompt = own["usage"]["prompt_tokens"]
    assert again["timings"]["cache_n"] == n_prompt - 1 and again["timings"]["prompt_n"] == 1
    assert http.get("/slots").json()[3]["n_past"] >= n_prompt


def test_a_short_prefix_is_evaluated_not_copied(spawn) -> None:
    # without the host-RAM prompt cache, which would restore the 50-odd tokens kept from slot 0 (a copy of
    # just those cells, cheaper than evaluating them: tests/test_prompt_cache.py)
    node = spawn("--cache-ram", "0", "--no-rpc-backend")
    node.wait_ready()
    system = f"[{uuid.uuid4().hex}] You are terse."
    with httpx.Client(base_url=node.base, timeout=120) as http:
        first = ask(http, system, "Who lit the lamp?", id_slot=0)
        assert SHARE_MIN_TOKENS > first["usage"]["prompt_tokens"] > 32
        other = ask(http, system, "Who lit the lamp?", id_slot=1)
        assert other["timings"]["cache_n"] == 0


def test_concurrent_requests_with_one_system_prompt_evaluate_it_once(server: ServerProcess, http: httpx.Client) -> None:
    fresh = f"[{uuid.uuid4().hex}] {SYSTEM}"  # in no slot's cache yet
    questions = ["How many steps?", "Who lit the lamp?", "Where is the rock?", "What did the father do?"]
    erase_all(http)  # the concurrent requests find the prefix in no slot's cache
    with concurrent.futures.ThreadPoolExecutor(4) as pool, httpx.Client(base_url=server.base, timeout=120) as c:
        together = list(pool.map(lambda q: ask(c, fresh, q), questions))
    # (the texts may differ from solo runs in the last bits: llama.cpp's CPU
    # kernels sum in another order when a batch holds other slots' tokens)
    assert all(text(r) for r in together)
    n_prompt = together[0]["usage"]["prompt_tokens"]
    evaluated = sum(r["timings"]["prompt_n"] for r in together)
    # one request evaluates the system prompt, the other three copy it
    assert evaluated < n_prompt + 3 * (n_prompt - SYSTEM_TOKENS_AT_LEAST)
    assert sum(r["timings"]["cache_n"] >= SYSTEM_TOKENS_AT_LEAST for r in together) >= 3
