"""Router mode as the cluster runs it, on real sockets with real child nodes: the head's preset (one section per
quantization, with ``n-cpu-moe`` / ``override-tensor`` / ``alias``), the memory the models take and give back,
``GET /models/sse``, ``POST`` / ``DELETE /models`` and the router's status page.

Expected values are llama-server's in router mode (``tools/server/server-models.cpp``, ``server.cpp`` and the
"Model presets" / "Routing requests" sections of ``tools/server/README.md`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors).
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra_trio.engine.llama.ggml_backend import GgufHeader
from hydra_trio.models.presets import resolve_model

from .test_router import chat, router

EXPERTS = r"blk\.[0-9]+\.ffn_.*_exps\.=CPU"
SOME_EXPERTS = r"blk\.1[01]\.ffn_up_exps\.=CPU,blk\.1[01]\.ffn_down_exps\.=CPU"

CLUSTER_HEAD = f"""\
version = 1
[*]
c = 256
np = 1

; the cluster's head: one section per quantization of its model, the experts kept on the CPU
[moe-q4]
model = smollm2-135m-moe
n-cpu-moe = 4
override-tensor = {EXPERTS}
alias = moe,default

[moe-q8]
model = smollm2-135m-moe-q8
n-cpu-moe = 2
override-tensor = {SOME_EXPERTS}
alias = moe-fine

[dense-q8]
model = smollm2-135m-q8
n-cpu-moe = 0
override-tensor = token_embd\\.weight=CPU
alias = dense
"""


def tensors(model: str, pattern: str) -> set[str]:
    """The tensors of ``model`` that ``pattern`` finds (re.search, as llama.cpp's overrides)."""
    rx = re.compile(pattern)
    return {name for name, _ in GgufHeader(resolve_model(model)[0]).tensors if rx.search(name)}


def test_the_cluster_heads_preset_loads_routes_by_alias_and_unloads(tmp_path: Path) -> None:
    """Each section's ``override-tensor`` (a regex with ``\\.``, ``=``, a comma between two) and ``n-cpu-moe``
    reach its child as written (``/models``'s ``args``, the child's ``tensor_placement``); ``--models-max 1``
    swaps the quantizations one for another."""
    with router(tmp_path, CLUSTER_HEAD, "--models-max", "1") as r:
        models = r.models()
        assert list(models) == ["dense-q8", "moe-q4", "moe-q8"]  # by name, as llama-server's std::map
        for name, ot, ncmoe in (("moe-q4", EXPERTS, "4"), ("moe-q8", SOME_EXPERTS, "2"), ("dense-q8", None, "0")):
            args = models[name]["status"]["args"]
            if ot is not None:
                assert args[args.index("--override-tensor") + 1] == ot
                assert f"override-tensor = {ot}\n" in models[name]["status"]["preset"]
            assert args[args.index("--n-cpu-moe") + 1] == ncmoe
        assert models["moe-q4"]["aliases"] == ["default", "moe"] and models["dense-q8"]["aliases"] == ["dense"]

        assert r.http.post("/models/load", json={"model": "moe-q4"}).json() == {"success": True}
        r.wait_status("moe-q4", "loaded")
        placed = r.http.get("/props", params={"model": "moe"}).json()["tensor_placement"]
        assert sum(placed.values()) == len(tensors("smollm2-135m-moe", EXPERTS.split("=")[0])) == 90

        reply = r.http.post("/v1/chat/completions", json=chat("moe-fine"))  # by alias: moe-q4 makes room
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "moe-q8" and reply.json()["usage"]["completion_tokens"] == 4
        assert r.status("moe-q4") == "unloaded"
        placed = r.http.get("/props", params={"model": "moe-fine"}).json()["tensor_placement"]
        first_two = r"blk\.[01]\.ffn_(up|down|gate|gate_up)_(ch|)exps"
        some = {t for p in SOME_EXPERTS.split(",") for t in tensors("smollm2-135m-moe-q8", p.split("=")[0])}
        assert sum(placed.values()) == len(some | tensors("smollm2-135m-moe-q8", first_two)) == 4 + 6

        assert r.http.post("/models/unload", json={"model": "moe-fine"}).json() == {"success": True}
        r.wait_status("moe-q8", "unloaded")
        assert "failed" not in r.models()["moe-q8"]["status"]
