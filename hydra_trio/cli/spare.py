"""A warm interpreter for the router's next child node (``python -m hydra_trio.cli.spare``).

A child node spends most of its start importing (Python, trio, the HTTP stack, llama-cpp-python and
llama.cpp's libraries: about 0.6 s on 2 cores) before it reads a byte of its model.  The router keeps one
such interpreter started ahead, its imports done, waiting on its standard input; a load hands it the
node's command line (one JSON line, ``{"argv": [...]}``: the flags a child would get after
``python -m hydra_trio``) and it runs the node's ``main`` in place, so only the model's own load is left.
The router then starts the next spare.  Its standard input closed without a line: it exits 0.

The same process serves the child's whole life: the router's supervision (its output relayed line by line,
its exit status, ``PR_SET_PDEATHSIG``, SIGTERM then SIGKILL) is the same as for a child started cold.
"""

from __future__ import annotations

import json
import os
import sys


def warm_up() -> None:
    """Import what a node imports before it loads its model."""
    import llama_cpp  # noqa: F401  (llama.cpp's libraries, mapped)

    import hydra_trio.cli.run
    import hydra_trio.http.app
    import hydra_trio.node.server  # noqa: F401
    from hydra_trio.engine import Engine  # noqa: F401  (the engine package loads its modules on first use)


def main() -> int:
    warm_up()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    argv = json.loads(line)["argv"]
    devnull = os.open(os.devnull, os.O_RDONLY)  # a node reads nothing from its standard input
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = [sys.argv[0], *argv]
    from hydra_trio.cli import main as node_main

    return node_main(argv)


if __name__ == "__main__":
    from hydra_trio.cli import exit_now

    exit_now(main())
