"""Router mode (``--models-preset`` / ``--models-dir`` without ``-m``) on real sockets: the router process, its
child nodes serving the real SmolLM2 (its Q4_1 and the Q8_0 made from it), llama-server's statuses and bodies.

Expected values are llama-server's in router mode (``tools/server/server-models.cpp`` and ``server.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors; the slow test asks the binary built from it the same questions):
``POST /models/load`` answers ``{"success": true}`` once the child is started (``loading``), ``GET /models``
lists every model with ``status.value`` ``unloaded`` / ``loading`` / ``loaded`` and the ``args`` it runs with,
a model that failed is ``unloaded`` with ``failed: true`` and its ``exit_code``, requests go to the model their
body's ``model`` (or ``?model=``) names, and ``--models-max`` unloads the least recently used idle model first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hydra_trio.cli import parse_args
from hydra_trio.cli.router import build_models
from hydra_trio.models.presets import PRESETS, resolve_model
from hydra_trio.router.ini import parse_ini
from hydra_trio.testing.spawn import SHARED_MACHINE_ENV

from .conftest import ROOT, free_port, wait_for

TWO_MODELS = """\
version = 1
; every model: a small context, one slot
[*]
c = 256
np = 1

[smollm2-135m]
model = smollm2-135m
alias = small

