"""Router mode as the cluster runs it, on real sockets with real child nodes: the head's preset (one section per
quantization, with ``n-cpu-moe`` / ``override-tensor`` / ``alias``), the memory the models take and give back,
``GET /models/sse``, ``POST`` / ``DELETE /models`` and the router's status page.

Expected values are llama-server's in router mode (``tools/server/server-models.cpp``, ``server.cpp`` and the
"Model presets" / "Routing requests" sections of ``tools/server/README.md`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from hydra_trio.cli import parse_args
from hydra_trio.cli.router import build_models
from hydra_trio.cli.router_memory import check_router_memory
from hydra_trio.engine.llama.ggml_backend import GgufHeader
from hydra_trio.models.presets import resolve_model
from hydra_trio.observability.memory import available_memory, resident_bytes
from hydra_trio.router.page import STATIC_DIR
from hydra_trio.router.presets import ModelsConfigError

from .conftest import ROOT, listening_pid, wait_for
from .test_router import TWO_MODELS, Router, chat, error_of, router, run_router_cli
from .test_status_page import page  # noqa: F401 (the fixture: a page in a real headless Chromium)

EXPERTS = r"blk\.[0-9]+\.ffn_.*_exps\.=CPU"
SOME_EXPERTS = r"blk\.1[01]\.ffn_up_exps\.=CPU,blk\.1[01]\.ffn_down_exps\.=CPU"

CLUSTER_HEAD = f"""\
version = 1
[*]
c = 256
np = 1

; the cluster's head: one section per quantization of its model, the experts kept on the CPU
[moe-q4]
model = smollm2-135m-moe
n-cpu-moe = 4
override-tensor = {EXPERTS}
alias = moe,default

[moe-q8]
model = smollm2-135m-moe-q8
n-cpu-moe = 2
override-tensor = {SOME_EXPERTS}
alias = moe-fine

