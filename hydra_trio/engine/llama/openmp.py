"""One OpenMP thread team at a time: release a thread's team when another thread takes over the compute.

llama-cpp-python builds ggml's CPU backend with OpenMP (``GGML_OPENMP``, on
wherever the compiler has it), so each thread that runs a CPU graph
(``llama_decode``) becomes the master of its own libgomp thread team, and
the team stays until that thread exits.  A COMBINED head decodes on two
threads: SOLO on the engine thread, COMBINED on the peer's worker
(:class:`~hydra_trio.engine.experts.combined.PeerWorker`, so that a dead peer's
abort parks that thread and not the engine).  With both teams alive, libgomp
counts more threads than CPUs and switches every thread of both teams to
its *throttled* spin (``gomp_throttled_spin_count_var``: 100 spins instead
of 300,000 before sleeping, see GCC's ``libgomp/env.c`` and
``config/linux/wait.h``).  ggml waits at an OpenMP barrier after each
operation, so every operation then ends in a futex sleep and wake-up.
Measured on the test MoE with ``-t 2`` on 2 cores: SOLO decode fell from
68 to 46 tok/s after the first COMBINED attach, and stayed there.

The cure is OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)``, which
libgomp implements for the host as "free the calling thread's team"
(``gomp_pause_host``): the thread that stops computing releases its team,
and the next parallel region on the thread that takes over starts one
afresh (thread creation, well under a millisecond, once per switch).

The peer's worker also frees its team whenever the slots go idle, and checks
the peer with one round trip before it computes again
(:meth:`~hydra_trio.engine.experts.combined.PeerWorker.decode`), so a connection
that breaks between requests parks the worker without a team.

A peer that dies in the middle of a busy period (a request decoding) leaves
the worker waiting inside ``llama_decode`` for good: ggml-RPC's dispatcher
thread aborted (the abort handler parks it) before it completed the message
the worker waits for.  No other thread can release the worker's team, so
:func:`release_team_of` makes the worker release it itself: a signal sent to
that thread alone runs a handler there, which calls
``omp_pause_resource_all``.  The worker is blocked in a futex wait (ggml-RPC's
``std::future::wait``), outside any parallel region and holding no lock that
the handler takes, and goes back to that wait when the handler returns.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

log = logging.getLogger("hydra_trio.engine")

OMP_PAUSE_SOFT = 1  # enum omp_pause_resource_t (omp.h, OpenMP 5.0)


_lib: list[ctypes.CDLL] = []  # libgomp, once found loaded


def _libgomp() -> ctypes.CDLL | None:
    """libgomp if this process has loaded it (ggml's CPU backend links it), else None: nothing to release."""
    if _lib:
        return _lib[0]
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # not loaded (yet, or another OpenMP, or ggml's own threads), or pre-5.0
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    _lib.append(lib)
    return lib


def in_use() -> bool:
    """True when this process runs libgomp (ggml's CPU backend built with OpenMP, and loaded)."""
    return _libgomp() is not None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP team (its worker threads exit); True if released or none was there.

    Call it on the thread that stops running graphs, outside any graph computation (libgomp refuses
    from inside a parallel region: False).  A process without libgomp has nothing to release: True.
    """
    lib = _libgomp()
    if lib is None:
        return True
    rc = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all: %d (the thread's OpenMP team stays)", rc)
    return rc == 0


RELEASE_SIGNAL = signal.SIGRTMIN + 4
"""The real-time signal :func:`release_team_of` sends to a stuck thread (neither Python, trio nor ggml
uses real-time signals)."""

_released: dict[int, int] = {}  # thread ident -> omp_pause_resource_all's return code, set by the handler
_handler_installed = False


@ctypes.CFUNCTYPE(None, ctypes.c_int)
def _release_here(_signum: int) -> None:
    """Runs on the thread the signal was sent to: free that thread's team (no logging here: a signal handler)."""
    lib = _libgomp()
    _released[threading.get_ident()] = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) if lib is not None else 0


def _install_handler() -> None:
    global _handler_installed
    if _handler_installed:
        return
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(RELEASE_SIGNAL, ctypes.cast(_release_here, ctypes.c_void_p))  # BSD semantics: restarts syscalls
    _handler_installed = True


def release_team_of(thread: threading.Thread, tries: int = 20, every: float = 0.25) -> bool:
    """Free the OpenMP team of ``thread``, a thread blocked for good (a peer worker stuck inside a
    ``llama_decode`` whose peer died): :data:`RELEASE_SIGNAL` is sent to that thread alone and its handler
    calls ``omp_pause_resource_all`` there.  libgomp refuses while the thread is inside a parallel region
    (it may still be finishing a CPU part of the graph), so the signal is sent again, every ``every``
    seconds, up to ``tries`` times.  True once released (or when there is nothing to release)."""
    if _libgomp() is None or thread.ident is None or not thread.is_alive():
        return True
    _install_handler()
    for _ in range(tries):
        _released.pop(thread.ident, None)
        signal.pthread_kill(thread.ident, RELEASE_SIGNAL)
        deadline = time.monotonic() + every
        while thread.ident not in _released and time.monotonic() < deadline:
            time.sleep(0.01)
        if _released.get(thread.ident) == 0:
            return True
    log.debug("thread %s did not release its OpenMP team (return code %s)", thread.name, _released.get(thread.ident))
    return False
