"""The ggml-RPC backend behind the front door: a supervised child process and a byte pump.

The child runs llama.cpp's own ggml-RPC server (:mod:`hydra_trio.engine.ggml_rpc`)
on a private loopback port, with a tensor cache directory.  Connections whose
first byte is ``0x0E`` are passed through to it in both directions,
half-close aware; Python never parses ggml-RPC messages (hydra-protocol.md §4).
If the child dies (a malformed ggml-RPC message can crash it), its connections
are closed and it is restarted with backoff; the engine's own inference runs
in this process and is not disturbed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import attrs
import trio

from ._spawn import free_port

log = logging.getLogger("hydra_trio.rpc")

PUMP_BUFFER = 1 << 20  # bytes per receive_some: ggml-RPC moves tensors in large messages


@attrs.frozen
class RpcBackendSettings:
    """ggml-RPC backend settings.

    Attributes:
        devices: local devices to expose (``cpu`` = the CPU device).
        cache_dir: where the child caches tensors by hash (SET_TENSOR_HASH);
            None disables the cache.
        threads: CPU threads for the child's graph computes (None: all cores).
        restart_backoff: first and largest delay between restarts, seconds.
    """

    devices: tuple[str, ...] = ("cpu",)
    cache_dir: Path | None = Path(os.path.expanduser("~/.cache/hydra-trio/rpc-cache"))
    threads: int | None = None
    restart_backoff: tuple[float, float] = (0.5, 10.0)


class RpcBackend:
    """Supervises the ggml-RPC child and pumps classified connections to it.

    Counters (for INFO and ``/metrics``): :attr:`bytes_in` (client → backend),
    :attr:`bytes_out`, :attr:`connections`, :attr:`restarts`.
    """

    def __init__(self, settings: RpcBackendSettings = RpcBackendSettings()) -> None:
        self.settings = settings
        self.port: int | None = None
        self.active = False
        self.restarts = 0
        self.connections = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.pid: int | None = None
        self._scopes: set[trio.CancelScope] = set()
        self._up = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the child, restart it whenever it exits, until cancelled."""
        first, biggest = self.settings.restart_backoff
        delay = first
        task_status.started()
        while True:
            port = free_port()
            cmd = [sys.executable, "-m", "hydra_trio.engine.ggml_rpc", "--endpoint", f"127.0.0.1:{port}",
                   "--parent-pid", str(os.getpid())]
            if self.settings.cache_dir is not None:
                cmd += ["--cache-dir", str(self.settings.cache_dir)]
            cmd += ["--threads", str(self.settings.threads or os.cpu_count() or 1)]
            for dev in self.settings.devices:
                cmd += ["--device", dev]
            proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.DEVNULL, stderr=None)
            self.pid = proc.pid
            try:
                if await self._wait_listening(proc, port):
                    self.port = port
                    self.active = True
                    self._up.set()
                    log.info("ggml-RPC backend serving on 127.0.0.1:%d (pid %d, devices %s)", port, proc.pid,
                             ",".join(self.settings.devices))
                    delay = first
                code = await proc.wait()
            finally:
                self.active = False
                self._up = trio.Event()
                for scope in list(self._scopes):
                    scope.cancel()
                if proc.returncode is None:
                    proc.kill()
                    with trio.CancelScope(shield=True):
                        await proc.wait()
            self.restarts += 1
            log.warning("ggml-RPC backend exited (code %s); restarting in %.1f s", code, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, biggest)

    async def _wait_listening(self, proc: trio.Process, port: int, timeout: float = 30.0) -> bool:
        with trio.move_on_after(timeout):
            while proc.returncode is None:
                try:
                    s = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                # an empty connection: the server reads EOF as a closed client
                await s.aclose()
                return True
        return False

    async def wait_active(self) -> None:
        """Wait until the child accepts connections."""
        await self._up.wait()

    async def __call__(self, stream: trio.SocketStream) -> None:
        """Pass one classified connection through to the child until both sides are done."""
        if not self.active or self.port is None:
            log.warning("ggml-RPC connection refused: the backend is not running")
            return
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.port)
        except OSError as exc:
            log.warning("ggml-RPC backend unreachable: %s", exc)
            return
        self.connections += 1
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, stream, upstream, True, nursery.cancel_scope)
                    nursery.start_soon(self._pump, upstream, stream, False, nursery.cancel_scope)
            finally:
                self._scopes.discard(scope)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, inbound: bool, both: trio.CancelScope
    ) -> None:
        try:
            while data := await src.receive_some(PUMP_BUFFER):
                await dst.send_all(data)
                if inbound:
                    self.bytes_in += len(data)
                else:
                    self.bytes_out += len(data)
            await dst.send_eof()  # half-close: the other direction keeps flowing
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            both.cancel()  # a reset on either side ends the whole connection
