"""Media in the engine, in-process on the generated ``tiny-vision`` pair (a ``qwen2vl`` language model, M-RoPE, and
its Qwen2-VL merger projector): a prompt tokenized with its image (``ModelView.tokenize_with_media``) runs on a slot
as llama-server runs it (``tools/server/server-context.cpp`` of the llama.cpp that llama-cpp-python 0.3.36
vendors): the image's chunk evaluated at the slot's position, the text after it at the position the image advanced
to, the prompt's tokens counting the image's embeddings; a cached prefix reaches through an identical image and
stops at a different one; a slot holding media moves whole through a state blob (version 5: its media layout).

A tiny model's exact tokens depend on the kernels' arithmetic, so each test compares runs on this machine: the
engine against llama-cpp-python's own ``mtmd_helper_eval_chunks`` path (the same prompt, the same batch shapes),
or against itself.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from hydra_trio.engine import MEDIA_MARKER, MediaTokens
from hydra_trio.engine.engine import Engine
from hydra_trio.engine.kv.state import MediaLayoutError, blob_checksum, verify_checksum
from hydra_trio.engine.requests import CompletionJob, Finished, JobRun
from hydra_trio.engine.settings import LlamaOptions, SamplingParams
from hydra_trio.engine.tasks import RestoreSlot, SwapQuant
from hydra_trio.errors import Cancelled, InvalidRequest
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
        assert engine.model.modalities == {"vision": True, "video": True, "audio": False}
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


async def test_a_slot_holding_media_moves_whole_through_a_blob() -> None:
    """A PREFILL's saved state of a prompt with an image is a version 5 blob: the image's chunk (id, kind, start,
    n_tokens, n_pos) and its cells' placeholders.  Restored onto the other slot, that slot has the layout (its
    next position is the image's M-RoPE one, not its cell count), generates on as the prefilled slot does
    (greedy), and the same prompt returning there is a cache hit through the image.  SWAP_QUANT to the same file
    under another key keeps the slot, image and all, as it keeps a text slot."""
    path = resolve_model("tiny-vision")[0]
    async with vision_engine(quants=(("a", path, "tiny-vision"), ("b", path, "tiny-vision"))) as engine:
        prompt = prompt_with(engine, 1)
        (chunk,) = prompt.chunks
        async with JobRun(
            engine,
            CompletionJob(
                prompt_tokens=prompt.tokens,
                media_chunks=prompt.chunks,
                id_slot=0,
                n_predict=0,
                prompt_only=True,
                save_state=True,
            ),
        ) as run:
            done = await run.result()
        assert done.state is not None
        n_past, blob = done.state
        header = verify_checksum(blob)
        assert (n_past, header.version, header.n_tokens) == (len(prompt.tokens), 5, len(prompt.tokens))
        assert [(c.id, c.kind, c.start, c.n_tokens, c.n_pos) for c in header.media] == [
            (chunk.id, "image", chunk.start, IMAGE_TOKENS, IMAGE_POS)
        ]
        saved = bytes(blob.view())
        restored = await engine.run_task(RestoreSlot(1, bytearray(saved)))
        assert restored.n_past == len(prompt.tokens)
        slots = engine.scheduler.slots
        assert slots[1].cache_tokens == list(prompt.tokens) and slots[1].holds_media
        assert slots[1].pos_next == slots[0].pos_next == prompt.n_pos
        on = {}
        for id_slot in (0, 1):
            async with JobRun(
                engine,
                CompletionJob(
                    prompt_tokens=(),
                    continue_slot=True,
                    cache_prompt=True,
                    id_slot=id_slot,
                    n_predict=N_PREDICT,
                    ignore_eos=True,
                    sampling=GREEDY,
                ),
            ) as run:
                on[id_slot] = [t async for delta in run for t in delta.tokens]
        assert on[1] == on[0] and len(on[0]) == N_PREDICT
        # the image's prompt again on the restored slot: all of it from the cache but the last token
        await engine.run_task(RestoreSlot(1, bytearray(saved)))
        again, done = await generate(engine, prompt, id_slot=1)
        assert done.cache_n == len(prompt.tokens) - 1
        fresh, _ = await generate(engine, prompt, id_slot=0, cache_prompt=False)
        assert again == fresh
        # SWAP_QUANT: the slot keeps its tokens and its layout on the new model
        meta = await engine.run_task(SwapQuant("b"))
        assert meta["swapped"] and meta["kv_preserved"] and meta["slots_preserved"] == 2
        moved = engine.scheduler.slots[1]
        assert moved.holds_media and moved.n_past == len(prompt.tokens) + N_PREDICT - 1
        assert moved.pos_next == prompt.n_pos + N_PREDICT - 1


async def test_a_slot_ending_with_a_restored_image_refuses_to_generate_on_and_a_bad_layout_is_refused() -> None:
    """A blob whose tokens end with an image cannot give the first token of a continuation (that needs the
    image's last cell evaluated again, and a restored slot has its embeddings, not the picture): a continuation
    there is refused naming why, the slot untouched; a blob whose layout disagrees with its tokens is refused
    before the slot is touched."""
    async with vision_engine() as engine:
        whole = prompt_with(engine, 1)
        # the prompt up to the image's last cell (mtmd puts the projector's end-of-image token after it)
        prompt = attrs.evolve(whole, tokens=whole.tokens[: whole.chunks[0].end])
        async with JobRun(
            engine,
            CompletionJob(
                prompt_tokens=prompt.tokens,
                media_chunks=prompt.chunks,
                id_slot=0,
                n_predict=0,
                prompt_only=True,
                save_state=True,
            ),
        ) as run:
            done = await run.result()
        assert done.state is not None
        saved = bytes(done.state[1].view())
        assert (await engine.run_task(RestoreSlot(1, bytearray(saved)))).n_past == len(prompt.tokens)
        async with JobRun(
            engine,
            CompletionJob(
                prompt_tokens=(), continue_slot=True, cache_prompt=True, id_slot=1, n_predict=2, sampling=GREEDY
            ),
        ) as run:
            with pytest.raises(InvalidRequest, match=r"ends with media \(image\) restored from a state blob"):
                await run.result()
        assert engine.scheduler.slots[1].cache_tokens == list(prompt.tokens)
        # the last placeholder changed (checksum made good): refused, slot 1 as it was
        bad = bytearray(saved)
        header = verify_checksum(bad)
        struct.pack_into("<i", bad, header.tokens_at + 4 * (header.n_tokens - 1), -5)
        struct.pack_into("<Q", bad, 52, blob_checksum(bad))
        with pytest.raises(MediaLayoutError, match=f"token {header.n_tokens - 1} is -5, not the placeholder"):
            await engine.run_task(RestoreSlot(1, bad))
        assert engine.scheduler.slots[1].cache_tokens == list(prompt.tokens)
        assert engine.scheduler.slots[1].holds_media


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
