"""The cluster's three node configs, started as its launcher starts them.

The launcher (a Go program) merges ``global.yaml``'s ``llama.params`` with the node file's (the node's
win) and execs ``BINARY --host H --port P --rpc-port R`` followed by one ``--key value`` per param, keys
sorted, a true boolean as a bare ``--key``, a false one left out, an integer as ``%d``, a float as Go's
``%v``, a string as it is; the node's ``llama.env`` is added to the process environment.  The params
below are the configs' own, as YAML reads them (``"blk\\\\.…"`` in YAML double quotes is ``blk\\.…``);
only the model path, the chat template and the ports are replaced by the packaged model, a test
template and free ports.  Every value is one the cluster's llama-server fork (and llama-server, for its flags) starts
with, so hydra-trio starts with each of them too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hydra_trio import cli
from hydra_trio.cli.run import combined_target, engine_config, extra_ports, llama_options
from hydra_trio.models.presets import resolve_model
from hydra_trio.testing import spawn as _spawn

from .conftest import ROOT, free_port, wait_for
from .test_cli_flags import hydra_info

GLOBAL = {  # global.yaml, llama.params
    "flash-attn": "on",
    "cache-type-v": "q8_0",
    "cache-type-k": "q8_0",
    "kv-unified": True,
    "cont-batching": True,
    "cache-prompt": True,
    "cache-reuse": 64,
    "prio": 3,
    "prio-batch": 1,
    "rope-scaling": "yarn",
    "rope-scale": 5,
    "yarn-orig-ctx": 32768,
    "reasoning": "on",
    "jinja": True,
    "timeout": 1800,
    "chat-template-kwargs": '{"preserve_thinking": true}',
    "log-prefix": False,
    "metrics": True,
    "slots": True,
    "perf": True,
    "log-verbosity": 4,
    "context-shift": True,
}
_SAMPLING = {"temp": 0.86, "repeat-penalty": 1.06, "top-k": 20, "top-p": 0.95}
_OT = r"token_embd\.weight=CPU,output\.weight=CPU,output_norm\.weight=CPU"
NODES = {
    # node-rtx.yaml: the COMBINED head (llama-engine)
    "rtx": {
        "port": 8080,
        "rpc_port": 9503,
        "params": {
            "model": "/models/Qwopus3.6-35B-A3B-v1-APEX-I-Mini.gguf",
            "chat-template-file": "/models/qwen3.6_merged_template.jinja",
            "n-cpu-moe": 8,
            "n-gpu-layers": "all",
            "override-tensor": _OT,
            "ctx-size": 320000,
            "parallel": 2,
            **_SAMPLING,
            "slot-prompt-similarity": 0.4,
            "ggml-rpc-port": 9505,
            "rpc-engine": "localhost:9506",
            "combined-ot-pattern": r"blk\.([0-9]+)\.ffn_.*_exps\.weight=CPU",
        },
        "env": {
            "NVIDIA_VISIBLE_DEVICES": "all",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            "LD_LIBRARY_PATH": "/llama/bin:/usr/local/cuda-13.2/lib64",
            "LLAMA_CHAT_TEMPLATE_KWARGS": '{"preserve_thinking": true}',
        },
    },
    # node-rtx3060.yaml: the head's COMBINED peer (llama-engine)
    "rtx3060": {
        "port": 8081,
        "rpc_port": 9504,
        "params": {
            "model": "/models/Qwopus3.6-35B-A3B-v1-APEX-I-Mini.gguf",
            "chat-template-file": "/models/qwen3.6_merged_template.jinja",
            "n-cpu-moe": 8,
            "n-gpu-layers": 99,
            "override-tensor": _OT,
            "ctx-size": 320000,
            "parallel": 1,
            **_SAMPLING,
            "slot-prompt-similarity": 0.4,
            "ggml-rpc-port": 9506,
        },
        "env": {
            "CUDA_VISIBLE_DEVICES": "1",
            "NVIDIA_VISIBLE_DEVICES": "1",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            "LD_LIBRARY_PATH": "/llama/bin:/usr/local/cuda-13.2/lib64",
            "LLAMA_CHAT_TEMPLATE_KWARGS": '{"preserve_thinking": true}',
        },
    },
    # node-p100.yaml (llama-server)
    "p100": {
        "port": 8086,
        "rpc_port": 9502,
        "params": {
            "model": "/mnt/readonly_data/Qwopus3.6-35B-A3B-v1-APEX-I-Balanced.gguf",
            "chat-template-file": "/mnt/readonly_data/qwen3.6_merged_template.jinja",
            "ctx-size": 160000,
            "parallel": 1,
            "n-gpu-layers": "all",
            "n-cpu-moe": 26,
            **_SAMPLING,
            "override-tensor": "token_embd.weight=CPU",
            "chat-template-kwargs": '{"preserve_thinking": true}',
        },
        "env": {
            "OTEL_SERVICE_NAME": "llama-server",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://192.168.122.1:4318",
        },
    },
}

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)


def _value(v: object) -> str:
    """A param's value as the launcher writes it: ``%d`` for an int, Go's ``%v`` for a float (the shortest
    text that reads back, as Python's ``repr``), a string as it is."""
    return repr(v) if isinstance(v, float) else str(v)


def launcher_argv(node: str, tmp_path: Path, *, model: str = "smollm2-135m-moe", **replace: object) -> list[str]:
    """The launcher's argv for ``node`` (:data:`NODES`), with the packaged ``model``, a test template, and
    ``replace`` (``port``, ``rpc_port``, ``host`` and param keys) over the config's values."""
    cfg = NODES[node]
    tmpl = tmp_path / "chat.jinja"
    tmpl.write_text(TEMPLATE)
    params = {**GLOBAL, **cfg["params"], "model": str(resolve_model(model)[0]), "chat-template-file": str(tmpl)}
    params.update({k: v for k, v in replace.items() if k not in ("port", "rpc_port", "host")})
    argv = [
        "--host",
        str(replace.get("host", "0.0.0.0")),
        "--port",
        str(replace.get("port", cfg["port"])),
        "--rpc-port",
        str(replace.get("rpc_port", cfg["rpc_port"])),
    ]
    for key in sorted(params):
        v = params[key]
        if v is True:
            argv.append(f"--{key}")
        elif v is not False:
            argv += [f"--{key}", _value(v)]
    return argv


def launcher_env(node: str) -> dict[str, str]:
    """The launcher's environment for ``node``: this process's, then the node's ``llama.env``."""
    return {**os.environ, **NODES[node]["env"]}


def test_the_launcher_writes_the_configs_as_its_argv(tmp_path: Path) -> None:
    argv = launcher_argv("rtx", tmp_path)
    assert argv[:6] == ["--host", "0.0.0.0", "--port", "8080", "--rpc-port", "9503"]
    flags = [a for a in argv[6:] if a.startswith("--")]
    assert flags == sorted(flags) and "--log-prefix" not in flags and "--kv-unified" in flags
    i = argv.index("--combined-ot-pattern")
    assert argv[i + 1] == "blk\\.([0-9]+)\\.ffn_.*_exps\\.weight=CPU"
    assert argv[argv.index("--temp") + 1] == "0.86" and argv[argv.index("--rope-scale") + 1] == "5"


@pytest.mark.parametrize("node", sorted(NODES))
def test_each_node_config_parses_with_its_values_in_place(tmp_path: Path, node: str) -> None:
    """Every value of the three configs as given (the real context sizes included) parses, and lands."""
    args = cli.parse_args(launcher_argv(node, tmp_path), environ=launcher_env(node))
    cfg = NODES[node]
    params = {**GLOBAL, **cfg["params"]}
    assert (args.command, args.host, args.port, args.rpc_port) == ("run", "0.0.0.0", cfg["port"], cfg["rpc_port"])
    assert (args.ctx_size, args.parallel, args.timeout) == (params["ctx-size"], params["parallel"], 1800.0)
    s = args.sampling
    assert (s.temperature, s.top_k, s.top_p, s.repeat_penalty) == (0.86, 20, 0.95, 1.06)
    opts = llama_options(args)
    assert (opts.cache_type_k, opts.cache_type_v, opts.flash_attn, opts.kv_unified) == ("q8_0", "q8_0", "on", True)
    assert (opts.rope_scaling, opts.rope_freq_scale, opts.yarn_orig_ctx) == ("yarn", 0.2, 32768)
    assert opts.n_gpu_layers == params["n-gpu-layers"] and opts.n_cpu_moe == params["n-cpu-moe"]
    config = engine_config(args, opts)
    assert config.chat_template_kwargs == {"preserve_thinking": True, "enable_thinking": True}
    _peer, _pattern, notes = combined_target(args)
    if node == "rtx":  # the head: the regex before the last '=' is COMBINED's pattern, the buffer type ignored
        assert (config.peer, config.combined_pattern) == ("localhost:9506", r"blk\.([0-9]+)\.ffn_.*_exps\.weight")
        assert notes == [
            r"--combined-ot-pattern: the buffer type CPU after the last '=' is ignored; COMBINED "
            r"places the tensors matching blk\.([0-9]+)\.ffn_.*_exps\.weight on the --rpc-engine peer"
        ]
        assert extra_ports(args) == (9503, 9505)
    else:
        assert config.peer is None and notes == []
        assert extra_ports(args) == ((9504, 9506) if node == "rtx3060" else (9502,))


@pytest.mark.parametrize(
    ("value", "peer", "pattern"),
    [
        ("blk\\.([0-9]+)\\.ffn_.*_exps\\.weight=CPU", "h:1", "blk\\.([0-9]+)\\.ffn_.*_exps\\.weight"),
        ("ffn_.*_exps=RPC0[127.0.0.1:50052]", "h:1", "ffn_.*_exps"),  # the regex is what precedes the LAST '='
        ("ffn_(up|down)_exps", "h:1", "ffn_(up|down)_exps"),  # no buffer type: the value whole
        ("a=b=CUDA0", "h:1", "a=b"),
        ("=CPU", None, "ffn_(up|down|gate)_exps"),  # an empty regex: COMBINED off, as the engine matches nothing
        ("blk.(=CPU", None, "ffn_(up|down|gate)_exps"),  # not a regex: the engine logs it and stays SOLO
    ],
)
def test_combined_ot_pattern_takes_any_value_the_engine_starts_with(value: str, peer, pattern: str) -> None:
    args = cli.parse_args(["--rpc-engine", "h:1", "--combined-ot-pattern", value], environ={})
    assert combined_target(args)[:2] == (peer, pattern)


@pytest.mark.parametrize(
    ("argv", "ports", "note"),
    [
        (["--ggml-rpc-port", "9505"], (9505,), None),
        (["--ggml-rpc-port", " 9505abc"], (9505,), None),  # atoi: leading blanks, then the digits
        (["--ggml-rpc-port", "none"], (), None),  # atoi: 0, no ggml-RPC port
        (["--ggml-rpc-port", "-1", "--rpc-port", "-1"], (), None),  # the engine opens only a port above 0
        (["--ggml-rpc-port", "70000"], (), "--ggml-rpc-port 70000: not a TCP port; no port opened for it"),
        (
            ["--rpc-engine", "localhost"],
            (),
            "--rpc-engine: expected 'host:port', got 'localhost': COMBINED is off, the node serves SOLO",
        ),
    ],
)
def test_the_engines_port_and_peer_flags_take_what_it_starts_with(argv: list[str], ports, note) -> None:
    args = cli.parse_args(["--port", "8080", *argv], environ={})
    assert extra_ports(args) == ports
    assert combined_target(args)[2] == ([note] if note else [])


class Node:
    """``python -m hydra_trio ARGV`` with the launcher's environment, as the launcher execs the binary."""

    def __init__(self, log: Path, argv: list[str], env: dict[str, str], port: int) -> None:
        self.port, self.base, self.log_path = port, f"http://127.0.0.1:{port}", log
        self._log = open(log, "wb")  # noqa: SIM115  (the child's log, open while the child runs)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hydra_trio", *argv], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> None:
        try:
            _spawn.wait_healthy(self.port, self.proc, 240)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}:\n{self.log()[-6000:]}") from None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.mark.slow
