"""A child node's process, started on the router's own (trio) thread.

``trio.lowlevel.open_process`` forks in a worker thread of trio's thread cache, and Linux ties a child's
``PR_SET_PDEATHSIG`` to the *thread* that forked it: when that worker retires (after 10 s idle) every child
it started gets the death signal, though the router lives on.  Forked from the thread that runs trio, which
lives as long as the router, the child gets it only when the router goes.  The fork blocks the event loop for
the few milliseconds ``subprocess.Popen`` takes (it returns once the child has exec'd).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

import trio


class _Awaitable:
    """What waiting for a child's exit takes: its :attr:`returncode` (None while it runs; it reaps) and a
    pidfd, readable once it has exited."""

    _pidfd: int | None

    @property
    def returncode(self) -> int | None:  # pragma: no cover - each subclass overrides it
        raise NotImplementedError

    async def wait(self) -> int:
        """Wait for the exit (and reap it); its :attr:`returncode`."""
        while (code := self.returncode) is None:
            if self._pidfd is None:  # closed by another waiter: it has exited
                await trio.sleep(0.01)
                continue
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
            except trio.ClosedResourceError:
                continue
            if self.returncode is None:  # exited, but not ours to reap yet (a forked node's adoption)
                await trio.sleep(0.001)
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
        return code


class ChildProcess(_Awaitable):
    """One child process: its output as a trio stream, its exit awaited without a thread (a pidfd).

    Its standard input is empty (``/dev/null``).

    The same calls as :class:`trio.Process` that the router makes: :attr:`returncode` (None while it runs,
    ``-N`` after signal N), :meth:`kill`, :meth:`send_signal`, ``await`` :meth:`wait`, :attr:`stdout` (its
    standard output and error, merged).

    Raises:
        OSError: the program cannot be started.
    """

    def __init__(
        self,
        args: list[str],
        env: Mapping[str, str] | None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self._popen = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=preexec_fn,
            start_new_session=True,
        )
        self.pid = self._popen.pid
        assert self._popen.stdout is not None
        self.stdout = trio.lowlevel.FdStream(os.dup(self._popen.stdout.fileno()))
        self._popen.stdout.close()
        self._pidfd: int | None = os.pidfd_open(self.pid)

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        self._popen.kill()  # a no-op once it has been reaped

    def send_signal(self, signum: int) -> None:
        self._popen.send_signal(signum)


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _subreaper(on: bool | None = None) -> bool:
    """Whether this process adopts its descendants' orphans (``PR_SET_CHILD_SUBREAPER``); with ``on``, set it
    first.  Raises OSError where the kernel refuses (not Linux 3.4 or later)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if on is not None and libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")
    flag = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_GET_CHILD_SUBREAPER")
    return bool(flag.value)


