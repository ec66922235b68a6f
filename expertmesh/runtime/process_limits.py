"""Memory limits for helper processes (the operator's planning process, the router's image decoders): cap a
process's data segment — heap and anonymous mappings, what RLIMIT_DATA counts — at what it holds now plus a budget,
so an allocation past it raises MemoryError there instead of growing until the node's OOM killer picks a victim."""

from __future__ import annotations


def data_segment_bytes() -> int | None:
    """This process's data segment (what RLIMIT_DATA counts), from /proc; None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def limit_data_segment(extra_bytes: int) -> bool:
    """Cap this process's data segment at its present size plus `extra_bytes` (never above the hard limit).
    False where it cannot be measured or set (no /proc, no `resource`)."""
    used = data_segment_bytes()
    if used is None:
        return False
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        soft = used + extra_bytes
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    except (ImportError, OSError, ValueError):
        return False
    return True
