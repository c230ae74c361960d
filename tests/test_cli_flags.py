"""The command line as the cluster's launcher uses it: llama-server's whole flag set (every flag of the
vendored ``common/arg.cpp`` in a class), no subcommand, no abbreviations, ``LLAMA_ARG_*`` variables,
parse-time refusals, and launcher-style argvs that start real nodes."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hydra_trio import cli
from hydra_trio.cli import RUN_FLAGS, table
from hydra_trio.cli._flags import ACCEPTED, OWN, REFUSED
from hydra_trio.models.presets import resolve_model
from hydra_trio.protocol.hydra import Op, Status
from hydra_trio.testing import spawn as _spawn
from hydra_trio.testing.hydra_wire import Wire

from .conftest import ROOT, free_port, wait_for
from .llama_arg_cpp import server_flags

BY_NAME = {n: f for f in RUN_FLAGS for n in f.all_names}


def parse(*argv: str, env: dict | None = None):
    return cli.parse_args(list(argv), environ=env or {})


def refused(capsys, *argv: str, env: dict | None = None) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(*argv, env=env)
    assert exited.value.code == 2
    return capsys.readouterr().err


# --------------------------------------------------------------------------- the flag set


@pytest.fixture(scope="module")
def llama_server() -> dict[str, set[str]]:
    return server_flags()


def test_every_llama_server_flag_is_in_exactly_one_class(llama_server) -> None:
    assert len(llama_server) > 300  # every spelling; a broken reader would find few
    missing = sorted(set(llama_server) - set(BY_NAME))
    assert not missing, f"llama-server flags in no class (wire, accept or refuse each): {missing}"
    own = sorted(n for n in llama_server if BY_NAME[n].kind == OWN)
    assert not own, f"llama-server's flags listed as hydra-trio's own: {own}"
    # the other way: every flag claimed as llama-server's is one (not the fork's or hydra-trio's own)
    stale = sorted(n for n, f in BY_NAME.items() if f.kind != OWN and f.group != "hydra" and n not in llama_server)
    assert not stale, f"flags classed as llama-server's that it does not have: {stale}"
    wrong_env = sorted(n for n in llama_server if BY_NAME[n].env and BY_NAME[n].env not in llama_server[n])
    assert not wrong_env, f"environment variables that differ from llama-server's: {wrong_env}"


def test_the_reader_sees_what_llama_server_registers(llama_server) -> None:
    # options of other tools only, excluded from the server, or preset-only never appear
    assert {"-p", "--prompt", "--interactive", "-ns"}.isdisjoint(llama_server)
    assert {"--ctx-size", "-np", "--no-context-shift", "-no-kvu", "--api-key", "--jinja"} <= set(llama_server)
    assert llama_server["--ctx-size"] == {"LLAMA_ARG_CTX_SIZE"}


def test_the_command_line_page_holds_the_generated_flag_table() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    assert table.markdown() in page, "docs/cli.md's flag table is stale: python -m hydra_trio.cli.table"


# --------------------------------------------------------------------------- invocation


def test_a_first_argument_that_is_a_flag_runs_the_server() -> None:
    args = parse("--port", "9000", "-np", "2")
    assert args.command == "run" and args.port == 9000 and args.parallel == 2
    assert parse().command == "run"  # no argument at all: the server with its defaults, as llama-server
    assert cli.parse_args(["models", "--json"], environ={}).command == "models"


def test_no_flag_is_an_abbreviation_of_another() -> None:
    args = parse("--metrics")  # was silently --metrics-auth
    assert args.metrics is True and args.metrics_auth is True  # (the default: /metrics needs the API key)
    assert parse("--no-metrics-auth").metrics_auth is False
    assert parse("--no-metrics-auth", "--metrics-auth").metrics_auth is True  # the last one wins
    args = parse("-n", "128")  # was -np 128
    assert args.n_predict == 128 and args.parallel == 4
    args = parse("-ctk", "q8_0", "-ctv", "q8_0")  # was -c tk
    assert (args.cache_type_k, args.cache_type_v, args.ctx_size) == ("q8_0", "q8_0", None)  # not given: the default


def test_an_abbreviation_is_an_error(capsys) -> None:
    assert "unrecognized arguments: --metr" in refused(capsys, "--metr")
    assert "unrecognized arguments: --no-metrics" in refused(capsys, "--no-metrics")
    assert "unrecognized arguments: --paral 2" in refused(capsys, "--paral", "2")


def test_underscores_read_as_dashes_as_llama_server() -> None:
    args = parse("--ctx_size", "1024", "--n_gpu_layers", "all", "--cache_type_k=q4_0")
    assert (args.ctx_size, args.gpu_layers, args.cache_type_k) == (1024, "all", "q4_0")


def test_environment_variables_set_flags_and_an_explicit_flag_wins(capsys) -> None:
    env = {
        "LLAMA_ARG_CTX_SIZE": "1024",
        "LLAMA_ARG_N_PARALLEL": "2",
        "LLAMA_ARG_FLASH_ATTN": "on",
        "LLAMA_API_KEY": "k1,k2",
        "LLAMA_ARG_TEMPERATURE": "0.3",
        "LLAMA_ARG_CONT_BATCHING": "1",
        "LLAMA_ARG_NO_CONTEXT_SHIFT": "1",
        "LLAMA_ARG_HOST": "0.0.0.0",
    }
    args = parse("-np", "3", env=env)
    assert (args.ctx_size, args.parallel, args.flash_attn, args.host) == (1024, 3, "on", "0.0.0.0")
    assert args.api_key == [("k1", "k2")] and args.sampling.temperature == 0.3
    assert args.context_shift is False and args.cont_batching is True
    assert "--cont-batching (from LLAMA_ARG_CONT_BATCHING)" in args._accepted_given
    assert parse("--context-shift", env=env).context_shift is True
    err = refused(capsys, env={"LLAMA_ARG_CTX_SIZE": "big"})
    assert "environment variable LLAMA_ARG_CTX_SIZE (--ctx-size): expected an integer, got 'big'" in err
    err = refused(capsys, env={"LLAMA_ARG_MMPROJ_URL": "https://example.com/x.gguf"})
    assert "environment variable LLAMA_ARG_MMPROJ_URL (--mmproj-url): not supported by hydra-trio" in err
    err = refused(capsys, env={"LLAMA_ARG_MMPROJ": "x.gguf"})  # a wired flag's value, checked as the flag's
    assert "environment variable LLAMA_ARG_MMPROJ (--mmproj): no such file: x.gguf" in err


@pytest.mark.parametrize("name", sorted(n for n, f in BY_NAME.items() if f.kind == REFUSED))
def test_each_refused_flag_exits_2_naming_itself_and_why(capsys, name: str) -> None:
    flag = BY_NAME[name]
    argv = [name, "x"] if flag.value else [name]
    err = refused(capsys, *argv)
    assert err.startswith("usage: hydra-trio run ")
    assert f"error: {name}: not supported by hydra-trio: {flag.note}" in err


SAMPLE = {
    "N": "1",
    "[on|off|auto]": "on",
    "[on|off]": "off",
    "<0|1>": "1",
    "<0...100>": "50",
    "TYPE": "isolate",
    "MODE": "auto",
    "M": "ff",
    "lo-hi": "0-1",
    "FORMAT": "deepseek",
    "SIMILARITY": "0.5",
}


@pytest.mark.parametrize("name", sorted(n for n, f in BY_NAME.items() if f.kind == ACCEPTED))
def test_each_accepted_flag_parses_and_is_noted(name: str) -> None:
    flag = BY_NAME[name]
    value = SAMPLE.get(flag.value or "", "x")
    if name in ("-lzm", "--lazy-mode"):
        value = "on"
    if name in ("-fitt", "--fit-target", "--combined-tensor-split"):
        value = "1024"
    args = parse(*([name, value] if flag.value and name not in flag.neg else [name]))
    assert name in args._accepted_given
    notes = cli._flags.accepted_notes(RUN_FLAGS, args)
    assert notes == [f"{name}: accepted, no effect here: {flag.note}"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-ngl", "many"], "argument -ngl/--gpu-layers/--n-gpu-layers: expected N, 'all' or 'auto', got 'many'"),
        (["-ngl", "-3"], "expected N >= 0, 'all' or 'auto'"),
        (["-fa", "yes"], "argument -fa/--flash-attn: expected [on|off|auto], got 'yes'"),
        (["-ctk", "q9_0"], "argument -ctk/--cache-type-k: expected one of f32, f16, bf16, q8_0"),
        (["-ot", "token_embd"], "expected <tensor name pattern>=<buffer type>,..., got 'token_embd'"),
        (["-ot", "(=CPU"], "not a valid regular expression"),
        (["--chat-template-kwargs", "[1]"], "expected a JSON object, got list"),
        (["--chat-template-kwargs", "{enable"], "expected a JSON object, got '{enable'"),
        (["--rope-scaling", "cubic"], "expected one of {none,linear,yarn}, got 'cubic'"),
        (["-sm", "diagonal"], "expected one of {none,layer,row,tensor}"),
        (["-ts", "3,x"], "expected a number, got 'x'"),
        (["-np", "0"], "must be between 1 and 256 (llama.cpp's most sequences), or below 0 (auto), got 0"),
        (["-np", "257"], "or below 0 (auto), got 257"),
        (["-c", "-1"], "must be between 0 and 2147483647"),
        (["--prio", "4"], "argument --prio: must be between -1 and 3"),
        (["--top-p", "x"], "argument --top-p: expected a number, got 'x'"),
        (["--reasoning", "maybe"], "argument -rea/--reasoning: expected [on|off|auto], got 'maybe'"),
        (["-sps", "1.5"], "must be between 0 and 1"),
        (["--rpc-port", "9503x"], "argument --rpc-port: expected an integer, got '9503x'"),
        (["-C", "zz"], "expected a hex CPU mask"),
        (["--api-key", ","], "argument --api-key: must be non-empty"),
        (["--api-key", "k1, k2"], "argument --api-key: must be non-empty, without leading or trailing whitespace"),
    ],
)
def test_wrong_values_are_refused_with_llama_servers_value_syntax(capsys, argv: list[str], needle: str) -> None:
    err = refused(capsys, *argv)
    assert err.startswith("usage: hydra-trio run ")
    assert needle in err, err


LAUNCHER = (
    "--cache-prompt --cache-reuse 64 --cache-type-k q8_0 --cache-type-v q8_0 --chat-template-file {tmpl} "
    "--chat-template-kwargs '{{\"enable_thinking\": true}}' --cont-batching --context-shift --ctx-size 4096 "
    "--flash-attn on --jinja --kv-unified --log-verbosity 3 --metrics --model {model} --n-cpu-moe 8 "
    "--n-gpu-layers all --override-tensor 'token_embd\\.weight=CPU' --parallel 2 --perf --prio 1 "
    "--reasoning on --repeat-penalty 1.06 --rope-scaling yarn --rope-scale 1 --yarn-orig-ctx 8192 "
    "--slot-prompt-similarity 0.4 --slots --temp 0.7 --top-k 20 --top-p 0.95 --timeout 1800"
)


def launcher_argv(tmp_path: Path, port: int, rpc_port: int) -> list[str]:
    """The cluster launcher's argv: ``--host H --port P --rpc-port R`` then sorted ``--key value`` pairs."""
    tmpl = tmp_path / "chat.jinja"
    tmpl.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
    )
    model, _ = resolve_model("smollm2-135m")
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--rpc-port",
        str(rpc_port),
        *shlex.split(LAUNCHER.format(tmpl=tmpl, model=model)),
    ]