[dense-q8]
model = smollm2-135m-q8
n-cpu-moe = 0
override-tensor = token_embd\\.weight=CPU
alias = dense
"""


def tensors(model: str, pattern: str) -> set[str]:
    """The tensors of ``model`` that ``pattern`` finds (re.search, as llama.cpp's overrides)."""
    rx = re.compile(pattern)
    return {name for name, _ in GgufHeader(resolve_model(model)[0]).tensors if rx.search(name)}


def test_the_cluster_heads_preset_loads_routes_by_alias_and_unloads(tmp_path: Path) -> None:
    """Each section's ``override-tensor`` (a regex with ``\\.``, ``=``, a comma between two) and ``n-cpu-moe``
    reach its child as written (``/models``'s ``args``, the child's ``tensor_placement``); ``--models-max 1``
    swaps the quantizations one for another."""
    with router(tmp_path, CLUSTER_HEAD, "--models-max", "1") as r:
        models = r.models()
        assert list(models) == ["dense-q8", "moe-q4", "moe-q8"]  # by name, as llama-server's std::map
        for name, ot, ncmoe in (("moe-q4", EXPERTS, "4"), ("moe-q8", SOME_EXPERTS, "2"), ("dense-q8", None, "0")):
            args = models[name]["status"]["args"]
            if ot is not None:
                assert args[args.index("--override-tensor") + 1] == ot
                assert f"override-tensor = {ot}\n" in models[name]["status"]["preset"]
            assert args[args.index("--n-cpu-moe") + 1] == ncmoe
        assert models["moe-q4"]["aliases"] == ["default", "moe"] and models["dense-q8"]["aliases"] == ["dense"]

        assert r.http.post("/models/load", json={"model": "moe-q4"}).json() == {"success": True}
        r.wait_status("moe-q4", "loaded")
        placed = r.http.get("/props", params={"model": "moe"}).json()["tensor_placement"]
        assert sum(placed.values()) == len(tensors("smollm2-135m-moe", EXPERTS.split("=")[0])) == 90

        reply = r.http.post("/v1/chat/completions", json=chat("moe-fine"))  # by alias: moe-q4 makes room
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "moe-q8" and reply.json()["usage"]["completion_tokens"] == 4
        assert r.status("moe-q4") == "unloaded"
        placed = r.http.get("/props", params={"model": "moe-fine"}).json()["tensor_placement"]
        first_two = r"blk\.[01]\.ffn_(up|down|gate|gate_up)_(ch|)exps"
        some = {t for p in SOME_EXPERTS.split(",") for t in tensors("smollm2-135m-moe-q8", p.split("=")[0])}
        assert sum(placed.values()) == len(some | tensors("smollm2-135m-moe-q8", first_two)) == 4 + 6

        assert r.http.post("/models/unload", json={"model": "moe-fine"}).json() == {"success": True}
        r.wait_status("moe-q8", "unloaded")
        assert "failed" not in r.models()["moe-q8"]["status"]


# ------------------------------------------------------------------------------------------ memory


def node_kv_bytes_per_token(model: str) -> int:
    """The node's own count: a node asked for a context no machine holds refuses with its bytes per token."""
    out = subprocess.run(
        [sys.executable, "-m", "hydra_trio", "-m", model, "-c", "2000000000", "--port", "0", "--no-rpc-backend"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    found = re.search(r"KV cache \(K f16, V f16: (\d+) bytes per token\); only \d+ MiB", out.stderr)
    assert out.returncode != 0 and found, out.stderr
    return int(found.group(1))


def test_the_start_up_memory_check_counts_what_models_max_runs_at_once(tmp_path: Path) -> None:
    """Two models whose KV caches each take 60% of the memory available: each alone passes the node's check;
    ``--models-max 2`` (or 0, no limit) runs both at once and is refused at start, exit 2, naming each model's
    size with the node's own bytes per token; ``--models-max 1`` starts."""
    per_token = node_kv_bytes_per_token("smollm2-135m")
    free = available_memory()
    assert free is not None
    n_ctx = int(0.6 * free / per_token)
    preset = f"[*]\nnp = 1\nc = {n_ctx}\n[a]\nmodel = smollm2-135m\n[b]\nmodel = smollm2-135m-moe\n"
    for models_max in ("2", "0"):
        out = run_router_cli(tmp_path, preset, "--models-max", models_max)
        assert out.returncode == 2, out.stderr
        assert f"2 models at once (--models-max {models_max}) need" in out.stderr, out.stderr
        assert f"a {n_ctx * per_token / 2**20:.0f} MiB (n_ctx {n_ctx}, {per_token} bytes per token)" in out.stderr
        assert "MiB of memory is available" in out.stderr and "listening" not in out.stderr
    with router(tmp_path, preset, "--models-max", "1") as r:
        assert "memory: 1 model at once (--models-max 1) take up to" in r.log()
        assert r.status("a") == "unloaded"


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (/proc/PID/stat's fourth field)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_an_unload_gives_the_models_memory_back(tmp_path: Path) -> None:
    """The model lives in its child (its resident set holds the weights it ran with); the router's own stays
    as it was (it relays, it loads nothing); after ``/models/unload`` the child process is gone."""
    weights = resolve_model("smollm2-135m")[0].stat().st_size
    # without the router's own ggml-RPC backend, whose child would be the router's other child
    with router(tmp_path, TWO_MODELS, "--models-max", "1", "--no-rpc-backend") as r:
        assert r.http.get("/models").status_code == 200
        before = resident_bytes(r.proc.pid)
        assert before is not None
        assert r.http.post("/v1/chat/completions", json=chat("smollm2-135m")).status_code == 200  # loads, runs
        args = r.http.get("/models").json()["data"][0]["status"]["args"]
        child = listening_pid(int(args[args.index("--port") + 1]))
        assert child in children_of(r.proc.pid)
        child_rss = resident_bytes(child)
        assert child_rss is not None and child_rss > weights // 2, (child_rss, weights)
        assert r.http.post("/models/unload", json={"model": "smollm2-135m"}).json() == {"success": True}
        r.wait_status("smollm2-135m", "unloaded")
        # what is left is the fork server the children come from (cli/spare.py), with no model
        assert not Path(f"/proc/{child}").exists()
        for pid in children_of(r.proc.pid):
            assert Path(f"/proc/{pid}/comm").read_text().strip() == "hydra-forksrv"
            spare_rss = resident_bytes(pid)
            assert spare_rss is not None and spare_rss < child_rss - weights // 2, (spare_rss, child_rss)
        after = resident_bytes(r.proc.pid)
        assert after is not None and after - before < weights // 2, (before, after, weights)


# ------------------------------------------------------------------------------------------ /models/sse, POST / DELETE

ONE_MODEL = "[*]\nc = 256\nnp = 1\n[small]\nmodel = smollm2-135m\n"


class SseReader:
    """``GET /models/sse`` read in a thread: :attr:`events` (each ``data:`` line's JSON), :attr:`ended`."""

    def __init__(self, base_url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self.headers: dict[str, str] = {}
        self.ended = threading.Event()
        self.opened = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base_url,), daemon=True)
        self.thread.start()
        assert self.opened.wait(120), "the SSE stream did not open"

    def _read(self, base_url: str) -> None:
        try:
            with httpx.stream("GET", f"{base_url}/models/sse", timeout=httpx.Timeout(300, read=None)) as s:
                self.headers = {"status": str(s.status_code), "content-type": s.headers["content-type"]}
                self.opened.set()
                for line in s.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except httpx.HTTPError:
            pass
        finally:
            self.opened.set()
            self.ended.set()

    def wait(self, model: str, event: str, status: str | None = None) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            return next(
                (
                    e
                    for e in self.events
                    if e["model"] == model
                    and e["event"] == event
                    and (status is None or e.get("data", {}).get("status") == status)
                ),
                None,
            )

        return wait_for(seen, 300, f"{event} {status or ''} of {model}")


def test_models_sse_sends_llama_servers_events_through_load_and_unload(tmp_path: Path) -> None:
    """``{"model", "event", "data"}`` as ``data: JSON`` events: ``model_status`` loading when the child starts,
    ``status_change`` loaded with the child's ``/v1/models`` entry as ``info``, ``status_change`` unloaded with
    its ``exit_code``; the stream ends when the router stops."""
    with router(tmp_path, ONE_MODEL) as r:
        sse = SseReader(str(r.http.base_url))
        assert sse.headers == {"status": "200", "content-type": "text/event-stream; charset=utf-8"}
        assert r.http.post("/models/load", json={"model": "small"}).json() == {"success": True}
        assert sse.wait("small", "model_status") == {
            "model": "small",
            "event": "model_status",
            "data": {"status": "loading"},
        }
        loaded = sse.wait("small", "status_change", "loaded")
        assert loaded["data"]["info"]["id"] == "small" and loaded["data"]["info"]["meta"]["n_ctx"] == 256
        assert r.http.post("/models/unload", json={"model": "small"}).json() == {"success": True}
        assert sse.wait("small", "status_change", "unloaded") == {
            "model": "small",
            "event": "status_change",
            "data": {"status": "unloaded", "exit_code": 0},
        }
        assert [e["event"] for e in sse.events] == ["model_status", "status_change", "status_change"]
        assert all(line.startswith("data: {") or line == "" for line in sse.lines)  # no "event:" lines
    assert sse.ended.wait(60), "the SSE stream outlived the router"


def test_post_and_delete_models_add_and_remove_a_model_that_is_here(tmp_path: Path) -> None:
    """``POST /models`` of a model already on this machine lists it at once (``source: "cache"``,
    ``can_remove: true``, the ``[*]`` flags); what would need a download, or a name listed, is llama-server's
    400; ``DELETE /models`` stops and removes a model so added, and refuses a preset's (500, as llama-server)."""
    with router(tmp_path, ONE_MODEL) as r:
        sse = SseReader(str(r.http.base_url))
        post, delete = r.http.post, r.http.delete
        assert error_of(post("/models", json={})) == (400, "invalid_request_error", "model must be a non-empty string")
        for name in ("no-such-model", "gemma-3-270m", "small"):  # not here (gemma: not installed); a preset's name
            assert error_of(post("/models", json={"model": name})) == (
                400,
                "invalid_request_error",
                "model validation failed, unable to download",
            ), name
        assert list(r.models()) == ["small"]

        assert post("/models", json={"model": "smollm2-135m-q8"}).json() == {"success": True}
        assert sse.wait("smollm2-135m-q8", "download_finished") == {
            "model": "smollm2-135m-q8",
            "event": "download_finished",
        }
        assert sse.wait("*", "models_reload") == {"model": "*", "event": "models_reload"}
        added = r.models()["smollm2-135m-q8"]
        assert (added["source"], added["can_remove"], added["status"]["value"]) == ("cache", True, "unloaded")
        args = added["status"]["args"]
        assert args[args.index("--ctx-size") + 1] == "256" and args[args.index("--model") + 1] == "smollm2-135m-q8"
        assert r.models()["small"]["can_remove"] is False
        assert error_of(post("/models", json={"model": "smollm2-135m-q8"})) == (
            400,
            "invalid_request_error",
            "model 'smollm2-135m-q8' already exists",
        )

        reply = post("/v1/chat/completions", json=chat("smollm2-135m-q8"))  # autoloads like any model
        assert reply.status_code == 200 and reply.json()["model"] == "smollm2-135m-q8", reply.text

        assert error_of(delete("/models")) == (400, "invalid_request_error", "model must be a non-empty string")
        assert error_of(delete("/models", params={"model": "nope"})) == (
            500,
            "server_error",
            "model name=nope is not found",
        )
        assert error_of(delete("/models", params={"model": "small"})) == (
            500,
            "server_error",
            "model name=small is not removable (not from cache)",
        )
        assert delete("/models", params={"model": "smollm2-135m-q8"}).json() == {"success": True}
        assert list(r.models()) == ["small"]  # stopped and gone when the reply came
        assert sse.wait("smollm2-135m-q8", "status_change", "unloaded")["data"]["exit_code"] == 0
        assert sse.wait("smollm2-135m-q8", "model_remove") == {"model": "smollm2-135m-q8", "event": "model_remove"}
        assert error_of(post("/v1/chat/completions", json=chat("smollm2-135m-q8")))[2] == (
            "model 'smollm2-135m-q8' not found"
        )


# ------------------------------------------------------------------------------------------ status page


def test_the_router_serves_its_status_page_open_and_its_data_behind_the_key(tmp_path: Path) -> None:
    """``/`` and ``/static/...`` are open, as the node's page (llama-server leaves its web UI's files open);
    ``/health`` too, listing every model; the page's data (``/models``, ``/models/sse``) needs the key."""
    path = tmp_path / "p.ini"
    path.write_text(ONE_MODEL)
    r = Router(tmp_path / "router.log", "--models-preset", str(path), "--api-key", "sk-router")
    try:
        r.wait_listening()
        page = r.http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text
        assert 'src="static/router.js"' in page.text and 'href="static/status.css"' in page.text
        assert page.text.index('src="static/page.js"') < page.text.index('src="static/router.js"')
        for name in ("router.js", "page.js", "status.css"):
            f = r.http.get(f"/static/{name}")
            assert f.status_code == 200 and f.content == (STATIC_DIR / name).read_bytes()
        assert r.http.get("/static/router.html").headers["location"] == "../"
        assert r.http.get("/health").json()["models"] == [{"id": "small", "status": "unloaded"}]
        assert r.http.get("/models").status_code == 401 and r.http.get("/models/sse").status_code == 401
        keyed = r.http.get("/models", headers={"Authorization": "Bearer sk-router"})
        assert [m["id"] for m in keyed.json()["data"]] == ["small"]
    finally:
        assert r.stop() == 0, r.log()


def test_the_status_page_lists_every_model_and_follows_their_status_live(tmp_path: Path, page: Any) -> None:  # noqa: F811
    """In a real Chromium: every model is a row with its status, redrawn from ``/models/sse`` as it loads and
    unloads, and a model ``POST /models`` adds gets its row."""
    from playwright.sync_api import expect

    with router(tmp_path, TWO_MODELS) as r:
        page.goto(f"{r.http.base_url}/")
        expect(page.locator("#link")).to_have_attribute("data-state", "open")
        rows = page.locator("#models-body tr")
        expect(rows).to_have_count(2)
        small = page.locator('#models-body tr[data-model="smollm2-135m"]')
        expect(small.locator(".status")).to_have_text("unloaded")
        expect(small.locator(".aliases")).to_have_text("small")
        expect(page.locator("#models-max")).to_have_text("4")

        assert r.http.post("/models/load", json={"model": "small"}).json() == {"success": True}
        expect(small.locator(".status")).to_have_text("loaded")
        expect(small.locator(".n_ctx")).to_have_text("256")
        expect(small.locator(".port")).not_to_have_text("")
        expect(page.locator("#running")).to_have_text("1")
        expect(page.locator("#events li .type").first).to_have_text("status_change")

        assert r.http.post("/models", json={"model": "smollm2-135m-moe"}).json() == {"success": True}
        expect(rows).to_have_count(3)
        expect(page.locator('#models-body tr[data-model="smollm2-135m-moe"] .source')).to_have_text("cache")

        assert r.http.post("/models/unload", json={"model": "small"}).json() == {"success": True}
        expect(small.locator(".status")).to_have_text("unloaded")
        expect(page.locator("#running")).to_have_text("0")
        assert [row.get_attribute("data-model") for row in rows.all()] == [
            "smollm2-135m",
            "smollm2-135m-moe",
            "smollm2-135m-q8",
        ]


def test_the_memory_check_refuses_kv_caches_and_warns_for_weights(tmp_path: Path, caplog: Any) -> None:
    """With a given memory available: the largest ``--models-max`` KV caches above it are refused; their weights
    and KV caches above it only warn (the weights are mapped from their files, as the node does not count them)."""
    path = tmp_path / "p.ini"
    path.write_text("[*]\nnp = 1\nc = 1024\n[a]\nmodel = smollm2-135m\n[b]\nmodel = smollm2-135m-moe\nc = 4096\n")
    args = parse_args(["--models-preset", str(path)], {})
    models, _ = build_models(args, args.argv, parse_args, {})
    sizes = check_router_memory(models, 1, parse_args, available=2**40)
    weights = {n: resolve_model(m)[0].stat().st_size for n, m in (("a", "smollm2-135m"), ("b", "smollm2-135m-moe"))}
    assert {n: (f.weights, f.kv, f.n_ctx) for n, f in sizes.items()} == {
        "a": (weights["a"], 1024 * 23040, 1024),
        "b": (weights["b"], 4096 * 23040, 4096),
    }
    kv_both = (1024 + 4096) * 23040
    with pytest.raises(ModelsConfigError, match=r"2 models at once \(--models-max 2\) need 112 MiB of KV cache"):
        check_router_memory(models, 2, parse_args, available=kv_both - 1)
    check_router_memory(models, 1, parse_args, available=kv_both - 1)  # one at once: b's alone fits
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hydra_trio"):
        check_router_memory(models, 0, parse_args, available=kv_both + min(weights.values()))
    assert "2 models at once (--models-max 0) take up to" in caplog.text and "more than the" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hydra_trio"):
        check_router_memory(models, 0, parse_args, available=kv_both + sum(weights.values()))
    assert caplog.text == ""


def test_a_relayed_reply_may_stay_silent_as_long_as_the_routers_timeout(tmp_path: Path) -> None:
    """llama-server's proxy reads its children with its ``--timeout``: a whole (not streamed) reply that takes
    longer than it is a 500 ``proxy error``; a stream whose chunks come sooner than it is relayed whole."""
    with router(tmp_path, ONE_MODEL, "--no-rpc-backend", "--timeout", "3") as r:
        long = {
            "model": "small",
            "prompt": "Once upon a time",
            "max_tokens": 2000,
            "ignore_eos": True,
            "temperature": 0,
        }
        assert r.http.post("/v1/completions", json={**long, "max_tokens": 1}).status_code == 200  # loaded
        slow = r.http.post("/v1/completions", json=long)
        assert slow.status_code == 500 and "proxy error: ReadTimeout" in slow.json()["error"]["message"], slow.text
        with r.http.stream("POST", "/v1/completions", json={**long, "max_tokens": 200, "stream": True}) as s:
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert s.status_code == 200 and len(chunks) >= 200
