"""COMBINED mode: the same GGUF with its MoE expert tensors on a ggml-RPC peer.

The COMBINED model is built next to the SOLO one (so a flip between them
costs milliseconds, not a reload) with the peer's device in
``llama_model_params.devices`` and a ``tensor_buft_overrides`` entry that puts
every tensor matching the expert pattern (default ``ffn_(up|down|gate)_exps``)
in the peer's buffer type (``ggml_backend_dev_buffer_type`` of the peer's device).  It keeps the
operator's placement flags, composed in this order (first match wins, as
llama.cpp applies overrides; :class:`~hydra_trio.engine.llama.placement.Placement`): the
operator's ``-ot`` entries, then the expert pattern on the peer, then
``-cmoe``/``-ncmoe``/``-ncffn``.  So ``-ot 'token_embd\\.weight=CPU'`` keeps the
embedding where it says and the experts still go to the peer, while an ``-ot``
that names expert tensors keeps those off the peer (the bytes the peer must
hold count only what reaches it).

A peer that dies must never take the head down, but ggml's RPC client calls
``GGML_ABORT`` when a peer stops answering.  So every call that can talk to
the peer (loading the model, ``llama_decode``, freeing it) runs on a
:class:`PeerWorker` thread, and ggml's abort callback, when it fires on such a
thread, marks the worker dead and parks that thread for good instead of
returning into ``abort()``.  The engine sees the worker die, fails the
requests of that step with a clear error and goes back to SOLO.  The parked
thread and the COMBINED model it held are leaked (one per peer death; logged).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp

from ...errors import EngineFailure
from ...observability import progress
from ...observability.events import EventBus
from ...validation.address import parse_peer
from ...validation.strict import MessageError
from ..bridge import Call
from ..llama import ggml_backend, openmp
from ..llama.model import LoadedModel
from ..settings import DEFAULT_PATTERN  # noqa: F401  (re-exported: the default of ExpertModes.pattern)

log = logging.getLogger("hydra_trio.combined")
T = TypeVar("T")


class PeerError(RuntimeError):
    """The peer cannot host the experts (unreachable, too little memory, load failed)."""


class PeerLost(RuntimeError):
    """The peer stopped answering in the middle of a call; the worker thread is gone."""


# ----------------------------------------------------------------------------- abort handling

_local = threading.local()
_abort_installed = False
_live_workers: set[PeerWorker] = set()
_lost_endpoints: set[str] = set()
"""Peers whose ggml-RPC connection broke mid-call: llama.cpp keeps that connection (and its lock)
for the life of the process, and a new attach to the same ``host:port`` would wait on it forever."""


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _on_ggml_abort(message: bytes) -> None:
    text = ggml_backend.clean_build_paths(message.decode("utf-8", "replace")) if message else "?"
    worker: PeerWorker | None = getattr(_local, "worker", None)
    # ggml-RPC's client sends from its own thread, so the abort may come from
    # there: any RPC abort while peers are attached is a peer failure
    victims = [worker] if worker is not None else ([*_live_workers] if "RPC" in text else [])
    # threading._DummyThread: the class Python gives a thread it did not start (a C library's own); the
    # threading module offers no public test for "not started by Python", so the class is checked
    if not victims and "RPC" in text and isinstance(threading.current_thread(), threading._DummyThread):
        # ggml-RPC's own thread (not one Python started) of a connection whose worker was retired
        # (PeerWorker.retire): park it; the process has nothing else waiting on it
        log.error("ggml-RPC: %s (a connection given up on earlier); its thread is parked", text)
        threading.Event().wait()
    if not victims:
        log.critical("ggml abort: %s", text)
        return  # ggml calls abort() next
    for w in victims:
        log.error("peer %s: %s; its worker is parked for good, the head goes back to SOLO", w.peer, text)
        w._die()
    if worker is not None:  # the parked thread's OpenMP team would slow every later SOLO decode
        try:
            if openmp.release_thread_team():
                worker.holds_team = False
                log.info("peer %s: the parked worker released its OpenMP threads", worker.peer)
        except Exception:  # returning from here would abort() the process
            log.exception("peer %s: its parked worker keeps its OpenMP threads", worker.peer)
    elif openmp.in_use():
        # the abort came from ggml-RPC's dispatcher thread: the worker waits inside llama_decode for
        # good, with its OpenMP team, and two teams throttle each other (engine/llama/openmp.py); it releases
        # the team itself, on a signal (one that released its team already, at a switch to SOLO or
        # when the slots went idle, keeps none)
        for w in victims:
            if w.holds_team:
                w.release_stuck_team()
    threading.Event().wait()  # never returns: returning would abort() the process


def install_abort_handler() -> None:
    """Route ggml aborts on peer-worker threads to :class:`PeerLost` (idempotent)."""
    global _abort_installed
    if _abort_installed:
        return
    base, _, _ = ggml_backend.libs()
    base.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    base.ggml_set_abort_callback.restype = ctypes.c_void_p
    base.ggml_set_abort_callback(ctypes.cast(_on_ggml_abort, ctypes.c_void_p))
    _abort_installed = True


class PeerWorker:
    """One thread that makes every call that may talk to one peer.

    :meth:`call` runs a function there and waits (a :class:`~hydra_trio.engine.bridge.Call`);
    if ggml aborts on the thread (the peer died), the abort handler fails the
    call in progress and every queued one with :class:`PeerLost`, and the
    worker is dead for good.
    """

    def __init__(self, peer: str) -> None:
        install_abort_handler()
        self.peer = peer
        self._jobs: queue.SimpleQueue[Call[Any] | None] = queue.SimpleQueue()
        self._current: Call[Any] | None = None
        self.holds_team = False
        """True from a decode on this worker until it releases its OpenMP team
        (:mod:`~hydra_trio.engine.llama.openmp`)."""
        self._dead = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"peer-{peer}", daemon=True)
        self._thread.start()
        _live_workers.add(self)

    @property
    def dead(self) -> bool:
        return self._dead.is_set()

    def _main(self) -> None:
        _local.worker = self
        while (call := self._jobs.get()) is not None:
            self._current = call
            call.run()
            self._current = None

    def release_stuck_team(self) -> None:
        """The dead peer's worker is stuck inside a decode with its OpenMP team: make it free the team
        (:func:`~hydra_trio.engine.llama.openmp.release_team_of`), so SOLO decodes are not throttled; logged
        either way.  Runs in ggml's abort handler: it never raises."""
        try:
            released = openmp.release_team_of(self._thread)
        except Exception:  # we are in ggml's abort handler: returning would abort() the process
            log.exception("peer %s: releasing the stuck worker's OpenMP threads failed", self.peer)
            released = False
        if released:
            self.holds_team = False
            log.info("peer %s: the stuck worker released its OpenMP threads; SOLO decodes at full speed", self.peer)
        else:
            log.warning(
                "the stuck worker keeps its OpenMP threads: SOLO decodes run with OpenMP's short "
                "spin waits (slower) until this node restarts"
            )

    def _die(self) -> None:
        """The peer is gone: fail the call in progress and all queued ones (from the abort handler)."""
        self._dead.set()
        _live_workers.discard(self)
        _lost_endpoints.add(self.peer)
        lost = PeerLost(f"peer {self.peer} stopped answering")
        if self._current is not None:
            self._current.fail(lost)
        while True:
            try:
                call = self._jobs.get_nowait()
            except queue.Empty:
                return
            if call is not None:
                call.fail(lost)

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the worker thread and wait (from a plain thread: the engine's).

        Raises:
            PeerLost: the peer died during the call (or before it).
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if self.dead:
            raise PeerLost(f"peer {self.peer} is gone")
        job: Call[T] = Call(fn, from_trio=False)
        self._jobs.put(job)
        if self.dead:  # it died between the check and the put: nobody will run the job
            job.fail(PeerLost(f"peer {self.peer} is gone"))
        return job.wait_blocking(timeout)

    def answers(self, dev: int, timeout: float = 30.0) -> bool:
        """True when the peer answers a ``GET_DEVICE_MEMORY`` round trip on this process's own ggml-RPC
        connection to it (the one the attached model's buffers use, through ggml-RPC's dispatcher).  False
        when it does not (the worker is dead then, parked without an OpenMP team if it computed nothing
        since it last released one) or within ``timeout`` seconds.  A TCP connect would not tell: a peer
        restarted at the same address accepts, and the connection this node holds is still broken."""
        try:
            self.call(lambda: ggml_backend.device_memory(dev), timeout=timeout)
        except (PeerLost, TimeoutError):
            return False
        return True

    def decode(self, ctx: Any, batch: Any, dev: int) -> int:
        """``llama_decode(ctx, batch)`` here.  The first decode after :meth:`rest` checks the peer first
        (:meth:`answers`, one round trip per busy period): a connection that broke while the slots were
        idle then parks this worker before it builds an OpenMP team, not inside the decode with one.

        Raises PeerLost when the peer does not answer or died during the call.
        """
        if not self.holds_team and not self.answers(dev):
            raise PeerLost(f"peer {self.peer} stopped answering")
        self.holds_team = True
        return self.call(lambda: llama_cpp.llama_decode(ctx, batch))

    def rest(self) -> None:
        """Free this worker's OpenMP team (:mod:`~hydra_trio.engine.llama.openmp`), if it holds one: at a switch away
        from its model, and when the slots go idle, so that a peer lost in between leaves no team behind."""
        if not self.holds_team or self.dead:
            return
        try:
            self.call(openmp.release_thread_team, timeout=30)
            self.holds_team = False
        except (PeerLost, TimeoutError) as exc:
            log.warning("peer %s: its worker did not release its OpenMP threads (%s)", self.peer, exc)

    def retire(self, model: LoadedModel) -> None:
        """Given up on while a call of its waits for a peer that does not answer (a hung peer, not a dead
        one): should that call ever return, free ``model`` (its buffers on the peer, and so the ggml-RPC
        connection, which the peer needs closed to serve a new client) and end the thread."""
        self._jobs.put(Call(model.close, from_trio=False))
        self.stop()

    def stop(self) -> None:
        _live_workers.discard(self)
        if not self.dead:
            self._jobs.put(None)


# ----------------------------------------------------------------------------- peer checks


def peer_reachable(peer: str, timeout: float = 2.0) -> bool:
    """True when ``host:port`` answers a ggml-RPC HELLO with a compatible version (a Python probe:
    ggml's own client would abort on a peer that vanishes mid-handshake)."""
    try:
        with socket.create_connection(parse_peer(peer), timeout=timeout) as s:
            s.sendall(b"\x0e" + (24).to_bytes(8, "little") + bytes(24))
            reply = b""
            while len(reply) < 12:
                chunk = s.recv(64)
                if not chunk:
                    return False
                reply += chunk
            return reply[8] == 7  # RPC_PROTO_MAJOR_VERSION of this llama.cpp
    except (OSError, MessageError):
        return False


def peer_listening(peer: str, timeout: float = 2.0) -> bool:
    """True when ``host:port`` accepts TCP connections.

    The liveness check while a COMBINED model is attached: a ggml-RPC server
    serves one client at a time, so a HELLO probe would wait behind the head's
    own connection; a connect is answered by the peer's kernel (or front door).
    """
    try:
        with socket.create_connection(parse_peer(peer), timeout=timeout):
            return True
    except (OSError, MessageError):
        return False


def expert_bytes(path: Path, pattern: str, before: tuple[str, ...] = ()) -> int:
    """Bytes of the GGUF tensors that an override ``pattern`` places (``re.search``, like llama.cpp's
    overrides): those whose names match it and none of the ``before`` patterns (the overrides that come
    first in the list; llama.cpp applies the first that matches).

    Reads only the GGUF header (:class:`~hydra_trio.engine.llama.ggml_backend.GgufHeader`).  Raises PeerError
    when the file's header cannot be read.
    """
    try:
        header = ggml_backend.GgufHeader(path)
    except OSError as exc:
        raise PeerError(str(exc)) from None
    rx = re.compile(pattern)
    earlier = [re.compile(p) for p in before]
    return sum(size for name, size in header.tensors if rx.search(name) and not any(e.search(name) for e in earlier))


# ----------------------------------------------------------------------------- expert modes


class ExpertMode(enum.StrEnum):
    """Which model serves new work (docs/hydra-protocol.md §3 SET_EXPERT_MODE)."""

    SOLO = "solo"
    COMBINED = "combined"
    PIPELINE = "pipeline"  # PIPELINE_ATTACH: the tensors matching ot_split (e.g. upper layers) on the peer


class PeerAttach(enum.StrEnum):
    """Where the COMBINED model stands: none asked, start-up attach queued, attached, or it failed."""

    NONE = "none"
    PENDING = "pending"
    ATTACHED = "attached"
    FAILED = "failed"


class ExpertModes:
    """SOLO and COMBINED: the two models, the peer, and the switches between them.

    The engine thread calls every method (switches run as exclusive engine
    tasks, when every slot is idle); other threads read :meth:`info` (INFO,
    ``/health``, ``/metrics``), whose values are plain attributes updated in
    an order that never shows a half switch.  Both models stay resident once
    built, so a flip costs milliseconds; each has its own KV cache, so
    ``on_switch`` (the scheduler's "forget cached prompts") runs on every flip.

    Args:
        peer: ``host:port`` of the ggml-RPC peer (``--rpc-engine``), or None.
        pattern: regex of the tensors that live on the peer (``--combined-pattern``).
        counters: an object with ``mode_switches``, ``combined_fallbacks`` and
            ``peer_losses`` integer attributes (the engine's stats).
        model_kwargs: keyword arguments for building the COMBINED
            :class:`~hydra_trio.engine.llama.model.LoadedModel` like the SOLO one
            (``n_batch``, ``n_threads``, ``chat_template``).
    """

    def __init__(
        self,
        peer: str | None,
        pattern: str,
        counters: Any,
        model_kwargs: dict[str, Any],
        events: EventBus | None = None,
    ) -> None:
        self.events = events if events is not None else EventBus()
        self._mode = ExpertMode.SOLO
        self.peer = peer
        self.peer_reachable = False
        self.pattern = pattern
        self.expert_pattern = pattern  # COMBINED's pattern; PIPELINE_ATTACH sets ``pattern`` to its ot_split
        self.home_peer = peer  # --rpc-engine: what a PIPELINE_ATTACH detach goes back to
        self.expert_quant: str | None = None  # the quant the peer's tensors come from, after an expert-only swap
        self.fallback_reason: str | None = None
        self.peer_attach = PeerAttach.PENDING if peer else PeerAttach.NONE
        self.solo: LoadedModel | None = None
        self.combined: LoadedModel | None = None
        self.active: LoadedModel | None = None
        self.counters = counters
        self.model_kwargs = model_kwargs
        self.on_switch: Callable[[], None] = lambda: None
        self.dial: Callable[[str], str] = lambda peer: peer
        """The address ggml's client and the HELLO probe use for a peer: the peer itself, or (``--rpc-tls``)
        a loopback TLS tunnel's (:meth:`hydra_trio.transport.tunnel.TunnelPool.dial`).  Raises OSError when none can
        serve it.  :attr:`peer`, INFO, events and the watchdog keep the real address."""
        self._worker: PeerWorker | None = None
        self._peer_dev = 0  # the attached peer's ggml device (ggml_backend_dev_t), for the liveness round trip

    @property
    def mode(self) -> ExpertMode:
        """The mode new work runs in; setting it to another one publishes ``mode.changed``."""
        return self._mode

    @mode.setter
    def mode(self, mode: ExpertMode) -> None:
        previous, self._mode = self._mode, mode
        if mode != previous:
            self.events.publish("mode.changed", mode=str(mode), previous=str(previous), peer=self.peer or "")

    def info(self) -> dict[str, Any]:
        """The expert-mode keys of Hydra INFO (docs/hydra-protocol.md §3), safe to call from any thread."""
        return {
            "mode": str(self.mode),
            "peer_addr": self.peer or "",
            "peer_reachable": self.peer_reachable,
            "layer_split": self.pattern,
            "combined_head_attached": self.combined is not None,
            "fallback_reason": self.fallback_reason,
            "peer_attach": str(self.peer_attach),
            "expert_quant": self.expert_quant,
        }

    def set_solo(self, model: LoadedModel) -> None:
        """A new SOLO model (load or reload): it serves; a COMBINED model of the old one is detached first."""
        if self.combined is not None:
            log.info(
                "the SOLO model changes: detaching the %s model (SET_EXPERT_MODE combined or PIPELINE_ATTACH "
                "rebuilds it)",
                "PIPELINE" if self.pattern != self.expert_pattern else "COMBINED",
            )
            self.detach()
            self.pattern = self.expert_pattern
        self.solo = self.active = model
        self.mode = ExpertMode.SOLO

    def decode(self, batch: Any) -> int:
        """``llama_decode`` of ``batch`` on the active model; COMBINED decodes run on the peer's worker.

        Raises PeerLost when the peer died during the call.
        """
        m = self.active
        assert m is not None
        if m is self.combined and self._worker is not None:
            return self._worker.decode(m.ctx, batch, self._peer_dev)
        return llama_cpp.llama_decode(m.ctx, batch)

    def rest(self) -> None:
        """Every slot idle (engine thread): the peer's worker frees its OpenMP team (:meth:`PeerWorker.rest`)."""
        if self._worker is not None and self.active is self.combined:
            self._worker.rest()

    def _activate(self, m: LoadedModel | None) -> None:
        """Make ``m`` serve new work: its KV cache starts empty and the slots forget their cached prompts."""
        if m is None or m is self.active:
            return
        self._release_compute_threads(self.active)
        llama_cpp.llama_memory_clear(m.memory, True)
        self.active = m
        self.counters.mode_switches += 1
        self.on_switch()

    def _release_compute_threads(self, old: LoadedModel | None) -> None:
        """The thread that ran ``old``'s graphs (the engine thread for SOLO, the peer's worker for
        COMBINED) frees its OpenMP team before another thread starts one (:mod:`~hydra_trio.engine.llama.openmp`: two
        teams at once throttle both).  A worker that is gone released its team as it died."""
        if old is None:
            return
        if old is self.solo:
            openmp.release_thread_team()  # we are on the engine thread
            return
        if old is self.combined and self._worker is not None:
            self._worker.rest()

    def detach(self) -> None:
        """Free the COMBINED model (on the peer's worker: it frees buffers on the peer); SOLO serves."""
        model, worker = self.combined, self._worker
        if self.active is model and model is not None:
            self._activate(self.solo)
            self.mode = ExpertMode.SOLO
        self.combined = None
        self._worker = None
        self.expert_quant = None
        if self.peer_attach == PeerAttach.ATTACHED:
            self.peer_attach = PeerAttach.NONE
        if model is not None and worker is not None:
            try:
                worker.call(model.close, timeout=30)
            except (PeerLost, TimeoutError) as exc:
                log.warning("peer %s: could not free the COMBINED model (%s); leaked", worker.peer, exc)
                _lost_endpoints.add(worker.peer)
            worker.stop()

    def _attach(self, peer: str, path: Path | None = None) -> int:
        """Build the COMBINED model with the expert tensors on ``peer``, from ``path`` (default: the
        SOLO model's file); returns the bytes placed on the peer.

        Raises PeerError (unreachable, too little memory, load failed); nothing changes then.
        """
        solo = self.solo
        assert solo is not None
        src = path or solo.path
        t_probe = time.perf_counter()
        if peer in _lost_endpoints:
            raise PeerError(
                f"the ggml-RPC connection to {peer} broke mid-call earlier, and llama.cpp keeps it for "
                "the life of this process: restart this node to use that address again, or reach the "
                "peer by another address (its host name, another IP)"
            )
        endpoint = self._endpoint(peer)
        if not peer_reachable(endpoint):
            self.peer_reachable = False
            raise PeerError(
                f"peer {peer} does not answer ggml-RPC"
                + (f" (through the TLS tunnel {endpoint})" if endpoint != peer else "")
            )
        self.peer_reachable = True
        t_bytes = time.perf_counter()
        # the operator's -ot entries come first in the override list (Placement): what they match stays theirs
        operator = tuple(p for p, _ in solo.options.tensor_overrides)
        need = expert_bytes(src, self.pattern, before=operator)
        log.info(
            "attach %s: probe %.0f ms, expert bytes counted in %.0f ms",
            peer,
            (t_bytes - t_probe) * 1e3,
            (time.perf_counter() - t_bytes) * 1e3,
        )
        if need == 0:
            raise PeerError(
                f"no tensor of {solo.path.name} matches {self.pattern!r}"
                + (" (not a MoE model?)" if self.pattern == self.expert_pattern else "")
                + (" that no -ot/--override-tensor entry places first" if operator else "")
            )
        worker = PeerWorker(peer)

        def build() -> LoadedModel:
            devs = ggml_backend.add_peer(endpoint)
            if not devs:
                raise PeerError(f"peer {peer} has no ggml devices")
            self._peer_dev = devs[0]
            free, _total = ggml_backend.device_memory(devs[0])
            if free < need:
                raise PeerError(f"peer {peer} has {free} bytes free; the expert tensors need {need}")
            label = "COMBINED" if self.pattern == self.expert_pattern else "PIPELINE"
            # llama.cpp reports the fraction of all weights loaded; scaled to the bytes bound for the
            # peer, it is their upload within a layer's worth (the tensors load in file order)
            with progress.step(f"attaching peer {peer}: uploading tensors", total=need, unit="B") as bar:

                def uploaded(p: float) -> bool:
                    bar.update(p * need)
                    return True

                return LoadedModel(
                    src,
                    n_ctx=solo.n_ctx,
                    n_parallel=solo.n_parallel,
                    **self.model_kwargs,
                    peer=(devs[0], self.pattern, label),
                    progress=uploaded,
                )

        t0 = time.perf_counter()
        try:
            model = worker.call(build, timeout=600)
        except PeerLost as exc:
            raise PeerError(f"peer {peer} died while the experts were uploaded: {exc}") from None
        except PeerError:
            worker.stop()
            raise
        except Exception as exc:
            worker.stop()
            raise PeerError(f"COMBINED model failed to load on {peer}: {exc}") from None
        self.combined, self._worker = model, worker
        self.peer_attach = PeerAttach.ATTACHED
        self.events.publish(
            "peer.attached", peer=peer, bytes=need, pattern=self.pattern, ms=round((time.perf_counter() - t0) * 1e3, 1)
        )
        log.info(
            "COMBINED model ready: %d bytes of %r on peer %s, built in %.2f s",
            need,
            self.pattern,
            peer,
            time.perf_counter() - t0,
        )
        return need

    def _endpoint(self, peer: str) -> str:
        """:attr:`dial` of ``peer``; PeerError when no address can serve it (e.g. no TLS tunnel)."""
        try:
            return self.dial(peer)
        except OSError as exc:
            raise PeerError(f"peer {peer}: {exc}") from None

    def replace_peer_tensors(self, path: Path, quant: str) -> dict[str, Any]:
        """Every slot idle, COMBINED attached: rebuild the COMBINED model from ``path`` (the same
        model whose expert tensors come from another quant, :func:`~hydra_trio.models.quant.merge_tensors`);
        the SOLO model and the head's own tensors stay.  Returns SWAP_QUANT's meta.

        Whole or nothing on the head: when the new model does not build, the node is back in SOLO
        (the old COMBINED model was freed first, as the peer holds one at a time) with a
        ``fallback_reason``, and this raises PeerError.
        """
        assert self.combined is not None and self.peer is not None
        t0 = time.perf_counter()
        was_active = self.active is self.combined
        self.detach()
        try:
            uploaded = self._attach(self.peer, path)
        except PeerError as exc:
            self._fallback(f"the experts of quant {quant!r} did not load on {self.peer}: {exc}")
            raise
        if was_active:
            self._activate(self.combined)
            self.mode = ExpertMode.COMBINED
        self.expert_quant = quant
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "swapped": True,
            "quant": quant,
            "tensor_pattern": self.pattern,
            "bytes": uploaded,
            "swap_ms": round(ms, 3),
            "kv_preserved": False,
            "mode": str(self.mode),
            "peer": self.peer,
        }

    def set_mode(self, mode: str, peer: str | None) -> dict[str, Any]:
        """Every slot idle (an exclusive task: :class:`~hydra_trio.engine.tasks.SetExpertMode`): switch SOLO / COMBINED;
        returns the reply meta.

        ``peer`` different from the current one detaches the old peer (frees
        what lives there) and attaches the new one.  COMBINED without a usable
        peer stays SOLO: ``success`` false, ``mode: "solo"`` and a
        ``fallback_reason`` (docs/hydra-protocol.md §3, SET_EXPERT_MODE).
        """
        t0 = time.perf_counter()
        if mode == ExpertMode.SOLO:
            self._activate(self.solo)
            self.mode = ExpertMode.SOLO
            self.fallback_reason = None
            return {"success": True, "mode": "solo", "peer": self.peer}
        target = peer or self.peer
        if target is None:
            return self._fallback(
                'no peer: start with --rpc-engine HOST:PORT or send {"mode": "combined", "peer": ...}'
            )
        if self.pattern != self.expert_pattern:  # the peer holds a pipeline split: COMBINED needs the experts
            self.detach()
            self.pattern = self.expert_pattern
        if target == self.peer:
            self._drop_dead_attachment()
        if target != self.peer or self.combined is None or self._worker is None or self._worker.dead:
            if self.combined is not None:
                log.info("detaching peer %s", self.peer)
            self.detach()
            self.peer = target
            try:
                self._attach(target)
            except PeerError as exc:
                return self._fallback(str(exc))
        self._activate(self.combined)
        self.mode = ExpertMode.COMBINED
        self.fallback_reason = None
        ms = (time.perf_counter() - t0) * 1e3
        log.info("expert mode COMBINED (peer %s), switch took %.1f ms", self.peer, ms)
        return {"success": True, "mode": "combined", "peer": self.peer, "switch_ms": round(ms, 3)}

    def attach_pipeline(self, peer: str | None, ot_split: str) -> dict[str, Any]:
        """Every slot idle: PIPELINE_ATTACH (docs/hydra-protocol.md §3) with COMBINED's machinery.

        The tensors whose names match ``ot_split`` (``re.search``; e.g. the
        upper half of the layers, ``blk\\.(1[5-9]|2[0-9])\\.``) are placed on
        the ggml-RPC ``peer``, on a dense model as on a MoE; the node then
        serves in mode ``pipeline``.  ``peer`` None detaches (back to local).
        Same rules as SET_EXPERT_MODE: an unusable peer leaves the node as it
        was, local, with ``success`` false and a ``fallback_reason``; a peer
        that dies mid-request fails that request and the node goes local.
        """
        t0 = time.perf_counter()
        if peer is None:
            self.detach()
            self.pattern = self.expert_pattern
            self.fallback_reason = None
            if self.peer != self.home_peer:
                self.peer, self.peer_reachable = self.home_peer, False
            return {"success": True, "mode": str(self.mode), "peer": self.peer}
        if self.combined is not None and (peer != self.peer or ot_split != self.pattern):
            # check what can be checked before the attachment that works is torn down
            assert self.solo is not None
            try:
                endpoint = self._endpoint(peer)
            except PeerError as exc:
                return self._refuse(str(exc), "pipeline")
            # the peer serves one ggml-RPC client at a time: while this node holds it, a probe would
            # wait behind this node's own connection; that live connection answers for it instead
            held = peer == self.peer and self._worker is not None and not self._worker.dead
            if not held and (peer in _lost_endpoints or not peer_reachable(endpoint)):
                return self._refuse(f"peer {peer} does not answer ggml-RPC", "pipeline")
            if (
                expert_bytes(self.solo.path, ot_split, before=tuple(p for p, _ in self.solo.options.tensor_overrides))
                == 0
            ):
                return self._refuse(f"no tensor of {self.solo.path.name} matches {ot_split!r}", "pipeline")
            self.detach()
        self._drop_dead_attachment()
        old = self.peer, self.pattern
        self.peer, self.pattern = peer, ot_split
        if self.combined is None or self._worker is None or self._worker.dead:
            try:
                self._attach(peer)
            except PeerError as exc:  # as it was: local, the old peer (none was attached)
                self.peer, self.pattern = old[0], self.expert_pattern
                return self._fallback(str(exc))
        self._activate(self.combined)
        self.mode = ExpertMode.PIPELINE
        self.fallback_reason = None
        ms = (time.perf_counter() - t0) * 1e3
        log.info("PIPELINE: tensors matching %r on peer %s, attached in %.1f ms", ot_split, peer, ms)
        return {"success": True, "mode": "pipeline", "peer": peer, "layer_split": ot_split, "switch_ms": round(ms, 3)}

    def _drop_dead_attachment(self) -> None:
        """Before a kept COMBINED/PIPELINE model serves again: if its peer died while SOLO served (the
        watchdog acts only in COMBINED/PIPELINE), forget it (leaked with its parked worker, as
        :meth:`peer_lost` does), so the switch attaches afresh or falls back instead of reporting success
        and failing the next request, whose stuck decode would keep the worker's OpenMP team
        (engine/llama/openmp.py)."""
        worker = self._worker
        if self.combined is None or self.active is self.combined or worker is None or worker.answers(self._peer_dev):
            return
        log.warning("peer %s: the kept %s model's connection no longer answers; it is dropped", self.peer, self.pattern)
        self.counters.peer_losses += 1
        self.peer_reachable = False
        if not worker.dead:  # no answer in time: a hung peer
            worker.retire(self.combined)
        self.combined = self._worker = None
        self.peer_attach = PeerAttach.NONE

    def _refuse(self, reason: str, asked: str) -> dict[str, Any]:
        """``asked`` cannot be done and nothing changed (the mode in effect stays): ``success`` false."""
        self.counters.combined_fallbacks += 1
        log.warning("%s refused, %s stays in effect: %s", asked, self.mode, reason)
        self.events.publish("peer.fallback", asked=asked, mode=str(self.mode), peer=self.peer or "", reason=reason)
        return {"success": False, "mode": str(self.mode), "peer": self.peer, "fallback_reason": reason}

    def _fallback(self, reason: str) -> dict[str, Any]:
        """COMBINED was asked for and SOLO stays in effect: ``success`` is false (the mode in
        effect is not the one asked for); ``mode`` and ``fallback_reason`` say what and why."""
        self.counters.combined_fallbacks += 1
        self.peer_attach = PeerAttach.FAILED if self.peer else PeerAttach.NONE
        self._activate(self.solo)
        self.mode = ExpertMode.SOLO
        self.fallback_reason = reason
        log.warning("COMBINED unavailable, staying in SOLO: %s", reason)
        self.events.publish("peer.fallback", asked="combined", mode="solo", peer=self.peer or "", reason=reason)
        return {"success": False, "mode": "solo", "peer": self.peer, "fallback_reason": reason}

    def peer_gone(self) -> None:
        """Slots idle: the watchdog found the peer unreachable; back to SOLO."""
        if self.mode not in (ExpertMode.COMBINED, ExpertMode.PIPELINE):
            return
        self.fallback_reason = (
            f"peer {self.peer} became unreachable"  # before the mode flips: INFO is read concurrently
        )
        self.counters.combined_fallbacks += 1
        self.events.publish("peer.lost", peer=self.peer or "", reason=self.fallback_reason, in_flight=False)
        self.detach()
        self.peer_attach = PeerAttach.FAILED

    def peer_lost(self, why: str) -> EngineFailure:
        """The peer died during a decode (a completion step's or an embedding's): back to SOLO, then the
        error the requests in flight fail with (so INFO shows SOLO by the time a client hears of it).

        The COMBINED model is leaked with its parked worker thread (ggml cannot free it).
        """
        peer = self.peer
        self.counters.peer_losses += 1
        log.error("COMBINED peer %s lost (%s): requests in flight fail, back to SOLO", self.peer, why)
        self.fallback_reason = f"peer {self.peer} stopped answering mid-request"
        self.events.publish("peer.lost", peer=self.peer or "", reason=why, in_flight=True)
        self.peer_reachable = False
        if self._worker is not None and self.combined is not None and not self._worker.dead:
            self._worker.retire(self.combined)  # no answer in time (PeerWorker.decode), not dead
        self.combined = None
        self._worker = None
        self.peer_attach = PeerAttach.FAILED
        self._activate(self.solo)
        self.mode = ExpertMode.SOLO
        return EngineFailure(f"the ggml-RPC peer {peer} died mid-request; the node is back in SOLO mode, retry")

    def close(self) -> None:
        """Free both models (engine thread, at shutdown)."""
        self.detach()
        if self.solo is not None:
            self.solo.close()
        self.solo = self.active = None