class ForkedChild(_Awaitable):
    """A node forked by the :class:`ForkServer`: the router's child (adopted as its subreaper), with the same
    calls as :class:`ChildProcess` (:attr:`returncode`, :meth:`kill`, :meth:`send_signal`, ``await``
    :meth:`wait`, :attr:`stdout`).  Signals go through a pidfd, so none reaches another process once it has
    been reaped."""

    def __init__(self, pid: int, stdout: int) -> None:
        self.pid = pid
        self._pidfd: int | None = os.pidfd_open(pid)
        self.stdout = trio.lowlevel.FdStream(stdout)
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not adopted yet (it ended before the middle process did): still ours
                return None
            if pid == self.pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def send_signal(self, signum: int) -> None:
        if self._pidfd is not None and self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:  # exited, not reaped yet
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The router's warm interpreter (:mod:`hydra_trio.cli.fork_server`): it forks each child node from its
    imported state (a fork server).  ``pid`` and ``control`` (the router's end of its socket) come from
    :func:`hydra_trio.cli.fork_server.start_here` (a fork of this process), or from :meth:`spawn` (a new
    interpreter, started as a :class:`ChildProcess` is: its own session, the death signal); its standard
    error is the router's.  Use it only where :meth:`supported`.
    """

    READY_TIMEOUT_S = 30.0
    """How long the first fork waits for the server to be ready (a new interpreter's imports, on a busy
    machine) before the child starts cold."""
    FORK_TIMEOUT_S = 5.0
    """How long a fork of a ready server may take (a few milliseconds) before the child starts cold."""

    def __init__(self, pid: int, control: socket.socket, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self._popen = popen
        self._code: int | None = None
        self._sock = control
        self._control = trio.socket.from_stdlib_socket(control)  # the same socket object, for trio's waits
        self._lock = trio.Lock()
        self._ready = False

    @staticmethod
    def supported() -> bool:
        """Whether this kernel lets the router adopt the nodes a server forks (``PR_SET_CHILD_SUBREAPER``)."""
        try:
            _subreaper()
        except (OSError, AttributeError):
            return False
        return True

    @classmethod
    def spawn(cls, args: list[str], env: Mapping[str, str] | None, preexec_fn: Callable[[], None] | None) -> ForkServer:
        """Start ``args`` (``python -m hydra_trio.cli.spare``) as the server.

        Raises:
            OSError: it cannot be started, or this kernel has no child subreapers.
        """
        _subreaper()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            popen = subprocess.Popen(
                args,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                env=env,
                preexec_fn=preexec_fn,
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(popen.pid, ours, popen)

    @property
    def returncode(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return -signal.SIGKILL  # reaped elsewhere: gone
            if pid == self.pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def close(self) -> None:
        """Stop it (its children run on) and reap it; inside or outside ``trio.run``."""
        with contextlib.suppress(RuntimeError):  # outside trio.run nothing can wait on it
            trio.lowlevel.notify_closing(self._sock)
        self._sock.close()
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
        if self._popen is not None:
            self._popen.wait()
        elif self._code is None:
            try:
                self._code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:
                self._code = -signal.SIGKILL

    async def fork(self, argv: list[str]) -> ForkedChild:
        """A node with ``argv`` (after ``python -m hydra_trio``) forked from the server, its output on a new
        pipe.  The first call waits up to :attr:`READY_TIMEOUT_S` for the server to be ready (a new
        interpreter imports first); a fork has :attr:`FORK_TIMEOUT_S`.  The flags go in a memory file
        (``memfd_create``), whatever their size.

        Raises:
            OSError: the server is gone, not ready, did not answer in time, or could not fork (the server is
                stopped then: it is not trusted with another request; so too when the call is cancelled).
        """
        async with self._lock:
            rd, wr = os.pipe()
            spec = os.memfd_create("hydra-trio-argv", os.MFD_CLOEXEC)
            answered = False
            try:
                data = memoryview(json.dumps({"argv": argv}).encode())
                while data:
                    data = data[os.write(spec, data) :]
                os.lseek(spec, 0, os.SEEK_SET)
                if not self._ready:
                    with trio.move_on_after(self.READY_TIMEOUT_S):
                        self._ready = _answer(await self._control.recv(4096)).get("ready") is True
                    if not self._ready:
                        raise OSError(f"not ready after {self.READY_TIMEOUT_S:g} s")
                was = _subreaper()
                _subreaper(True)
                try:
                    with trio.fail_after(self.FORK_TIMEOUT_S):
                        await self._control.sendmsg(
                            [b"fork"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [wr, spec]))]
                        )
                        os.close(wr)
                        wr = -1
                        answer = _answer(await self._control.recv(4096))  # the node's own, once adopted
                finally:
                    _subreaper(was)
                if not isinstance(answer.get("pid"), int):
                    raise OSError(str(answer.get("error", answer)))
                answered = True
                child = ForkedChild(answer["pid"], rd)
                rd = -1
                return child
            except (OSError, ValueError, trio.TooSlowError) as exc:
                raise OSError(f"fork server: {str(exc) or type(exc).__name__}") from exc
            finally:
                for fd in (rd, wr, spec):
                    if fd >= 0:
                        os.close(fd)
                if not answered:  # a reply may still come, or never: not trusted with another request
                    self.close()


def _answer(message: bytes) -> dict[str, Any]:
    """One message of the fork server's socket as a dict (``{"error": ...}`` for an empty one: it closed).

    Raises:
        ValueError: not a JSON object."""
    if not message:
        return {"error": "the fork server has gone"}
    answer = json.loads(message)
    if not isinstance(answer, dict):
        raise ValueError(f"not a JSON object: {message[:80]!r}")
    return answer
