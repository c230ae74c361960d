"""How a ``hydra-trio`` process ends: :func:`exit_now`."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once the log and the standard streams are flushed, without tearing the
    interpreter down (``os._exit``).

    A node has stopped everything it runs by the time :func:`main` returns (its engine, its ggml-RPC
    child, its connections; nothing of hydra-trio's waits on ``atexit``), and the interpreter's own
    teardown of what a node imports (llama-cpp-python, the HTTP stack, trio) takes about 70 ms of CPU on
    2 cores: a router's unload waits for its child's exit, and llama-server's C++ child exits in a few ms.
    A program that embeds the server calls :func:`main` (or :func:`~hydra_trio.node.server.serve`) instead.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: the process started with that descriptor closed (`>&-`)
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say on it
            pass
    os._exit(code)
