"""Media in the engine, in-process on the generated ``tiny-vision`` pair (a ``qwen2vl`` language model, M-RoPE, and
its Qwen2-VL merger projector): a prompt tokenized with its image (``ModelView.tokenize_with_media``) runs on a slot
as llama-server runs it (``tools/server/server-context.cpp`` of the llama.cpp that llama-cpp-python 0.3.36
vendors): the image's chunk evaluated at the slot's position, the text after it at the position the image advanced
to, the prompt's tokens counting the image's embeddings; a cached prefix reaches through an identical image and
stops at a different one; a slot holding media is not saved into a state blob.

A tiny model's exact tokens depend on the kernels' arithmetic, so each test compares runs on this machine: the
engine against llama-cpp-python's own ``mtmd_helper_eval_chunks`` path (the same prompt, the same batch shapes),
or against itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from hydra_trio.engine import MEDIA_MARKER, MediaTokens
from hydra_trio.engine.engine import Engine
from hydra_trio.engine.requests import CompletionJob, Finished, JobRun
from hydra_trio.engine.settings import LlamaOptions, SamplingParams
from hydra_trio.engine.tasks import SaveSlot
from hydra_trio.errors import Cancelled, NotSupported
from hydra_trio.models import tiny_vision
from hydra_trio.models.presets import PRESETS, resolve_model

from .conftest import running_engine
from .test_tiny_vision import IMAGE_POS, IMAGE_TOKENS, N_PREDICT, Bindings, chat_prompt

GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class Item:
    """A media item as a front end hands it over: the file's bytes and an id (empty: the bytes' hash)."""

    data: bytes
    id: str = ""


@contextlib.asynccontextmanager
async def vision_engine(**config: Any) -> AsyncIterator[Engine]:
    """``tiny-vision`` with its projector: 2 slots of 2048 tokens (the bindings' n_ctx), n_batch 2048 (theirs:
    each text chunk is one decode, as there)."""
    opts = LlamaOptions(mmproj=str(PRESETS["tiny-vision"].projector()))
    async with running_engine(n_ctx=4096, model="tiny-vision", llama=opts, n_batch=2048, **config) as engine:
        yield engine


def prompt_with(engine: Engine, *seeds: int, question: str = "", size: tuple[int, int] = (112, 84)) -> MediaTokens:
    """The chat prompt with one image per seed (``png_image(seed, *size)``) before the question."""
    markers = MEDIA_MARKER * len(seeds)
    text = chat_prompt(markers)
    if question:
        text = text.replace("What is in the picture?", question)
    return engine.model.tokenize_with_media(text, [Item(tiny_vision.png_image(s, *size)) for s in seeds])


async def generate(engine: Engine, prompt: MediaTokens, **job: Any) -> tuple[list[int], Finished]:
    fields: dict[str, Any] = {"n_predict": N_PREDICT, "ignore_eos": True, "id_slot": 0, "sampling": GREEDY, **job}
    out: list[int] = []
    async with JobRun(engine, CompletionJob(prompt_tokens=prompt.tokens, media_chunks=prompt.chunks, **fields)) as run:
        async for delta in run:
            out.extend(delta.tokens)
        assert run.finished is not None
        return out, run.finished


@pytest.fixture(scope="module")
def bindings() -> Any:
    b = Bindings(resolve_model("tiny-vision")[0], PRESETS["tiny-vision"].projector())
    yield b
    b.close()


async def test_an_image_prompt_gives_the_bindings_greedy_tokens_and_counts_the_image_tokens(bindings) -> None:
    """The engine's greedy tokens for the image prompt are llama-cpp-python's ``mtmd_helper_eval_chunks`` path's
    (image chunk at the slot's position, text after it at ``n_past`` + the image's ``n_pos``), twice; the prompt
    counts the image's 12 embeddings (llama-server's ``usage.prompt_tokens``), positions only 4."""
    async with vision_engine() as engine:
        assert engine.model.modalities == {"vision": True, "audio": False}
        for seed in (1, 2):
            prompt = prompt_with(engine, seed)
            (chunk,) = prompt.chunks
            assert (chunk.n_tokens, chunk.n_pos, chunk.kind) == (IMAGE_TOKENS, IMAGE_POS, "image")
            assert prompt.n_pos == len(prompt.tokens) - IMAGE_TOKENS + IMAGE_POS
            want = bindings.greedy(tiny_vision.png_image(seed))
            for _ in range(2):
                tokens, done = await generate(engine, prompt, cache_prompt=False)
                assert tokens == want
                assert (done.n_prompt, done.prompt_n, done.cache_n) == (len(prompt.tokens), len(prompt.tokens), 0)
            # the slot's next position: the prompt's positions and the generated tokens decoded (the last one is not)
            assert engine.scheduler.slots[0].pos_next == prompt.n_pos + N_PREDICT - 1


async def test_the_same_image_is_a_cache_hit_and_another_image_a_miss_at_the_image() -> None:
    """A returning prompt with the same image reuses the cache past the image (all but its last token, as for
    text); another image (another id) reuses the text before it only, and gives other tokens; the id decides,
    not the bytes: the same pixels under another id miss too."""
    async with vision_engine() as engine:
        first = prompt_with(engine, 1)
        start = first.chunks[0].start
        tokens1, done = await generate(engine, first)
        assert done.cache_n == 0
        again, done = await generate(engine, prompt_with(engine, 1))
        assert again == tokens1
        assert done.cache_n == len(first.tokens) - 1 > first.chunks[0].end
        other, done = await generate(engine, prompt_with(engine, 2))
        assert done.cache_n == start and other != tokens1
        named = engine.model.tokenize_with_media(chat_prompt(MEDIA_MARKER), [Item(tiny_vision.png_image(2), "x")])
        _, done = await generate(engine, named)
        assert done.cache_n == start


async def test_two_slots_with_different_images_at_once_give_what_each_gives_alone() -> None:
    """Two requests with different images run at the same time (their text in one batch, each image on its
    slot's sequence); each gives the tokens it gives alone.  A third prompt with the first image and another
    question, on the other slot, copies the prefix through the image from the slot that holds it."""
    async with vision_engine() as engine:
        prompts = [prompt_with(engine, s, size=(448, 448)) for s in (1, 2)]
        alone = [(await generate(engine, p, cache_prompt=False))[0] for p in prompts]
        assert alone[0] != alone[1]
        together: list[list[int]] = [[], []]

        async def one(i: int) -> None:
            together[i] = (await generate(engine, prompts[i], id_slot=i, cache_prompt=False))[0]

        async with trio.open_nursery() as nursery:
            for i in (0, 1):
                nursery.start_soon(one, i)
        assert together == alone
        # slot 0 holds image 1's prompt; slot 1 holds image 2's: a question on image 1 on slot 1 copies slot 0's
        await generate(engine, prompts[0], id_slot=0)
        follow = prompt_with(engine, 1, question="And what colour is it?", size=(448, 448))
        tokens, done = await generate(engine, follow, id_slot=1)
        assert done.cache_n >= follow.chunks[0].end
        fresh, _ = await generate(engine, follow, id_slot=0, cache_prompt=False)
        assert tokens == fresh


async def test_a_slot_holding_media_is_not_saved() -> None:
    """STATE_GET, ``/slots?action=save`` and slot files of a slot whose KV cache holds an image are refused with
    NotSupported (HTTP 501, llama-server's ``not_supported_error`` status); so is a PREFILL snapshot of a prompt
    with media.  Once a text-only prompt cut the slot back before the image, it saves again."""
    async with vision_engine() as engine:
        prompt = prompt_with(engine, 1)
        await generate(engine, prompt)
        with pytest.raises(NotSupported, match="a slot holding media cannot be saved") as info:
            await engine.run_task(SaveSlot(0))
        assert info.value.http_status == 501
        with pytest.raises(NotSupported, match="a slot holding media cannot be saved"):
            engine.submit(
                CompletionJob(prompt_tokens=prompt.tokens, media_chunks=prompt.chunks, snapshot=True, n_predict=1)
            )
        text = engine.model.chat_prompt_tokens(chat_prompt("a picture"))
        async with JobRun(engine, CompletionJob(prompt_tokens=tuple(text), n_predict=2, id_slot=0)) as run:
            await run.result()
        n_past, blob = await engine.run_task(SaveSlot(0))
        assert n_past == len(text) + 2 - 1 and len(blob)


async def test_a_request_cancelled_during_its_images_leaves_whole_chunks() -> None:
    """A request cancelled while its three images are evaluated ends Cancelled between chunks: the slot keeps a
    prefix that ends off any image's inside, and the same prompt then gives what it gives evaluated afresh."""
    async with vision_engine() as engine:
        prompt = prompt_with(engine, 1, 2, 3, size=(448, 448))
        assert len(prompt.chunks) == 3
        run = JobRun(
            engine,
            CompletionJob(
                prompt_tokens=prompt.tokens,
                media_chunks=prompt.chunks,
                id_slot=0,
                n_predict=N_PREDICT,
                ignore_eos=True,
                sampling=GREEDY,
            ),
        ).submit()
        await run.started()
        run.close()
        with pytest.raises(Cancelled):
            await run.result()
        tokens, done = await generate(engine, prompt)
        bounds = {0, *(c.start for c in prompt.chunks), *(c.end for c in prompt.chunks)}
        assert done.cache_n < len(prompt.tokens)
        assert all(not c.start < done.cache_n < c.end for c in prompt.chunks), (done.cache_n, bounds)
        fresh, _ = await generate(engine, prompt, cache_prompt=False)
        assert tokens == fresh