def test_the_launchers_argv_parses_with_every_value_in_place(tmp_path: Path) -> None:
    args = parse(*launcher_argv(tmp_path, 8080, 9503))
    assert args.command == "run" and (args.port, args.rpc_port, args.parallel, args.ctx_size) == (8080, 9503, 2, 4096)
    assert (args.cache_type_k, args.cache_type_v, args.flash_attn, args.gpu_layers) == ("q8_0", "q8_0", "on", "all")
    assert args.override_tensor == [(("token_embd\\.weight", "CPU"),)] and args.n_cpu_moe == 8
    assert args.chat_template_kwargs == {"enable_thinking": True} and args.reasoning == "on"
    s = args.sampling
    assert (s.temperature, s.top_k, s.top_p, s.repeat_penalty) == (0.7, 20, 0.95, 1.06)
    assert (args.n_cache_reuse, args.slot_prompt_similarity, args.timeout) == (64, 0.4, 1800.0)


# --------------------------------------------------------------------------- real nodes


class Launched:
    """``python -m hydra_trio ARGV`` with no subcommand, as the launcher execs the binary."""

    def __init__(self, log: Path, argv: list[str], port: int) -> None:
        self.port, self.base, self.log_path = port, f"http://127.0.0.1:{port}", log
        self._log = open(log, "wb")  # noqa: SIM115  (the child's log, open while the child runs)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hydra_trio", *argv], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> None:
        try:
            _spawn.wait_healthy(self.port, self.proc, 180)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}:\n{self.log()}") from None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def launch(tmp_path: Path):
    started: list[Launched] = []

    def _launch(argv: list[str], port: int) -> Launched:
        node = Launched(tmp_path / f"node{len(started)}.log", argv, port)
        started.append(node)
        return node

    yield _launch
    for node in started:
        node.stop()


