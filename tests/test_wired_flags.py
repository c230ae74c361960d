"""llama-server flags once refused or noted as without effect, wired with llama-server's meaning (``common/arg.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors), each shown on the real model or a real process."""

from __future__ import annotations

import subprocess
import sys

import httpx

from hydra_trio import cli

from .conftest import ROOT

LONG = 120.0


def test_override_kv_changes_the_models_metadata_as_it_loads(spawn) -> None:
    # -c 0 is the training context, which llama.context_length gives: 8192 in the file, 4096 overridden
    srv = spawn(
        "-np",
        "1",
        "-c",
        "0",
        "--no-rpc-backend",
        "--override-kv",
        "llama.context_length=int:4096,tokenizer.ggml.add_bos_token=bool:true",
    )
    srv.wait_ready()
    assert httpx.get(srv.base + "/props", timeout=LONG).json()["default_generation_settings"]["n_ctx"] == 4096
    # SmolLM2's file says add_bos_token false; overridden, /tokenize with add_special starts with BOS (id 1)
    tokens = httpx.post(srv.base + "/tokenize", json={"content": "Hi", "add_special": True}, timeout=LONG).json()
    assert tokens["tokens"][0] == 1
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=LONG)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens["tokens"]), r.text


def test_override_kv_values_read_as_llama_server_reads_them(capsys) -> None:
    args = cli.parse_args(
        ["--override-kv", "a=int:12x,b=float:2.5,c=bool:false", "--override-kv", "d=str:x y"], environ={}
    )
    from hydra_trio.cli.run import llama_options

    assert llama_options(args).kv_overrides == (
        ("a", "int", 12),
        ("b", "float", 2.5),
        ("c", "bool", False),
        ("d", "str", "x y"),
    )
    for bad in ("a=int", "a=long:1", "c=bool:yes", "k=str:" + "x" * 128):
        out = subprocess.run(
            [sys.executable, "-m", "hydra_trio", "--override-kv", bad],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=LONG,
        )
        assert out.returncode == 2 and "argument --override-kv" in out.stderr, out.stderr


CAPS = (
    "{% for m in messages %}{{ m.content }}{% endfor %}|"
    "{% if preserve_reasoning %}R{% else %}r{% endif %}{% if preserve_thinking %}P{% else %}p{% endif %}"
    "{% if clear_thinking %}C{% else %}c{% endif %}{% if truncate_history_thinking %}T{% else %}t{% endif %}"
    "{% if drop_thinking %}D{% else %}d{% endif %}|{{ reasoning_strength }}|"
)


def _rendered(base: str, **body) -> str:
    r = httpx.post(
        base + "/apply-template", json={"messages": [{"role": "user", "content": "x"}], **body}, timeout=LONG
    )
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_reasoning_preserve_sets_the_template_variables_llama_server_derives(spawn) -> None:
    # llama-server sets preserve_reasoning true unless told otherwise (common/arg.cpp), and derives
    # preserve_thinking and its opposites from it (common/jinja/caps.cpp); reasoning_effort gives reasoning_strength
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--chat-template", CAPS, "--reasoning-effort", "low")
    srv.wait_ready()
    assert _rendered(srv.base) == "x|RPctd|low|"
    assert _rendered(srv.base, chat_template_kwargs={"preserve_reasoning": False}) == "x|rpCTD|low|"
    # a variable given by name wins over the derived one
    assert (
        _rendered(srv.base, chat_template_kwargs={"preserve_reasoning": False, "clear_thinking": False})
        == "x|rpcTD|low|"
    )
    off = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--chat-template", CAPS, "--no-reasoning-preserve")
    off.wait_ready()
    assert _rendered(off.base) == "x|rpCTD||"
    assert _rendered(off.base, chat_template_kwargs={"preserve_reasoning": True}) == "x|RPctd||"


THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_skip_chat_parsing_leaves_the_whole_reply_in_content(spawn) -> None:
    srv = spawn(
        "-np", "1", "-c", "1024", "--no-rpc-backend", "--chat-template", THINKING, "--skip-chat-parsing", "--temp", "0"
    )
    srv.wait_ready()
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}
    prompt = _rendered(srv.base, **chat)
    assert prompt.endswith("<think>\n")  # the reply starts inside the thinking block
    raw = httpx.post(srv.base + "/completion", json={"prompt": prompt, "n_predict": 8}, timeout=LONG).json()
    for fmt in (None, "deepseek"):  # a request's reasoning_format does not bring the parser back
        r = httpx.post(
            srv.base + "/v1/chat/completions", json={**chat, **({"reasoning_format": fmt} if fmt else {})}, timeout=LONG
        )
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == raw["content"] and not msg.get("reasoning_content"), msg
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            },
        }
    ]
    r = httpx.post(
        srv.base + "/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": "required"}, timeout=LONG
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] != "tool_calls"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hydra_trio", *argv], cwd=ROOT, capture_output=True, text=True, timeout=LONG
    )


def test_cache_list_prints_the_installed_models_and_exits() -> None:
    from hydra_trio.models.presets import resolve_model

    out = _run("-cl")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("number of models in cache: ") and int(lines[0].rsplit(" ", 1)[1]) == len(lines) - 1
    assert f"   1. smollm2-135m ({resolve_model('smollm2-135m')[0]})" in lines  # the default model is installed


def test_completion_bash_completes_the_flags(tmp_path) -> None:
    out = _run("--completion-bash")
    assert out.returncode == 0, out.stderr
    script = tmp_path / "hydra-trio.bash"
    script.write_text(out.stdout)

    def complete(*words: str) -> list[str]:
        cmd = (
            f"source {script}; COMP_WORDS=(hydra-trio {' '.join(words)}); COMP_CWORD={len(words)}; "
            "_hydra_trio_completions; printf '%s\\n' \"${COMPREPLY[@]}\""
        )
        return subprocess.run(
            ["bash", "-c", cmd], capture_output=True, text=True, timeout=LONG, cwd=tmp_path
        ).stdout.split()

    assert complete("--ctx-s") == ["--ctx-size"]
    assert set(complete("--reasoning-p")) == {"--reasoning-preserve"}
    (tmp_path / "m.gguf").write_text("")
    (tmp_path / "m.txt").write_text("")
    assert complete("-m", "m") == ["m.gguf"]


def test_reuse_port_lets_two_nodes_share_a_port(tmp_path) -> None:
    from hydra_trio.testing import spawn as _spawn

    from .conftest import free_port

    port = free_port()
    logs = [open(tmp_path / f"node{i}.log", "wb") for i in range(2)]  # noqa: SIM115  (the child's log, open while the child runs)
    procs = []
    try:
        for log in logs:  # each with a port of its own too (--rpc-port), to see it ready
            own = free_port()
            proc, _ = _spawn.spawn(
                "--no-model", "--reuse-port", "--rpc-port", str(own), "--log-level", "DEBUG", port=port, output=log
            )
            procs.append(proc)
            _spawn.wait_healthy(own, proc, LONG)  # without --reuse-port the second cannot listen (as llama-server)
        for _ in range(40):  # new connections, each from a new source port: the kernel spreads them over both
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=LONG).status_code == 200
        for log in logs:
            log.flush()
        served = [(tmp_path / f"node{i}.log").read_text(errors="replace").count("GET /health") for i in range(2)]
        assert all(served), served
        procs[0].terminate()
        procs[0].wait(LONG)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=LONG).status_code == 200  # the other serves on
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(LONG)
        for log in logs:
            log.close()


def test_special_writes_generated_special_tokens_into_the_text(spawn) -> None:
    srv = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "-sp")
    srv.wait_ready()
    ids = httpx.post(
        srv.base + "/tokenize", json={"content": "<|im_start|>", "parse_special": True}, timeout=LONG
    ).json()["tokens"]
    assert len(ids) == 1  # a special token, not end of generation
    r = httpx.post(
        srv.base + "/completion", json={"prompt": "Hi", "n_predict": 3, "logit_bias": [[ids[0], 100]]}, timeout=LONG
    ).json()
    assert r["tokens_predicted"] == 3 and r["content"] == "<|im_start|>" * 3  # without -sp: "" (no text)
