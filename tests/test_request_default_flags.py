"""llama-server's flags that set what a request gets when it leaves a field out, on the real model.

llama-server starts every request from its ``params_base`` (``tools/server/server-schema.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors, ``eval_llama_cmpl_schema``): ``--samplers`` /
``--sampler-seq`` the sampler order, ``--ignore-eos``, ``-l/--logit-bias``, ``--grammar`` /
``--grammar-file`` / ``-j`` / ``-jf`` the grammar, ``--adaptive-target`` / ``--adaptive-decay``,
``-r/--reverse-prompt`` the stop strings (the ``antiprompt``, used when the request's own list is empty,
escapes processed unless ``--no-escape``), ``--no-cache-prompt``.  A request's own field wins.
Expected values are what each holds on any CPU: greedy paths compared with themselves, token ids a
bias forces, a grammar's language, stop strings found or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from hydra_trio import cli
from hydra_trio.cli.run import engine_config, llama_options

LONG = 120.0


def completion(base: str, **body) -> dict:
    r = httpx.post(base + "/completion", json={"prompt": "Once upon a time", "n_predict": 16, **body}, timeout=LONG)
    assert r.status_code == 200, r.text
    return r.json()


def params(base: str) -> dict:
    return httpx.get(base + "/props", timeout=LONG).json()["default_generation_settings"]["params"]


def test_samplers_order_and_adaptive_p_defaults(spawn) -> None:
    # top-k 1 is set but not in the chain: temperature alone samples, so two seeds part ways
    srv = spawn(
        "-np",
        "1",
        "-c",
        "1024",
        "--no-rpc-backend",
        "--top-k",
        "1",
        "--temp",
        "1.5",
        "--samplers",
        "Temperature;bogus",
        "--adaptive-target",
        "0.4",
        "--adaptive-decay",
        "1.5",
    )
    srv.wait_ready()
    p = params(srv.base)
    assert p["samplers"] == ["temperature"]  # an unknown name is left out, as llama-server does
    assert (p["adaptive_target"], p["adaptive_decay"]) == (pytest.approx(0.4), pytest.approx(0.99))  # clamped
    assert "unknown samplers left out: 'bogus'" in srv.log()
    a, b = (completion(srv.base, seed=s, n_predict=24) for s in (1, 2))
    assert a["generation_settings"]["samplers"] == ["temperature"]
    assert a["content"] != b["content"]  # no top-k in the chain: temperature 1.5 over the whole vocabulary
    # the request's own order wins: top-k 1 first leaves one candidate, whatever the seed
    c, d = (completion(srv.base, seed=s, n_predict=24, samplers=["top_k", "temperature"]) for s in (1, 2))
    assert c["content"] == d["content"] and c["generation_settings"]["samplers"] == ["top_k", "temperature"]
    g = completion(srv.base, samplers="kt", adaptive_target=0.7)["generation_settings"]
    assert (g["adaptive_target"], g["adaptive_decay"]) == (pytest.approx(0.7), pytest.approx(0.99))
    # adaptive-p picks the token where the order names it
    e = completion(srv.base, samplers=["top_k", "adaptive_p"], n_predict=8)
    assert e["tokens_predicted"] == 8 or e["stop_type"] == "eos"


def test_sampler_seq_sets_the_order_by_letters(spawn) -> None:
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--sampler-seq", "kt", "--top-k", "1", "--temp", "1.5")
    srv.wait_ready()
    assert params(srv.base)["samplers"] == ["top_k", "temperature"]
    a, b = (completion(srv.base, seed=s) for s in (1, 2))
    assert a["content"] == b["content"]  # top-k 1 in the chain: one candidate each step


def _token_id(base: str, text: str) -> int:
    ids = httpx.post(base + "/tokenize", json={"content": text, "parse_special": True}, timeout=LONG).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_ignore_eos_and_logit_bias_defaults(spawn) -> None:
    forced = 2000  # any ordinary token: +100 makes it the only one ever sampled
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--ignore-eos", "-l", f"{forced}+100")
    srv.wait_ready()
    assert params(srv.base)["ignore_eos"] is True
    eos = _token_id(srv.base, httpx.get(srv.base + "/props", timeout=LONG).json()["eos_token"])
    r = completion(srv.base, n_predict=6, return_tokens=True)
    assert r["tokens"] == [forced] * 6  # the node's -l
    assert r["generation_settings"]["logit_bias"] == [{"bias": 100.0, "token": forced}]
    # a request's logit_bias replaces the node's: here it makes end of generation the likeliest token ...
    r = completion(srv.base, n_predict=6, return_tokens=True, logit_bias=[[eos, 100]])
    assert forced not in r["tokens"]
    assert r["tokens_predicted"] == 6 and r["stop_type"] == "limit"  # ... which --ignore-eos bans
    # the request's ignore_eos wins over the node's
    r = completion(srv.base, n_predict=6, logit_bias=[[eos, 100]], ignore_eos=False)
    assert r["stop_type"] == "eos" and r["tokens_predicted"] <= 1
    # a request's grammar: --ignore-eos yields (a finished grammar allows only the end of generation)
    r = completion(srv.base, n_predict=6, grammar='root ::= "yes"')
    assert r["content"] == "yes" and r["stop_type"] == "eos" and r["generation_settings"]["ignore_eos"] is False


def test_ignore_eos_with_a_grammar_is_refused_at_start(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["--ignore-eos", "--grammar", 'root ::= "a"'], environ={})
    assert exited.value.code == 2
    assert "argument --ignore-eos: not allowed with a grammar" in capsys.readouterr().err


YES_NO = 'root ::= "yes" | "no"'


def test_grammar_file_is_every_replys_unless_the_request_has_its_own(spawn, tmp_path: Path) -> None:
    f = tmp_path / "yes_no.gbnf"
    f.write_text(YES_NO)
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--grammar-file", str(f))
    srv.wait_ready()
    r = completion(srv.base, prompt="Is Paris in France?")
    assert r["content"] in ("yes", "no") and r["generation_settings"]["grammar"] == YES_NO
    chat = httpx.post(
        srv.base + "/v1/chat/completions",
        timeout=LONG,
        json={"messages": [{"role": "user", "content": "Is Paris in France?"}], "max_tokens": 8},
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] in ("yes", "no"), chat.text
    assert completion(srv.base, grammar='root ::= "maybe"')["content"] == "maybe"
    r = completion(
        srv.base,
        json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        n_predict=32,
    )
    assert isinstance(json.loads(r["content"])["a"], int)
    r = completion(srv.base, ignore_eos=True, n_predict=4)  # the node's grammar yields to the request's ignore_eos
    assert r["generation_settings"]["grammar"] == "" and r["tokens_predicted"] == 4


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def test_json_schema_file_constrains_every_reply(spawn, tmp_path: Path) -> None:
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(SCHEMA))
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "-jf", str(f))
    srv.wait_ready()
    r = completion(srv.base, prompt="How many legs has a cat? Answer in JSON.", n_predict=48)
    assert isinstance(json.loads(r["content"])["answer"], int), r["content"]
    assert completion(srv.base, grammar='root ::= "free"')["content"] == "free"  # the request's own wins


def test_grammar_and_json_schema_flags_land_as_their_file_forms(tmp_path: Path) -> None:
    g, s = tmp_path / "g.gbnf", tmp_path / "s.json"
    g.write_text(YES_NO)
    s.write_text(json.dumps(SCHEMA))

    def grammar(*argv: str) -> str | None:
        args = cli.parse_args(list(argv), environ={})
        return engine_config(args, llama_options(args)).generation.grammar

    assert grammar("--grammar", YES_NO) == grammar("--grammar-file", str(g)) == YES_NO
    assert grammar("-j", json.dumps(SCHEMA)) == grammar("-jf", str(s))
    assert "answer" in grammar("-j", json.dumps(SCHEMA))
    assert grammar("--grammar", YES_NO, "-j", json.dumps(SCHEMA)) != YES_NO  # the last one wins, as llama-server


def test_reverse_prompt_is_the_stop_list_of_a_request_without_one(spawn) -> None:
    # -e (on by default): '\x20' is a space, which any English reply holds
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "-r", "\\x20", "--temp", "0")
    srv.wait_ready()
    r = completion(srv.base, prompt="The capital of France is Paris. The capital of Italy is", n_predict=32)
    assert r["stop_type"] == "word" and r["stopping_word"] == " " and " " not in r["content"], r
    own = completion(
        srv.base, prompt="The capital of France is Paris. The capital of Italy is", n_predict=32, stop=["\u2603"]
    )
    assert " " in own["content"] and own["generation_settings"]["stop"] == ["\u2603"]


def test_no_escape_keeps_a_reverse_prompts_backslashes(spawn) -> None:
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--no-escape", "-r", "\\x20", "--temp", "0")
    srv.wait_ready()
    r = completion(srv.base, prompt="The capital of France is Paris. The capital of Italy is", n_predict=32)
    assert r["generation_settings"]["stop"] == ["\\x20"] and " " in r["content"]


def test_escapes_follow_llama_servers_string_process_escapes() -> None:
    from hydra_trio.cli._types import escapes

    assert escapes(r"a\nb\tc\rd\'e\"f\\g") == "a\nb\tc\rd'e\"f\\g"
    assert escapes(r"\x41\x4\q\\") == "A\\x4\\q\\"  # a short \x and an unknown escape stay as they are
    args = cli.parse_args(["--dry-sequence-breaker", r"\n"], environ={})
    assert args.sampling.dry_sequence_breakers == ("\n",)
    args = cli.parse_args(["--no-escape", "--dry-sequence-breaker", r"\n"], environ={})
    assert args.sampling.dry_sequence_breakers == ("\\n",)


def test_no_cache_prompt_is_the_default_of_cache_prompt(spawn) -> None:
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--no-cache-prompt", "--temp", "0")
    srv.wait_ready()
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    first = completion(srv.base, prompt=prompt, n_predict=2)
    again = completion(srv.base, prompt=prompt, n_predict=2)
    assert again["generation_settings"]["cache_prompt"] is False
    assert again["timings"]["cache_n"] == 0  # nothing of the slot's cached prefix reused
    kept = completion(srv.base, prompt=prompt, n_predict=2, cache_prompt=True)
    kept = completion(srv.base, prompt=prompt, n_predict=2, cache_prompt=True)
    assert kept["timings"]["cache_n"] > 0 and first["timings"]["prompt_n"] > 0
