"""What several benches share: one greedy decode's speed as the node itself reports it."""

from __future__ import annotations

import httpx


def tok_s(port: int, n: int) -> float:
    """Decode tokens/s (``timings.predicted_per_second``) of one greedy completion of ``n`` tokens
    with ``ignore_eos``, its prompt evaluated afresh (``cache_prompt`` off)."""
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=300,
        json={
            "prompt": "Once upon a time",
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        },
    ).json()
    return r["timings"]["predicted_per_second"]
