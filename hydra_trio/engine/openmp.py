"""One OpenMP thread team at a time: release a thread's team when another thread takes over the compute.

llama-cpp-python builds ggml's CPU backend with OpenMP (``GGML_OPENMP``, on
wherever the compiler has it), so each thread that runs a CPU graph
(``llama_decode``) becomes the master of its own libgomp thread team, and
the team stays until that thread exits.  A COMBINED head decodes on two
threads: SOLO on the engine thread, COMBINED on the peer's worker
(:class:`~hydra_trio.engine.combined.PeerWorker`, so that a dead peer's
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
(:meth:`~hydra_trio.engine.combined.PeerWorker.decode`), so a connection
that breaks between requests parks the worker without a team.

Left: a peer that dies in the middle of a busy period (a request decoding)
leaves the worker waiting inside ``llama_decode`` for good (ggml-RPC's
dispatcher thread aborted, and the abort handler parks it), and that
worker's team cannot be released from another thread, so SOLO runs
throttled until the node restarts (logged as a warning).
"""

from __future__ import annotations

import ctypes
import logging
import os

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
