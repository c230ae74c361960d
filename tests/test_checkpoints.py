"""Context checkpoints on the generated hybrid model (LFM2 layout: short convolutions + attention).

Its memory cannot be cut back to a shorter prefix, so without checkpoints a
prompt that diverges from a slot's cache is evaluated whole; with them the
slot resumes from the latest checkpoint at or before the common prefix
(llama-server's ``--ctx-checkpoints``).  Random weights give nonsense text,
but greedy output is deterministic: a continuation after a restore must
equal a fresh evaluation token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import pytest

from hydra_trio.models.presets import resolve_model

from .conftest import ServerProcess

DOC = " ".join(f"Item {i} of the list is worth a note;" for i in range(50))


def _server(tmp: Path, model: Path, *args: str) -> Iterator[ServerProcess]:
    with ServerProcess(tmp / "server.log", "-m", str(model), "-c", "4096", *args).serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path) -> Iterator[ServerProcess]:
    """The hybrid on one slot, default checkpoints (32, min step 8192) and batch (512)."""
    yield from _server(tmp_path_factory.mktemp("hybrid"), hybrid_model, "-np", "1")


@pytest.fixture(scope="module")
def hybrid_nockpt(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path) -> Iterator[ServerProcess]:
    """The hybrid on one slot with ``--ctx-checkpoints 0``: the behaviour before checkpoints."""
    yield from _server(tmp_path_factory.mktemp("nockpt"), hybrid_model, "-np", "1", "--ctx-checkpoints", "0")


TOL = 1e-2
"""Log-probabilities of a restored and a fresh evaluation agree within this: other batch splits round
differently (F16 KV cache; up to 1.5e-3 measured), while a wrong recurrent state (another slot's, given by
the cross-slot copy this node no longer makes for such models) moved them by 0.076."""


class Reply:
    """A greedy completion's text, timings, usage and per-token log-probabilities."""

    def __init__(self, j: dict) -> None:
        choice = j["choices"][0]
        self.timings, self.usage = j["timings"], j["usage"]
        if "message" in choice:
            self.text = choice["message"]["content"]
            self.logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
        else:
            self.text = choice["text"]
            self.logprobs = choice["logprobs"]["token_logprobs"]

    def same_as(self, fresh: Reply) -> bool:
        """Token for token the same text, log-probabilities within :data:`TOL`."""
        return (
            self.text == fresh.text
            and len(self.logprobs) == len(fresh.logprobs) > 0
            and max(abs(a - b) for a, b in zip(self.logprobs, fresh.logprobs, strict=False)) < TOL
        )


def _chat(base: str, messages: list[dict], **extra) -> Reply:
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "logprobs": True, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return Reply(r.json())


def _complete(base: str, prompt: list[int], **extra) -> Reply:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1, **extra}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return Reply(r.json())


def test_generated_hybrid_is_an_lfm2_with_the_default_models_tokenizer(hybrid_model: Path) -> None:
    reader = gguf.GGUFReader(str(hybrid_model))
    assert reader.fields["general.architecture"].contents() == "lfm2"
    assert reader.fields["lfm2.attention.head_count_kv"].contents() == [0, 2, 0, 2]  # conv, attn, conv, attn
    names = {t.name for t in reader.tensors}
    assert {"blk.0.shortconv.conv.weight", "blk.1.attn_q.weight", "token_embd_norm.weight"} <= names
    src = gguf.GGUFReader(str(resolve_model("smollm2-135m")[0]))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == src.fields[key].contents(), key
    assert hybrid_model.stat().st_size < 20 * 2**20


def test_the_server_loads_and_serves_the_generated_hybrid(hybrid: ServerProcess, hybrid_model: Path) -> None:
    props = httpx.get(hybrid.base + "/props", timeout=30).json()
    assert Path(props["model_path"]).name == hybrid_model.name
    r = _chat(hybrid.base, [{"role": "user", "content": "Hello"}], cache_prompt=False)
    assert r.usage["completion_tokens"] == r.timings["predicted_n"] > 0 and r.text
    again = _chat(hybrid.base, [{"role": "user", "content": "Hello"}], cache_prompt=False)
    assert again.text == r.text and again.logprobs == r.logprobs  # greedy on random weights: deterministic


