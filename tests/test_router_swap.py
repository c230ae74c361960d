"""Router mode's in-place switches (docs/router.md, "Which switches are in place"), on real sockets with real
children serving the real SmolLM2 (its Q4_1 and the Q8_0 made from it).

llama-server's router restarts a child for every switch under ``--models-max`` (``tools/server/server-models.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors: the least recently used instance is stopped, the new one
spawned).  hydra-trio keeps llama-server's statuses and replies, but a switch between two presets that differ
only in their quantization is a SWAP_QUANT in the running child: the same process (same PID, same port), the
first model ``unloaded`` (not failed), the second ``loaded``.  Any other switch is llama-server's restart.
"""

from __future__ import annotations

from pathlib import Path

from hydra_trio.cli import parse_args
from hydra_trio.cli.router import build_models
from hydra_trio.models.presets import resolve_model

from .conftest import listening_pid
from .test_router import Router, chat, router

SIBLINGS = """\
version = 1
[*]
c = 256
np = 1

[smollm2-135m]
model = smollm2-135m
alias = small

[q8]
model = smollm2-135m-q8
stop-timeout = 5
"""
"""Two quantizations of one model, every other option equal; the second's name is no project model name, so
the name a child answers with after a swap is the router's."""


def child_of(r: Router, name: str) -> tuple[int, int]:
    """``(port, pid)`` of the child serving ``name``: its port from ``/models``, its process the one listening
    there."""
    args = r.models()[name]["status"]["args"]
    port = int(args[args.index("--port") + 1])
    return port, listening_pid(port)


def statuses(r: Router) -> dict[str, tuple[str, bool]]:
    return {n: (m["status"]["value"], bool(m["status"].get("failed"))) for n, m in r.models().items()}


def test_only_quantizations_of_one_model_with_equal_options_are_siblings(tmp_path: Path) -> None:
    """The test MoE is made from SmolLM2 (same attention and tokenizer: the same KV identity) but holds other
    tensors: another model.  Another ``-c`` is another option.  ``alias``, ``stop-timeout`` do not count."""
    from hydra_trio.models.family import weights_layout

    q4, q8, moe = (resolve_model(n)[0] for n in ("smollm2-135m", "smollm2-135m-q8", "smollm2-135m-moe"))
    assert weights_layout(q4) == weights_layout(q8) != weights_layout(moe)
    path = tmp_path / "p.ini"
    path.write_text(
        SIBLINGS + "[moe]\nmodel = smollm2-135m-moe\n[q8-512]\nmodel = smollm2-135m-q8\nc = 512\n"
        "[q4-512]\nmodel = smollm2-135m\nc = 512\nstop-timeout = 3\nalias = other\n"
    )
    args = parse_args(["--models-preset", str(path), "--models-max", "1"], {})
    models = {m.name: m for m in build_models(args, args.argv, parse_args, {})[0]}
    assert (
        models["smollm2-135m"].quants
        == models["q8"].quants
        == {"smollm2-135m": "smollm2-135m", "q8": "smollm2-135m-q8"}
    )
    assert models["q8-512"].quants == models["q4-512"].quants == {"q8-512": "smollm2-135m-q8", "q4-512": "smollm2-135m"}
    assert models["moe"].quants == {}
    flags = models["q8"].args()
    assert flags[-4:] == ["--quant", "smollm2-135m=smollm2-135m", "--quant", "q8=smollm2-135m-q8"]
    assert flags[flags.index("--alias") + 1] == "q8" and "--quant" not in models["moe"].args()


