"""hydra-trio as a library: a trio app embeds the server in its own nursery."""

from __future__ import annotations

import httpx
import trio

from hydra_trio import EngineConfig, ServerConfig, serve
from hydra_trio.models.presets import resolve_model

from .conftest import CAPITAL_QUESTION


async def test_serve_in_own_nursery() -> None:
    path, _alias = resolve_model("smollm2-135m")
    config = ServerConfig(
        port=0, engine=EngineConfig(model_path=path, model_alias="embedded", n_parallel=2, n_ctx=2048)
    )
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, config)
        assert server.port
        base = f"http://127.0.0.1:{server.port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            with trio.fail_after(120):
                await server.engine.wait_ready()
            r = await client.post(
                "/v1/chat/completions",
                json={"messages": CAPITAL_QUESTION, "temperature": 0, "max_tokens": 16},
            )
            assert r.status_code == 200
            assert "Paris" in r.json()["choices"][0]["message"]["content"]
            assert r.json()["model"] == "embedded"
            assert len((await client.get("/slots")).json()) == 2
        model = server.engine.model
        nursery.cancel_scope.cancel()
    # the engine thread has stopped and freed llama.cpp's objects
    assert model is not None and model.ctx is None and model.model is None
    assert server.engine.model is None


def test_the_library_example_runs_as_written(tmp_path) -> None:
    """The "As a library" block of docs/library.md, with its ``...`` replaced by one request and a cancel."""
    import re
    import subprocess
    import sys

    from hydra_trio.testing.spawn import ROOT

    page = (ROOT / "docs" / "library.md").read_text()
    section = page[page.index("## As a library") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "\n        ...  #" in code
    code = code.replace(
        "\n        ...  #",
        "\n        import httpx; r = await httpx.AsyncClient().get(f'http://127.0.0.1:{server.port}/health')"
        "; print('health', r.status_code); nursery.cancel_scope.cancel()  #",
    )
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "serving on port" in out.stdout and "health 200" in out.stdout