def hydra_info(port: int) -> dict:
    with Wire(port) as w:
        status, meta, _ = w.call(Op.INFO)
    assert status == Status.OK, meta
    return meta


@pytest.mark.slow
def test_the_launchers_argv_starts_a_node_that_serves(tmp_path: Path, launch) -> None:
    port, rpc_port = free_port(), free_port()
    node = launch(launcher_argv(tmp_path, port, rpc_port), port)
    # the health checker's probe answers from the moment the port is bound, loading or not
    slots = wait_for(lambda: _slots_or_none(node.base), timeout=180, what="/slots answers")
    assert isinstance(slots, list) or slots["error"]["code"] == 503  # JSON either way, never a refused connection
    node.wait_ready()
    slots = httpx.get(node.base + "/slots", timeout=30).json()
    assert [s["id"] for s in slots] == [0, 1]
    assert all({"id", "is_processing", "n_past"} <= set(s) and "n_remain" in s["next_token"][0] for s in slots)
    r = httpx.post(
        node.base + "/v1/chat/completions",
        timeout=120,
        json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    props = httpx.get(node.base + "/props", timeout=30).json()
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["repeat_penalty"]) == (
        pytest.approx(0.7),
        20,
        pytest.approx(0.95),
        pytest.approx(1.06),
    )
    assert "enable_thinking" in props["chat_template"]  # the template file is the one in use
    for p in (port, rpc_port):  # Hydra INFO on the main port and on --rpc-port
        meta = hydra_info(p)
        assert (meta["stage"], meta["n_slots"], meta["n_ctx"]) == ("ready", 2, 4096)
        assert meta["sampling_defaults"]["top_k"] == 20
    log = node.log()
    assert f"ports {port}, {rpc_port}" in log
    assert "--cont-batching: accepted, no effect here: continuous batching is always on" in log
    assert "-ngl, -ncmoe: no usable GPU in this build" in log


