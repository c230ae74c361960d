"""Speculative decoding on real nodes started from the command line (``--spec-type``, llama-server's flags):
the replies, ``/slots``, ``/props``, ``/metrics`` and the Hydra protocol, against a node that does not
speculate.  Every comparison evaluates whole prompts (``cache_prompt`` false) so that both nodes compute the
same way up to the drafts (tests/test_speculative.py says why)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hydra_trio.protocol.hydra import DECODE_FLAG_PAD, Op, Status, unpack_decode_frames
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ServerProcess
from .test_speculative import ALPHABET

BODY = {
    "prompt": ALPHABET,
    "n_predict": 48,
    "temperature": 0,
    "ignore_eos": True,
    "cache_prompt": False,
    "return_tokens": True,
}


def complete(base: str, **kw: object) -> dict:
    r = httpx.post(base + "/completion", json={**BODY, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def decode_tokens(port: int, slot: int) -> list[int]:
    """A Hydra DECODE of the alphabet (a chat body with one user message), greedy: its token ids."""
    body = {
        "messages": [{"role": "user", "content": ALPHABET}],
        "n_predict": 32,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    with Wire(port) as w:
        status, meta, payload = w.call(Op.DECODE, key=str(slot), payload=json.dumps(body).encode())
    assert status == Status.OK, meta
    return [t for t, _, flags in unpack_decode_frames(payload) if not flags & DECODE_FLAG_PAD]


def spec_metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("llamacpp:spec_decode_num_") and "position" not in s.labels
    }


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("spec")
    plain = ServerProcess(d / "plain.log", "-np", "2", "--no-rpc-backend")
    spec = ServerProcess(
        d / "spec.log", "-np", "2", "--no-rpc-backend", "--spec-type", "suffix,ngram-mod", "--spec-draft-n-max", "8"
    )
    with plain.serving(180), spec.serving(180):
        yield plain, spec


def test_a_speculating_node_answers_as_one_that_does_not(nodes) -> None:
    plain, spec = nodes
    want, got = complete(plain.base), complete(spec.base)
    assert got["tokens"] == want["tokens"] and got["content"] == want["content"]
    assert "draft_n" not in want["timings"]  # llama-server's timings carry them once a token was drafted
    assert got["timings"]["draft_n"] > 0 and 0 < got["timings"]["draft_n_accepted"] <= got["timings"]["draft_n"]
    assert decode_tokens(spec.port, 1) == decode_tokens(plain.port, 1)


def test_slots_props_and_metrics_say_it_speculates(nodes) -> None:
    plain, spec = nodes
    before = spec_metrics(spec.base)
    got = complete(spec.base, n_predict=24)
    after = spec_metrics(spec.base)
    moved = {k: after[k] - before.get(k, 0) for k in after}
    assert moved["llamacpp:spec_decode_num_draft_tokens_total"] == got["timings"]["draft_n"]
    assert moved["llamacpp:spec_decode_num_accepted_tokens_total"] == got["timings"]["draft_n_accepted"]
    assert moved["llamacpp:spec_decode_num_drafts_total"] >= 1
    slots = httpx.get(spec.base + "/slots", timeout=30).json()
    assert all(s["speculative"] is True for s in slots)
    assert all(s["speculative"] is False for s in httpx.get(plain.base + "/slots", timeout=30).json())
    props = httpx.get(spec.base + "/props", timeout=30).json()
    assert props["default_generation_settings"]["params"]["speculative.types"] == "none,suffix,ngram-mod"
    assert "speculative decoding: suffix,ngram-mod" in spec.log()


@pytest.mark.slow
def test_draft_simple_with_a_draft_model_and_without_one(spawn) -> None:
    """``-md`` the default model's q8_0 (one vocabulary): the q4_1 target's own tokens; ``draft-simple``
    without ``-md`` starts too, as llama-server, logs why and serves without speculative decoding."""
    node = spawn("-np", "1", "--no-rpc-backend", "--spec-type", "draft-simple", "-md", "smollm2-135m-q8")
    bare = spawn("-np", "1", "--no-rpc-backend", "--spec-type", "draft-simple")
    plain = spawn("-np", "1", "--no-rpc-backend")
    for srv in (node, bare, plain):
        srv.wait_ready(300)
    want = complete(plain.base, n_predict=24)
    got = complete(node.base, n_predict=24)
    assert got["tokens"] == want["tokens"] and got["timings"]["draft_n_accepted"] > 0
    alone = complete(bare.base, n_predict=24)
    assert alone["tokens"] == want["tokens"] and "draft_n" not in alone["timings"]
    assert "failed to initialize speculative decoding context (draft-simple)" in bare.log()
    assert httpx.get(bare.base + "/slots", timeout=30).json()[0]["speculative"] is False
