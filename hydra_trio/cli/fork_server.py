"""A warm interpreter that forks the router's child nodes: a fork server (its side; the router's is
:class:`hydra_trio.router.child_process.ForkServer`).

A child node spends most of its start importing (Python, trio, the HTTP stack, llama-cpp-python and
llama.cpp's libraries: about 0.5 s on 2 cores) before it reads a byte of its model.  The router keeps one
such interpreter running, its imports done and no thread started; each load is one request to it, and it
forks the node from its warm state, so only the model's own load is left, and the next load (even one
right after) finds it ready again.  The router makes it by forking itself (:func:`start_here`) before it
starts a thread: it has imported nearly all a node needs by then, so the server is warm at once, and
shares the router's pages.  When it has to make another (the first one died), it starts
``python -m hydra_trio.cli.spare``, which imports all that first.

What ``ps`` and ``top`` show: a forked process has the memory of the one it was forked from, its command
line too, so each writes its own over it (:func:`show_command_line`, cut to the room the first one had):
``hydra-trio fork-server``, and ``hydra-trio FLAGS...`` for a node (its name, model and port first); their
process names (``/proc/PID/comm``) are ``hydra-forksrv`` and ``hydra-trio``.

Protocol, on a ``SOCK_SEQPACKET`` Unix socket (one message each; standard input for
``python -m hydra_trio.cli.spare``):

* the server, once its imports are done: ``{"ready": true}``;
* a request: ``fork``, with two descriptors (``SCM_RIGHTS``): where the node's standard output and error go
  (the router's end of it relays them), and a file holding ``{"argv": [...]}`` (the flags a child gets after
  ``python -m hydra_trio``; a file, so that no flag is too long for a message);
* its answer: ``{"pid": N}`` from the node itself, once the router is its parent, or ``{"error": "..."}``
  when it could not be forked or the request was wrong.

The node is forked twice (the first child starts a session, forks the node and exits at once), so it is
not this interpreter's child but the router's: the router marks itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``, Linux's rule for orphans) until the answer comes, and the node answers only
once the router is its parent, so the router has its pid even if this server dies meanwhile.  The router
then waits for the node's exit and reads its status as for a child it started itself.  The node asks to be
sent SIGTERM when the router goes (``PR_SET_PDEATHSIG``), as a child started cold is; its standard input
is ``/dev/null``.  The interpreter itself ends when the router closes the socket, or with the router.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from .ending import exit_now

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
REPARENT_WAIT_S = 10.0
"""How long a forked node waits to become the router's child before it gives up (exit 1)."""


def warm_up() -> None:
    """Import what a node imports before it loads its model (also what it imports on first use: anyio's trio
    backend when the HTTP app starts, the IDNA codec for host names)."""
    import encodings.idna
    import encodings.unicode_escape  # noqa: F401

    import anyio._backends._trio  # noqa: F401
    import llama_cpp  # noqa: F401  (llama.cpp's libraries, mapped)

    import hydra_trio.cli.run
    import hydra_trio.http.app
    import hydra_trio.node.server  # noqa: F401
    from hydra_trio.engine import Engine  # noqa: F401  (the engine package loads its modules on first use)


def show_command_line(words: list[str], name: bytes) -> None:
    """Make ``/proc/self/cmdline`` (what ``ps`` shows) ``words`` and the process name ``name`` (15 bytes at
    most).  The command line lives in the process's own memory (``arg_start`` to ``arg_end`` in
    ``/proc/self/stat``): the words, separated and padded with NUL bytes, are written there, cut to fit.
    Nothing happens where that cannot be read."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name[:15])
    start, end = _stat_field(48), _stat_field(49)  # arg_start, arg_end
    if start is None or end is None or end - start < 2:
        return
    text = b"\0".join(w.encode(errors="replace") for w in words)[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _stat_field(index: int) -> int | None:
    """Field ``index`` of ``/proc/self/stat`` counted from 1 (``man 5 proc``), None where it cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[index - 3])  # the first two fields precede ")"
    except (OSError, IndexError, ValueError):
        return None


def show_environment() -> None:
    """Make ``/proc/self/environ`` this process's environment as it is now (``os.environ``), once some of
    it was taken out: that file shows the block the process started with (``env_start`` to ``env_end``),
    which a forked process shares with the one it was forked from.  The entries, each ended by a NUL byte,
    are written there when they fit and nothing in libc's ``environ`` points into the block any more (the
    entries of ``os.environ`` were set anew); else nothing is written."""
    start, end = _stat_field(50), _stat_field(51)
    if start is None or end is None or end <= start:
        return
    text = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in os.environ.items())
    if len(text) > end - start:
        return
    libc = ctypes.CDLL(None)
    table = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    i = 0
    while table[i]:
        if start <= table[i] < end:  # still in use: rewriting it would change a value
            return
        i += 1
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


_NAMES = ("--alias", "-a", "--model", "-m", "--port")
"""The flags that tell one node from another, shown first (the room for a command line is short)."""


def _names_first(argv: list[str]) -> list[str]:
    """``argv`` with :data:`_NAMES` and their values moved to the front, in that order."""
    pairs = [(i, argv[i]) for i in range(len(argv) - 1) if argv[i] in _NAMES]
    taken = {j for i, _ in pairs for j in (i, i + 1)}
    first = [argv[j] for i, _ in sorted(pairs, key=lambda p: _NAMES.index(p[1])) for j in (i, i + 1)]
    return first + [w for j, w in enumerate(argv) if j not in taken]


