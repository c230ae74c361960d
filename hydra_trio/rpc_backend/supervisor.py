"""Supervision of the ggml-RPC server child: start, restart with backoff, crash counting, output relay.

The child (:mod:`hydra_trio.rpc_backend.child`) listens on a private loopback
port chosen anew at each start.  When it exits, every connection bound to it
is cancelled (:attr:`ChildSupervisor.bound`) and it is restarted at once;
only repeated crashes (exits by a signal or with a non-zero code, counted in
:attr:`ChildSupervisor.crashes`) back off, doubling the delay while the child
keeps dying within 10 s of its start.

A child that ends while the node stops (:meth:`ChildSupervisor.node_stopping`) is
part of the stop, not a crash: it is neither counted nor restarted.  That is the
usual case when the stop signal goes to the whole process group (systemd's
default ``KillMode=control-group``, a launcher that stops its child's group, Ctrl-C
in a terminal): the child gets the same SIGTERM as the node, and may die before
the node has handled its own.  So a child ended by SIGTERM or SIGINT waits up to
:data:`STOP_SIGNAL_SETTLE_S` for the node's stop before it counts as a crash.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from ..engine.llama.ggml_backend import clean_build_paths
from ..observability.events import EventBus
from ..transport.net import free_port

log = logging.getLogger("hydra_trio.rpc")
child_log = logging.getLogger("hydra_trio.rpc.child")

STABLE_S = 10.0
"""A child that ran this long (seconds) before exiting restarts after the shortest delay again."""
_MAX_LINE = 1 << 16  # longer lines are logged in pieces
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
"""Signals that stop a node: a child ended by one of them may have got its node's own stop signal."""
STOP_SIGNAL_SETTLE_S = 3.0
"""Seconds a child ended by a :data:`STOP_SIGNALS` signal waits for the node's stop before it counts as a crash
(the node's signal handler runs in its event loop, a moment after the child's end may be seen)."""
_LISTEN_TIMEOUT = 30.0  # seconds for a fresh child to accept connections
_RETRY_S = 0.02  # seconds between connection attempts to a child that is not listening (yet)

CHILD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Added to the child's environment unless the node's own environment sets the variable.

