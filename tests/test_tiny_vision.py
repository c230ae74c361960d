"""The generated vision-language model ``tiny-vision`` (:mod:`hydra_trio.models.tiny_vision`) on the real libraries:
llama-cpp-python's ``mtmd`` bindings load its projector with its language model, tokenize a prompt with an image
into chunks, evaluate them and decode greedily; llama-server built from the same vendored llama.cpp serves the
same files and answers a chat completion with an image with the same prompt tokens and the same greedy tokens.

A tiny model's exact words depend on the kernels' arithmetic, so no test names a token: each compares two runs
on the same machine (the same image twice, another image, the bindings against llama-server).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest

from hydra_trio.engine.llama.model import init_backend
from hydra_trio.models import tiny_vision
from hydra_trio.models.presets import PRESETS, resolve_model
from hydra_trio.testing.spawn import SHARED_MACHINE_ENV, wait_healthy

from .conftest import ROOT, free_port

N_CTX = 2048
N_BATCH = 2048  # llama-server's default n_batch: a text chunk or an image is decoded in pieces of at most this
N_PREDICT = 8
QUESTION = "What is in the picture?"
IMAGE_W, IMAGE_H = 112, 84
IMAGE_TOKENS = (IMAGE_W // 28) * (IMAGE_H // 28)  # one embedding per 2 x 2 patches of 14 pixels: 4 x 3
IMAGE_POS = max(IMAGE_W, IMAGE_H) // 28  # M-RoPE: an image advances the position by its larger side in cells


def chat_prompt(marker: str) -> str:
    """The prompt llama-server renders from one user message whose content parts are the image then
    :data:`QUESTION` (``tools/server/server-common.cpp`` turns the image part into its media marker;
    ``common/chat.cpp`` joins the parts with no newline after a marker), with SmolLM2's chat template, which
    adds its default system message, and the generation prompt."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{marker}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )


@llama_cpp.llama_log_callback
def _quiet(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    """mtmd's and clip's log lines (one per tensor at load) are not wanted in the test output."""


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    """``tiny-vision`` as ``-m tiny-vision`` finds it: the language model and, beside it, its projector."""
    model, alias = resolve_model("tiny-vision")
    assert alias == "tiny-vision"
    return model, PRESETS["tiny-vision"].projector()


class Bindings:
    """The language model and an ``mtmd`` context on its projector, loaded through llama-cpp-python."""

    def __init__(self, model: Path, mmproj: Path) -> None:
        init_backend()
        mtmd.mtmd_log_set(_quiet, None)
        mtmd.mtmd_helper_log_set(_quiet, None)
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(model).encode(), mparams)
        assert self.model, model
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        cparams = mtmd.mtmd_context_params_default()
        cparams.use_gpu = False
        cparams.n_threads = 2
        self.ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), self.model, cparams)
        assert self.ctx, mmproj

    def close(self) -> None:
        mtmd.mtmd_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    @contextlib.contextmanager
    def chunks(self, prompt: str, png: bytes) -> Iterator[int]:
        """``prompt`` with its media marker tokenized with one image (special tokens parsed, as llama-server
        does); yields the ``mtmd_input_chunks`` pointer."""
        buf = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(png), False)
        assert bitmap
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            text = prompt.encode()
            inp = mtmd.mtmd_input_text(text, len(text), True, True)
            rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
            assert rc == 0
            yield chunks
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def layout(self, chunks: int) -> list[tuple[int, int, int, list[int]]]:
        """Each chunk as ``(type, n_tokens, n_pos, text tokens)``."""
        out = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            tokens: list[int] = []
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                arr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens = [arr[j] for j in range(n.value)]
            out.append(
                (kind, mtmd.mtmd_input_chunk_get_n_tokens(chunk), mtmd.mtmd_input_chunk_get_n_pos(chunk), tokens)
            )
        return out

    def greedy(self, png: bytes, n_predict: int = N_PREDICT) -> list[int]:
        """The prompt with ``png`` evaluated by ``mtmd_helper_eval_chunks`` into a fresh context (llama-server's
        n_ctx of one slot and n_batch), then ``n_predict`` greedy tokens, each decoded at the next position."""
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch = N_CTX, N_BATCH
        cparams.n_threads = cparams.n_threads_batch = 2
        lctx = llama_cpp.llama_init_from_model(self.model, cparams)
        assert lctx
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        try:
            with self.chunks(chat_prompt(mtmd.mtmd_default_marker().decode()), png) as chunks:
                n_past = llama_cpp.llama_pos(0)
                rc = mtmd.mtmd_helper_eval_chunks(self.ctx, lctx, chunks, 0, 0, N_BATCH, True, ctypes.byref(n_past))
                assert rc == 0
                assert n_past.value == mtmd.mtmd_helper_get_n_pos(chunks)
            out: list[int] = []
            for _ in range(n_predict):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,))
                token = int(np.argmax(logits))
                out.append(token)
                if llama_cpp.llama_vocab_is_eog(self.vocab, token):
                    break
                batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(token), 1)
                assert llama_cpp.llama_decode(lctx, batch) == 0
            return out
        finally:
            llama_cpp.llama_free(lctx)

    def piece_bytes(self, tokens: list[int]) -> bytes:
        """The tokens' bytes as llama-server sends them: each piece without special tokens' text, joined."""
        buf = ctypes.create_string_buffer(256)
        pieces = b""
        for t in tokens:
            n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, False)
            assert n >= 0
            pieces += buf.raw[:n]
        return pieces


