"""The router's models and their child nodes: load, unload, the ``--models-max`` limit (least recently used
first), waiting for a model to serve, as llama-server's ``server_models`` (``tools/server/server-models.cpp`` of
the llama.cpp that llama-cpp-python 0.3.36 vendors).

Each loaded model is a child node (``python -m hydra_trio`` with the model's flags) on a free loopback port,
supervised here: its output goes to the router's log line by line (``[port] ...``), it serves once its
``GET /health`` answers 200 (then its ``GET /v1/models`` entry joins the router's), and when it exits its model is
``unloaded`` again, ``failed`` with its exit code when that is not 0 (a signal N counts as 128 + N).  Where the
limit makes a model give way to a quantization sibling (:mod:`.swap`), its child swaps its model file in place
and serves the sibling instead.  A stop is
SIGTERM (the node drains its requests), then SIGKILL after the model's ``stop-timeout``; a model still loading is
killed at once.  A child runs in its own session (a terminal's Ctrl-C reaches the router, which stops the
children) and dies with the router (``PR_SET_PDEATHSIG``).

Statuses (``status.value``): ``unloaded``, ``loading``, ``loaded``.  A model that failed to load is
``unloaded`` with ``failed: true`` and its ``exit_code``, as llama-server says it.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import httpx
import trio

from ..errors import InvalidRequest, ModelLoadError
from ..transport.net import free_port
from .child_process import ChildProcess, ForkedChild, ForkServer
from .errors import ModelUnavailable
from .events import ModelEvents
from .presets import SET_BY_ROUTER, ModelPreset, OptionTable
from .swap import SwapFailed, hydra_token, quant_argv, swap_quant

log = logging.getLogger("hydra_trio.router")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request relayed or health poll
child_log = logging.getLogger("hydra_trio.router.child")

CHILD_HOST = "127.0.0.1"
"""Where children listen (loopback, whatever the router binds)."""

READY_POLL_S = 0.02
"""Seconds between two ``GET /health`` of a child that loads."""

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"

LAUNCHER = (sys.executable, "-m", "hydra_trio")
"""A child node's command before its flags."""

SPARE = (sys.executable, "-m", "hydra_trio.cli.spare")
"""The command of a fork server started anew (:mod:`hydra_trio.cli.fork_server`: where children are forked)."""


