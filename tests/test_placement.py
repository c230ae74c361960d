"""Placement flags applied for real: -ot, -cmoe, -ncmoe on the test MoE and SmolLM2, COMBINED composed
with the operator's -ot, where each overridden tensor went (log and /props), and unknown devices / buffer types."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from hydra_trio.engine.llama.ggml_backend import GgufHeader
from hydra_trio.engine.llama.model import LoadedModel, ModelLoadError
from hydra_trio.engine.llama.placement import Placement, PlacementError, check_placement
from hydra_trio.engine.settings import LlamaOptions
from hydra_trio.models.presets import resolve_model
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ROOT, ServerProcess, free_port, wait_for

BODY = {"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
SMALL = ("-np", "1", "-c", "512", "--no-rpc-backend")


def complete(node: ServerProcess) -> str:
    r = httpx.post(node.base + "/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def props(node: ServerProcess) -> dict:
    return httpx.get(node.base + "/props", timeout=30).json()


def moe_tensors(pattern: str) -> set[str]:
    """The test MoE's tensor names that ``pattern`` matches (re.search, as llama.cpp's overrides)."""
    rx = re.compile(pattern)
    return {name for name, _ in GgufHeader(resolve_model("smollm2-135m-moe")[0]).tensors if rx.search(name)}


def info(port: int) -> dict:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK
    return meta


# --------------------------------------------------------------------------- in process, nothing loads


def test_the_engine_refuses_unknown_devices_and_buffer_types_before_loading(tmp_path) -> None:
    missing = tmp_path / "never-read.gguf"  # the placement is checked before llama.cpp opens the file
    for opts, needle in (
        (LlamaOptions(devices=("CUDA0",)), "-dev/--device: no device 'CUDA0' here (devices: CPU"),
        (LlamaOptions(devices=("CPU",)), "'CPU' is the CPU, not an offload device"),
        (LlamaOptions(tensor_overrides=(("x", "CUDA0"),)), "unknown buffer type 'CUDA0' (available: CPU)"),
        (LlamaOptions(tensor_overrides=(("x", "RPC0[127.0.0.1:1]"),)), "needs llama-server's --rpc"),
    ):
        with pytest.raises(PlacementError, match=re.escape(needle)):
            check_placement(opts)
        with pytest.raises(ModelLoadError, match=re.escape(needle)):
            LoadedModel(missing, n_ctx=256, n_parallel=1, n_batch=64, n_threads=1, options=opts)


def test_override_order_and_llama_servers_patterns() -> None:
    p = Placement(
        LlamaOptions(
            tensor_overrides=(("token_embd\\.weight", "CPU"),),
            cpu_moe=True,
            n_cpu_moe=2,
            n_cpu_ffn=1,
            devices=("none",),
            n_gpu_layers="all",
        ),
        n_layer=30,
    )
    assert [(pattern, source) for pattern, _, source in p.overrides] == [
        ("token_embd\\.weight", "-ot"),
        ("\\.ffn_(up|down|gate|gate_up)_(ch|)exps", "-cmoe"),
        ("blk\\.0\\.ffn_(up|down|gate|gate_up)_(ch|)exps", "-ncmoe"),
        ("blk\\.1\\.ffn_(up|down|gate|gate_up)_(ch|)exps", "-ncmoe"),
        ("blk\\.0\\.ffn_(up|down|gate)\\.", "-ncffn"),
    ]
    assert (p.devices, p.n_gpu_layers) == ([], -2)  # -dev none: an explicit empty list, never NULL
    assert len(Placement(LlamaOptions(n_cpu_moe=1000), n_layer=30).overrides) == 30  # no pattern past the model


# --------------------------------------------------------------------------- real nodes


@pytest.mark.slow
def test_cpu_moe_flags_serve_the_same_text_and_say_where_the_experts_went(spawn) -> None:
    runs = {"none": (), "-ncmoe 8": ("--n-cpu-moe", "8"), "-ot": ("-ot", "ffn_.*_exps=CPU"), "-cmoe": ("-cmoe",)}
    nodes = {name: spawn("-m", "smollm2-135m-moe", *SMALL, *flags) for name, flags in runs.items()}
    experts = moe_tensors(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
    first8 = moe_tensors(r"blk\.[0-7]\.ffn_(up|down|gate|gate_up)_(ch|)exps")
    assert len(experts) == 90 and len(first8) == 24  # 30 layers x gate/up/down
    expected = {"none": 0, "-ncmoe 8": len(first8), "-ot": len(experts), "-cmoe": len(experts)}
    texts = {}
    for name, node in nodes.items():
        node.wait_ready(timeout=240)
        texts[name] = complete(node)
        placed = props(node)["tensor_placement"]
        assert sum(placed.values()) == expected[name] and all(k.startswith("CPU") for k in placed), (name, placed)
        if expected[name]:
            buft = next(iter(placed))
            assert f"tensors overridden: {expected[name]} to {buft}" in node.log(), name
            assert "overrides " + {"-ncmoe 8": "-ncmoe x8", "-ot": "-ot x1", "-cmoe": "-cmoe x1"}[name] in node.log()
    assert len(set(texts.values())) == 1, texts
    assert "Paris" in texts["none"]
    assert "-ncmoe: no usable GPU in this build" in nodes["-ncmoe 8"].log()  # the one warning, as llama-server


@pytest.mark.slow
def test_token_embd_on_the_cpu_on_smollm2(server: ServerProcess, spawn) -> None:
    node = spawn(*SMALL, "-ot", "token_embd\\.weight=CPU")
    node.wait_ready()
    assert props(node)["tensor_placement"] == {"CPU": 1}  # the tied output weight is the same tensor
    assert props(node)["tensor_placement_peer"] is None
    assert complete(node) == complete(server)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["-ot", "x=CUDA0"], "-ot/--override-tensor x=CUDA0: unknown buffer type 'CUDA0' (available: CPU)"),
        (["-dev", "CUDA0"], "-dev/--device: no device 'CUDA0' here (devices: CPU"),
    ],
)
def test_bad_buffer_type_or_device_exits_2_naming_it(argv, needle) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "--port", str(free_port()), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert needle in out.stderr and "listening" not in out.stderr


@pytest.mark.slow
def test_combined_keeps_the_operators_overrides_and_puts_the_rest_of_the_experts_on_the_peer(spawn) -> None:
    peer = spawn("--no-model")
    peer.wait_ready()
    # the operator's -ot (embedding and layer 0's experts on the CPU) come first, then COMBINED's pattern
    # (the other experts on the peer), then -ncmoe (nothing left for it in COMBINED)
    head = spawn(
        "-m",
        "smollm2-135m-moe",
        *SMALL,
        "-ot",
        "token_embd\\.weight=CPU,blk\\.0\\.ffn_.*_exps=CPU",
        "--n-cpu-moe",
        "8",
        "--rpc-engine",
        f"127.0.0.1:{peer.port}",
    )
    head.wait_ready(timeout=240)
    wait_for(lambda: info(head.port)["mode"] == "combined", timeout=180, what="the head in COMBINED")
    p = props(head)
    assert p["tensor_placement"] == {"CPU": 1 + len(moe_tensors(r"blk\.[0-7]\.ffn_.*_exps"))}  # SOLO: -ot, -ncmoe
    peer_placed = p["tensor_placement_peer"]
    rpc = {k: v for k, v in peer_placed.items() if k.startswith("RPC")}
    assert list(rpc.values()) == [len(moe_tensors(r"ffn_(up|down|gate)_exps")) - 3], peer_placed  # all but layer 0's
    assert peer_placed["CPU"] == 1 + 3
    combined = complete(head)
    with Wire(head.port) as w:
        status, meta, _ = w.call(Op.SET_EXPERT_MODE, payload=b"solo")
    assert status == Status.OK and meta["mode"] == "solo", meta
    assert complete(head) == combined
    assert "overrides -ot x2, COMBINED x1, -ncmoe x8" in head.log()
