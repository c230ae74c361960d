"""The ggml-RPC backend behind the front door: a supervised child process, a queue and a validating pump.

The child runs llama.cpp's own ggml-RPC server (:mod:`hydra_trio.rpc_backend.child`)
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
   to a client that connects meanwhile.  A child that does not answer HELLO in
   time (or answers it wrongly) is hung: the client is closed and the child
   killed, so its supervisor starts a fresh one for the next client.  Unless the
   last connection ended with work in flight (its client reset mid-compute): the
   child, single-threaded, answers only once that work is done, so that HELLO gets
   ``wait_timeout`` (if longer) and no kill: a healthy child busy is not hung.
4. **Pump.** Both directions go through a validator (:mod:`hydra_trio.rpc_backend.pump`).
   A child that stops mid-reply for ``stall_timeout`` seconds is killed too
   (reason ``backend_stall``); a reply not yet begun may take as long as its compute.

A client that came over TLS (:class:`~hydra_trio.transport.tls.TlsStream`, unwrapped by
the front door) goes through the same steps; its pump's threads carry its TLS
on from where trio's handshake left it (:class:`~hydra_trio.transport.blocking.TlsPipe`).

The parts: :class:`RpcBackend` (this module) is the admission (steps 1 to 3)
and the face the rest of the node sees (counters, :meth:`~RpcBackend.drain`);
:class:`~hydra_trio.rpc_backend.supervisor.ChildSupervisor` starts the child and
restarts it when it dies (by a signal or a non-zero exit: a *crash*, counted
apart from planned restarts; backoff only for repeated crashes);
:class:`~hydra_trio.rpc_backend.pump.Pump` moves a served client's bytes.  The
engine's own inference runs in the parent and is not disturbed by any of this.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from pathlib import Path
from typing import Any

import attrs
import trio

from ..engine.llama.ggml_backend import type_traits as ggml_type_traits
from ..protocol.ggml_rpc import (
    GGML_TYPE_COUNT,
    GgmlRpcConnection,
    InvalidRpcRequest,
    live_type_table,
    reconcile_type_traits,
)
from ..transport.access import AllowList, Refusals, allowed, is_loopback, new_refusals
from ..transport.frontdoor import AcceptedStream, peer_name
from ..transport.tls import TlsStream, peer_of
from .pump import CLOSE_REASONS, PUMP_BUFFER, Close, Counters, Pump, exchange_hello, payload
from .supervisor import ChildSupervisor

__all__ = ["CLOSE_REASONS", "PUMP_BUFFER", "RpcBackend", "RpcBackendSettings"]

log = logging.getLogger("hydra_trio.rpc")


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
            for the child to answer it once the client's turn has come (a child
            that does not is killed and restarted).
        stall_timeout: seconds a begun message may go without a byte, or a reply
            without being read, before the connection is closed; and a reply the
            child has begun without its next byte, before the child is killed and
            restarted.  Between messages there is no limit.
        restart_wait: seconds a client whose turn has come is held while the child
            restarts, then it is closed.
        drain_idle: seconds a served connection must have been quiet, with nothing
            owed either way, before :meth:`RpcBackend.drain` closes it (a decode step
            is many messages; this keeps one in progress whole).
        max_message_size: largest client message, bytes (tensor data streams through).
        max_graph_size: largest GRAPH_COMPUTE, bytes (held whole in memory to be validated).
        allow: peers that may connect (``--rpc-allow``); others are closed before a
            byte is read (reason ``not_allowed``).  None: everyone.
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
    allow: AllowList | None = None


class _Of:
    """A read-only attribute that a part of the object holds: ``pid = _Of("child")`` reads ``self.child.pid``."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)