@attrs.frozen
class RouterSettings:
    """The router's own settings.

    Attributes:
        models_max: most models running at once (loading or loaded); 0 or less: no limit (``--models-max``).
        models_autoload: a request for a model that is not running loads it (``--[no-]models-autoload``);
            a request's ``?autoload=`` decides for itself.
        launcher: the command a child node starts with, before its flags.
        relay_timeout: seconds a child may stay silent in a relayed reply (``--timeout``; None: no limit).
        spare: keep a warm interpreter that forks the children (:mod:`hydra_trio.cli.fork_server`;
            ``--no-router-spare`` turns it off): a child started with :data:`LAUNCHER` is forked from it.
    """

    models_max: int = 4
    models_autoload: bool = True
    launcher: tuple[str, ...] = LAUNCHER
    spare: bool = True
    relay_timeout: float | None = 3600.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ModelInstance:
    """One model of the router: its preset, its state, its child while it runs.

    Attributes:
        name, aliases, tags, source: what ``/models`` lists (aliases and tags from ``--alias`` / ``--tags``).
        preset: the model's options (without what the router sets).
        status: ``unloaded``, ``loading`` or ``loaded``.
        exit_code: the last child's exit status (not 0: it failed).
        port: the child's port (0 before the first load).
        last_used: ``time.monotonic()`` of its load or last POST (the least recently used unloads first).
        requests: requests being proxied to it.
        stopping: a stop was asked and the child has not exited yet.
        info: the child's ``/v1/models`` entry once it serves.
        quants: ``{name: model}`` of this model and its quantization siblings (:mod:`.swap`), empty without.
    """

    def __init__(
        self,
        preset: ModelPreset,
        table: OptionTable,
        launcher: tuple[str, ...],
        stop_timeout: float,
        modalities: tuple[str, ...] = ("text",),
    ) -> None:
        self.name = preset.name
        self.source = preset.source
        self.aliases = sorted({a.strip() for a in (preset.get("--alias") or "").split(",") if a.strip()})
        self.tags = sorted({a.strip() for a in (preset.get("--tags") or "").split(",") if a.strip()})
        self.preset = preset.without(SET_BY_ROUTER)
        self.table = table
        self.launcher = launcher
        self.stop_timeout = stop_timeout
        self.modalities = modalities
        self.status = UNLOADED
        self.exit_code = 0
        self.port = 0
        self.last_used = 0.0
        self.requests = 0
        self.stopping = False
        self.info: dict[str, Any] = {}
        self.process: ChildProcess | ForkedChild | None = None
        self.kill_scope: trio.CancelScope | None = None
        self.fork_scope: trio.CancelScope | None = None
        """While its child is being forked from the fork server: an unload cancels the fork."""
        self.quants: dict[str, str] = {}

    @property
    def running(self) -> bool:
        return self.status in (LOADING, LOADED)

    @property
    def failed(self) -> bool:
        return self.status == UNLOADED and self.exit_code != 0

    def args(self) -> list[str]:
        """The child's command: the launcher, then the model's flags with the router's ``--host``, ``--port``,
        ``--alias`` (its name) and ``--no-rpc-backend`` (a child lends no compute over ggml-RPC), in
        llama-server's order, then a ``--quant NAME=MODEL`` for it and each quantization sibling."""
        set_here = {"--host": CHILD_HOST, "--port": str(self.port), "--alias": self.name, "--no-rpc-backend": "true"}
        top = {(o := self.table.option(k.lstrip("-"), v, self.name)).spec.names[0]: o for k, v in set_here.items()}
        return [*self.launcher, *self.preset.under(top).argv(), *quant_argv(self.quants)]

    def swaps_to(self, other: ModelInstance) -> bool:
        """Whether this model's child can become ``other``'s in place (SWAP_QUANT): ``other`` is a
        quantization sibling, and this one serves, idle."""
        return other.name in self.quants and other is not self and self.status == LOADED and not self.stopping

    def hand_child_to(self, other: ModelInstance) -> None:
        """``other`` owns this model's child from now on (its port, process, ``info``); this one is left
        ``unloaded`` with no failure."""
        other.process, other.port, other.kill_scope, other.info = self.process, self.port, self.kill_scope, self.info
        other.exit_code, other.stopping = 0, False
        self.process, self.kill_scope, self.info, self.status, self.exit_code = None, None, {}, UNLOADED, 0

    def entry(self, created: int) -> dict[str, Any]:
        """This model in ``GET /models``, llama-server's shape::

            {"id", "aliases", "tags", "object": "model", "owned_by", "created",
             "status": {"value", "args", "preset"[, "exit_code", "failed": true]},
             "architecture": {"input_modalities", "output_modalities"}, "source", "can_remove": false}

        and, while it runs, the keys of the child's own entry not already there (``meta``)."""
        status: dict[str, Any] = {
            "value": self.status,
            "args": self.args(),
            "preset": self.preset.without(("--tags",)).ini(),
        }
        if self.failed:
            status.update(exit_code=self.exit_code, failed=True)
        out: dict[str, Any] = {
            "id": self.name,
            "aliases": self.aliases,
            "tags": self.tags,
            "object": "model",
            "owned_by": "hydra-trio",
            "created": created,
            "status": status,
            "architecture": {"input_modalities": list(self.modalities), "output_modalities": ["text"]},
            "source": self.source,
            "can_remove": self.source == "cache",
        }
        if self.running:
            for k, v in self.info.items():
                out.setdefault(k, v)
        return out


