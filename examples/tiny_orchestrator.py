"""A tiny orchestrator in trio: two embedded nodes, prefill on one, move the KV cache, decode on the other.

    .venv/bin/python examples/tiny_orchestrator.py

Node A evaluates the prompt (Hydra PREFILL, which returns the slot's KV state
blob), node B takes the blob (STATE_PUT) and generates the answer from it
without evaluating the prompt again: its reply's ``timings.cache_n`` is the
prompt's length minus the one token it re-evaluates.  Both nodes run inside
this program, each with its own engine thread.
"""

import httpx
import trio

from hydra_trio import EngineConfig, HydraClient, ServerConfig, resolve_model, serve

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]


async def main() -> None:
    path, alias = resolve_model("smollm2-135m")
    async with trio.open_nursery() as nursery:
        a = await nursery.start(serve, ServerConfig(port=0, engine=EngineConfig(path, alias, n_parallel=1, n_ctx=1024)))
        b = await nursery.start(serve, ServerConfig(port=0, engine=EngineConfig(path, alias, n_parallel=2, n_ctx=2048)))
        await a.engine.wait_ready()
        await b.engine.wait_ready()
        async with HydraClient("127.0.0.1", a.port) as node_a:
            meta, blob = await node_a.prefill(0, {"messages": MESSAGES})
        print(f"A prefilled {meta['n_past']} tokens in {meta['prefill_ms']:.0f} ms; KV blob {len(blob)} bytes")
        async with HydraClient("127.0.0.1", b.port) as node_b:
            put = await node_b.state_put(1, blob)
        print(f"B restored slot 1: n_past {put['n_past']}")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{b.port}", timeout=120) as client:
            r = await client.post(
                "/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "max_tokens": 16, "id_slot": 1}
            )
        reply = r.json()
        print("B answered:", reply["choices"][0]["message"]["content"])
        print("cache_n:", reply["timings"]["cache_n"], "prompt_n:", reply["timings"]["prompt_n"])
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
