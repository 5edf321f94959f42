"""The kernel's resident-set figures of this process, which the micro-benchmarks measure memory by
(algo.py's log-prob, weight_sync.py's sync): Linux's /proc/self/status and clear_refs (proc(5))."""

from __future__ import annotations


def rss_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (the high-water mark since the last reset_peak_rss), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """VmHWM := the current VmRSS (writing 5 to clear_refs, Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