class ModelRouter:
    """The models of a router node and their children (the module docstring); run :meth:`run` in a nursery
    first.  Every change of a model's state wakes the requests that wait for one (:meth:`ensure_ready`)."""

    def __init__(
        self,
        models: list[ModelInstance],
        settings: RouterSettings,
        environ: Mapping[str, str] | None = None,
        factory: Callable[[str], ModelInstance] | None = None,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.models = {m.name: m for m in sorted(models, key=lambda m: m.name.encode())}
        """By name, as llama-server lists them (its models are a ``std::map``)."""
        self.factory = factory
        """``POST /models``: a new model named after its model (a model name or a GGUF file), built as the
        router's own (over ``[*]``, under its command line); raises ``ModelsConfigError``.  None: refused."""
        self.events = ModelEvents()
        """``GET /models/sse``'s events (:mod:`hydra_trio.router.events`)."""
        self.settings = settings
        self.environ = dict(environ) if environ is not None else None
        self.wanted: dict[str, int] = {}
        """Requests waiting for each model to serve: such a model is never the one unloaded for another."""
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._spare: ForkServer | None = fork_server
        """Where children are forked from (:mod:`hydra_trio.cli.fork_server`): one made before trio ran
        (``start_here`` there), else started when wanted; stopped with the router."""
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))

    def add(self, m: ModelInstance) -> None:
        """A model joins the list (``POST /models``), in its place by name."""
        self.models = dict(sorted({**self.models, m.name: m}.items(), key=lambda kv: kv[0].encode()))
        self._notify()

    def remove(self, m: ModelInstance) -> None:
        """A model that is not running leaves the list (``DELETE /models``)."""
        assert not m.running, "unload it first"
        self.models = {n: x for n, x in self.models.items() if x is not m}
        self._notify()

    def find(self, name: str) -> ModelInstance | None:
        """The model called ``name`` or with ``name`` among its aliases."""
        if name in self.models:
            return self.models[name]
        return next((m for m in self.models.values() if name in m.aliases), None)

    async def run(self, *, task_status: trio.TaskStatus[ModelRouter] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise the children until cancelled; on the way out every child is stopped."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._spare is not None:
                    nursery.start_soon(self._watch_spare, self._spare)
                self._want_spare()
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                spare, self._spare = self._spare, None
                if spare is not None:
                    spare.close()
                for m in self.models.values():
                    if m.process is not None and m.process.returncode is None:
                        m.process.kill()
                        await m.process.wait()
                await self.client.aclose()

    # ------------------------------------------------------------------------------------------ state
    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def running_count(self) -> int:
        return sum(m.running for m in self.models.values())

    def has_capacity(self) -> bool:
        return self.settings.models_max <= 0 or self.running_count() < self.settings.models_max

    def pick_victim(self) -> ModelInstance | None:
        """The least recently used model that may be unloaded for another: loaded, idle, not stopping, not
        waited for (llama-server's ``pick_victim``)."""
        idle = [
            m
            for m in self.models.values()
            if m.status == LOADED and m.requests == 0 and not m.stopping and not self.wanted.get(m.name)
        ]
        return min(idle, key=lambda m: m.last_used, default=None)

    # ------------------------------------------------------------------------------------------ load
    async def load(self, m: ModelInstance) -> None:
        """``POST /models/load`` and ``load-on-startup``: make room (unload the least recently used idle model
        and wait for its exit) when ``--models-max`` is reached, then start the child; returns once it is
        started (the model is ``loading``).  A model already running is left as it is.

        Raises:
            ModelUnavailable: the limit is reached and every running model is busy or loading.
        """
        if not self.has_capacity():
            victim = self.pick_victim()
            if victim is not None and m.status == UNLOADED and victim.swaps_to(m):
                log.info("models_max limit reached, switching LRU name=%s in place", victim.name)
                self._switch(victim, m)
                return
            if victim is not None:
                log.info("models_max limit reached, removing LRU name=%s", victim.name)
                self.unload(victim)
                while victim.running:
                    await self._wait_change()
        if m.status != UNLOADED:
            return
        if not self.has_capacity():
            raise ModelUnavailable("model limit reached, try again later")
        self._start(m)

    def _start(self, m: ModelInstance) -> None:
        assert self._nursery is not None, "ModelRouter.run is not running"
        m.port = free_port(CHILD_HOST)
        m.status, m.exit_code, m.info, m.stopping = LOADING, 0, {}, False
        m.last_used = time.monotonic()
        args = m.args()
        log.info("spawning server instance with name=%s on port %d: %s", m.name, m.port, " ".join(args))
        self.events.notify("model_status", m.name, {"status": LOADING})
        self._nursery.start_soon(self._supervise, m, args)
        self._notify()

    # ------------------------------------------------------------------------------------------ spare
    def _want_spare(self) -> None:
        """Start the fork server anew (:mod:`hydra_trio.cli.spare`) unless one runs already, the settings want
        none, or a child is loading (the server's imports would take its CPU)."""
        from .presets import child_environment

        if not self.settings.spare or self.settings.launcher != LAUNCHER or self._nursery is None:
            return
        if self._spare is not None and self._spare.returncode is None:
            return
        if not ForkServer.supported() or any(m.status == LOADING for m in self.models.values()):
            return
        try:
            spare = ForkServer.spawn(list(SPARE), child_environment(self.environ), _die_with_parent)
        except OSError as exc:
            log.warning("could not start the fork server for the children (each starts cold): %s", exc)
            return
        self._spare = spare
        self._nursery.start_soon(self._watch_spare, spare)

    async def _watch_spare(self, spare: ForkServer) -> None:
        """Forget a fork server that exits (the next load starts one afresh).  Polled: it exits only when
        killed, or when a fork failed (then :meth:`ForkServer.fork` has closed it)."""
        while self._spare is spare:
            await trio.sleep(1.0)
            if self._spare is spare and spare.returncode is not None:
                self._spare = None
                log.warning("the fork server exited with status %d", spare.returncode)
                self._want_spare()

    async def _take_spare(self, args: list[str]) -> ForkedChild | None:
        """The child for ``args`` forked from the fork server; None when none runs or the fork failed (the
        child is started cold)."""
        spare = self._spare
        if spare is None or spare.returncode is not None or args[: len(LAUNCHER)] != list(LAUNCHER):
            return None
        try:
            return await spare.fork(args[len(LAUNCHER) :])
        except OSError as exc:
            log.warning("%s: the child starts cold", exc)
            if self._spare is spare:
                self._spare = None
            return None

    async def _supervise(self, m: ModelInstance, args: list[str]) -> None:
        """One child's life: start it (in the warm interpreter when one waits), relay its output, watch for it
        to serve, record its exit."""
        from .presets import child_environment

        forked: ForkedChild | None = None
        if not m.stopping:
            with trio.CancelScope() as m.fork_scope:
                forked = await self._take_spare(args)
            m.fork_scope = None
        if forked is None and m.stopping:  # unloaded while it was being forked: nothing ran
            log.info("instance name=%s was unloaded before it started", m.name)
            m.status, m.stopping, m.exit_code = UNLOADED, False, 0
            self.events.notify("status_change", m.name, {"status": UNLOADED, "exit_code": 0})
            self._notify()
            return
        try:
            # forked on this thread, which lives as long as the router: PR_SET_PDEATHSIG follows the thread
            process = forked or ChildProcess(args, child_environment(self.environ), _die_with_parent)
        except OSError as exc:
            log.error("failed to spawn server instance name=%s: %s", m.name, exc)
            m.status, m.exit_code = UNLOADED, 1
            self.events.notify("status_change", m.name, {"status": UNLOADED, "exit_code": 1})
            self._notify()
            return
        m.process = process
        if m.stopping:  # unloaded while it was being started
            process.kill()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_ready, m, process)
                assert process.stdout is not None
                await _relay_output(m.port, process.stdout)
                await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            m = next((x for x in self.models.values() if x.process is process), m)  # switched in place
            code = process.returncode if process.returncode is not None else -signal.SIGKILL
            if m.kill_scope is not None:
                m.kill_scope.cancel()
            m.process, m.kill_scope = None, None
            m.status, m.stopping = UNLOADED, False
            m.exit_code = code if code >= 0 else 128 - code
            log.info("instance name=%s exited with status %d", m.name, m.exit_code)
            self.events.notify("status_change", m.name, {"status": UNLOADED, "exit_code": m.exit_code})
            self._notify()
            self._want_spare()

    async def _watch_ready(self, m: ModelInstance, process: ChildProcess | ForkedChild) -> None:
        base = f"http://{CHILD_HOST}:{m.port}"
        while process.returncode is None:
            try:
                r = await self.client.get(f"{base}/health")
                if r.status_code == 200:
                    models = (await self.client.get(f"{base}/v1/models")).json()
                    m.info = (models.get("data") or [{}])[0]
                    if m.process is process and m.status == LOADING:
                        m.status = LOADED
                        log.info("model name=%s is loaded (port %d)", m.name, m.port)
                        self.events.notify("status_change", m.name, {"status": LOADED, "info": m.info})
                        self._notify()
                        self._want_spare()
                    return
            except (httpx.HTTPError, ValueError):
                pass  # not listening yet, or stopped while asked
            await trio.sleep(READY_POLL_S)

    # ------------------------------------------------------------------------------------------ switch
    def _switch(self, old: ModelInstance, new: ModelInstance) -> None:
        """Make ``old``'s child (loaded, idle) serve ``new``, a quantization sibling (:mod:`.swap`): ``old`` is
        ``unloaded`` and ``new`` ``loading`` at once, ``loaded`` when the child has swapped; returns at once."""
        assert self._nursery is not None, "ModelRouter.run is not running"
        process = old.process
        assert process is not None
        old.hand_child_to(new)
        new.status, new.last_used, new.info = LOADING, time.monotonic(), {}  # its entry once it has swapped
        log.info("switching instance name=%s to name=%s in place (port %d)", old.name, new.name, new.port)
        self.events.notify("status_change", old.name, {"status": UNLOADED, "exit_code": 0})
        self.events.notify("model_status", new.name, {"status": LOADING})
        self._nursery.start_soon(self._swap, old, new, process)
        self._notify()

    async def _swap(self, old: ModelInstance, new: ModelInstance, process: ChildProcess | ForkedChild) -> None:
        """SWAP_QUANT in ``new``'s child; when it fails, the child goes back to ``old``, which is stopped
        (its unload), and ``new`` starts in a child of its own."""
        t0 = time.perf_counter()
        base = f"http://{CHILD_HOST}:{new.port}"
        try:
            meta = await swap_quant(CHILD_HOST, new.port, new.name, hydra_token(new.preset), old.stop_timeout)
            info = ((await self.client.get(f"{base}/v1/models")).json().get("data") or [{}])[0]
        except (SwapFailed, httpx.HTTPError, ValueError) as exc:
            log.warning("in-place switch to name=%s failed (%s): stopping the child, starting a new one", new.name, exc)
            if new.process is process and process.returncode is None:
                new.hand_child_to(old)
                new.status, old.status = LOADING, LOADED
                self.events.notify("status_change", old.name, {"status": LOADED, "info": old.info})
                self.unload(old)
                while old.running:
                    await self._wait_change()
            if new.status == LOADING and new.process is None:
                if new.stopping:  # unloaded meanwhile
                    new.status, new.stopping = UNLOADED, False
                    self.events.notify("status_change", new.name, {"status": UNLOADED, "exit_code": 0})
                    self._notify()
                else:
                    self._start(new)
            return
        if new.process is process and new.status == LOADING and not new.stopping:
            new.info, new.status = info, LOADED
            log.info(
                "model name=%s is loaded in place of name=%s (port %d): SWAP_QUANT %.0f ms, in all %.0f ms",
                new.name,
                old.name,
                new.port,
                meta.get("swap_ms", 0.0),
                (time.perf_counter() - t0) * 1e3,
            )
            self.events.notify("status_change", new.name, {"status": LOADED, "info": new.info})
            self._notify()

    # ------------------------------------------------------------------------------------------ unload
    def unload(self, m: ModelInstance) -> None:
        """Stop ``m``'s child: killed at once while it loads, else SIGTERM and SIGKILL after its
        ``stop-timeout``; returns at once (the model is ``unloaded`` when the child has exited)."""
        process = m.process
        if not m.running or m.stopping or process is None:
            if m.status == LOADING and process is None:  # asked before its process started
                m.stopping = True
                if m.fork_scope is not None:  # a fork under way (or a fork server that does not answer)
                    m.fork_scope.cancel()
                self._notify()
            return
        m.stopping = True
        log.info("stopping model instance name=%s", m.name)
        if m.status == LOADING:
            log.warning("model name=%s is still loading, force-killing", m.name)
            process.kill()
        else:
            process.send_signal(signal.SIGTERM)
            assert self._nursery is not None
            self._nursery.start_soon(self._kill_after, m, process)
        self._notify()

    async def _kill_after(self, m: ModelInstance, process: ChildProcess | ForkedChild) -> None:
        with trio.CancelScope() as scope:
            m.kill_scope = scope
            await trio.sleep(m.stop_timeout)
            if process.returncode is None:
                log.warning("force-killing model instance name=%s after timeout", m.name)
                process.kill()

    async def stop_and_wait(self, m: ModelInstance) -> None:
        """Unload ``m`` and wait until it is not running (a request that loads it again meanwhile is waited
        for too)."""
        while m.running:
            self.unload(m)
            await self._wait_change()

    async def unload_all(self) -> None:
        """Stop every child and wait for them all to exit (the router's shutdown)."""
        for m in self.models.values():
            self.unload(m)
        while any(m.running for m in self.models.values()):
            await self._wait_change()

    # ------------------------------------------------------------------------------------------ requests
    async def ensure_ready(self, m: ModelInstance, should_stop: Callable[[], bool] | None = None) -> None:
        """Wait until ``m`` serves, loading it when it is not running (a request with autoload), as
        llama-server's ``ensure_model_ready``: when ``--models-max`` is reached the least recently used idle
        model is unloaded for it, and when every running model is busy the request waits until one is idle.
        Requests for one model share its one load.  A model being stopped serves again after a new load.

        Raises:
            ModelLoadError: its child exited before it served (``model name=X failed to load``).
            InvalidRequest: it was unloaded by something else while this waited (``model name=X is not
                running``).
        """
        if m.status == LOADED and not m.stopping:
            return
        self.wanted[m.name] = self.wanted.get(m.name, 0) + 1
        started = saw_loading = False
        try:
            while True:
                if m.stopping:
                    await self._wait_change()
                    continue
                if m.status == LOADED:
                    return
                if m.status == LOADING:
                    saw_loading = True
                elif started or saw_loading:
                    if m.failed:
                        raise ModelLoadError(f"model name={m.name} failed to load")
                    raise InvalidRequest(f"model name={m.name} is not running")
                elif self.has_capacity():
                    self._start(m)
                    started = True
                    continue
                elif (victim := self.pick_victim()) is not None and victim.swaps_to(m):
                    log.info("switching idle LRU name=%s in place for a queued request", victim.name)
                    self._switch(victim, m)
                    started = True
                    continue
                elif victim is not None:
                    log.info("evicting idle LRU name=%s for a queued request", victim.name)
                    self.unload(victim)
                await self._wait_change()
        finally:
            self.wanted[m.name] -= 1

    def acquire(self, m: ModelInstance, *, used: bool) -> Callable[[], None]:
        """Count a request proxied to ``m`` (``used``: a POST, which makes it the most recently used); returns
        the release, which wakes the requests that wait for an idle model.

        Raises:
            InvalidRequest: ``m`` is not running (``model name=X is not running``).
        """
        if not m.running or m.stopping:
            raise InvalidRequest(f"model name={m.name} is not running")
        if used:
            m.last_used = time.monotonic()
        m.requests += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                m.requests -= 1
                if m.requests == 0:
                    self._notify()

        return release


async def _relay_output(port: int, stream: trio.abc.ReceiveStream) -> None:
    """A child's output into the router's log, one record per line, ``[port] line``, until it closes."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            child_log.info("[%5d] %s", port, line.decode("utf-8", "replace").rstrip("\r"))
        if len(buffer) > 1 << 20:  # a child that never writes a newline does not grow this without bound
            buffer = b""
    if buffer:
        child_log.info("[%5d] %s", port, buffer.decode("utf-8", "replace"))
