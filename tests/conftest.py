"""Fixtures: real hydra-trio server processes on loopback, serving the real SmolLM2."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hydra_trio.testing import spawn as _spawn
from hydra_trio.testing.spawn import ROOT, free_port  # noqa: F401  (tests import both from here)

# The suite must pass on a machine busy with other work: every server and
# client process the tests start waits passively at llama.cpp's thread
# barriers (see hydra_trio.testing.spawn.SHARED_MACHINE_ENV for the measurements).
for _k, _v in _spawn.SHARED_MACHINE_ENV.items():
    os.environ.setdefault(_k, _v)

# README's question ("Talk to it"), for tests that need SmolLM2-135M to say "Paris" in a chat.  A tiny model's
# words depend on the kernels' arithmetic, which differs between the instruction sets a build uses, so the
# question is one the model answers with a wide margin: greedy, it answers "The capital of France is Paris."
# and over the six tokens up to " Paris" the likeliest token's probability leads the runner-up's by at least
# 0.24 (measured on an AVX2-only and an AVX-512 build, with f16 and q8_0 KV caches, on the Q4_1 and the Q8_0
# model).  Without "Answer in one word." the first token is a near tie ("The" against "La", a lead of 0.02 to
# 0.06) and an AVX2-only build with a q8_0 cache answers in French.
CAPITAL_QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]


def wait_for(pred: Callable[[], Any], timeout: float = 60.0, what: str = "condition", every: float = 0.1) -> Any:
    """Poll ``pred()`` every ``every`` s until it is truthy and return that value; AssertionError naming
    ``what`` after ``timeout`` s (generous timeouts: a busy machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout:g} s"
        time.sleep(every)


@contextlib.contextmanager
def embedded_node(config: Any, ready_timeout: float = 180.0) -> Iterator[Any]:
    """A node (:func:`hydra_trio.serve` with ``config``) served by trio in a thread of this process, for
    tests that reach into its engine; yields the running :class:`~hydra_trio.node.server.Server` once its model
    serves, and stops it (cancels its nursery) afterwards."""
    import trio

    from hydra_trio import serve

    up = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            with trio.fail_after(ready_timeout):
                await server.engine.wait_ready()
            box.update(server=server, scope=nursery.cancel_scope, token=trio.lowlevel.current_trio_token())
            up.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported below
            box["error"] = exc
        finally:
            up.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert up.wait(ready_timeout + 60) and "error" not in box, box.get("error")
    try:
        yield box["server"]
    finally:
        trio.from_thread.run_sync(box["scope"].cancel, trio_token=box["token"])
        thread.join(60)


class ServerProcess:
    """``python -m hydra_trio run`` in a subprocess; logs go to a file under tmp; ``env`` is added to the
    child's environment."""

    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  (the child's log, open while the child runs)
        self.proc, _ = _spawn.spawn(*args, port=self.port, output=self._log, env=env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        try:
            _spawn.wait_healthy(self.port, self.proc, timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}:\n{self.log()}") from None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    @contextlib.contextmanager
    def serving(self, timeout: float = 120.0) -> Iterator[ServerProcess]:
        """This server once ready; stopped on the way out, where its exit code must be 0 (the log shows
        otherwise)."""
        try:
            self.wait_ready(timeout)
            yield self
        finally:
            code = self.stop()
            assert code == 0, f"server exit code {code}:\n{self.log()}"


@contextlib.asynccontextmanager
async def running_engine(n_ctx: int = 2048, model: str = "smollm2-135m", **config: Any) -> AsyncIterator[Any]:
    """In-process: a ready :class:`~hydra_trio.engine.engine.Engine` on ``model`` (a preset; the packaged default
    model unless told: 2 slots, ``n_ctx`` tokens, other :class:`~hydra_trio.EngineConfig` fields from ``config``);
    it ends with the block."""
    import trio

    from hydra_trio import EngineConfig, resolve_model
    from hydra_trio.engine.engine import Engine

    path, alias = resolve_model(model)
    engine = Engine(EngineConfig(path, alias, n_parallel=2, n_ctx=n_ctx, **config))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(300):
            await engine.wait_ready()
        yield engine
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared server: default model, 4 slots, 1 s classify timeout."""
    with ServerProcess(tmp_path_factory.mktemp("server") / "server.log", "--classify-timeout", "1").serving() as srv:
        yield srv


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[callable]:
    """Start extra servers for one test; they are stopped afterwards."""
    started: list[ServerProcess] = []

    def _spawn(*args: str) -> ServerProcess:
        srv = ServerProcess(tmp_path / f"server{len(started)}.log", *args)
        started.append(srv)
        return srv

    yield _spawn
    for srv in started:
        srv.stop(signal.SIGKILL if os.environ.get("HYDRA_TEST_KILL") else signal.SIGTERM)


@pytest.fixture(scope="session")
def hybrid_model() -> Path:
    """A tiny random-weight hybrid GGUF (LFM2: short-convolution and attention layers) with SmolLM2's
    tokenizer, generated on first use and cached (:mod:`hydra_trio.models.hybrid`)."""
    from hydra_trio.models.hybrid import ensure_test_hybrid
    from hydra_trio.models.presets import resolve_model

    return ensure_test_hybrid(resolve_model("smollm2-135m")[0])


@pytest.fixture(scope="session")
def swa_model() -> Path:
    """A tiny random-weight Gemma 3 GGUF (sliding window of 32 tokens on five of six layers) with SmolLM2's
    tokenizer, generated on first use and cached (:func:`hydra_trio.models.hybrid.make_test_swa`)."""
    from hydra_trio.models.hybrid import ensure_test_swa
    from hydra_trio.models.presets import resolve_model

    return ensure_test_swa(resolve_model("smollm2-135m")[0])


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=120) as client:
        yield client


@contextlib.contextmanager
def streaming(base: str, body: dict, path: str = "/v1/completions") -> Iterator[None]:
    """Inside the block a streamed request to ``base + path`` is running (its first chunk has
    arrived); leaving the block stops reading it and closes it (the slot frees soon after)."""
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break

    t = threading.Thread(target=run)
    t.start()
    try:
        assert started.wait(60), "the stream did not start"
        yield
    finally:
        stop.set()
        t.join(60)


def listening_pid(port: int) -> int:
    """The pid of the process listening on TCP ``port`` (``/proc/net/tcp``: the listening socket's inode, then
    the process holding it): a router's child whether it started cold or in the spare interpreter."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # state LISTEN on this port
                inodes.add(f"socket:[{f[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")
