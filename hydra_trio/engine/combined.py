"""COMBINED mode: the same GGUF with its MoE expert tensors on a ggml-RPC peer.

The COMBINED model is built next to the SOLO one (so a flip between them
costs milliseconds, not a reload) with ``llama_model_params.devices`` = the
peer's device and a ``tensor_buft_overrides`` entry that puts every tensor
matching the expert pattern (default ``ffn_(up|down|gate)_exps``) in the
peer's buffer type (DESIGN.md, "Environment facts").

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
import logging
import queue
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..protocol.messages import MessageError, parse_peer
from . import ggml_rpc

log = logging.getLogger("hydra_trio.combined")
T = TypeVar("T")

DEFAULT_PATTERN = r"ffn_(up|down|gate)_exps"


class PeerError(RuntimeError):
    """The peer cannot host the experts (unreachable, too little memory, load failed)."""


class PeerLost(RuntimeError):
    """The peer stopped answering in the middle of a call; the worker thread is gone."""


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }``."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def tensor_overrides(pairs: list[tuple[str, int]]) -> ctypes.Array[_Override]:
    """A NULL-terminated ``llama_model_tensor_buft_override`` array (keep it alive while loading)."""
    arr = (_Override * (len(pairs) + 1))()
    for i, (pattern, buft) in enumerate(pairs):
        arr[i].pattern = pattern.encode()
        arr[i].buft = buft
    return arr


# ----------------------------------------------------------------------------- abort handling

_local = threading.local()
_abort_installed = False
_live_workers: set[PeerWorker] = set()


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _on_ggml_abort(message: bytes) -> None:
    text = ggml_rpc.clean_build_paths(message.decode("utf-8", "replace")) if message else "?"
    worker: PeerWorker | None = getattr(_local, "worker", None)
    # ggml-RPC's client sends from its own thread, so the abort may come from
    # there: any RPC abort while peers are attached is a peer failure
    victims = [worker] if worker is not None else ([*_live_workers] if "RPC" in text else [])
    if not victims:
        log.critical("ggml abort: %s", text)
        return  # ggml calls abort() next
    for w in victims:
        log.error("peer %s: %s; its worker is parked for good, the head goes back to SOLO", w.peer, text)
        w._dead.set()
        _live_workers.discard(w)
    threading.Event().wait()  # never returns: returning would abort() the process


def install_abort_handler() -> None:
    """Route ggml aborts on peer-worker threads to :class:`PeerLost` (idempotent)."""
    global _abort_installed
    if _abort_installed:
        return
    base, _, _ = ggml_rpc.libs()
    base.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    base.ggml_set_abort_callback.restype = ctypes.c_void_p
    base.ggml_set_abort_callback(ctypes.cast(_on_ggml_abort, ctypes.c_void_p))
    _abort_installed = True


class PeerWorker:
    """One thread that makes every call that may talk to one peer.

    :meth:`call` runs a function there and waits; if ggml aborts on the
    thread (the peer died), :meth:`call` raises :class:`PeerLost` and the
    worker is dead for good.
    """

    def __init__(self, peer: str) -> None:
        install_abort_handler()
        self.peer = peer
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._dead = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"peer-{peer}", daemon=True)
        self._thread.start()
        _live_workers.add(self)

    @property
    def dead(self) -> bool:
        return self._dead.is_set()

    def _main(self) -> None:
        _local.worker = self
        while (item := self._jobs.get()) is not None:
            fn, box, done = item
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            done.set()

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the worker thread.

        Raises:
            PeerLost: the peer died during the call (or before it).
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if self.dead:
            raise PeerLost(f"peer {self.peer} is gone")
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        while not done.wait(0.05):
            if self.dead:
                raise PeerLost(f"peer {self.peer} stopped answering")
            if timeout is not None:
                timeout -= 0.05
                if timeout <= 0:
                    raise TimeoutError(f"peer {self.peer}: no answer")
        if "error" in box:
            raise box["error"]
        return box["value"]

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


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def expert_bytes(path: Path, pattern: str) -> int:
    """Bytes of the GGUF tensors whose names match ``pattern`` (re.search, like llama.cpp's overrides).

    Reads only the GGUF header, with ggml's own ``gguf_*`` reader (the Python
    ``gguf`` reader parses every metadata array and takes seconds).
    """
    base, _, _ = ggml_rpc.libs()
    base.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    base.gguf_init_from_file.restype = ctypes.c_void_p
    base.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    base.gguf_get_n_tensors.restype = ctypes.c_int64
    base.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    base.gguf_get_tensor_name.restype = ctypes.c_char_p
    base.gguf_get_tensor_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    base.gguf_get_tensor_size.restype = ctypes.c_size_t
    base.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = base.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
    if not ctx:
        raise PeerError(f"cannot read the GGUF header of {path}")
    try:
        rx = re.compile(pattern)
        return sum(
            base.gguf_get_tensor_size(ctx, i)
            for i in range(base.gguf_get_n_tensors(ctx))
            if rx.search(base.gguf_get_tensor_name(ctx, i).decode())
        )
    finally:
        base.gguf_free(ctx)