@pytest.fixture(scope="module")
def bindings(pair: tuple[Path, Path]) -> Iterator[Bindings]:
    b = Bindings(*pair)
    yield b
    b.close()


# --------------------------------------------------------------------------- the files


def test_preset_makes_the_pair_side_by_side_and_the_cli_writes_the_same_files(pair, tmp_path: Path) -> None:
    """``tiny-vision`` is a ``qwen2vl`` language model (M-RoPE sections, SmolLM2's vocabulary plus the two
    image control tokens) with a ``qwen2vl_merger`` projector beside it; ``python -m
    hydra_trio.models tiny-vision DIR`` writes the same bytes (fixed seed) for ``-m FILE --mmproj FILE``."""
    import gguf

    model, mmproj = pair
    assert mmproj.parent == model.parent and (model, mmproj) == tiny_vision.default_paths()
    lm = gguf.GGUFReader(str(model))
    assert lm.fields["general.architecture"].contents() == "qwen2vl"
    assert lm.fields["qwen2vl.rope.dimension_sections"].contents() == tiny_vision.ROPE_SECTIONS
    tokens = lm.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[-2:] == list(tiny_vision.IMAGE_TOKENS)
    assert lm.fields["tokenizer.ggml.token_type"].contents()[-2:] == [gguf.TokenType.CONTROL] * 2
    proj = gguf.GGUFReader(str(mmproj))
    assert proj.fields["general.architecture"].contents() == "clip"
    assert proj.fields["clip.projector_type"].contents() == "qwen2vl_merger"
    assert proj.fields["clip.vision.projection_dim"].contents() == lm.fields["qwen2vl.embedding_length"].contents()

    cli_writes_the_cached_pair("tiny-vision", tmp_path, pair)


# --------------------------------------------------------------------------- llama-cpp-python's mtmd