def test_a_diverging_second_turn_restores_a_checkpoint_and_continues_as_a_fresh_evaluation(
    hybrid: ServerProcess, hybrid_nockpt: ServerProcess
) -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read this: " + DOC}]
    first = _chat(hybrid.base, turn1)
    n1 = first.usage["prompt_tokens"]
    assert n1 > 512 + 4 and first.timings["prompt_n"] == n1
    # the client sends back an edited reply: the prompt diverges inside the first reply
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text[: len(first.text) // 2] + " (edited)"},
        {"role": "user", "content": "And then?"},
    ]
    cont = _chat(hybrid.base, turn2)
    n2 = cont.usage["prompt_tokens"]
    # the checkpoint taken 4 tokens before the end of the first prompt (llama-server's placement)
    assert cont.timings["cache_n"] == cont.usage["prompt_tokens_details"]["cached_tokens"] == n1 - 4
    assert cont.timings["prompt_n"] == n2 - (n1 - 4)
    fresh = _chat(hybrid.base, turn2, cache_prompt=False)
    assert fresh.timings["cache_n"] == 0 and fresh.timings["prompt_n"] == n2
    assert cont.same_as(fresh)

    # a third turn resumes from the second turn's checkpoint (taken by the fresh evaluation just now)
    turn3 = turn2 + [{"role": "assistant", "content": "No."}, {"role": "user", "content": "Why?"}]
    cont3 = _chat(hybrid.base, turn3)
    assert cont3.timings["cache_n"] == n2 - 4
    assert cont3.same_as(_chat(hybrid.base, turn3, cache_prompt=False))

    # --ctx-checkpoints 0: the old behaviour, the whole prompt again, and the same text
    _chat(hybrid_nockpt.base, turn1)
    old = _chat(hybrid_nockpt.base, turn2)
    assert old.timings["cache_n"] == 0 and old.timings["prompt_n"] == n2
    assert old.same_as(cont)


def test_checkpoints_sit_4_and_n_batch_tokens_before_the_prompt_end(tmp_path: Path, hybrid_model: Path) -> None:
    """With 64 tokens a step (llama-server's offsets 4 + n_ubatch and 4, each at most n_batch): a prompt
    of 300 tokens leaves checkpoints after 236 and 296 tokens; a prompt diverging at 250 resumes from
    236, at 298 from 296, at 100 from nothing (before both)."""
    for srv in _server(tmp_path, hybrid_model, "-np", "1", "-b", "64", "-ub", "64"):
        first = [1000 + i for i in range(300)]
        assert _complete(srv.base, first).timings["cache_n"] == 0
        for diverge, kept in ((250, 236), (298, 296)):
            _complete(srv.base, first)  # the slot holds the first prompt again, with its checkpoints
            second = first[:diverge] + [7000 + i for i in range(40)]
            r = _complete(srv.base, second)
            assert r.timings["cache_n"] == kept, diverge
            assert r.timings["prompt_n"] == len(second) - kept
            assert r.same_as(_complete(srv.base, second, cache_prompt=False))
        _complete(srv.base, first)
        early = first[:100] + [7000 + i for i in range(40)]
        r = _complete(srv.base, early)
        assert r.timings["cache_n"] == 0 and r.timings["prompt_n"] == len(early)
        # the same prompt again: the memory cannot drop just the last token, the checkpoint 4 back serves
        again = _complete(srv.base, early)
        assert again.timings["cache_n"] == len(early) - 4 and again.same_as(r)


@pytest.mark.parametrize("unified", [False, True], ids=["per-slot-kv", "unified-kv"])
def test_no_cross_slot_prefix_copy_for_a_memory_that_cannot_be_cut(
    tmp_path: Path, hybrid_model: Path, unified: bool
) -> None:
    """A recurrent state copied from another slot would be that slot's whole state (llama_memory_seq_cp
    ignores the range for recurrent memory): the second slot evaluates the shared prefix itself and
    gets the same text as a fresh evaluation."""
    for srv in _server(tmp_path, hybrid_model, "-np", "2", *(["-kvu"] if unified else [])):
        shared = [1000 + i for i in range(300)]
        _complete(srv.base, shared + [5000 + i for i in range(20)], id_slot=0)
        other = shared + [6000 + i for i in range(20)]
        r = _complete(srv.base, other, id_slot=1)
        assert r.timings["cache_n"] == 0
        assert r.same_as(_complete(srv.base, other, id_slot=1, cache_prompt=False))


