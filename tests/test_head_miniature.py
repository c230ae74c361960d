"""The cluster's head in miniature: a hybrid (recurrent + attention) qwen35moe with one MTP layer and M-RoPE
(``tiny-mtp``) served with a vision projector of its width (``tiny-vision``'s Qwen2-VL merger) and
``--spec-type draft-mtp --spec-draft-n-max 3``, as llama-server serves it: the projector loads, speculative
decoding stays, and requests with an image draft too (``tools/server/server-context.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors hands a media chunk's embeddings to its drafters through
``mtmd_helper_decode_image_chunk``'s callback; its ``draft-mtp`` skips them).

A random-weight model's exact tokens depend on the kernels' arithmetic, so each test compares this node with
speculation against one without it on the same machine (greedy: the same token ids), and the slow test compares
it with llama-server on the same files.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hydra_trio.engine.kv.state import parse_header
from hydra_trio.models import tiny_vision
from hydra_trio.models.presets import PRESETS

from .conftest import ServerProcess

N_PREDICT = 16
SPEC = ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3")


def png(seed: int) -> str:
    return base64.b64encode(tiny_vision.png_image(seed)).decode()


def user(image: str, text: str) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
            {"type": "text", "text": text},
        ],
    }


def chat(base: str, messages: list[dict], n_predict: int = N_PREDICT, **extra: object) -> dict:
    body = {"messages": messages, "max_tokens": n_predict, "temperature": 0, "logprobs": True, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def ids(reply: dict) -> list[int]:
    """The greedy token ids of a chat reply (its logprob entries carry them)."""
    return [c["id"] for c in reply["choices"][0]["logprobs"]["content"]]


def node_args(slots: Path) -> tuple[str, ...]:
    mmproj = str(PRESETS["tiny-vision"].projector())
    return ("-m", "tiny-mtp", "--mmproj", mmproj, "-np", "2", "-c", "2048", "--slot-save-path", str(slots))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(the head in miniature with draft-mtp, the same node without --spec-type)."""
    d = tmp_path_factory.mktemp("head")
    (d / "slots").mkdir()
    spec = ServerProcess(d / "spec.log", *node_args(d / "slots"), "--no-rpc-backend", *SPEC)
    plain = ServerProcess(d / "plain.log", *node_args(d / "slots"), "--no-rpc-backend")
    with spec.serving(300), plain.serving(300):
        yield spec, plain


def test_the_projector_and_draft_mtp_both_stay(nodes) -> None:
    """``/props``: vision, and draft-mtp among the speculative types; every slot speculates (``/slots``); the
    log has no line dropping the drafter (llama-server keeps it with a projector)."""
    spec, _ = nodes
    props = httpx.get(spec.base + "/props", timeout=30).json()
    assert props["modalities"]["vision"] is True
    assert "draft-mtp" in props["default_generation_settings"]["params"]["speculative.types"].split(",")
    assert all(s["speculative"] is True for s in httpx.get(spec.base + "/slots", timeout=30).json())
    assert "not supported by multimodal" not in spec.log().split("ctx_shift")[0]


def test_an_image_request_drafts_and_gives_the_same_tokens(nodes) -> None:
    """A chat with an image drafts (``timings.draft_n`` > 0, some accepted) and its greedy tokens are those of
    the node without speculation; a text chat after it on the same node drafts too, with the same tokens."""
    spec, plain = nodes
    msgs = [user(png(1), "What is in the picture?")]
    got, want = chat(spec.base, msgs, id_slot=0), chat(plain.base, msgs, id_slot=0)
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert ids(got) == ids(want) and len(ids(got)) == N_PREDICT
    assert got["timings"]["draft_n"] > 0 and 0 < got["timings"]["draft_n_accepted"] <= got["timings"]["draft_n"]
    assert "draft_n" not in want["timings"]
    text = [{"role": "user", "content": "Tell me a short story about a cat."}]
    got, want = chat(spec.base, text, id_slot=1), chat(plain.base, text, id_slot=1)
    assert ids(got) == ids(want) and got["timings"]["draft_n"] > 0


