"""``python -m hydra_trio.cli.spare``: the router's fork server (:mod:`hydra_trio.cli.fork_server`) in a new
interpreter, its socket on standard input.  The router forks its first fork server from itself; it starts
this one when it needs another (the first one died)."""

from __future__ import annotations

import os
import socket
import sys

from hydra_trio.cli import exit_now, forked_node
from hydra_trio.cli.fork_server import serve, show_command_line, stdin_empty, warm_up


def main() -> int:
    router = os.getppid()
    control = socket.socket(fileno=os.dup(0))
    stdin_empty()
    show_command_line(["hydra-trio", "fork-server"], b"hydra-forksrv")
    warm_up()
    sys.stdout.flush()
    sys.stderr.flush()
    return serve(control, router, forked_node)


if __name__ == "__main__":
    exit_now(main())
