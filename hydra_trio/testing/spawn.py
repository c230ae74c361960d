"""Start ``hydra-trio run`` in a child process and wait until it serves (tests, benches, the fuzzer)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from ..transport.net import free_port  # tests, benches and the fuzzer import it from here too

ROOT = Path(__file__).resolve().parents[2]


SHARED_MACHINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment for a server on a machine whose cores are busy with other work.

llama.cpp's CPU threads meet at OpenMP barriers many times per token and, by
default, spin while they wait.  When other processes hold the cores, a
spinning thread keeps its partner off the CPU and decode collapses (measured
on 2 cores next to two ``yes``: 15 tok/s and worse, 0.3 tok/s with a second
server, against 46 tok/s with passive waiting; idle it costs about 15 %).
The tests and the fuzzer run their servers with it; benches do not.
"""


def spawn(
    *args: str, port: int | None = None, output: IO[Any] | int | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, int]:
    """``python -m hydra_trio run --port PORT *args``; returns ``(process, port)`` without waiting.

    ``env`` is added to this process's environment for the child.
    """
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydra_trio", "run", "--port", str(port), *args],
        cwd=ROOT,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        env={**os.environ, **env} if env else None,
    )
    return proc, port


def wait_healthy(port: int, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Poll ``GET /health`` every 50 ms until it answers 200.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: not ready within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # 503 while loading, or not listening yet
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server on port {port} not ready after {timeout} s")