def test_a_returning_conversation_with_its_image_is_served_from_the_checkpoints(nodes) -> None:
    """This hybrid model's memory cannot be cut back: a returning turn with the same image keeps its cached
    prefix, image and all, through the context checkpoint taken near the end of the first prompt
    (``cache_n`` > the image's end), with or without speculation alike, and the same tokens; the same turn
    with another image misses at the image (``cache_n`` below the first turn's prompt)."""
    spec, plain = nodes
    first = [user(png(1), "What is in the picture?")]
    results = {}
    for name, node in (("spec", spec), ("plain", plain)):
        one = chat(node.base, first, id_slot=0)
        back = first + [{"role": "assistant", "content": one["choices"][0]["message"]["content"]}]
        two = chat(node.base, [*back, user(png(1), "And this one?")], id_slot=0)
        other = [user(png(7), "What is in the picture?"), back[1]]
        three = chat(node.base, [*other, user(png(7), "And this one?")], id_slot=0)
        results[name] = (one, two, three)
    (one, two, three), (_, p_two, p_three) = results["spec"], results["plain"]
    n_first = one["usage"]["prompt_tokens"]
    assert two["timings"]["cache_n"] == p_two["timings"]["cache_n"]
    assert n_first - 8 <= two["timings"]["cache_n"] < n_first  # a checkpoint a few tokens before the prompt's end
    assert ids(two) == ids(p_two) and two["timings"]["draft_n"] > 0
    assert three["timings"]["cache_n"] == p_three["timings"]["cache_n"] < n_first - 12  # before the image's 12 cells
    assert ids(three) == ids(p_three)