def test_the_combined_head_and_its_peer_start_from_their_configs_and_serve(tmp_path: Path) -> None:
    """node-rtx3060 (the peer) and node-rtx (the head) as the launcher starts them, on loopback with free
    ports and a small context (the configs' 320000 tokens is far beyond the test model): the head reaches
    the peer's --ggml-rpc-port through its --rpc-engine, goes COMBINED with the tensors its
    --combined-ot-pattern's regex names, and serves a chat completion."""
    nodes: list[Node] = []
    try:
        peer_port, peer_rpc, peer_ggml = free_port(), free_port(), free_port()
        peer = Node(
            tmp_path / "peer.log",
            launcher_argv(
                "rtx3060",
                tmp_path,
                host="127.0.0.1",
                port=peer_port,
                rpc_port=peer_rpc,
                **{"ctx-size": 2048, "ggml-rpc-port": peer_ggml},
            ),
            launcher_env("rtx3060"),
            peer_port,
        )
        nodes.append(peer)
        peer.wait_ready()
        head_port, head_rpc, head_ggml = free_port(), free_port(), free_port()
        head = Node(
            tmp_path / "head.log",
            launcher_argv(
                "rtx",
                tmp_path,
                host="127.0.0.1",
                port=head_port,
                rpc_port=head_rpc,
                **{"ctx-size": 4096, "ggml-rpc-port": head_ggml, "rpc-engine": f"localhost:{peer_ggml}"},
            ),
            launcher_env("rtx"),
            head_port,
        )
        nodes.append(head)
        head.wait_ready()
        meta = wait_for(
            lambda: (m := hydra_info(head_rpc))["mode"] == "combined" and m, timeout=240, what="the head in COMBINED"
        )
        assert meta["peer_addr"] == f"localhost:{peer_ggml}"
        props = httpx.get(head.base + "/props", timeout=30).json()
        on_peer = {k: n for k, n in (props["tensor_placement_peer"] or {}).items() if k.startswith("RPC")}
        assert sum(on_peer.values()) == 30 * 3, props["tensor_placement_peer"]  # each layer's 3 expert tensors
        r = httpx.post(
            head.base + "/v1/chat/completions",
            timeout=180,
            json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        assert hydra_info(peer_rpc)["rpc_backend"]["bytes_in"] > 0  # the experts went to the peer's ggml-RPC port
        log = head.log()
        assert log.count("the buffer type CPU after the last '=' is ignored") == 1, log[-4000:]
        for port in (head_ggml, peer_ggml):  # each config's --ggml-rpc-port is served
            assert hydra_info(port)["stage"] == "ready"
    finally:
        for node in reversed(nodes):
            node.stop()