@pytest.mark.parametrize("n_ckpt", [32, 0], ids=["checkpoints", "no-checkpoints"])
def test_an_swa_model_resumes_from_a_checkpoint_once_its_window_has_moved_on(
    tmp_path: Path, swa_model: Path, n_ckpt: int
) -> None:
    """Gemma 3 layout, a 32-token window: the SWA layers' cache (256 cells at 64 tokens a step) no longer
    holds the window before token 298 once the slot has grown to 616 tokens.  With checkpoints the slot
    resumes from the one after 296 tokens (llama-server keeps pos_max = 295 of it); without, the whole
    prompt is evaluated.  Before checkpoints the node kept 298 tokens and generated other text."""
    for srv in _server(tmp_path, swa_model, "-np", "1", "-b", "64", "-ub", "64", "--ctx-checkpoints", str(n_ckpt)):
        first = [1000 + i for i in range(300)]
        _complete(srv.base, first)
        assert _complete(srv.base, first + [3000 + i for i in range(300)]).timings["cache_n"] == 300  # extends
        third = first[:298] + [7000 + i for i in range(40)]
        r = _complete(srv.base, third)
        assert r.timings["cache_n"] == (295 if n_ckpt else 0)
        assert r.same_as(_complete(srv.base, third, cache_prompt=False))
        # far before any checkpoint: from nothing, with or without them
        _complete(srv.base, first)
        early = first[:100] + [7000 + i for i in range(40)]
        r = _complete(srv.base, early)
        assert r.timings["cache_n"] == 0 and r.same_as(_complete(srv.base, early, cache_prompt=False))


def test_the_flags_land_in_the_engine_settings() -> None:
    from hydra_trio import cli
    from hydra_trio.cli.run import engine_config, llama_options

    def cfg(*argv: str, env: dict | None = None):
        args = cli.parse_args(list(argv), environ=env or {})
        return engine_config(args, llama_options(args))

    plain = cfg()
    assert (plain.n_ctx_checkpoints, plain.checkpoint_min_step) == (32, 8192)  # llama-server's common.h
    for argv in (("-ctxcp", "3", "-cms", "100"), ("--swa-checkpoints", "3", "--checkpoint-min-step", "100")):
        c = cfg(*argv)
        assert (c.n_ctx_checkpoints, c.checkpoint_min_step) == (3, 100)
    c = cfg(env={"LLAMA_ARG_CTX_CHECKPOINTS": "0", "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": "7"})
    assert (c.n_ctx_checkpoints, c.checkpoint_min_step) == (0, 7)
    assert cfg("-ctxcp", "-1").n_ctx_checkpoints == 0  # llama-server takes any integer; 0 or less: none kept


def test_two_slots_in_one_batch_each_resume_from_their_own_checkpoints(tmp_path: Path, hybrid_model: Path) -> None:
    """Two conversations at once on two slots (their prompts share one batch, cut at each one's
    checkpoint places): each second turn resumes from its own slot's checkpoint and equals a fresh
    evaluation."""
    from concurrent.futures import ThreadPoolExecutor

    for srv in _server(tmp_path, hybrid_model, "-np", "2", "-b", "64", "-ub", "64"):
        firsts = [[1000 + 7 * k + i for i in range(200)] for k in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda k: _complete(srv.base, firsts[k], id_slot=k), range(2)))  # noqa: B023  (called and finished within this iteration)
            seconds = [f[:180] + [8000 + k + i for i in range(30)] for k, f in enumerate(firsts)]
            replies = list(pool.map(lambda k: _complete(srv.base, seconds[k], id_slot=k), range(2)))  # noqa: B023  (called and finished within this iteration)
        for k, r in enumerate(replies):
            # Every first turn has a chunk boundary 64 tokens (one step) before its end, so a checkpoint at
            # 136; when the two prompts share a step's budget, chunks may also start between 136 and the
            # end, each with its own checkpoint.  The second turn resumes from the latest at or before the
            # 180 tokens it shares, which depends on how the prompts' arrivals fell into steps.
            assert 200 - 64 <= r.timings["cache_n"] <= 180, (k, r.timings)
            assert r.timings["prompt_n"] == 210 - r.timings["cache_n"], (k, r.timings)
            assert r.same_as(_complete(srv.base, seconds[k], id_slot=k, cache_prompt=False)), k
