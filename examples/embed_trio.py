"""Embed a hydra-trio node in your own trio app: your nursery, your task beside it, cancel to stop.

    .venv/bin/python examples/embed_trio.py

Starts a node (2 slots) on a free port inside this program's nursery, runs a
task of its own beside it (it asks the node one question over HTTP and prints
the answer and the reply's timings), then cancels the nursery: the node stops
with it.
"""

import httpx
import trio

from hydra_trio import EngineConfig, ServerConfig, resolve_model, serve


async def my_task(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France? Answer in one word."},
                ],
                "temperature": 0,
                "max_tokens": 16,
            },
        )
        reply = r.json()
        print("answer:", reply["choices"][0]["message"]["content"])
        print("prompt_ms:", round(reply["timings"]["prompt_ms"], 1), "predicted_n:", reply["timings"]["predicted_n"])


async def main() -> None:
    path, alias = resolve_model("smollm2-135m")
    config = ServerConfig(port=0, engine=EngineConfig(path, alias, n_parallel=2, n_ctx=2048))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, config)  # listening once this returns
        await server.engine.wait_ready()  # the model is loaded
        print("serving on port", server.port)
        await my_task(server.port)
        nursery.cancel_scope.cancel()  # stops the node with everything else in the nursery
    print("stopped")


if __name__ == "__main__":
    trio.run(main)
