"""The generated audio-language model ``tiny-audio`` (:mod:`hydra_trio.models.tiny_audio`) end to end: llama-cpp-
python's ``mtmd`` bindings load its Qwen2-Audio projector with its language model and tokenize a prompt with a WAV
clip into chunks; a node started with ``-m tiny-audio`` answers chats with an ``input_audio`` part on real sockets
(the clip's embeddings counted, the same greedy text twice, the slot's cache hit through the same clip and missed
at another); llama-server built from the same vendored llama.cpp gives the same prompt tokens and greedy text.

A tiny model's exact words depend on the kernels' arithmetic, so no test names a token: each compares two runs on
the same machine (the same clip twice, another clip, the node against the bindings and llama-server).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import pytest

from hydra_trio.models import tiny_audio
from hydra_trio.models.presets import PRESETS, resolve_model

from .conftest import ServerProcess
from .test_tiny_vision import (
    N_CTX,
    N_PREDICT,
    QUESTION,
    Bindings,
    chat_prompt,
    cli_writes_the_cached_pair,
    llama_server,
)

CLIP = tiny_audio.wav_clip(1)
"""1 s: one 30 s window, 750 embeddings."""
OTHER = tiny_audio.wav_clip(2, 5.0)
"""Another pitch and noise, 5 s: also one window, so as many embeddings; a different greedy text."""
NOT_SUPPORTED = "{} input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
"""llama-server's error for a media part the projector does not take: HTTP 500, ``server_error``
(``oaicompat_content_load_media`` in ``tools/server/server-common.cpp``)."""


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    """``tiny-audio`` as ``-m tiny-audio`` finds it: the language model and, beside it, its projector."""
    model, alias = resolve_model("tiny-audio")
    assert alias == "tiny-audio"
    return model, PRESETS["tiny-audio"].projector()


@pytest.fixture(scope="module")
def bindings(pair: tuple[Path, Path]) -> Iterator[Bindings]:
    b = Bindings(*pair)
    yield b
    b.close()


def audio_chat(wav: bytes, **extra) -> dict:
    """One user message: the clip (base64 WAV, as OpenAI's ``input_audio``) then :data:`QUESTION`."""
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    content = [part, {"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": N_PREDICT, "temperature": 0, **extra}


# --------------------------------------------------------------------------- the files


def test_preset_makes_the_pair_side_by_side_and_the_cli_writes_the_same_files(pair, tmp_path: Path) -> None:
    """``tiny-audio`` is a ``qwen2`` language model (no M-RoPE; SmolLM2's vocabulary plus the two audio control
    tokens) with a ``qwen2a`` projector beside it, an audio encoder only, projecting to the language model's
    width; ``python -m hydra_trio.models tiny-audio DIR`` writes the same bytes (fixed seed)."""
    import gguf

    model, mmproj = pair
    assert mmproj.parent == model.parent and (model, mmproj) == tiny_audio.default_paths()
    lm = gguf.GGUFReader(str(model))
    assert lm.fields["general.architecture"].contents() == "qwen2"
    assert "qwen2.rope.dimension_sections" not in lm.fields
    assert lm.fields["tokenizer.ggml.tokens"].contents()[-2:] == list(tiny_audio.AUDIO_TOKENS)
    assert lm.fields["tokenizer.ggml.token_type"].contents()[-2:] == [gguf.TokenType.CONTROL] * 2
    proj = gguf.GGUFReader(str(mmproj))
    assert proj.fields["general.architecture"].contents() == "clip"
    assert proj.fields["clip.projector_type"].contents() == "qwen2a"
    assert proj.fields["clip.has_audio_encoder"].contents() is True
    assert "clip.has_vision_encoder" not in proj.fields
    assert proj.fields["clip.audio.projection_dim"].contents() == lm.fields["qwen2.embedding_length"].contents()

    cli_writes_the_cached_pair("tiny-audio", tmp_path, pair)


def test_wav_clip_is_16khz_mono_pcm16() -> None:
    """The test clips: RIFF/WAVE (what mtmd's ``is_audio_file`` looks for), 16 kHz, mono, 16-bit, ``seconds``
    long, a fixed seed's bytes."""
    import wave
    from io import BytesIO

    with wave.open(BytesIO(CLIP)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16000, 1, 2, 16000)
    assert CLIP[:4] == b"RIFF" and CLIP[8:12] == b"WAVE"
    assert tiny_audio.wav_clip(1) == CLIP != tiny_audio.wav_clip(2)


# --------------------------------------------------------------------------- llama-cpp-python's mtmd


def test_bindings_load_the_projector_and_tokenize_a_clip_into_chunks(bindings: Bindings) -> None:
    """clip loads the projector for the language model (their widths agree, or mtmd refuses): audio, no vision,
    no M-RoPE; the prompt splits into text, audio, text, the clip framed by ``<|audio_bos|>`` and ``<|audio_eos|>``
    as single tokens; a clip of up to 30 s is one window of 750 embeddings over 750 positions, 31 s two windows,
    two audio chunks in a row."""
    assert mtmd.mtmd_support_audio(bindings.ctx) and not mtmd.mtmd_support_vision(bindings.ctx)
    assert not mtmd.mtmd_decode_use_mrope(bindings.ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(bindings.vocab)
    bos, eos = n_vocab - 2, n_vocab - 1
    prompt = chat_prompt(mtmd.mtmd_default_marker().decode())
    with bindings.chunks(prompt, CLIP) as chunks:
        layout = bindings.layout(chunks)
        assert [k for k, *_ in layout] == [
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT,
            mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO,
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT,
        ]
        (_, n_before, _, before), (_, n_clip, n_pos, _), (_, n_after, _, after) = layout
        assert before[-1] == bos and after[0] == eos
        assert (n_clip, n_pos) == (tiny_audio.CLIP_TOKENS, tiny_audio.CLIP_TOKENS) == (750, 750)
        assert mtmd.mtmd_helper_get_n_tokens(chunks) == mtmd.mtmd_helper_get_n_pos(chunks)
        assert mtmd.mtmd_helper_get_n_tokens(chunks) == n_before + 750 + n_after
    with bindings.chunks(prompt, OTHER) as chunks:
        assert bindings.layout(chunks)[1][1:3] == (750, 750)
    with bindings.chunks(prompt, tiny_audio.wav_clip(3, 31.0)) as chunks:
        layout = bindings.layout(chunks)
        assert [(k, n) for k, n, _, _ in layout[1:-1]] == [(mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO, 750)] * 2  # a window each


def test_bindings_greedy_text_is_deterministic_and_depends_on_the_clip(bindings: Bindings) -> None:
    """The same clip twice gives the same greedy tokens; the other clip other tokens."""
    first = bindings.greedy(CLIP)
    assert len(first) == N_PREDICT
    assert bindings.greedy(CLIP) == first
    assert bindings.greedy(OTHER) != first


# --------------------------------------------------------------------------- the node, on real sockets


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """``-m tiny-audio`` (its projector by ``--mmproj-auto``, the default), one slot of llama-server's defaults
    for the comparison: n_ctx :data:`N_CTX`, n_batch 2048."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("audio") / "server.log", "-m", "tiny-audio", "-np", "1", "-c", str(N_CTX), "-t", "2"
    )
    with srv.serving(timeout=300), httpx.Client(base_url=srv.base, timeout=300) as client:
        yield client


def test_node_reports_audio_and_serves_a_clip_with_the_cache(node: httpx.Client, bindings: Bindings) -> None:
    """``/props`` ``modalities``: audio only (the projector's encoders, as llama-server's ``get_res_props``; no
    vision encoder, so no video: a video part is llama-server's 500 ``video input is not supported``).  A
    chat with an ``input_audio`` part: 200, ``usage.prompt_tokens`` the bindings' count of the same prompt (the
    clip's 750 embeddings and its two framing tokens counted, as llama-server counts a media chunk's tokens) and
    the bindings' greedy text; the same request again: the same text, all the prompt from the slot's cache but its
    last token (the clip matched by its hash); the other clip: a miss from the clip on (``cache_n`` = the tokens
    before it) and another text."""
    assert node.get("/props").json()["modalities"] == {"vision": False, "video": False, "audio": True}
    video = {"type": "input_video", "input_video": {"data": "QUJD"}}  # no vision encoder: no video either
    r = node.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [video]}]})
    assert r.status_code == 500 and r.json()["error"]["message"].startswith("video input is not supported")
    prompt = chat_prompt(mtmd.mtmd_default_marker().decode())
    with bindings.chunks(prompt, CLIP) as chunks:
        n_prompt = mtmd.mtmd_helper_get_n_tokens(chunks)
        n_before = bindings.layout(chunks)[0][1]

    first = node.post("/v1/chat/completions", json=audio_chat(CLIP, cache_prompt=False))
    assert first.status_code == 200, first.text
    j = first.json()
    assert j["usage"]["prompt_tokens"] == n_prompt == j["timings"]["prompt_n"], j["usage"]
    assert j["usage"]["completion_tokens"] == N_PREDICT
    text = j["choices"][0]["message"]["content"]
    assert text == bindings.piece_bytes(bindings.greedy(CLIP)).decode("utf-8", "replace")

    again = node.post("/v1/chat/completions", json=audio_chat(CLIP)).json()
    assert again["choices"][0]["message"]["content"] == text
    assert again["usage"]["prompt_tokens"] == n_prompt
    assert again["timings"]["cache_n"] == n_prompt - 1, again["timings"]

    other = node.post("/v1/chat/completions", json=audio_chat(OTHER)).json()
    assert other["usage"]["prompt_tokens"] == n_prompt
    assert other["timings"]["cache_n"] == n_before, other["timings"]  # up to <|audio_bos|>, not into the clip
    assert other["choices"][0]["message"]["content"] != text


def test_an_image_on_the_audio_projector_is_llama_servers_500(node: httpx.Client) -> None:
    """An image part on a projector without a vision encoder: llama-server's 500 ``image input is not
    supported - hint: ...`` (``server_error``), for a chat and ``/apply-template``; the node stays up."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    for path in ("/v1/chat/completions", "/apply-template"):
        r = node.post(path, json=body)
        assert r.status_code == 500, r.text
        assert r.json()["error"] == {"code": 500, "message": NOT_SUPPORTED.format("image"), "type": "server_error"}
    assert node.get("/health").status_code == 200


# --------------------------------------------------------------------------- llama-server


@pytest.mark.slow
def test_llama_server_serves_the_pair_with_the_nodes_tokens(pair, node: httpx.Client, tmp_path: Path) -> None:
    """llama-server (``-m LM --mmproj PROJ``) reports audio in ``/props`` and answers the same chats with the
    node's ``usage.prompt_tokens`` (the clip's embeddings counted alike) and the node's greedy text, for both
    clips; an image part is its 500."""
    model, mmproj = pair
    with (
        llama_server(
            tmp_path, "-m", str(model), "--mmproj", str(mmproj), "-c", str(N_CTX), "-np", "1", "-t", "2", "--no-webui"
        ) as base,
        httpx.Client(base_url=base, timeout=300) as ls,
    ):
        props = ls.get("/props").json()
        assert props["modalities"]["audio"] is True and props["modalities"]["vision"] is False
        for wav in (CLIP, OTHER):
            theirs = ls.post("/v1/chat/completions", json=audio_chat(wav))
            assert theirs.status_code == 200, theirs.text
            mine = node.post("/v1/chat/completions", json=audio_chat(wav)).json()
            assert theirs.json()["usage"]["prompt_tokens"] == mine["usage"]["prompt_tokens"]
            assert theirs.json()["usage"]["completion_tokens"] == mine["usage"]["completion_tokens"] == N_PREDICT
            assert theirs.json()["choices"][0]["message"]["content"] == mine["choices"][0]["message"]["content"]
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}
        r = ls.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 500 and r.json()["error"]["message"] == NOT_SUPPORTED.format("image")