def test_bindings_load_the_projector_and_tokenize_an_image_into_chunks(bindings: Bindings) -> None:
    """clip loads the projector for the language model (their widths agree, or mtmd refuses); the model
    decodes with M-RoPE; the prompt splits into text, image, text, the image framed by ``<|vision_start|>`` and
    ``<|vision_end|>`` as single tokens; a 112 x 84 image is 4 x 3 embeddings over 4 positions."""
    assert mtmd.mtmd_support_vision(bindings.ctx) and not mtmd.mtmd_support_audio(bindings.ctx)
    assert mtmd.mtmd_decode_use_mrope(bindings.ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(bindings.vocab)
    start, end = n_vocab - 2, n_vocab - 1
    prompt = chat_prompt(mtmd.mtmd_default_marker().decode())
    with bindings.chunks(prompt, tiny_vision.png_image(1, IMAGE_W, IMAGE_H)) as chunks:
        layout = bindings.layout(chunks)
        kinds = [k for k, *_ in layout]
        assert kinds == [
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT,
            mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE,
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT,
        ]
        (_, n_before, _, before), (_, n_image, n_pos, _), (_, n_after, _, after) = layout
        assert before[-1] == start and after[0] == end
        assert start not in before[:-1] and end not in after[1:]
        assert (n_image, n_pos) == (IMAGE_TOKENS, IMAGE_POS)
        assert mtmd.mtmd_helper_get_n_tokens(chunks) == n_before + IMAGE_TOKENS + n_after
        assert mtmd.mtmd_helper_get_n_pos(chunks) == n_before + IMAGE_POS + n_after
    with bindings.chunks(prompt, tiny_vision.png_image(1, 224, 224)) as chunks:
        assert bindings.layout(chunks)[1][1:3] == (64, 8)  # 8 x 8 cells
    with bindings.chunks(prompt, tiny_vision.png_image(1, 28, 28)) as chunks:
        assert bindings.layout(chunks)[1][1:3] == (9, 3)  # scaled up to Qwen-VL's minimum of 8 cells: 3 x 3


def test_bindings_greedy_text_is_deterministic_and_depends_on_the_image(bindings: Bindings) -> None:
    """The same image twice gives the same greedy tokens; two other images each give other tokens."""
    first = bindings.greedy(tiny_vision.png_image(1))
    assert len(first) == N_PREDICT
    assert bindings.greedy(tiny_vision.png_image(1)) == first
    assert bindings.greedy(tiny_vision.png_image(2)) != first
    assert bindings.greedy(tiny_vision.png_image(3)) != first


# --------------------------------------------------------------------------- llama-server


def llama_server_binary() -> Path:
    """llama-server built from the vendored llama.cpp by ``bench/build_llama_server.sh`` (about 10 minutes on 2
    cores the first time, cached afterwards)."""
    out = subprocess.run([str(ROOT / "bench" / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def llama_server(tmp_path: Path, *args: str) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "llama-server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [str(llama_server_binary()), "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SHARED_MACHINE_ENV},
        )
    try:
        try:
            wait_healthy(port, proc, timeout=300)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}:\n{log.read_text(errors='replace')[-4000:]}") from None
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_llama_server_serves_the_pair_with_the_bindings_tokens(pair, bindings: Bindings, tmp_path: Path) -> None:
    """llama-server (``-m LM --mmproj PROJ``) answers a chat completion whose user message is an image (a
    base64 PNG ``data:`` URL) and a question: 200, ``usage.prompt_tokens`` counting the image's embeddings
    (llama-server counts an image chunk by its tokens, not its positions), and the greedy tokens and text the
    bindings give for the same prompt; another image, other tokens."""
    model, mmproj = pair

    def ask(png: bytes, client: httpx.Client) -> dict:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        body = {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}],
                }
            ],
            "max_tokens": N_PREDICT,
            "temperature": 0,
            "logprobs": True,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    with bindings.chunks(chat_prompt(mtmd.mtmd_default_marker().decode()), tiny_vision.png_image(1)) as chunks:
        n_prompt = mtmd.mtmd_helper_get_n_tokens(chunks)
    with (
        llama_server(
            tmp_path, "-m", str(model), "--mmproj", str(mmproj), "-c", str(N_CTX), "-np", "1", "-t", "2", "--no-webui"
        ) as base,
        httpx.Client(base_url=base, timeout=300) as client,
    ):
        props = client.get("/props").json()
        assert props["modalities"]["vision"] is True and props["modalities"]["audio"] is False
        for seed in (1, 2):
            png = tiny_vision.png_image(seed)
            tokens = bindings.greedy(png)
            reply = ask(png, client)
            assert reply["usage"]["prompt_tokens"] == n_prompt, json.dumps(reply["usage"])
            # the second request reuses the text before the image from the first one's cache
            assert reply["timings"]["prompt_n"] + reply["timings"]["cache_n"] == n_prompt
            assert reply["usage"]["completion_tokens"] == len(tokens) == N_PREDICT
            # llama-server reports a token whose bytes end inside a UTF-8 character together with the next one
            # (one logprobs entry, the later id): compare the bytes, and the text with the same replacements
            raw = bindings.piece_bytes(tokens)
            assert b"".join(bytes(t["bytes"]) for t in reply["choices"][0]["logprobs"]["content"]) == raw
            assert {t["id"] for t in reply["choices"][0]["logprobs"]["content"]} <= set(tokens)
            assert reply["choices"][0]["message"]["content"] == raw.decode("utf-8", "replace")


def cli_writes_the_cached_pair(name: str, out_dir: Path, pair: tuple[Path, Path]) -> None:
    """``python -m hydra_trio.models NAME OUT_DIR`` writes the preset's model and projector under their cached
    names, byte for byte the cached ``pair``, and prints their paths."""
    out = subprocess.run(
        [sys.executable, "-m", "hydra_trio.models", name, str(out_dir)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    written = [Path(line) for line in out.stdout.split()]
    assert written == [out_dir / p.name for p in pair]
    for mine, cached in zip(written, pair, strict=True):
        assert hashlib.sha256(mine.read_bytes()).digest() == hashlib.sha256(cached.read_bytes()).digest()