class RpcBackend:
    """Supervises the ggml-RPC child and serves classified connections through it, one at a time.

    Counters (for INFO and ``/metrics``): :attr:`bytes_in` (client → backend),
    :attr:`bytes_out`, :attr:`connections` (clients served), :attr:`restarts`,
    :attr:`crashes`, :attr:`closed` (by reason, :data:`CLOSE_REASONS`),
    :attr:`invalid` (refused messages by check, :data:`~hydra_trio.protocol.ggml_rpc.CHECKS`);
    gauges :attr:`waiting`, :attr:`serving`, :attr:`handshaking`; the child's
    :attr:`active` (it accepts connections), :attr:`port` and :attr:`pid` (None
    before its first start).  ``active``, ``port``, ``pid``, ``restarts`` and
    ``crashes`` are read from :attr:`child` (the
    :class:`~hydra_trio.rpc_backend.supervisor.ChildSupervisor`); ``connections``,
    ``bytes_*`` and ``invalid`` from :attr:`counters`, which the pumps bump.
    """

    def __init__(self, settings: RpcBackendSettings = RpcBackendSettings(), refused: Refusals | None = None) -> None:
        self.settings = settings
        self.refused = refused if refused is not None else new_refusals()
        self.child = ChildSupervisor(
            settings.devices, settings.cache_dir, settings.threads or os.cpu_count() or 1, settings.restart_backoff
        )
        self.counters = Counters()
        self.waiting = 0
        self.serving = 0
        self.handshaking = 0
        self.draining = False
        self.closed: collections.Counter[str] = collections.Counter({r: 0 for r in CLOSE_REASONS})
        self._unbound: set[trio.CancelScope] = set()  # not (yet) talking to the child: drain closes them at once
        self._slot = trio.StrictFIFOLock()  # the child's one client
        self._open = 0
        self._one_closed = trio.Event()
        self._drain_started = trio.Event()
        self._traits: dict[int, tuple[int, int]] | None = None
        # the child (pid) a connection left with work in flight (a compute, a reply owed, a message
        # half-sent): it answers the next HELLO only once that work is done
        self._busy_pid: int | None = None

    # ------------------------------------------------------------ the child
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the child, restart it whenever it exits, until cancelled."""
        self.type_traits()
        await self.child.run(task_status=task_status)

    async def wait_active(self) -> None:
        """Wait until the child accepts connections."""
        await self.child.wait_active()

    # read from the parts (see the class docstring)
    active = _Of("child")
    port = _Of("child")
    pid = _Of("child")
    restarts = _Of("child")
    crashes = _Of("child")
    connections = _Of("counters")
    bytes_in = _Of("counters")
    bytes_out = _Of("counters")
    invalid = _Of("counters")

    def warn_if_open(self, listeners: list[trio.SocketListener], port: int | None) -> None:
        """One warning when ggml-RPC, which writes into this process's memory, is open to every peer
        (no ``--rpc-allow``) of a non-loopback address of ``listeners`` (llama.cpp's rpc-server warns likewise:
        never expose it on an open network)."""
        if self.settings.allow is not None:
            return
        exposed = [
            host for host in (listener.socket.getsockname()[0] for listener in listeners) if not is_loopback(host)
        ]
        if exposed:
            log.warning(
                "ggml-RPC is open to every peer that reaches %s:%d: its commands write into this node's memory. "
                "Limit it with --rpc-allow CIDR (e.g. the cluster network) or turn it off with --no-rpc-backend",
                "/".join(sorted(set(exposed))),
                port,
            )

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

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Close("draining", "the node is shutting down")

    # ------------------------------------------------------------ one client
    async def __call__(self, stream: AcceptedStream) -> None:
        """Serve one classified connection (first byte ``0x0E``) until it is done; the caller closes it."""
        self._open += 1
        peer = peer_name(stream)
        try:
            await self._handle(stream, peer)
        except Close as exc:
            self._closed(peer, exc)
        finally:
            self._open -= 1
            self._one_closed.set()
            self._one_closed = trio.Event()

    def _closed(self, peer: str, exc: Close) -> None:
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
        """The type table the validator uses: this ggml's own sizes; where gguf's differ is logged once at
        DEBUG (only then is ``gguf`` imported: it brings numpy, 15 MiB of a node's memory)."""
        if self._traits is None:
            live = ggml_type_traits(GGML_TYPE_COUNT)
            self._traits = live_type_table(live)
            if log.isEnabledFor(logging.DEBUG):
                for note in reconcile_type_traits(live)[1]:
                    log.debug("ggml-RPC validator: %s", note)
        return self._traits

    def _cached_size(self, h: int) -> int | None:
        """Size of the child's cache file for FNV-1a hash ``h`` (ggml-rpc.cpp ``get_cached_file``), or None."""
        assert self.settings.cache_dir is not None
        try:
            return os.stat(self.settings.cache_dir / f"{h:016x}").st_size
        except OSError:
            return None

    async def _handle(self, stream: AcceptedStream, peer: str) -> None:
        if not allowed(self.settings.allow, who := peer_of(stream)):
            self.refused["ggml_rpc", "not_allowed"] += 1
            raise Close("not_allowed", f"peer {who} is not in --rpc-allow ({self.settings.allow})")
        self._refuse_if_draining()
        conn = self._new_conn()
        early: list[bytes | memoryview] = []  # validated bytes that wait for the child
        if not await self._handshake(stream, conn, early, peer):  # 1. HELLO, whole, before queueing
            return
        if not await self._queue(stream, peer):  # 2. wait for the child's one place
            return
        try:
            self._refuse_if_draining()
            self.serving += 1
            try:
                await self._serve(stream, conn, early, peer)
            finally:
                self.serving -= 1
        finally:
            self._slot.release()

    async def _handshake(self, stream: AcceptedStream, conn: GgmlRpcConnection, early: list, peer: str) -> bool:
        """Read until the HELLO request is whole, within ``handshake_timeout``, into ``early``;
        False if the client left first.  Raises Close."""
        timeout = self.settings.handshake_timeout
        self.handshaking += 1
        try:
            with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                self._unbound.add(scope)
                while not conn.hello_sent:
                    data = await stream.receive_some(PUMP_BUFFER)
                    if not data:
                        log.info("%s: ggml-RPC client closed before its HELLO was whole", peer)
                        return False
                    try:
                        early += payload(conn.receive_request(data))
                    except InvalidRpcRequest as exc:
                        raise self.counters.refuse(exc) from None
        finally:
            self.handshaking -= 1
            self._unbound.discard(scope)
        if scope.cancelled_caught:
            self._refuse_if_draining()
            raise Close("handshake_timeout", f"no whole HELLO within {timeout:g} s")
        return True

    async def _queue(self, stream: AcceptedStream, peer: str) -> bool:
        """Wait for the child's one place (``self._slot``, held on True) within ``wait_timeout``;
        False if the client hung up meanwhile.  Raises Close."""
        s = self.settings
        self._refuse_if_draining()
        if self._slot.locked() and self.waiting >= s.max_waiting:
            raise Close("queue_full", f"{self.waiting} clients already wait for the ggml-RPC backend")
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
            self._refuse_if_draining()
            if scope.cancelled_caught:
                raise Close("wait_timeout", f"waited {s.wait_timeout:g} s for the ggml-RPC backend")
            log.info("%s: ggml-RPC client hung up while waiting for its turn", peer)
        return acquired

    async def _serve(self, client: AcceptedStream, conn: GgmlRpcConnection, early: list, peer: str) -> None:
        """3. and 4.: HELLO to the child (again to a fresh one if it dies first), then the pump."""
        s = self.settings
        held_until = trio.current_time() + s.restart_wait
        while True:  # until the child answered HELLO
            with trio.CancelScope() as scope:
                self._unbound.add(scope)
                try:
                    upstream = await self.child.connect(held_until)
                finally:
                    self._unbound.discard(scope)
            if scope.cancelled_caught:
                raise Close("draining", "the node is shutting down")
            if upstream is None:
                raise Close("backend_unavailable", f"the ggml-RPC backend was not up within {s.restart_wait:g} s")
            pid = self.child.pid
            busy = pid is not None and pid == self._busy_pid
            self._busy_pid = None  # that grace is given once: a child still silent at its end is hung (killed)
            try:  # a child still busy with the last client's work gets that work's time (wait_timeout)
                replies = await exchange_hello(
                    upstream, conn, early, max(s.handshake_timeout, s.wait_timeout) if busy else s.handshake_timeout
                )
            except Close as exc:  # no answer in time, or a wrong one: a child hung at HELLO answers nobody
                grace = " (after the time given to a previous client's work)" if busy else ""
                self.child.kill_unresponsive(pid, exc.detail + grace)
                raise
            if replies is not None:
                break
            await upstream.aclose()  # the child went away before answering: a fresh one gets the same HELLO
            if trio.current_time() >= held_until:
                raise Close("backend_unavailable", "the ggml-RPC backend exited before answering HELLO")
            log.info("%s: ggml-RPC backend exited before answering HELLO; sending it to the next one", peer)
            conn = self._new_conn()
            conn.receive_request(b"".join(early))
        self.counters.bytes_in += sum(len(p) for p in early)
        self.counters.connections += 1
        pump = Pump(
            conn,
            client,
            upstream,
            self.counters,
            stall_timeout=s.stall_timeout,
            drain_idle=s.drain_idle,
            drain_started=self._drain_started,
        )
        try:
            await pump.run(replies, self.child.bound)
        except Close as exc:
            if exc.reason == "backend_stall":  # hung mid-reply: the next client would hang in it too
                self.child.kill_unresponsive(pid, exc.detail)
            raise
        finally:
            if not conn.between_messages:  # ended with work in flight (a reset, a close): the child may
                self._busy_pid = pid  # still compute, and reads the close only after that

    # ------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """The queue, the counters by reason and check, and the limits, for Hydra INFO ``rpc_backend``."""
        s = self.settings
        return {
            "waiting": self.waiting,
            "serving": self.serving,
            "handshaking": self.handshaking,
            "crashes": self.crashes,
            "trio_pumped": self.counters.trio_pumped,
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


async def _watch_hangup(stream: AcceptedStream, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client closes while it waits; stop watching if it sends more."""
    if isinstance(stream, TlsStream):  # no MSG_PEEK under TLS: read ahead and push the bytes back
        try:
            more = await stream.receive_some(PUMP_BUFFER)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            more = b""
        if more:
            stream.unread(more)
    else:
        try:
            more = await stream.socket.recv(1, socket.MSG_PEEK)
        except OSError:
            more = b""
    if not more:
        scope.cancel()
        return
    await trio.sleep_forever()  # pipelined bytes: they wait in the socket for the pump