[smollm2-135m-q8]
model = smollm2-135m-q8
stop-timeout = 5
"""


class Router:
    """``python -m hydra_trio FLAGS`` (router mode), or ``binary FLAGS``, in a subprocess logging to ``log_path``."""

    def __init__(self, log_path: Path, *args: str, binary: str | None = None) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop)
        command = [binary] if binary else [sys.executable, "-m", "hydra_trio"]
        self.proc = subprocess.Popen(
            [*command, "--port", str(self.port), "-t", "1", *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SHARED_MACHINE_ENV},
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_listening(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}:\n{self.log()}"
            try:
                return self.http.get("/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 120, "the router listens")

    def models(self) -> dict[str, dict[str, Any]]:
        r = self.http.get("/models")
        assert r.status_code == 200, r.text
        return {m["id"]: m for m in r.json()["data"]}

    def status(self, name: str) -> str:
        return self.models()[name]["status"]["value"]

    def wait_status(self, name: str, value: str, timeout: float = 300) -> None:
        wait_for(lambda: self.status(name) == value, timeout, f"{name} {value}")

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def router(tmp_path: Path, preset: str, *args: str) -> Iterator[Router]:
    path = tmp_path / "preset.ini"
    path.write_text(preset)
    r = Router(tmp_path / "router.log", "--models-preset", str(path), *args)
    ports: list[int] = []
    try:
        r.wait_listening()
        yield r
        ports = [m["status"]["args"][m["status"]["args"].index("--port") + 1] for m in r.models().values()]
    finally:
        code = r.stop()
    assert code == 0, f"router exit code {code}:\n{r.log()}"
    for port in map(int, ports):  # every child stopped with the router
        if port:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"a child still listens on {port}"


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def error_of(r: httpx.Response) -> tuple[int, str, str]:
    e = r.json()["error"]
    return r.status_code, e["type"], e["message"]


# ------------------------------------------------------------------------------------------ presets, at start


def test_the_ini_dialect_is_llama_servers() -> None:
    """``common/preset.cpp``'s grammar: keys keep their case, ``;``/``#`` end a value even without a space
    before them, quotes stay, keys before any section are in ``default``, a repeated section starts again."""
    text = 'top = 1\n[a]\nCtx-Size = 4096;comment\nx = "q" # c\n\n  ; indented comment\n[b]\nk=v\n[a]\ny = 2\n'
    assert parse_ini(text) == {"default": {"top": "1"}, "a": {"y": "2"}, "b": {"k": "v"}}
    assert parse_ini('[m]\nCtx-Size = 4096;c\nx = "q" # c\n')["m"] == {"Ctx-Size": "4096", "x": '"q"'}
    with pytest.raises(ValueError, match="line 2"):
        parse_ini("[m]\n  c = 1\n")  # llama-server reads no indented key (configparser would continue a value)


def run_router_cli(tmp_path: Path, preset: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "p.ini"
    path.write_text(preset)
    return subprocess.run(
        [sys.executable, "-m", "hydra_trio", "--models-preset", str(path), "--port", str(free_port()), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "preset, needles",
    [
        ("[mine]\nmodel = smollm2-135m\nfoo-bar = 1\n", ["option 'foo-bar' not recognized in preset 'mine'"]),
        ("[mine]\nmodel = smollm2-135m\nc = abc\n", ["preset 'mine'", "key 'c'", "-c/--ctx-size", "abc"]),
        ("[*]\nnp = 0\n[mine]\nmodel = smollm2-135m\n", ["preset 'mine'", "key 'np' (from [*])", "--parallel"]),
        ("[mine]\nmodel = smollm2-135m\nhf-repo = a/b\n", ["preset 'mine'", "key 'hf-repo'", "not supported"]),
        ("[mine]\nmodel = smollm2-135m\nno-warmup = maybe\n", ["preset 'mine'", "key 'no-warmup'", "no boolean"]),
        ("[mine]\nmodel = smollm2-135m\nstop-timeout = soon\n", ["preset 'mine'", "key 'stop-timeout'"]),
        ("[mine]\nmodel = /no/such.gguf\n", ["preset 'mine'", "key 'model'", "/no/such.gguf"]),
        ("[mine]\nc = 256\n", ["preset 'mine'", "no model"]),
        ("[mine]\n  model = smollm2-135m\n", ["failed to parse server config file", "line 2"]),
        (
            "[a]\nmodel = smollm2-135m\nload-on-startup = true\n[b]\nmodel = smollm2-135m\nload-on-startup = 1\n",
            ["number of models to load on startup (2) exceeds models_max (1)"],
        ),
    ],
)
def test_a_preset_the_node_refuses_exits_2_naming_the_preset_the_key_and_why(
    tmp_path: Path, preset: str, needles: list[str]
) -> None:
    """Before anything listens or loads (llama-server refuses an unknown key at start, with this message; a
    value it would only refuse when the child starts is refused here at once)."""
    out = run_router_cli(tmp_path, preset, "--models-max", "1")
    assert out.returncode == 2, out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr
    assert "listening" not in out.stderr and "spawning" not in out.stderr


def test_precedence_is_the_command_line_then_the_section_then_the_global_section(tmp_path: Path) -> None:
    """llama-server's cascade, and the keys it takes: a long or short spelling, a negative one (stored
    inverted), an environment variable name; the router's own flags and the model flags stay with the router."""
    path = tmp_path / "p.ini"
    path.write_text(
        "[*]\nc = 512\nnp = 2\ntemp = 0.5\n[m]\nmodel = smollm2-135m\nLLAMA_ARG_N_PARALLEL = 3\n"
        "no-warmup = 1\nctx-size = 1024\n"
    )
    argv = ["--models-preset", str(path), "--models-max", "2", "--temp", "0.25", "--api-key", "k", "--port", "9"]
    args = parse_args(argv, {})
    (m,), startup = build_models(args, args.argv, parse_args, {})
    assert startup == []
    flags = m.args()[3:]
    # ordered by each flag's first spelling, written with its last (llama-server's std::map<common_arg, ...>)
    assert flags == [
        "--host",
        "127.0.0.1",
        "--no-rpc-backend",
        "--port",
        "0",
        "--temperature",
        "0.25",
        "--no-warmup",
        "--alias",
        "m",
        "--ctx-size",
        "1024",
        "--model",
        "smollm2-135m",
        "--parallel",
        "3",
    ]
    assert m.entry(0)["status"]["preset"] == (
        "[m]\ntemperature = 0.25\nwarmup = false\nctx-size = 1024\nmodel = smollm2-135m\nparallel = 3\n\n"
    )


# ------------------------------------------------------------------------------------------ serving