The child computes a graph only when a peer asks (in COMBINED, about 30
GRAPH_COMPUTEs per token, one per layer, each with a round trip in
between).  With llama.cpp's default, its OpenMP threads spin between those
graphs and take the cores from whatever else runs there: the node's own
engine, or the head itself when the peer shares its machine.  Measured
(``bench/combined.py``, head and peer on one 2-core machine): COMBINED decode
4.6 tok/s with the child spinning, 20.3 tok/s with it waiting passively (SOLO
33-38 tok/s); passive waiting on the head instead changes nothing (3.7 tok/s).
"""


class ChildSupervisor:
    """Runs the ggml-RPC child and keeps it running.

    Args:
        devices: local devices the child exposes (``cpu`` = the CPU device).
        cache_dir: the child's tensor cache (SET_TENSOR_HASH); None: no cache.
        threads: CPU threads for the child's graph computes.
        restart_backoff: first and largest delay between restarts, seconds.

    Attributes (read by INFO and ``/metrics``): :attr:`active` (the child accepts
    connections), :attr:`port`, :attr:`pid`, :attr:`restarts` (every exit),
    :attr:`crashes` (exits by a signal or a non-zero code).
    """

    def __init__(
        self, devices: Sequence[str], cache_dir: Path | None, threads: int, restart_backoff: tuple[float, float]
    ) -> None:
        self.devices = tuple(devices)
        self.cache_dir = cache_dir
        self.threads = threads
        self.restart_backoff = restart_backoff
        self.port: int | None = None
        self.active = False
        self.pid: int | None = None
        self.restarts = 0
        self.crashes = 0
        self.bound: set[trio.CancelScope] = set()
        """Scopes of the connections to the current child: cancelled when it exits."""
        self._up = trio.Event()
        self._stopping = trio.Event()
        self._proc: trio.Process | None = None
        self.events = EventBus()
        """Where ``rpc.child_started`` / ``rpc.child_died`` / ``rpc.child_restarted`` go (the server sets its bus)."""

    def command(self, port: int) -> list[str]:
        """The child's command line, listening on ``127.0.0.1:port``."""
        cmd = [
            sys.executable,
            "-m",
            "hydra_trio.rpc_backend.child",
            "--endpoint",
            f"127.0.0.1:{port}",
            "--parent-pid",
            str(os.getpid()),
        ]
        if self.cache_dir is not None:
            cmd += ["--cache-dir", str(self.cache_dir)]
        cmd += ["--threads", str(self.threads)]
        for dev in self.devices:
            cmd += ["--device", dev]
        return cmd

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the child, restart it whenever it exits, until cancelled (then kill it)."""
        first, biggest = self.restart_backoff
        delay = first
        task_status.started()
        while True:
            port = free_port()
            env = {**CHILD_ENV, **os.environ}
            proc = await trio.lowlevel.open_process(
                self.command(port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
            self.pid = proc.pid
            self._proc = proc
            started = trio.current_time()
            async with trio.open_nursery() as relays:
                # the child's output goes through logging (see hydra_trio.rpc_backend.child): chatter at
                # DEBUG, problems at WARNING; the relays read until the child's end closes the pipes
                assert proc.stdout is not None and proc.stderr is not None
                relays.start_soon(_relay_output, proc.stdout, logging.DEBUG, proc.pid)
                relays.start_soon(_relay_output, proc.stderr, logging.WARNING, proc.pid)
                try:
                    if await self._wait_listening(proc, port):
                        self.port = port
                        self.active = True
                        self._up.set()
                        log.info(
                            "ggml-RPC backend serving on 127.0.0.1:%d (pid %d, devices %s)",
                            port,
                            proc.pid,
                            ",".join(self.devices),
                        )
                        self.events.publish(
                            "rpc.child_restarted" if self.restarts else "rpc.child_started",
                            pid=proc.pid,
                            port=port,
                            devices=list(self.devices),
                            restarts=self.restarts,
                        )
                    code = await proc.wait()
                finally:
                    self.active = False
                    self._up = trio.Event()
                    for scope in list(self.bound):
                        scope.cancel()
                    if proc.returncode is None:
                        proc.kill()
                        with trio.CancelScope(shield=True):
                            await proc.wait()
                    # the pipes end with the child; bound the wait in case something else holds them open
                    relays.cancel_scope.deadline = trio.current_time() + 2.0
            lived = trio.current_time() - started
            if await self._ended_with_node(code):
                log.info(
                    "ggml-RPC backend (pid %d) %s with the node",
                    proc.pid,
                    f"ended by {_signal_name(-code)}" if code < 0 else f"exited (code {code})",
                )
                await trio.sleep_forever()  # the node is stopping: nothing to restart; its cancel ends this
            self.restarts += 1
            if lived >= STABLE_S:
                delay = first
            if code < 0:
                self.crashes += 1
                how = f"crashed: {_signal_name(-code)}"
            elif code > 0:
                self.crashes += 1
                how = f"crashed: exit code {code}"
            else:
                how = "exited"
            log.warning("ggml-RPC backend (pid %d) %s after %.1f s; restarting in %.2f s", proc.pid, how, lived, delay)
            self.events.publish(
                "rpc.child_died", pid=proc.pid, code=code, how=how, lived_s=round(lived, 3), restart_in_s=delay
            )
            await trio.sleep(delay)
            delay = min(delay * 2, biggest)

    def node_stopping(self) -> None:
        """The node is stopping (a stop signal, :meth:`Server.begin_stop
        <hydra_trio.node.server.Server.begin_stop>`): a child that ends from now on is not restarted
        and not counted as a crash."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`node_stopping` was called."""
        return self._stopping.is_set()

    async def _ended_with_node(self, code: int) -> bool:
        """Whether a child that exited with ``code`` ended as part of the node's stop: the node is stopping,
        or starts to within :data:`STOP_SIGNAL_SETTLE_S` of a child ended by a stop signal."""
        if not self._stopping.is_set() and code < 0 and -code in STOP_SIGNALS:
            with trio.move_on_after(STOP_SIGNAL_SETTLE_S):
                await self._stopping.wait()
        return self._stopping.is_set()

    def kill_unresponsive(self, pid: int | None, why: str) -> None:
        """Kill the child ``pid`` (SIGKILL) if it is still the running one: it stopped answering
        (``why``, for the log). :meth:`run` then restarts it, counting a crash."""
        proc = self._proc
        if proc is None or pid is None or proc.pid != pid or proc.returncode is not None:
            return
        log.warning("ggml-RPC backend (pid %d) is unresponsive (%s): killing it", pid, why)
        proc.kill()

    async def _wait_listening(self, proc: trio.Process, port: int, timeout: float = _LISTEN_TIMEOUT) -> bool:
        """True once the child accepts a connection on ``port``; False if it exits or ``timeout`` passes."""
        with trio.move_on_after(timeout):
            while proc.returncode is None:
                try:
                    s = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(_RETRY_S)
                    continue
                # an empty connection: the server reads EOF as a closed client
                await s.aclose()
                return True
        return False

    async def wait_active(self) -> None:
        """Wait until the child accepts connections."""
        while not self.active:
            await self._up.wait()

    async def connect(self, deadline: float) -> trio.SocketStream | None:
        """A connection to the child, waiting for it to be (back) up until ``deadline`` (trio time); None after."""
        with trio.move_on_at(deadline):
            while True:
                await self._up.wait()
                port = self.port
                assert port is not None
                try:
                    return await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:  # it died and run() has not noticed yet
                    await trio.sleep(_RETRY_S)
        return None


async def _relay_output(stream: trio.abc.ReceiveStream, level: int, pid: int) -> None:
    """Log each line the ggml-RPC child writes on ``stream`` (logger ``hydra_trio.rpc.child``)
    at ``level``, with llama.cpp's build paths shortened; ends at EOF.  It reads whenever
    the child writes, so the child never waits on a full pipe for long, and the parent
    never writes to it."""
    pending = b""

    def emit(raw: bytes) -> None:
        line = clean_build_paths(raw.decode("utf-8", "replace").rstrip())
        if line:
            child_log.log(level, "[pid %d] %s", pid, line)

    try:
        while chunk := await stream.receive_some(_MAX_LINE):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                emit(raw)
            if len(pending) >= _MAX_LINE:
                emit(pending)
                pending = b""
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        if pending:
            emit(pending)
        await trio.aclose_forcefully(stream)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
