"""The bare relay (``bench/bare_relay.c``): built on first use with the machine's C compiler, started per bench.

It copies bytes between a client and a target on 127.0.0.1 and does nothing
else, so a path through it costs what one relay hop costs on this machine
(two more wake-ups per round trip): the floor of any relay, the front door's
and the TLS tunnel's included.  The benches print it as a reference row.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from hydra_trio.testing.spawn import free_port

SOURCE = Path(__file__).with_name("bare_relay.c")


def build() -> Path:
    """The relay binary, compiled (``cc -O2 -pthread``) into ``~/.cache/hydra-trio/bench`` keyed by the
    source's hash.

    Raises:
        RuntimeError: no C compiler (``cc`` or ``gcc``) on PATH.
        subprocess.CalledProcessError: the compile failed.
    """
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra-trio" / "bench"
    binary = cache / f"bare_relay-{digest}"
    if not binary.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("bench/bare_relay.c needs a C compiler (cc or gcc) on PATH")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        subprocess.run([cc, "-O2", "-pthread", "-o", str(tmp), str(SOURCE)], check=True)
        tmp.replace(binary)
    return binary


def start(target_port: int) -> tuple[subprocess.Popen, int]:
    """A bare relay from a free port on 127.0.0.1 to ``target_port``: the process and its port, once it listens."""
    port = free_port()
    proc = subprocess.Popen([str(build()), str(port), str(target_port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "listening":
        proc.kill()
        raise RuntimeError(f"bench/bare_relay.c did not start (exit {proc.wait()})")
    return proc, port