def test_load_route_stream_and_unload_as_llama_server(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--models-max", "2") as r:
        models = r.models()
        assert set(models) == {"smollm2-135m", "smollm2-135m-q8"}
        small = models["smollm2-135m"]
        assert small["status"]["value"] == "unloaded" and small["aliases"] == ["small"] and small["tags"] == []
        assert {k for k in small if k != "created"} == {
            "id",
            "aliases",
            "tags",
            "object",
            "owned_by",
            "status",
            "architecture",
            "source",
            "can_remove",
        }
        assert small["source"] == "preset" and small["can_remove"] is False and small["object"] == "model"
        assert small["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
        args = small["status"]["args"]
        assert args[:3] == [sys.executable, "-m", "hydra_trio"] and args[args.index("--port") + 1] == "0"
        assert args[args.index("--alias") + 1] == "smollm2-135m" and args[args.index("--ctx-size") + 1] == "256"
        assert "stop-timeout = 5\n" in models["smollm2-135m-q8"]["status"]["preset"]
        health = r.http.get("/health").json()
        assert health == {
            "status": "ok",
            "models": [{"id": "smollm2-135m", "status": "unloaded"}, {"id": "smollm2-135m-q8", "status": "unloaded"}],
        }

        r1 = r.http.post("/models/load", json={"model": "smollm2-135m"})
        assert (r1.status_code, r1.json()) == (200, {"success": True})
        assert r.status("smollm2-135m") in ("loading", "loaded")
        assert error_of(r.http.post("/models/load", json={"model": "small"})) == (
            400,
            "invalid_request_error",
            "model is already running",
        )
        r.wait_status("smollm2-135m", "loaded")
        entry = r.models()["smollm2-135m"]
        assert entry["meta"]["n_ctx"] == 256 and entry["meta"]["n_vocab"] == 49152  # the child's own entry
        port = int(entry["status"]["args"][entry["status"]["args"].index("--port") + 1])
        assert port > 0

        reply = r.http.post("/v1/chat/completions", json=chat("small"))  # an alias routes too
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "smollm2-135m" and reply.json()["usage"]["completion_tokens"] == 4
        direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat("x"), timeout=300)
        assert direct.json()["choices"][0]["message"] == reply.json()["choices"][0]["message"]  # greedy, same path

        events = []
        with r.http.stream("POST", "/v1/chat/completions", json=chat("smollm2-135m", stream=True)) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]" and len(events) >= 3
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        props = r.http.get("/props").json()
        assert props["role"] == "router" and props["max_instances"] == 2 and props["models_autoload"] is True
        assert r.http.get("/props", params={"model": "small"}).json()["total_slots"] == 1  # the child's
        assert r.http.get("/slots", params={"model": "smollm2-135m"}).json()[0]["n_ctx"] == 256
        assert r.http.post("/tokenize", json={"model": "small", "content": "hi"}).json() == {
            "tokens": httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"content": "hi"}).json()["tokens"]
        }

        assert r.http.post("/models/unload", json={"model": "smollm2-135m"}).json() == {"success": True}
        r.wait_status("smollm2-135m", "unloaded")
        status = r.models()["smollm2-135m"]["status"]
        assert "failed" not in status and "meta" not in r.models()["smollm2-135m"]
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0  # the child is gone


