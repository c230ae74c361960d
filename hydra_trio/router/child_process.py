"""A child node's process, started on the router's own (trio) thread.

``trio.lowlevel.open_process`` forks in a worker thread of trio's thread cache, and Linux ties a child's
``PR_SET_PDEATHSIG`` to the *thread* that forked it: when that worker retires (after 10 s idle) every child
it started gets the death signal, though the router lives on.  Forked from the thread that runs trio, which
lives as long as the router, the child gets it only when the router goes.  The fork blocks the event loop for
the few milliseconds ``subprocess.Popen`` takes (it returns once the child has exec'd).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping

import trio


class ChildProcess:
    """One child process: its output as a trio stream, its exit awaited without a thread (a pidfd).

    ``stdin``: its standard input is a pipe for :meth:`send_line` (a warm spare, :mod:`hydra_trio.cli.spare`),
    else empty.

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
        *,
        stdin: bool = False,
    ) -> None:
        self._popen = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
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

    def send_line(self, line: str) -> None:
        """Write one line to the standard input (``stdin=True``), then close it.  Raises OSError when the
        process has gone (a broken pipe)."""
        pipe = self._popen.stdin
        assert pipe is not None, "started without stdin=True"
        try:
            pipe.write(line.encode() + b"\n")  # a short line: the pipe's buffer takes it whole
            pipe.flush()
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        self._popen.kill()  # a no-op once it has been reaped

    def send_signal(self, signum: int) -> None:
        self._popen.send_signal(signum)

    async def wait(self) -> int:
        """Wait for the exit (and reap it); its :attr:`returncode`."""
        while self._popen.poll() is None:
            if self._pidfd is None:  # closed by another waiter: it has exited
                await trio.sleep(0.01)
                continue
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
            except trio.ClosedResourceError:
                continue
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
        code = self._popen.returncode
        assert code is not None
        return code
