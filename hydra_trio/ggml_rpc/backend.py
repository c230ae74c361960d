"""The ggml-RPC backend behind the front door: a supervised child process, a queue and a validating pump.

The child runs llama.cpp's own ggml-RPC server (:mod:`hydra_trio.engine.ggml_rpc`)
on a private loopback port, with a tensor cache directory.  That server serves
one client connection at a time (ggml-rpc.cpp v7.0.0,
``ggml_backend_rpc_start_server``: a sequential accept loop), so the front
door admits one ggml-RPC client at a time too:

1. **Handshake.** A connection whose first byte is ``0x0E`` must send its whole
   HELLO within ``handshake_timeout`` seconds, before it takes a place in the
   queue (a silent client never blocks anyone).
2. **Queue.** Then it waits, first come first served, for the child; at most
   ``max_waiting`` wait (more are closed at once), each for at most
   ``wait_timeout`` seconds.  A client that hangs up while waiting leaves the queue.
3. **Served.** Its HELLO goes to the child, whose answer must come within
   ``handshake_timeout``.  If the child is restarting, the client is held until
   it is back (at most ``restart_wait`` seconds); a child that dies before
   answering HELLO is replaced and HELLO is sent again, so a restart is invisible
   to a client that connects meanwhile.
4. **Pump.** Both directions go through a
   :class:`~hydra_trio.protocol.ggml_rpc.GgmlRpcConnection`: each client message is
   validated before it reaches the child (a message that fails is never passed on:
   the connection is closed, counted and logged), bulk tensor data streams through
   without being collected, and the replies are tracked so that the pump knows
   when the connection is between messages.  A message that has begun must keep
   arriving (``stall_timeout`` seconds without a byte of it closes the connection);
   between messages a connection may stay idle as long as it wants (a COMBINED
   head keeps one open for hours).

If the child dies (by a signal or a non-zero exit: a *crash*, counted apart
from planned restarts), its connection is closed and it is restarted at once,
with backoff only for repeated crashes.  :meth:`RpcBackend.drain` is the
graceful-shutdown hook.  The engine's own inference runs in the parent and is
not disturbed by any of this.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .._spawn import free_port
from ..engine.ggml_rpc import clean_build_paths
from ..protocol.ggml_rpc import (
    CHECKS,
    GGML_TYPE_COUNT,
    GgmlRpcConnection,
    InvalidReply,
    InvalidRequest,
    RequestEnd,
    ReplyEnd,
    reconcile_type_traits,
)

log = logging.getLogger("hydra_trio.rpc")

PUMP_BUFFER = 1 << 20  # bytes per receive_some: ggml-RPC moves tensors in large messages
_COALESCE = 1 << 16  # pieces smaller than this are joined into one send
_STABLE_S = 10.0  # a child that ran this long before exiting restarts after the shortest delay again

CLOSE_REASONS = (
    "queue_full",  # refused: max_waiting clients already wait
    "wait_timeout",  # waited wait_timeout seconds for the child
    "handshake_timeout",  # HELLO not whole, or not answered, within handshake_timeout
    "stall_timeout",  # a begun message stopped arriving (or the client stopped reading replies)
    "invalid_request",  # a message failed validation (see the invalid-message counts by check)
    "invalid_reply",  # the child answered something unexpected (should never happen)
    "backend_unavailable",  # the child was not back within restart_wait
    "backend_exit",  # the child exited while serving this client
    "draining",  # drain(): refused, dequeued, or closed at a message boundary
)
"""Why the front door closed a ggml-RPC client (stable: they label metrics)."""


@attrs.frozen
class RpcBackendSettings:
    """ggml-RPC backend settings.

    Attributes:
        devices: local devices to expose (``cpu`` = the CPU device).
        cache_dir: where the child caches tensors by hash (SET_TENSOR_HASH);
            None disables the cache.
        threads: CPU threads for the child's graph computes (None: all cores).
        restart_backoff: first and largest delay between restarts, seconds; the
            delay doubles while the child keeps exiting within 10 s of its start.
        max_waiting: clients that may wait for the child while it serves another;
            more are closed at once.
        wait_timeout: seconds a client may wait for its turn, then it is closed.
        handshake_timeout: seconds for a client's HELLO to arrive whole, and again
            for the child to answer it once the client's turn has come.
        stall_timeout: seconds a begun message may go without a byte, or a reply
            without being read, before the connection is closed.  Between messages
            there is no limit.
        restart_wait: seconds a client whose turn has come is held while the child
            restarts, then it is closed.
        drain_idle: seconds a served connection must have been quiet, with nothing
            owed either way, before :meth:`RpcBackend.drain` closes it (a decode step
            is many messages; this keeps one in progress whole).
        max_message_size: largest client message, bytes (tensor data streams through).
        max_graph_size: largest GRAPH_COMPUTE, bytes (held whole in memory to be validated).
    """

    devices: tuple[str, ...] = ("cpu",)
    cache_dir: Path | None = Path(os.path.expanduser("~/.cache/hydra-trio/rpc-cache"))
    threads: int | None = None
    restart_backoff: tuple[float, float] = (0.05, 10.0)
    max_waiting: int = 8
    wait_timeout: float = 30.0
    handshake_timeout: float = 5.0
    stall_timeout: float = 30.0
    restart_wait: float = 15.0
    drain_idle: float = 1.0
    max_message_size: int = 16 << 30
    max_graph_size: int = 256 << 20


class _Close(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@attrs.define
class _Pump:
    """What the three tasks of one served connection share.

    The pump tasks only bump counters; the watchdog turns them into times, so the per-message
    path reads no clock and arms no timer.
    """

    conn: GgmlRpcConnection
    ticks_in: int = 0  # bumped when the inbound task starts waiting for the client, and when bytes arrive
    n_in: int = 0  # receives that brought bytes
    receiving: bool = False  # waiting for the client's bytes
    busy_up: bool = False  # forwarding client bytes to the child right now
    ticks_out: int = 0  # bumped when a send to the client starts, and at each piece sent
    busy_down: bool = False  # forwarding child bytes to the client right now
    close: _Close | None = None


child_log = logging.getLogger("hydra_trio.rpc.child")
_MAX_LINE = 1 << 16  # longer lines are logged in pieces


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


class RpcBackend:
    """Supervises the ggml-RPC child and serves classified connections through it, one at a time.

    Counters (for INFO and ``/metrics``): :attr:`bytes_in` (client → backend),
    :attr:`bytes_out`, :attr:`connections` (clients served), :attr:`restarts`,
    :attr:`crashes`, :attr:`closed` (by reason, :data:`CLOSE_REASONS`),
    :attr:`invalid` (refused messages by check, :data:`~hydra_trio.protocol.ggml_rpc.CHECKS`);
    gauges :attr:`waiting`, :attr:`serving`, :attr:`handshaking`.
    """

    def __init__(self, settings: RpcBackendSettings = RpcBackendSettings()) -> None:
        self.settings = settings
        self.port: int | None = None
        self.active = False
        self.restarts = 0
        self.crashes = 0
        self.connections = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.pid: int | None = None
        self.waiting = 0
        self.serving = 0
        self.handshaking = 0
        self.draining = False
        self.closed: collections.Counter[str] = collections.Counter({r: 0 for r in CLOSE_REASONS})
        self.invalid: collections.Counter[str] = collections.Counter({c: 0 for c in CHECKS})
        self._scopes: set[trio.CancelScope] = set()  # served connections: cancelled when the child exits
        self._unbound: set[trio.CancelScope] = set()  # not (yet) talking to the child: drain closes them at once
        self._up = trio.Event()
        self._slot = trio.StrictFIFOLock()  # the child's one client
        self._open = 0
        self._one_closed = trio.Event()
        self._drain_started = trio.Event()
        self._traits: dict[int, tuple[int, int]] | None = None

    # ------------------------------------------------------------ the child
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the child, restart it whenever it exits, until cancelled."""
        first, biggest = self.settings.restart_backoff
        delay = first
        self.type_traits()
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
            proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.pid = proc.pid
            started = trio.current_time()
            async with trio.open_nursery() as relays:
                # the child's output goes through logging (see hydra_trio.engine.ggml_rpc): chatter at
                # DEBUG, problems at WARNING; the relays read until the child's end closes the pipes
                assert proc.stdout is not None and proc.stderr is not None
                relays.start_soon(_relay_output, proc.stdout, logging.DEBUG, proc.pid)
                relays.start_soon(_relay_output, proc.stderr, logging.WARNING, proc.pid)
                try:
                    if await self._wait_listening(proc, port):
                        self.port = port
                        self.active = True
                        self._up.set()
                        log.info("ggml-RPC backend serving on 127.0.0.1:%d (pid %d, devices %s)", port, proc.pid,
                                 ",".join(self.settings.devices))
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
                    # the pipes end with the child; bound the wait in case something else holds them open
                    relays.cancel_scope.deadline = trio.current_time() + 2.0
            lived = trio.current_time() - started
            self.restarts += 1
            if lived >= _STABLE_S:
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
            await trio.sleep(delay)
            delay = min(delay * 2, biggest)

    async def _wait_listening(self, proc: trio.Process, port: int, timeout: float = 30.0) -> bool:
        with trio.move_on_after(timeout):
            while proc.returncode is None:
                try:
                    s = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.02)
                    continue
                # an empty connection: the server reads EOF as a closed client
                await s.aclose()
                return True
        return False

    async def wait_active(self) -> None:
        """Wait until the child accepts connections."""
        while not self.active:
            await self._up.wait()

    # ------------------------------------------------------------ drain
    async def drain(self) -> None:
        """Stop admitting ggml-RPC clients and close every connection at its next message boundary.

        From the call on, new clients and those waiting for their turn are closed
        (reason ``draining``); the client being served is closed once nothing is
        owed either way (no message half-sent, no reply pending, no compute whose
        result has not been read) and it has been quiet for ``drain_idle``
        seconds, so a COMBINED head's decode step in flight gets its replies
        first.  Returns when no ggml-RPC connection is left; the caller puts a
        deadline around it.  The child keeps running until :meth:`run` is cancelled.
        """
        self.draining = True
        self._drain_started.set()
        for scope in list(self._unbound):
            scope.cancel()
        while self._open:
            await self._one_closed.wait()

    # ------------------------------------------------------------ one client
    async def __call__(self, stream: trio.SocketStream) -> None:
        """Serve one classified connection (first byte ``0x0E``) until it is done; the caller closes it."""
        self._open += 1
        peer = _peer(stream)
        try:
            await self._handle(stream, peer)
        except _Close as exc:
            self._closed(peer, exc)
        finally:
            self._open -= 1
            self._one_closed.set()
            self._one_closed = trio.Event()

    def _closed(self, peer: str, exc: _Close) -> None:
        self.closed[exc.reason] += 1
        level = logging.INFO if exc.reason in ("draining", "backend_exit") else logging.WARNING
        log.log(level, "%s: ggml-RPC client closed (%s): %s", peer, exc.reason, exc.detail)

    def _new_conn(self) -> GgmlRpcConnection:
        s = self.settings
        return GgmlRpcConnection(
            max_message_size=s.max_message_size,
            max_graph_size=s.max_graph_size,
            n_devices=len(s.devices),
            cached_size=self._cached_size if s.cache_dir is not None else None,
            type_traits=self.type_traits(),
        )

    def type_traits(self) -> dict[int, tuple[int, int]]:
        """The type table the validator uses: gguf's, checked against this ggml's own (logged once)."""
        if self._traits is None:
            from ..engine.ggml_rpc import type_traits

            self._traits, notes = reconcile_type_traits(type_traits(GGML_TYPE_COUNT))
            for note in notes:
                log.info("ggml-RPC validator: %s", note)
        return self._traits

    def _cached_size(self, h: int) -> int | None:
        """Size of the child's cache file for FNV-1a hash ``h`` (ggml-rpc.cpp ``get_cached_file``), or None."""
        assert self.settings.cache_dir is not None
        try:
            return os.stat(self.settings.cache_dir / f"{h:016x}").st_size
        except OSError:
            return None

    def _refuse(self, exc: InvalidRequest) -> _Close:
        self.invalid[exc.check] += 1
        return _Close("invalid_request", f"{exc} [{exc.check}]")

    async def _handle(self, stream: trio.SocketStream, peer: str) -> None:
        s = self.settings
        if self.draining:
            raise _Close("draining", "the node is shutting down")
        conn = self._new_conn()
        early: list[bytes | memoryview] = []  # validated bytes that wait for the child

        # 1. HELLO, whole, before queueing
        self.handshaking += 1
        try:
            with trio.CancelScope(deadline=trio.current_time() + s.handshake_timeout) as scope:
                self._unbound.add(scope)
                if not await self._read_hello(stream, conn, early):
                    return
        finally:
            self.handshaking -= 1
            self._unbound.discard(scope)
        if scope.cancelled_caught:
            if self.draining:
                raise _Close("draining", "the node is shutting down")
            raise _Close("handshake_timeout", f"no whole HELLO within {s.handshake_timeout:g} s")

        # 2. wait for the child's one place
        if self.draining:
            raise _Close("draining", "the node is shutting down")
        if self._slot.locked() and self.waiting >= s.max_waiting:
            raise _Close("queue_full", f"{self.waiting} clients already wait for the ggml-RPC backend")
        acquired = False
        self.waiting += 1
        try:
            with trio.CancelScope(deadline=trio.current_time() + s.wait_timeout) as scope:
                self._unbound.add(scope)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_watch_hangup, stream, nursery.cancel_scope)
                    await self._slot.acquire()
                    acquired = True
                    nursery.cancel_scope.cancel()
        except BaseException:
            if acquired:
                self._slot.release()
            raise
        finally:
            self.waiting -= 1
            self._unbound.discard(scope)
        if not acquired:
            if self.draining:
                raise _Close("draining", "the node is shutting down")
            if scope.cancelled_caught:
                raise _Close("wait_timeout", f"waited {s.wait_timeout:g} s for the ggml-RPC backend")
            log.info("%s: ggml-RPC client hung up while waiting for its turn", peer)
            return
        try:
            if self.draining:
                raise _Close("draining", "the node is shutting down")
            self.serving += 1
            try:
                await self._serve(stream, conn, early, peer)
            finally:
                self.serving -= 1
        finally:
            self._slot.release()

    async def _read_hello(self, stream: trio.SocketStream, conn: GgmlRpcConnection, early: list) -> bool:
        """Read until the HELLO request is whole; False if the client left or sent something invalid."""
        while not conn.hello_sent:
            data = await stream.receive_some(PUMP_BUFFER)
            if not data:
                log.info("%s: ggml-RPC client closed before its HELLO was whole", _peer(stream))
                return False
            conn.feed_request(data)
            try:
                while (ev := conn.next_request_event()) is not None:
                    if not isinstance(ev, RequestEnd):
                        early.append(ev.data)
            except InvalidRequest as exc:
                raise self._refuse(exc) from None
        return True

    async def _serve(self, client: trio.SocketStream, conn: GgmlRpcConnection, early: list, peer: str) -> None:
        s = self.settings
        held_until = trio.current_time() + s.restart_wait
        while True:  # until the child answered HELLO
            with trio.CancelScope() as scope:
                self._unbound.add(scope)
                try:
                    upstream = await self._connect(held_until)
                finally:
                    self._unbound.discard(scope)
            if scope.cancelled_caught:
                raise _Close("draining", "the node is shutting down")
            if upstream is None:
                raise _Close("backend_unavailable", f"the ggml-RPC backend was not up within {s.restart_wait:g} s")
            replies = await self._hello(upstream, conn, early)
            if replies is not None:
                break
            await upstream.aclose()  # the child went away before answering: a fresh one gets the same HELLO
            if trio.current_time() >= held_until:
                raise _Close("backend_unavailable", "the ggml-RPC backend exited before answering HELLO")
            log.info("%s: ggml-RPC backend exited before answering HELLO; sending it to the next one", peer)
            conn = self._new_conn()
            conn.receive_request(b"".join(early))
        self.connections += 1
        pump = _Pump(conn)
        with trio.CancelScope() as child_scope:
            self._scopes.add(child_scope)
            try:
                async with upstream:
                    await self._send_first(client, replies)
                    async with trio.open_nursery() as nursery:
                        both = nursery.cancel_scope
                        nursery.start_soon(self._guard, pump, both, self._inbound, client, upstream, pump)
                        nursery.start_soon(self._guard, pump, both, self._outbound, upstream, client, pump, both)
                        nursery.start_soon(self._guard, pump, both, self._watchdog, pump)
            except _Close as exc:  # from the first send of replies
                pump.close = exc
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                self._scopes.discard(child_scope)
        if pump.close is not None:
            raise pump.close
        if child_scope.cancelled_caught:
            raise _Close("backend_exit", "the ggml-RPC backend exited")

    async def _connect(self, deadline: float) -> trio.SocketStream | None:
        """A connection to the child, waiting for it to be (back) up until ``deadline``; None after."""
        with trio.move_on_at(deadline):
            while True:
                await self._up.wait()
                port = self.port
                assert port is not None
                try:
                    return await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:  # it died and run() has not noticed yet
                    await trio.sleep(0.02)
        return None

    async def _hello(self, upstream: trio.SocketStream, conn: GgmlRpcConnection, early: list) -> list | None:
        """Send the client's first bytes; return the child's reply bytes up to and with its HELLO answer.

        None: the child closed first (it exited).  Raises _Close on a timeout or a bad reply.
        """
        timeout = self.settings.handshake_timeout
        replies: list[bytes | memoryview] = []
        try:
            with trio.fail_after(timeout):
                for piece in _coalesce(early):
                    await upstream.send_all(piece)
                while not conn.hello_answered:
                    data = await upstream.receive_some(PUMP_BUFFER)
                    if not data:
                        return None
                    conn.feed_reply(data)
                    while (ev := conn.next_reply_event()) is not None:
                        if not isinstance(ev, ReplyEnd):
                            replies.append(ev.data)
        except trio.TooSlowError:
            raise _Close("handshake_timeout",
                         f"the ggml-RPC backend did not answer HELLO within {timeout:g} s") from None
        except (trio.BrokenResourceError, OSError):
            return None
        except InvalidReply as exc:
            raise _Close("invalid_reply", str(exc)) from None
        self.bytes_in += sum(len(p) for p in early)
        return replies

    async def _send_first(self, client: trio.SocketStream, pieces: Sequence[bytes | memoryview]) -> None:
        """The child's first replies (HELLO's answer), to the client, within ``stall_timeout``."""
        with trio.move_on_after(self.settings.stall_timeout) as scope:
            for piece in _coalesce(pieces):
                await client.send_all(piece)
                self.bytes_out += len(piece)
        if scope.cancelled_caught:
            raise _Close("stall_timeout", f"the client read no reply bytes for {self.settings.stall_timeout:g} s")

    @staticmethod
    async def _guard(pump: _Pump, both: trio.CancelScope, fn: Any, *args: Any) -> None:
        """Run one of a served connection's tasks; any end but a normal one ends the connection."""
        try:
            await fn(*args)
        except _Close as exc:
            if pump.close is None:
                pump.close = exc
            both.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            both.cancel()  # a reset on either side ends the whole connection

    async def _inbound(self, client: trio.SocketStream, upstream: trio.SocketStream, pump: _Pump) -> None:
        """Client → child: validate each message, pass on what passed, half-close on EOF."""
        conn = pump.conn
        while True:
            pump.ticks_in += 1
            pump.receiving = True
            data = await client.receive_some(PUMP_BUFFER)
            pump.receiving = False
            pump.ticks_in += 1
            pump.n_in += 1
            if not data:
                await upstream.send_eof()  # half-close: the replies keep flowing
                return
            conn.feed_request(data)
            pieces = []
            try:
                while (ev := conn.next_request_event()) is not None:
                    if not isinstance(ev, RequestEnd):
                        pieces.append(ev.data)
            except InvalidRequest as exc:
                raise self._refuse(exc) from None
            if len(pieces) > 1:
                pieces = _coalesce(pieces)
            pump.busy_up = True
            for piece in pieces:
                await upstream.send_all(piece)
                self.bytes_in += len(piece)
            pump.busy_up = False

    async def _outbound(self, upstream: trio.SocketStream, client: trio.SocketStream, pump: _Pump,
                        both: trio.CancelScope) -> None:
        """Child → client: track the replies and pass them on; when the child closes, so does the connection."""
        conn = pump.conn
        while True:
            data = await upstream.receive_some(PUMP_BUFFER)
            if not data:  # the child is done with this client (it closed, or rejected a message)
                await client.send_eof()
                both.cancel()
                return
            conn.feed_reply(data)
            pieces = []
            try:
                while (ev := conn.next_reply_event()) is not None:
                    if not isinstance(ev, ReplyEnd):
                        pieces.append(ev.data)
            except InvalidReply as exc:
                raise _Close("invalid_reply", str(exc)) from None
            if len(pieces) > 1:
                pieces = _coalesce(pieces)
            pump.busy_down = True
            for piece in pieces:
                pump.ticks_out += 1
                await client.send_all(piece)
                self.bytes_out += len(piece)
            pump.busy_down = False

    async def _watchdog(self, pump: _Pump) -> None:
        """The served connection's deadlines, checked a few times per ``stall_timeout``.

        Closes it when a begun message gets no byte, or the client reads none of its replies,
        for ``stall_timeout`` seconds (detected within a quarter of it more); after
        :meth:`drain`, at the first message boundary with ``drain_idle`` seconds of quiet.
        """
        stall, idle = self.settings.stall_timeout, self.settings.drain_idle
        period = max(0.01, min(stall / 4, 5.0))
        now = trio.current_time()
        seen = [pump.ticks_in, pump.n_in, pump.ticks_out]
        since = [now, now, now]  # when each counter was first seen at its current value
        while True:
            if self.draining:
                await trio.sleep(0.02)
            else:
                with trio.move_on_after(period):
                    await self._drain_started.wait()
            now = trio.current_time()
            for i, value in enumerate((pump.ticks_in, pump.n_in, pump.ticks_out)):
                if value != seen[i]:
                    seen[i], since[i] = value, now
            conn = pump.conn
            if pump.receiving and conn.request_in_progress and now - since[0] > stall:
                raise _Close("stall_timeout", f"a begun message got no byte for {stall:g} s")
            if pump.busy_down and now - since[2] > stall:
                raise _Close("stall_timeout", f"the client read no reply bytes for {stall:g} s")
            if (self.draining and conn.between_messages and not (pump.busy_up or pump.busy_down)
                    and now - since[1] >= idle):
                raise _Close("draining", "closed between messages: the node is shutting down")

    # ------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """The queue, the counters by reason and check, and the limits, for Hydra INFO ``rpc_backend``."""
        s = self.settings
        return {
            "waiting": self.waiting,
            "serving": self.serving,
            "handshaking": self.handshaking,
            "crashes": self.crashes,
            "draining": self.draining,
            "closed": dict(self.closed),
            "invalid_messages": dict(self.invalid),
            "limits": {
                "max_waiting": s.max_waiting,
                "wait_timeout": s.wait_timeout,
                "handshake_timeout": s.handshake_timeout,
                "stall_timeout": s.stall_timeout,
                "restart_wait": s.restart_wait,
                "max_message_size": s.max_message_size,
                "max_graph_size": s.max_graph_size,
            },
        }


async def _watch_hangup(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client closes while it waits; stop watching if it sends more."""
    try:
        more = await stream.socket.recv(1, socket.MSG_PEEK)
    except OSError:
        more = b""
    if not more:
        scope.cancel()
        return
    await trio.sleep_forever()  # pipelined bytes: they wait in the socket for the pump


def _coalesce(pieces: Iterable[bytes | memoryview]) -> list[bytes | memoryview]:
    """Join runs of small pieces into one send; pass big ones (tensor data) as they are."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for p in pieces:
        if len(p) >= _COALESCE:
            if small:
                out.append(small[0] if len(small) == 1 else b"".join(small))
                small = []
            out.append(p)
        elif len(p):
            small.append(p)
    if small:
        out.append(small[0] if len(small) == 1 else b"".join(small))
    return out


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