def test_refusals_have_llama_servers_statuses_and_messages(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS, "--no-models-autoload") as r:
        post = r.http.post
        no_model = {"messages": [{"role": "user", "content": "hi"}]}
        assert error_of(post("/v1/chat/completions", json=no_model)) == (
            400,
            "invalid_request_error",
            "model name is missing from the request",
        )
        assert error_of(post("/v1/chat/completions", json=chat("nope"))) == (
            400,
            "invalid_request_error",
            "model 'nope' not found",
        )
        assert error_of(post("/v1/chat/completions", json=chat("small"))) == (
            400,
            "invalid_request_error",
            "model is not loaded",
        )
        assert error_of(r.http.get("/slots")) == (
            400,
            "invalid_request_error",
            "model name is missing from the request",
        )
        assert error_of(r.http.get("/props", params={"model": "small"})) == (
            400,
            "invalid_request_error",
            "model is not loaded",
        )
        assert error_of(post("/models/load", json={"model": "nope"}))[:2] == (404, "not_found_error")
        assert error_of(post("/models/unload", json={"model": "nope"})) == (
            400,
            "invalid_request_error",
            "model is not found",
        )
        assert error_of(post("/models/unload", json={"model": "small"})) == (
            400,
            "invalid_request_error",
            "model is not running",
        )
        assert post("/models/load", content=b"{nope").status_code == 400
        assert r.http.get("/health").status_code == 200
        assert {m: r.status(m) for m in ("smollm2-135m", "smollm2-135m-q8")} == {
            "smollm2-135m": "unloaded",
            "smollm2-135m-q8": "unloaded",
        }  # nothing was loaded by any of them


def test_autoload_and_the_least_recently_used_model_unloads_at_models_max(tmp_path: Path) -> None:
    """``--models-max 1``: a request for the other model unloads the idle one first; two requests at once
    for a model that is not running share one load; ``?autoload=false`` refuses instead.  (Another ``-c``: the
    two are no quantization siblings, whose switch is in place: tests/test_router_swap.py.)"""
    with router(tmp_path, TWO_MODELS + "c = 512\n", "--models-max", "1") as r:
        replies: list[httpx.Response] = []

        def ask() -> None:
            replies.append(httpx.post(f"{r.http.base_url}/v1/chat/completions", json=chat("smollm2-135m"), timeout=300))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [x.status_code for x in replies] == [200, 200], [x.text for x in replies]
        assert r.log().count("spawning server instance with name=smollm2-135m ") == 1
        assert r.status("smollm2-135m") == "loaded"

        assert error_of(r.http.post("/v1/chat/completions?autoload=false", json=chat("smollm2-135m-q8"))) == (
            400,
            "invalid_request_error",
            "model is not loaded",
        )
        reply = r.http.post("/v1/chat/completions", json=chat("smollm2-135m-q8"))
        assert reply.status_code == 200 and reply.json()["model"] == "smollm2-135m-q8"
        assert {m: r.status(m) for m in ("smollm2-135m", "smollm2-135m-q8")} == {
            "smollm2-135m": "unloaded",
            "smollm2-135m-q8": "loaded",
        }
        assert "models_max" in r.log() or "evicting idle LRU name=smollm2-135m" in r.log()

        assert r.http.post("/models/load", json={"model": "smollm2-135m"}).json() == {"success": True}
        assert r.status("smollm2-135m-q8") == "unloaded"  # /models/load waited for the LRU model to exit
        r.wait_status("smollm2-135m", "loaded")