def complete(base: str, prompt: str, image: str, n_predict: int, **extra: object) -> dict:
    body = {
        "prompt": {"prompt_string": prompt, "multimodal_data": [image]},
        "n_predict": n_predict,
        "temperature": 0,
        "return_tokens": True,
        **extra,
    }
    r = httpx.post(base + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_saved_slot_with_media_and_its_mtp_state_restores_and_decodes_on(nodes) -> None:
    """A slot that holds an image and its draft-mtp state, saved to a file (``?action=save``) and restored into
    the other slot (``?action=restore``), serves a prompt that goes on from it from its cache (every cached
    token: this memory cannot be cut back, and a restored slot has no checkpoints) and drafts on, with the
    tokens the node without speculation gives for the same requests."""
    spec, plain = nodes
    image = png(3)
    done = {}
    for name, node in (("spec", spec), ("plain", plain)):
        marker = httpx.get(node.base + "/props", timeout=30).json()["media_marker"]  # each process has its own
        first = f"Look at this: {marker} What is it?"
        one = complete(node.base, first, image, 1, id_slot=0)  # the slot holds the prompt (the token is not decoded)
        r = httpx.post(node.base + "/slots/0?action=save", json={"filename": f"{name}.bin"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(node.base + "/slots/1?action=restore", json={"filename": f"{name}.bin"}, timeout=60)
        assert r.status_code == 200, r.text
        done[name] = (one, complete(node.base, first + " Tell me more.", image, N_PREDICT, id_slot=1))
    header = parse_header((spec.log_path.parent / "slots" / "spec.bin").read_bytes())
    assert header.version == 5 and [(c.kind, c.n_tokens) for c in header.media] == [("image", 12)]
    assert header.extra_len > 0  # the slot's draft-mtp state (its MTP sequence) came along
    (one, got), (_, want) = done["spec"], done["plain"]
    assert got["timings"]["cache_n"] == want["timings"]["cache_n"] == one["tokens_evaluated"]
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == N_PREDICT
    assert got["timings"]["draft_n"] > 0


def test_draft_simple_reads_the_images_embeddings(spawn, nodes, tmp_path: Path) -> None:
    """``--spec-type draft-simple -md tiny-vision``: a draft model of the target's width (64) and M-RoPE layout
    decodes the image's embeddings at their positions (llama.cpp's ``draft-simple`` feeds a draft of the same
    width the target's media rows), drafts after the image, and the greedy tokens are the node's without
    speculation."""
    _, plain = nodes
    (tmp_path / "slots").mkdir()
    node = spawn(
        *node_args(tmp_path / "slots"), "--no-rpc-backend", "--spec-type", "draft-simple", "-md", "tiny-vision"
    )
    with node.serving(300):
        msgs = [user(png(1), "What is in the picture?")]
        got, want = chat(node.base, msgs, id_slot=0), chat(plain.base, msgs, id_slot=0)
        assert ids(got) == ids(want) and got["timings"]["draft_n"] > 0
        assert "do not fit the draft's input width" not in node.log()


def test_the_ngram_types_draft_on_media_slots_from_text_only(spawn, nodes, tmp_path: Path) -> None:
    """``--spec-type suffix`` (it learns from finished requests): the drafters take a media slot's tokens
    without its media cells, as llama-server hands them (``server_tokens::get_text_tokens``), so the same chat
    with an image twice answers 200 both times, the second drafts what the first generated, and
    both give the tokens of the node without speculation."""
    _, plain = nodes
    (tmp_path / "slots").mkdir()
    node = spawn(*node_args(tmp_path / "slots"), "--no-rpc-backend", "--spec-type", "suffix")
    with node.serving(300):
        msgs = [user(png(1), "What?")]
        want = chat(plain.base, msgs, id_slot=0)
        one, two = chat(node.base, msgs, id_slot=0), chat(node.base, msgs, id_slot=1)
        assert ids(one) == ids(two) == ids(want)
        assert two["timings"]["draft_n"] > 0 and two["timings"]["draft_n_accepted"] > 0


@pytest.mark.slow
def test_llama_server_on_the_same_files_agrees(nodes, tmp_path: Path) -> None:
    """llama-server built from the vendored llama.cpp, started as the cluster starts its head (``--mmproj``,
    ``--spec-type draft-mtp --spec-draft-n-max 3``), on the same files: the same prompt token count for a chat
    with an image, the same greedy tokens, drafting (``draft_n`` > 0) on it and on a text chat, and the
    returning turn with the same image served from its cache (``cache_n`` past the image) while another image
    misses at the image, as this node serves them."""
    from hydra_trio.models.presets import resolve_model

    from .test_tiny_vision import llama_server

    spec, _ = nodes
    model, _alias = resolve_model("tiny-mtp")
    mmproj = str(PRESETS["tiny-vision"].projector())
    args = ("-m", str(model), "--mmproj", mmproj, *SPEC, "-np", "2", "-c", "2048")
    first = [user(png(1), "What is in the picture?")]

    def turns(base: str) -> tuple[dict, dict, dict]:
        one = chat(base, first, id_slot=0)
        back = [*first, {"role": "assistant", "content": one["choices"][0]["message"]["content"]}]
        two = chat(base, [*back, user(png(1), "And this one?")], id_slot=0)
        other = [user(png(7), "What is in the picture?"), back[1]]
        return one, two, chat(base, [*other, user(png(7), "And this one?")], id_slot=0)

    ours = turns(spec.base)
    with llama_server(tmp_path, *args) as base:
        props = httpx.get(base + "/props", timeout=30).json()
        assert props["modalities"]["vision"] is True
        theirs = turns(base)
        text = [{"role": "user", "content": "Tell me a short story about a cat."}]
        assert chat(base, text, id_slot=1)["timings"]["draft_n"] > 0
    for a, b in zip(ours, theirs, strict=True):
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert ids(a) == ids(b)
        assert a["timings"]["draft_n"] > 0 and b["timings"]["draft_n"] > 0
    assert [t["timings"]["cache_n"] for t in ours] == [t["timings"]["cache_n"] for t in theirs]
    n_first = theirs[0]["usage"]["prompt_tokens"]
    assert n_first - 8 <= ours[1]["timings"]["cache_n"] < n_first  # a checkpoint near the first prompt's end
    assert ours[2]["timings"]["cache_n"] < n_first - 12  # another image: a miss at (or before) the image
