"""The node on the hardware it is given: the build's backends and devices, CUDA builds from
dev.sh where a GPU exists, a unified KV cache (-kvu) with prefix sharing, RoPE-scaled contexts past the
training context.  GPU-marked tests run where a CUDA build exists and skip, saying so, elsewhere."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from hydra_trio.engine.llama.ggml_backend import build_backends

from .conftest import CAPITAL_QUESTION, ROOT, ServerProcess
from .test_cli_flags import hydra_info
from .test_prefix_sharing import SYSTEM, SYSTEM_TOKENS_AT_LEAST, ask, text

CUDA = "CUDA" in build_backends()


def cmake_args(**env: str) -> str:
    """``dev.sh cmake-args`` with ``env`` over a copy of this process's environment without the build
    choices (``HYDRA_TRIO_CPU``/``_CUDA``: the suite may itself run on a build chosen by them)."""
    base = {k: v for k, v in os.environ.items() if k not in ("HYDRA_TRIO_CPU", "HYDRA_TRIO_CUDA")}
    out = subprocess.run(
        ["bash", str(ROOT / "dev.sh"), "cmake-args"], capture_output=True, text=True, timeout=60, env={**base, **env}
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_dev_sh_builds_for_the_instruction_sets_it_is_told() -> None:
    v3 = cmake_args(HYDRA_TRIO_CPU="x86-64-v3")
    assert "-DGGML_NATIVE=OFF" in v3 and "-DGGML_AVX2=ON" in v3 and "-DGGML_FMA=ON" in v3
    assert "-DGGML_AVX512=OFF" in v3 and "-DGGML_AVX_VNNI=OFF" in v3
    assert "-DGGML_AVX512=ON" in cmake_args(HYDRA_TRIO_CPU="x86-64-v4")
    listed = cmake_args(HYDRA_TRIO_CPU="avx,avx2")
    assert "-DGGML_AVX2=ON" in listed and "-DGGML_FMA=OFF" in listed
    flags = set(
        next(
            (
                line.split(":", 1)[1].split()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    )
    native = cmake_args()  # the default: what /proc/cpuinfo lists, under its own names
    assert ("-DGGML_AVX512_VBMI=ON" in native) == ("avx512vbmi" in flags)
    assert ("-DGGML_AVX2=ON" in native) == ("avx2" in flags)
    out = subprocess.run(
        ["bash", str(ROOT / "dev.sh"), "cmake-args"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HYDRA_TRIO_CPU": "avx,sse9"},
    )  # set over any inherited choice
    assert out.returncode != 0 and "HYDRA_TRIO_CPU: unknown instruction set sse9" in out.stderr


def test_dev_sh_builds_cuda_only_where_a_gpu_is_or_when_told() -> None:
    forced = cmake_args(HYDRA_TRIO_CUDA="1", CMAKE_CUDA_ARCHITECTURES="90")
    assert forced.endswith("-DGGML_CUDA=ON -DGGML_CUDA_FA=ON -DCMAKE_CUDA_ARCHITECTURES=90")
    assert "-DGGML_RPC=ON" in forced  # the CPU flags stay: host memory still holds what is not offloaded
    assert "CUDA" not in cmake_args(HYDRA_TRIO_CUDA="0")
    # auto: CUDA when nvcc is there and nvidia-smi lists a GPU; these machines ship nvcc without a GPU
    has_gpu = subprocess.run("command -v nvidia-smi && nvidia-smi -L", shell=True, capture_output=True).returncode == 0
    assert ("-DGGML_CUDA=ON" in cmake_args()) == (
        has_gpu and bool(subprocess.run("command -v nvcc", shell=True, capture_output=True).stdout)
    )


def test_props_and_the_log_name_the_backends_and_devices(server: ServerProcess) -> None:
    props = httpx.get(server.base + "/props", timeout=30).json()
    assert props["backends"] == build_backends() and {"CPU", "RPC"} <= set(props["backends"])
    cpu = next(d for d in props["devices"] if d["name"] == "CPU")
    assert 0 < cpu["memory_free"] <= cpu["memory_total"]
    info = hydra_info(server.port)  # the Hydra INFO reply says the same
    assert info["backends"] == props["backends"] and [d["name"] for d in info["devices"]] == [
        d["name"] for d in props["devices"]
    ]
    log = server.log()
    assert "backends: " + ", ".join(build_backends()) in log
    assert "device CPU: " in log and " MiB free of " in log


@pytest.mark.slow
def test_a_unified_kv_cache_shares_prefixes(spawn) -> None:
    node = spawn("-kvu", "-np", "4", "-c", "8192")
    node.wait_ready()
    system = f"[{uuid.uuid4().hex}] {SYSTEM}"
    with httpx.Client(base_url=node.base, timeout=120) as unified:
        props = unified.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 8192  # a slot may fill the shared cache
        first = ask(unified, system, "Who lit the lamp?", id_slot=0)
        assert first["timings"]["cache_n"] == 0
        # slot 2 gets the system prompt from slot 0 by tagging its cells (nothing is evaluated again) ...
        copied = ask(unified, system, "How many steps are there?", id_slot=2)
        assert copied["timings"]["cache_n"] >= SYSTEM_TOKENS_AT_LEAST
        assert copied["timings"]["prompt_n"] == copied["usage"]["prompt_tokens"] - copied["timings"]["cache_n"]
        # ... and slot 0's own sequence is untouched: its prompt again is all cached but the last token
        again = ask(unified, system, "Who lit the lamp?", id_slot=0)
        assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens"] - 1
        # texts are compared within this node, not with a split cache: where a sequence's cells sit in the
        # one buffer changes the kernels' rounding, so a near tie in greedy text may go either way
        assert text(again) and "steps" in text(copied).lower()


@pytest.mark.slow
def test_rope_scaling_extends_the_context_past_training(tmp_path) -> None:
    # SmolLM2 trained on 8192 tokens: one slot of 16384 only with a RoPE scale of 2 (YaRN: llama.cpp
    # stretches the training context to yarn_orig_ctx / rope_freq_scale; without it the slot is capped
    # at 8192, tests/test_kv_unified.py)
    node = ServerProcess(
        tmp_path / "yarn.log",
        "-np",
        "1",
        "-c",
        "16384",
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "2",
        "--yarn-orig-ctx",
        "8192",
        "--no-rpc-backend",
    )
    try:
        node.wait_ready()
        props = httpx.get(node.base + "/props", timeout=30).json()
        assert props["default_generation_settings"]["n_ctx"] == 16384
        r = httpx.post(
            node.base + "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        node.stop()


@pytest.mark.gpu
@pytest.mark.skipif(
    not CUDA, reason="llama-cpp-python here has no CUDA backend (no GPU on this machine): runs where dev.sh built one"
)
def test_a_gpu_node_offloads_everything_and_answers(spawn) -> None:
    node = spawn("-ngl", "all", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-np", "2", "-c", "4096")
    node.wait_ready()
    props = httpx.get(node.base + "/props", timeout=30).json()
    assert any(d["name"].startswith("CUDA") for d in props["devices"])
    r = httpx.post(
        node.base + "/v1/chat/completions",
        timeout=120,
        json={"messages": CAPITAL_QUESTION, "max_tokens": 16, "temperature": 0},
    )
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
    assert "no usable GPU" not in node.log()