def test_a_model_that_fails_to_load_is_unloaded_with_failed_and_its_exit_code(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is no GGUF file")
    with router(tmp_path, f"[broken]\nmodel = {broken}\nc = 256\n") as r:
        assert error_of(r.http.post("/v1/completions", json={"model": "broken", "prompt": "hi"})) == (
            500,
            "server_error",
            "model name=broken failed to load",
        )
        status = r.models()["broken"]["status"]
        assert status["value"] == "unloaded" and status["failed"] is True and status["exit_code"] != 0
        assert r.http.get("/health").json()["models"] == [{"id": "broken", "status": "unloaded", "failed": True}]
        assert r.http.post("/models/load", json={"model": "broken"}).json() == {"success": True}  # tries again


def test_a_client_that_leaves_a_stream_ends_its_request_in_the_child(tmp_path: Path) -> None:
    with router(tmp_path, TWO_MODELS) as r:
        with r.http.stream(
            "POST", "/v1/chat/completions", json=chat("smollm2-135m", stream=True, max_tokens=200, ignore_eos=True)
        ) as s:
            for line in s.iter_lines():
                if '"content"' in line:
                    break  # the first token: leave
        wait_for(
            lambda: not r.http.get("/slots", params={"model": "smollm2-135m"}).json()[0]["is_processing"],
            60,
            "the child's slot is idle",
        )
        slot = r.http.get("/slots", params={"model": "smollm2-135m"}).json()[0]
        assert slot["next_token"][0]["n_decoded"] < 200


def test_models_dir_lists_each_gguf_and_folder(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "withproj").mkdir(parents=True)
    small = resolve_model("smollm2-135m")[0]
    (models / "solo.gguf").symlink_to(small)
    (models / "withproj" / "model.gguf").symlink_to(small)
    (models / "mmproj-x.gguf").write_bytes(b"")  # a projector alone is no model
    args = parse_args(["--models-dir", str(models), "-c", "256"], {})
    found, _ = build_models(args, args.argv, parse_args, {})
    assert [(m.name, m.source) for m in found] == [("solo", "models_dir"), ("withproj", "models_dir")]
    assert found[1].preset.get("--model") == str(models / "withproj" / "model.gguf")


# ------------------------------------------------------------------------------------------ llama-server


@pytest.mark.slow
def test_the_same_preset_answers_as_llama_servers_router(tmp_path: Path) -> None:
    """llama-server built from the vendored llama.cpp and this router, on one preset (files by path, which
    llama-server reads): the same models, keys, statuses over load and unload, args order and errors."""
    built = subprocess.run(
        [str(ROOT / "bench" / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    binary = built.stdout.strip().splitlines()[-1]
    q8 = PRESETS["smollm2-135m-q8"].locate()
    preset = (
        f"version = 1\n[*]\nc = 256\nnp = 1\n[small]\nmodel = {resolve_model('smollm2-135m')[0]}\n"
        f"alias = tiny\n[q8]\nmodel = {q8}\nno-warmup = true\nstop-timeout = 3\n"
    )
    path = tmp_path / "p.ini"
    path.write_text(preset)
    theirs = Router(tmp_path / "llama-server.log", "--models-preset", str(path), "--models-max", "1", binary=binary)
    try:
        theirs.wait_listening()
        seen = [_walk(theirs)]
    finally:
        theirs.stop()
    with router(tmp_path, preset, "--models-max", "1") as ours:
        seen.append(_walk(ours))
    for key in ("order", "keys", "statuses", "errors", "flags", "preset", "aliases"):
        assert seen[0][key] == seen[1][key], key


def _walk(r: Router) -> dict[str, Any]:
    """The same questions to a router: its models' keys and flags, statuses through load / route / unload, errors."""
    out: dict[str, Any] = {"statuses": []}
    models = r.models()
    out["order"] = list(models)
    out["keys"] = set().union(*(set(m) for m in models.values())) - {"created"}
    out["aliases"] = {n: m["aliases"] for n, m in models.items()}
    out["flags"] = {
        n: [a for a in m["status"]["args"] if a.startswith("-") and a not in ("-m", "--no-rpc-backend")]
        for n, m in models.items()
    }
    out["preset"] = {n: m["status"]["preset"] for n, m in models.items()}
    out["statuses"].append({n: m["status"]["value"] for n, m in models.items()})
    assert r.http.post("/models/load", json={"model": "small"}).json() == {"success": True}
    r.wait_status("small", "loaded")
    out["statuses"].append({n: r.status(n) for n in models})
    assert r.http.post("/v1/completions", json={"model": "q8", "prompt": "hi", "max_tokens": 2}).status_code == 200
    out["statuses"].append({n: r.status(n) for n in models})
    assert r.http.post("/models/unload", json={"model": "q8"}).json() == {"success": True}
    r.wait_status("q8", "unloaded")
    out["statuses"].append({n: r.status(n) for n in models})
    out["errors"] = [
        error_of(r.http.post("/v1/completions", json={"prompt": "hi"})),
        error_of(r.http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})),
        error_of(r.http.post("/v1/completions?autoload=false", json={"model": "q8", "prompt": "hi"})),
        error_of(r.http.post("/models/load", json={"model": "nope"}))[:2],
        error_of(r.http.post("/models/unload", json={"model": "q8"})),
        error_of(r.http.get("/slots")),
    ]
    return out