def test_a_switch_between_quantizations_is_a_swap_in_the_same_child(tmp_path: Path) -> None:
    with router(tmp_path, SIBLINGS, "--models-max", "1") as r:
        assert r.http.post("/models/load", json={"model": "small"}).json() == {"success": True}
        r.wait_status("smollm2-135m", "loaded")
        port, pid = child_of(r, "smollm2-135m")
        assert r.models()["smollm2-135m"]["meta"]["ftype"] == "Q4_1"

        reply = r.http.post("/v1/chat/completions", json=chat("q8"))  # autoload: the LRU model gives way
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "q8" and reply.json()["usage"]["completion_tokens"] == 4
        assert statuses(r) == {"smollm2-135m": ("unloaded", False), "q8": ("loaded", False)}
        assert child_of(r, "q8") == (port, pid)  # the same process
        entry = r.models()["q8"]
        assert entry["meta"]["ftype"] == "Q8_0" and "meta" not in r.models()["smollm2-135m"]
        assert r.http.get("/health").json()["models"] == [
            {"id": "q8", "status": "loaded"},
            {"id": "smollm2-135m", "status": "unloaded"},
        ]
        own = r.http.get("/v1/models").json()["data"]
        assert [m["id"] for m in own] == ["q8", "smollm2-135m"]
        direct = r.http.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        assert direct["id"] == "q8"  # the child's own name follows the swap
        assert r.http.get("/props", params={"model": "q8"}).json()["model_alias"] == "q8"

        back = r.http.post("/v1/chat/completions", json=chat("small"))  # an alias, back in place
        assert back.status_code == 200 and back.json()["model"] == "smollm2-135m"
        assert statuses(r) == {"smollm2-135m": ("loaded", False), "q8": ("unloaded", False)}
        assert child_of(r, "smollm2-135m") == (port, pid)

        assert r.http.post("/models/load", json={"model": "q8"}).json() == {"success": True}
        r.wait_status("q8", "loaded")
        assert child_of(r, "q8") == (port, pid) and r.status("smollm2-135m") == "unloaded"
        log = r.log()
        assert log.count("spawning server instance") == 1, log
        assert log.count("in place (port") == 3 and "stopping model instance" not in log


