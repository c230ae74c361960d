"""``python -m hydra_trio.cli.spare``: the router's fork server (:mod:`hydra_trio.cli.fork_server`) in a new
interpreter, its socket on standard input.  The router forks its first fork server from itself; it starts
this one when it needs another (the first one died)."""

from __future__ import annotations

import os
import socket

from hydra_trio.cli import exit_now
from hydra_trio.cli import main as node_main
from hydra_trio.cli.fork_server import run_server


def main() -> int:
    return run_server(socket.socket(fileno=os.dup(0)), os.getppid(), node_main)


if __name__ == "__main__":
    exit_now(main())