def _slots_or_none(base: str):
    try:
        r = httpx.get(base + "/slots", timeout=5)
    except httpx.HTTPError:
        return None
    assert r.status_code in (200, 503), r.text
    return r.json()


@pytest.mark.slow
def test_a_head_reaches_its_peer_through_the_peers_ggml_rpc_port(launch) -> None:
    peer_port, peer_ggml, peer_rpc = free_port(), free_port(), free_port()
    peer = launch(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(peer_port),
            "--rpc-port",
            str(peer_rpc),
            "--ggml-rpc-port",
            str(peer_ggml),
            "--no-model",
            "--peer-only",
        ],
        peer_port,
    )
    peer.wait_ready()
    head_port, head_rpc = free_port(), free_port()
    head = launch(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(head_port),
            "--rpc-port",
            str(head_rpc),
            "--model",
            "smollm2-135m-moe",
            "--parallel",
            "1",
            "--ctx-size",
            "1024",
            "--no-rpc-backend",
            "--rpc-engine",
            f"127.0.0.1:{peer_ggml}",
            "--combined-ot-pattern",
            "ffn_.*_exps=RPC0",
        ],
        head_port,
    )
    head.wait_ready()
    meta = wait_for(
        lambda: (m := hydra_info(head_rpc))["mode"] == "combined" and m, timeout=180, what="the head in COMBINED"
    )
    assert meta["peer_addr"] == f"127.0.0.1:{peer_ggml}"
    r = httpx.post(
        head.base + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert hydra_info(peer_rpc)["rpc_backend"]["bytes_in"] > 0  # the experts went to the peer's extra port
    assert "--peer-only: accepted, no effect here" in peer.log()


def test_list_devices_and_unknown_devices_or_buffer_types() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "--list-devices"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("Available devices:\n  CPU: "), out
    for argv, needle in (
        (["-dev", "CUDA7"], "-dev/--device: no device 'CUDA7' here (devices: CPU"),
        (["-ot", "token_embd\\.weight=CUDA0"], "unknown buffer type 'CUDA0' (available: CPU"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "hydra_trio", "--port", str(free_port()), *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out
        assert needle in out.stderr and "listening" not in out.stderr


@pytest.mark.slow
def test_ctx_size_0_and_parallel_auto_mean_what_they_mean_in_llama_server(launch) -> None:
    port = free_port()
    node = launch(["--port", str(port), "-c", "0", "-np", "-1", "--no-rpc-backend", "--numa", "distribute"], port)
    node.wait_ready()
    props = httpx.get(node.base + "/props", timeout=30).json()
    # -np -1: llama-server's auto, 4 slots sharing a unified KV cache of -c 0: the model's training context
    # (8192 for SmolLM2), which one slot may fill
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 8192


def test_every_llama_option_flag_reaches_the_engine_settings() -> None:
    from hydra_trio.cli.run import llama_options

    opts = llama_options(
        parse(
            "-tb",
            "3",
            "-ub",
            "64",
            "--swa-full",
            "-fa",
            "off",
            "-nkvo",
            "--no-op-offload",
            "-nr",
            "--no-host",
            "--check-tensors",
            "-lm",
            "mmap",
            "--numa",
            "isolate",
            "-ctk",
            "q8_0",
            "-ctv",
            "f32",
            "-kvu",
            "--rope-scaling",
            "yarn",
            "--rope-freq-base",
            "5000",
            "--rope-scale",
            "4",
            "--yarn-orig-ctx",
            "4096",
            "--yarn-ext-factor",
            "0.5",
            "--yarn-attn-factor",
            "0.9",
            "--yarn-beta-slow",
            "2",
            "--yarn-beta-fast",
            "16",
            "-ngl",
            "7",
            "-sm",
            "row",
            "-ts",
            "3,1",
            "-mg",
            "1",
            "-dev",
            "none",
            "-ot",
            "a=CPU",
            "-ot",
            "b=CPU,c=CPU",
            "-cmoe",
            "-ncmoe",
            "5",
            "-ncffn",
            "2",
        )
    )
    assert (opts.n_threads_batch, opts.n_ubatch, opts.swa_full, opts.flash_attn) == (3, 64, True, "off")
    assert (opts.kv_offload, opts.op_offload, opts.repack, opts.no_host, opts.check_tensors) == (
        False,
        False,
        False,
        True,
        True,
    )
    assert (opts.load_mode, opts.cache_type_k, opts.cache_type_v, opts.kv_unified) == ("mmap", "q8_0", "f32", True)
    assert opts.numa == "isolate" and llama_options(parse("--numa", "")).numa == "distribute"
    assert (opts.rope_scaling, opts.rope_freq_base, opts.rope_freq_scale) == ("yarn", 5000.0, 0.25)
    assert (
        opts.yarn_orig_ctx,
        opts.yarn_ext_factor,
        opts.yarn_attn_factor,
        opts.yarn_beta_slow,
        opts.yarn_beta_fast,
    ) == (4096, 0.5, 0.9, 2.0, 16.0)
    assert (opts.n_gpu_layers, opts.split_mode, opts.tensor_split, opts.main_gpu, opts.devices) == (
        7,
        "row",
        (3.0, 1.0),
        1,
        ("none",),
    )
    assert opts.tensor_overrides == (("a", "CPU"), ("b", "CPU"), ("c", "CPU"))
    assert (opts.cpu_moe, opts.n_cpu_moe, opts.n_cpu_ffn) == (True, 5, 2)
    assert llama_options(parse("-np", "-1")).kv_unified is True  # llama-server's auto
    assert llama_options(parse()) == type(opts)()  # no flag: llama.cpp's defaults, as EngineConfig's


def test_a_thinking_budget_in_tokens_lands_with_its_message_and_the_effort_in_the_kwargs() -> None:
    from hydra_trio.cli.run import engine_config, llama_options

    args = parse("--reasoning-budget", "2048", "--reasoning-budget-message", "Enough.", "--no-rpc-backend")
    cfg = engine_config(args, llama_options(args))
    assert (cfg.reasoning_budget, cfg.reasoning_budget_message) == (2048, "Enough.")
    assert engine_config(parse("--reasoning-budget", "0"), llama_options(args)).reasoning_budget == 0
    p = parse("--reasoning-effort", "low", "--reasoning", "on")
    assert engine_config(p, llama_options(p)).chat_template_kwargs == {
        "reasoning_effort": "low",
        "enable_thinking": True,
    }
    p = parse("--reasoning-effort", "default")
    assert "reasoning_effort" not in engine_config(p, llama_options(p)).chat_template_kwargs


def test_no_flag_leaves_the_engines_defaults_which_are_llama_servers() -> None:
    import attrs

    from hydra_trio.cli.run import engine_config, llama_options
    from hydra_trio.engine.settings import EngineConfig

    args = parse()
    cfg = engine_config(args, llama_options(args))
    plain = EngineConfig(model_path=cfg.model_path, model_alias=cfg.model_alias)
    assert attrs.asdict(cfg, recurse=False) == attrs.asdict(plain, recurse=False)
    given = engine_config(
        p := parse(
            "-n",
            "9",
            "--keep",
            "-1",
            "--cache-reuse",
            "64",
            "-sps",
            "0.5",
            "--embd-normalize",
            "1",
            "--reasoning-format",
            "none",
            "--reasoning-budget",
            "0",
            "--context-shift",
            "-cram",
            "64",
            "--no-cache-idle-slots",
        ),
        llama_options(p),
    )
    assert (
        given.n_predict,
        given.n_keep,
        given.n_cache_reuse,
        given.slot_prompt_similarity,
        given.embd_normalize,
        given.reasoning_format,
        given.reasoning_budget,
        given.context_shift,
        given.cache_ram_mib,
        given.cache_idle_slots,
    ) == (9, -1, 64, 0.5, 1, "none", 0, True, 64, False)
    assert (cfg.cache_ram_mib, cfg.cache_idle_slots) == (8192, True)  # llama-server's defaults
