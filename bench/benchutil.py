"""Helpers the benchmarks share: token ids, CPU accounting, sample summaries, machine facts."""

from __future__ import annotations

import os
import platform
import sys

import numpy as np
import torch


def new_tokens(rng: np.random.Generator, n: int, first: int) -> np.ndarray:
    """Random token ids whose first token is unique to this context (so every chunk is new)."""
    toks = rng.integers(0, 49152, size=n, dtype=np.int64)
    toks[0] = first
    return toks


def drop_file_cache(path: str) -> None:
    """Write back and drop the page cache of one file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cpu_busy_s() -> float:
    """CPU seconds all processes of the machine have spent busy (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of the children it waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def summarize(samples: list[float], nbytes: int) -> dict[str, object]:
    """Raw samples (seconds), percentiles, and GB/s (1e9 bytes/s) for ``nbytes`` each."""
    a = np.asarray(samples, dtype=np.float64)
    p50 = float(np.percentile(a, 50))
    return {
        "samples_s": [float(x) for x in a],
        "p50_s": p50,
        "p90_s": float(np.percentile(a, 90)),
        "min_s": float(a.min()),
        "max_s": float(a.max()),
        "gbps_p50": nbytes / p50 / 1e9,
        "gbps_best": nbytes / float(a.min()) / 1e9,
        "gbps_samples": [nbytes / float(x) / 1e9 for x in a],
    }


def machine_info(**extra: object) -> dict[str, object]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"platform": platform.platform(), "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "mem_bytes": mem, "torch": torch.__version__,
            "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
            "loadavg": os.getloadavg(), **extra}


def disk_usage(root) -> dict[str, int]:
    """Bytes allocated on disk (st_blocks) and apparent bytes of every file under ``root``."""
    from pathlib import Path

    alloc = apparent = files = 0
    for p in Path(root).rglob("*"):
        if p.is_file():
            st = p.stat()
            alloc += st.st_blocks * 512
            apparent += st.st_size
            files += 1
    return {"allocated_bytes": alloc, "apparent_bytes": apparent, "files": files}
