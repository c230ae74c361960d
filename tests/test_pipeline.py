"""PIPELINE_ATTACH: a dense model's upper layers on a compute-only peer over ggml-RPC."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing.hydra_wire import Wire

from .conftest import streaming, wait_for
from .test_combined import BODY, complete, info, peer_dies_mid_request, rpc_bytes

UPPER_HALF = r"blk\.(1[5-9]|2[0-9])\."  # SmolLM2-135M has 30 layers
# The head runs without flash attention (-fa off).  llama.cpp turns flash attention off by itself once a layer's
# attention weights are on the peer, since its KV cache stays here ("layer 15 is assigned to device CPU but Flash
# Attention is assigned to device RPC0 ... Flash Attention not supported, set to disabled"), so with the default
# (auto: on, on the CPU) the local text and the pipeline's would come from two attention kernels, and a near tie
# may fall otherwise in each (" 321" locally, " 311 million" over the peer, on an AVX2-only build).  With -fa off
# both are the same arithmetic: the same probabilities for each of the 48 tokens, on AVX2-only and AVX-512
# builds, so the texts are equal on any CPU.  (Repacking is no cause: on x86 llama.cpp repacks none of this
# model's weight types, Q4_1 and Q8_0.)
HEAD = ("-np", "1", "-c", "1024", "--no-rpc-backend", "-fa", "off")


def attach(port: int, body: dict) -> tuple[int, dict]:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.PIPELINE_ATTACH, payload=json.dumps(body).encode())
    return status, meta


def test_half_the_layers_on_a_peer_give_the_local_output(spawn) -> None:
    b = spawn("--no-model")
    b.wait_ready()
    a = spawn(*HEAD)
    a.wait_ready()
    local = complete(a.base)
    assert "flash attention off" in a.log()
    assert info(a.port)["pipeline_capable"] is True and info(a.port)["mode"] == "solo"

    uploaded = rpc_bytes(b.port)
    status, meta = attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": UPPER_HALF})
    assert status == Status.OK and meta["success"] is True and meta["mode"] == "pipeline", meta
    assert rpc_bytes(b.port) - uploaded > 30_000_000  # half the layers' weights went to B
    meta = info(a.port)
    assert meta["mode"] == "pipeline" and meta["layer_split"] == UPPER_HALF
    assert meta["peer_addr"] == f"127.0.0.1:{b.port}"
    metrics = httpx.get(a.base + "/metrics").text
    assert "hydra_trio:pipeline_mode 1.0" in metrics and 'hydra_trio:expert_mode{mode="pipeline"} 1.0' in metrics
    assert 'hydra_trio:expert_mode{mode="solo"} 0.0' in metrics and "hydra_trio:peer_reachable 1.0" in metrics

    before = rpc_bytes(b.port)
    assert complete(a.base) == local  # same greedy text, token for token
    assert rpc_bytes(b.port) - before > 100_000  # B computed the upper layers

    # a re-attach that cannot work (nothing matches) leaves the working attachment as it was
    status, meta = attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": "no_such_tensor"})
    assert status == Status.OK and meta["success"] is False and meta["mode"] == "pipeline"
    assert "matches" in meta["fallback_reason"], meta  # not "does not answer": this node is the peer's client
    assert info(a.port)["mode"] == "pipeline" and complete(a.base) == local
    # another split on the same peer (which serves one ggml-RPC client at a time: this node)
    status, meta = attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": r"blk\.2[0-9]\."})
    assert status == Status.OK and meta["success"] is True and meta["layer_split"] == r"blk\.2[0-9]\.", meta
    assert complete(a.base) == local
    status, meta = attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": "(?i)BLK"})
    assert status == Status.BAD_REQUEST and "std::regex" in meta["error"]  # llama.cpp would read it otherwise

    # a change while a stream runs: BUSY, nothing changes
    with streaming(a.base, {**BODY, "max_tokens": 400}):
        status, meta = attach(a.port, {"peer": ""})
        assert status == Status.BUSY and meta["busy_slots"] and meta["mode"] == "pipeline"
    # the closed stream's slot frees once the node has seen the client go and the engine's next step (a
    # step over ggml-RPC) has run: seconds on a busy machine
    wait_for(
        lambda: not any(s["is_processing"] for s in httpx.get(a.base + "/slots").json()),
        120,
        "the closed stream's slot free",
    )

    # detach: local again, same text
    status, meta = attach(a.port, {"peer": ""})
    assert status == Status.OK and meta["success"] is True and meta["mode"] == "solo"
    assert info(a.port)["mode"] == "solo" and complete(a.base) == local

    # an unreachable peer: stays local, says why
    status, meta = attach(a.port, {"peer": "127.0.0.1:1", "ot_split": UPPER_HALF})
    assert status == Status.OK and meta["success"] is False and meta["mode"] == "solo"
    assert "does not answer" in meta["fallback_reason"]
    status, meta = attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": "("})
    assert status == Status.BAD_REQUEST and "ot_split" in meta["error"]

    # the peer dies mid-request: that request fails with a clear error, the node goes local
    assert attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": UPPER_HALF})[1]["mode"] == "pipeline"
    reply = peer_dies_mid_request(a, b)
    assert reply.status_code == 500 and "died mid-request" in reply.json()["error"]["message"]
    wait_for(lambda: info(a.port)["mode"] == "solo", 30)
    assert complete(a.base) == local
    # llama.cpp keeps the broken connection: the same address is refused at once, saying why
    status, meta = attach(a.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": UPPER_HALF})
    assert status == Status.OK and meta["success"] is False and "broke mid-call" in meta["fallback_reason"]


def test_a_pipeline_peer_that_dies_between_requests_is_noticed(spawn) -> None:
    """The peer watchdog runs on a node started without --rpc-engine too."""
    c = spawn("--no-model")
    c.wait_ready()
    a = spawn("-np", "1", "-c", "1024", "--no-rpc-backend")
    a.wait_ready()
    local = complete(a.base)
    assert attach(a.port, {"peer": f"127.0.0.1:{c.port}", "ot_split": UPPER_HALF})[1]["mode"] == "pipeline"
    c.stop(signal.SIGKILL)
    wait_for(lambda: info(a.port)["mode"] == "solo", 90)
    meta = info(a.port)
    assert meta["peer_reachable"] is False and meta["fallback_reason"]
    assert complete(a.base) == local


@pytest.mark.slow
def test_drafts_compose_with_pipeline_mode(spawn) -> None:
    """A PIPELINE head verifies the drafts of its model-free types through the peer's layers in the same batch:
    the same greedy tokens as it gave locally, drafted and accepted.  A draft model (``draft-simple``) follows
    the local model it was built for, so once attached that head decodes without it (``/slots`` ``speculative``
    false, no ``draft_n``) and still gives its local tokens (docs/speculative.md)."""
    from .test_speculative import ALPHABET_BODY

    b = spawn("--no-model")
    b.wait_ready()
    free = spawn(*HEAD, "--spec-type", "ngram-simple,suffix")
    drafted = spawn(*HEAD, "--spec-type", "draft-simple", "-md", "smollm2-135m-q8")
    body = ALPHABET_BODY

    def run(node) -> dict:
        return httpx.post(node.base + "/completion", json=body, timeout=300).json()

    for node in (free, drafted):
        node.wait_ready(300)
        local = run(node)
        assert local["timings"]["draft_n_accepted"] > 0
        assert httpx.get(node.base + "/slots", timeout=30).json()[0]["speculative"] is True
        status, meta = attach(node.port, {"peer": f"127.0.0.1:{b.port}", "ot_split": UPPER_HALF})
        assert status == Status.OK and meta["mode"] == "pipeline", meta
        before = rpc_bytes(b.port)
        got = run(node)
        assert rpc_bytes(b.port) - before > 100_000  # B computed the upper layers
        assert got["tokens"] == local["tokens"] and got["content"] == local["content"]
        if node is free:
            assert got["timings"]["draft_n_accepted"] > 0
        else:
            assert "draft_n" not in got["timings"]
            assert httpx.get(node.base + "/slots", timeout=30).json()[0]["speculative"] is False
        # the peer serves one ggml-RPC client at a time: detach before the next head attaches
        assert attach(node.port, {"peer": ""})[1]["mode"] == "solo"
