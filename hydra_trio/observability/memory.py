"""What the OS tells about memory: what this process can still allocate (the node's memory check at load,
the router's at start) and a process's resident set."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int | None:
    """Bytes this process can still allocate, as far as the OS tells: the least of
    ``MemAvailable`` (/proc/meminfo), the cgroup v2 ``memory.max`` headroom and the
    ``RLIMIT_AS`` headroom.  None when none of them is known.
    """
    import resource

    limits: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError):
        pass
    try:
        cg = Path("/proc/self/cgroup").read_text().strip().split("\n")[0].split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / cg.lstrip("/")
        high = (base / "memory.max").read_text().strip()
        if high != "max":
            limits.append(int(high) - int((base / "memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        pass
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            vm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmSize:"))
            limits.append(soft - int(vm.split()[1]) * 1024)
        except (OSError, StopIteration, ValueError):
            pass
    return max(0, min(limits)) if limits else None


def resident_bytes(pid: int | str = "self") -> int | None:
    """``VmRSS`` of process ``pid`` (/proc/PID/status) in bytes; None when it is gone or does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