Node = Callable[[list[str]], int]
"""How a forked node runs: its flags (after ``python -m hydra_trio``) to the node's ``main``
(``hydra_trio.cli.main``), which returns its exit status."""


def _run_node(argv: list[str], out: int, router: int, control: socket.socket, node: Node) -> NoReturn:
    """The forked node: its descriptors, its parent, then ``node``; never returns."""
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        stdin_empty()  # a node reads nothing from its standard input
        deadline = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() != router:  # the middle process exits at once: the router adopts this one
            if time.monotonic() > deadline:
                print("hydra-trio: the forked node did not become the router's child", file=sys.stderr)
                raise SystemExit(1)
            time.sleep(0.0005)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != router:  # the router went before the signal was asked for
            raise SystemExit(1)
        control.send(json.dumps({"pid": os.getpid()}).encode())  # fails when the router gave up: exit 1
        control.close()
        show_command_line(["hydra-trio", *_names_first(argv)], b"hydra-trio")
        sys.argv = [sys.argv[0], *argv]
        code = node(argv)
    except SystemExit as exc:  # argparse's exit 2, or the checks above
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    exit_now(code)


def fork_node(argv: list[str], out: int, router: int, control: socket.socket, node: Node) -> None:
    """Fork the node for ``argv`` (output to descriptor ``out``) as a grandchild, which answers on
    ``control`` itself; returns once the middle process has exited and been reaped.

    Raises:
        OSError: the middle process could not be forked (the middle answers for the node's own fork).
    """
    middle = os.fork()
    if middle == 0:
        try:
            os.setsid()  # the node's own session, as a child started cold (a terminal's Ctrl-C is the router's)
            if os.fork() == 0:
                _run_node(argv, out, router, control, node)
        except OSError as exc:
            with contextlib.suppress(OSError):
                control.send(json.dumps({"error": f"the node could not be forked: {exc}"}).encode())
        finally:
            os._exit(0)
    os.waitpid(middle, 0)


def _read_argv(fd: int) -> list[str]:
    """The ``argv`` of a request's file (``{"argv": [str, ...]}``).

    Raises:
        ValueError: anything else."""
    data = b""
    while chunk := os.read(fd, 1 << 20):
        data += chunk
    request = json.loads(data) if data else None
    argv = request.get("argv") if isinstance(request, dict) else None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("a request's file holds {'argv': [str, ...]}")
    return argv


def serve(control: socket.socket, router: int, node: Node) -> int:
    """Answer fork requests on ``control`` until the router closes it (each forked node runs ``node``); 0.

    What the server holds then (its imports) is frozen out of the garbage collector's sight first
    (``gc.freeze``, CPython's advice for a process that forks): a node's collections would otherwise walk
    those objects and write to their headers, which copies every page of them (a full collection in a
    forked node took 60-70 ms here, against 1 ms frozen)."""
    gc.freeze()
    try:
        control.send(b'{"ready": true}')
    except OSError:
        return 0
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(control, 4096, 4)
        except OSError:
            return 0
        if not msg:
            for fd in fds:
                os.close(fd)
            return 0
        try:
            if msg != b"fork" or len(fds) != 2:
                raise ValueError("a request is 'fork' with two descriptors: the output, the flags' file")
            fork_node(_read_argv(fds[1]), fds[0], router, control, node)
        except (OSError, ValueError, KeyError) as exc:
            try:
                control.send(json.dumps({"error": str(exc)}).encode())
            except OSError:
                return 0
        finally:
            for fd in fds:
                os.close(fd)


def run_server(control: socket.socket, router: int, node: Node) -> int:
    """Be the fork server for ``router`` on ``control``: its name in ``ps``, an empty standard input, the
    imports (:func:`warm_up`), then :func:`serve`; 0 when the router closes the socket."""
    show_command_line(["hydra-trio", "fork-server"], b"hydra-forksrv")
    stdin_empty()
    warm_up()
    sys.stdout.flush()
    sys.stderr.flush()
    return serve(control, router, node)


def stdin_empty() -> None:
    """Standard input from ``/dev/null``."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def start_here(environ: dict[str, str], node: Node) -> tuple[int, socket.socket]:
    """Fork this process (the router, before it starts any thread: it has imported what a node needs) into
    the fork server, warm at once; ``(its pid, the router's end of its socket)``.  The server starts a
    session, asks for SIGTERM when the router goes, and takes ``environ`` as its (and its nodes')
    environment; its process name (``/proc/PID/comm``) is ``hydra-forksrv``, its nodes' ``hydra-trio``.

    Raises:
        OSError: the fork failed.
        RuntimeError: this process runs threads (forking it would copy their locks, held or not).
    """
    import threading

    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("the fork server is forked only from a process with one thread")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    router = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        theirs.close()
        return pid, ours
    code = 1
    try:
        ours.close()
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != router:
            raise SystemExit(0)
        os.environ.clear()
        os.environ.update(environ)
        show_environment()
        code = run_server(theirs, router, node)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