def test_a_switch_between_presets_of_other_options_restarts_the_child(tmp_path: Path) -> None:
    """``-c`` differs: llama-server's path (stop the child, start one for the other preset)."""
    preset = SIBLINGS + "[q8-512]\nmodel = smollm2-135m-q8\nc = 512\n"
    with router(tmp_path, preset, "--models-max", "1") as r:
        assert "--quant" in r.models()["q8"]["status"]["args"]
        assert "--quant" not in r.models()["q8-512"]["status"]["args"]
        assert r.http.post("/v1/completions", json={"model": "q8", "prompt": "hi", "max_tokens": 2}).status_code == 200
        _, pid = child_of(r, "q8")
        reply = r.http.post("/v1/completions", json={"model": "q8-512", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "q8-512"
        assert statuses(r)["q8"] == ("unloaded", False) and r.status("q8-512") == "loaded"
        assert child_of(r, "q8-512")[1] != pid
        assert r.models()["q8-512"]["meta"]["n_ctx"] == 512
        assert r.log().count("spawning server instance") == 2


def test_a_swap_the_child_refuses_falls_back_to_a_restart(tmp_path: Path) -> None:
    """A child that refuses SWAP_QUANT from the router (``--control-allow`` without loopback): the switch is
    llama-server's restart, and the model serves from a new child."""
    preset = SIBLINGS.replace("np = 1\n", "np = 1\ncontrol-allow = 192.0.2.0/24\n")
    with router(tmp_path, preset, "--models-max", "1") as r:
        assert (
            r.http.post("/v1/completions", json={"model": "small", "prompt": "hi", "max_tokens": 2}).status_code == 200
        )
        _, pid = child_of(r, "smollm2-135m")
        reply = r.http.post("/v1/completions", json={"model": "q8", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "q8"
        assert statuses(r) == {"smollm2-135m": ("unloaded", False), "q8": ("loaded", False)}
        assert child_of(r, "q8")[1] != pid
        assert "in-place switch to name=q8 failed" in r.log() and r.log().count("spawning server instance") == 2


def test_a_child_asked_to_stop_after_a_streamed_reply_exits_by_itself(tmp_path: Path) -> None:
    """The restart path's first half: the router keeps no connection to a child alive between two requests
    (llama-server's proxy opens one per request), so a child told to stop after a streamed reply finds no
    connection to wait for and exits 0 well before its ``stop-timeout`` (5 s here; a kept-alive connection held
    it for its 10 s shutdown grace, and the router killed it: ``failed``, exit code 137)."""
    with router(tmp_path, SIBLINGS, "--models-max", "2") as r:
        with r.http.stream("POST", "/v1/chat/completions", json=chat("q8", stream=True)) as s:
            assert s.status_code == 200 and s.read().rstrip().endswith(b"data: [DONE]")
        assert r.http.post("/models/unload", json={"model": "q8"}).json() == {"success": True}
        r.wait_status("q8", "unloaded")
        assert statuses(r)["q8"] == ("unloaded", False), r.models()["q8"]["status"]
        assert "force-killing model instance name=q8" not in r.log()


# ------------------------------------------------------------------------------------------ the node's side


def test_a_node_whose_alias_is_its_models_quant_key_names_each_quant_by_its_key() -> None:
    """What a router's child is started with (``--alias NAME --quant NAME=MODEL ...``): after a swap the node's
    model id is the router's name of the new quantization; any other ``-a`` keeps naming the start-up model
    only (the others keep their own aliases)."""
    from hydra_trio.engine.quants import QuantSet

    (q4, _), (q8, alias8) = resolve_model("smollm2-135m"), resolve_model("smollm2-135m-q8")
    quants = (("small", q4, "smollm2-135m"), ("q8", q8, alias8))
    assert {k: a for k, (_, a) in QuantSet(quants, q4, "small").paths.items()} == {"small": "small", "q8": "q8"}
    assert {k: a for k, (_, a) in QuantSet(quants, q4, "mine").paths.items()} == {"small": "mine", "q8": alias8}


def test_a_node_with_quants_hashes_their_files_once_it_serves() -> None:
    """A swap needs the new file's SHA-256 (its ``model_hash``): a node with ``--quant`` hashes every quant's
    file on a background thread once it serves, so that the swap does not."""
    from hydra_trio.engine.llama.model import sha256_file
    from hydra_trio.engine.quants import QuantSet

    q4, q8 = (resolve_model(n)[0].resolve() for n in ("smollm2-135m", "smollm2-135m-q8"))
    qs = QuantSet((("a", q4, ""), ("b", q8, "")), q4)
    assert QuantSet((("a", q4, ""),), q4).hash_in_background() is None  # nothing to swap to
    thread = qs.hash_in_background()
    assert thread is not None
    thread.join(300)
    assert {path: digest for (path, _, _), digest in qs._hashes.items()} == {q4: sha256_file(q4), q8: sha256_file(q8)}


def test_a_swap_between_siblings_keeps_the_vocabularys_tables() -> None:
    """The vocabulary's tables (the special tokens, read on a model's first request; the end-of-generation
    tokens) move to the new model of the same KV identity rather than being read again: the first request
    after a swap costs what the others do."""
    import llama_cpp

    from hydra_trio.engine.kv.kv_identity import identity_hash, kv_identity
    from hydra_trio.engine.llama.model import LoadedModel
    from hydra_trio.engine.llama.tokenize import SpecialTokens

    q4, q8 = (resolve_model(n)[0] for n in ("smollm2-135m", "smollm2-135m-q8"))
    old = LoadedModel(q4, n_ctx=256, n_parallel=1, n_batch=64, n_threads=1)
    new = LoadedModel(q8, n_ctx=256, n_parallel=1, n_batch=64, n_threads=1)
    try:
        assert identity_hash(kv_identity(old)) == identity_hash(kv_identity(new))
        new.share_vocabulary_tables(old)  # nothing read yet: nothing to share
        assert "special_tokens" not in new.__dict__ and "eog_tokens" not in new.__dict__
        table, eog = old.special_tokens, old.eog_tokens
        new.share_vocabulary_tables(old)
        assert new.special_tokens is table and new.eog_tokens is eog
        assert table.classes == SpecialTokens(new.vocab).classes  # what reading them again would give
        assert eog == [t for t in range(new.n_vocab) if llama_cpp.llama_vocab_is_eog(new.vocab, t)] != []
    finally:
        old.close()
        new.close()


def test_a_hydra_swap_quant_to_a_sibling_through_the_router_is_refused(tmp_path: Path) -> None:
    """The children know their siblings as quant keys; a SWAP_QUANT a client sends through the router's port
    to one of them would change the model behind the router's back (the router still listing the old one):
    BAD_REQUEST, pointing to the load that switches in place."""
    import struct

    from hydra_trio.protocol.hydra import Op, Status
    from hydra_trio.testing.hydra_wire import Wire

    with router(tmp_path, SIBLINGS, "--models-max", "1", "--no-rpc-backend") as r:
        assert r.http.post("/models/load", json={"model": "small"}).json() == {"success": True}
        r.wait_status("smollm2-135m", "loaded")
        with Wire(r.port, 300) as w:
            status, meta, _ = w.call(Op.SWAP_QUANT, "@small", struct.pack("<H", 2) + b"q8")
        assert status == Status.BAD_REQUEST and "is a model of this router" in meta["error"], meta
        assert statuses(r) == {"smollm2-135m": ("loaded", False), "q8": ("unloaded", False)}
        port, _ = child_of(r, "smollm2-135m")
        assert r.http.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["meta"]["ftype"] == "Q4_1"
