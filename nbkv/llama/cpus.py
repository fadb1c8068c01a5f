"""How many CPUs this process really has: its affinity mask and its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's cores. A container (Docker ``--cpus``, a Kubernetes
limit, mybinder.org) sees every core of its node but may use only a fraction of them: the
kernel throttles the whole cgroup once its quota of CPU time per period is spent. ggml's
threads wait for each other at every operation, spinning: with more threads than CPUs, a
thread that is not running holds all the others up. So llama.cpp gets as many threads as
the smallest of these allows:

- the CPUs in the affinity mask (``taskset``, ``docker --cpuset-cpus``);
- the cgroup's quota, rounded up: ``cpu.max`` (cgroup v2), or ``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us`` (v1), the tightest of the process's cgroup and its ancestors.

Pure logic over files: :func:`cpu_budget` takes the filesystem root, so the tests give it
fake ``/proc`` and ``/sys/fs/cgroup`` trees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, and why."""

    cores: int  # the machine's logical cores (os.cpu_count())
    affinity: int | None = None  # CPUs in the affinity mask (None: unknown)
    quota: float | None = None  # CPUs' worth of time the cgroup quota allows (None: no quota)
    source: str = ""  # the file the quota came from

    @property
    def threads(self) -> int:
        """Threads to run: the affinity mask's CPUs, capped by the quota (rounded up)."""
        n = self.affinity or self.cores
        if self.quota is not None:
            n = min(n, math.ceil(self.quota - 1e-9))
        return max(n, 1)

    def describe(self) -> str:
        """Why that many threads, in words: ``1 (a CPU quota of 0.5 of the 16 cores)``."""
        n = self.threads
        if self.quota is not None and n < (self.affinity or self.cores):
            return (f"{n} (a CPU quota of {self.quota:g} of the {self.cores} cores, "
                    f"cgroup {self.source})")
        if self.affinity is not None and self.affinity < self.cores:
            return f"{n} (the affinity mask allows {self.affinity} of the {self.cores} cores)"
        return f"{n} (every core)"


def cpu_budget(root: str | os.PathLike = "/", affinity: int | None = None,
               cores: int | None = None) -> CpuBudget:
    """What this process may use. ``root`` is where ``/proc`` and ``/sys`` are (tests).

    ``affinity`` is the affinity mask's size (default ``os.sched_getaffinity`` where the
    platform has it, for the real root only); ``cores`` the machine's (``os.cpu_count()``).
    """
    base = Path(root)
    if affinity is None and base == Path("/") and hasattr(os, "sched_getaffinity"):
        try:
            affinity = len(os.sched_getaffinity(0))
        except OSError:
            affinity = None
    quota, source = cgroup_quota(base)
    return CpuBudget(max(cores or os.cpu_count() or 1, 1), affinity, quota, source)


def cgroup_quota(root: Path) -> tuple[float | None, str]:
    """The tightest CPU quota over the process's cgroup and its ancestors, and its file.

    ``(None, "")`` where there is none (or no cgroup filesystem: macOS, Windows).
    """
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, ""
    best: tuple[float | None, str] = (None, "")
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            found = _walk(root, root / "sys/fs/cgroup", path, _v2)
        elif "cpu" in controllers.split(","):
            mount, mount_root = _v1_mount(root)
            rel = path[len(mount_root):] if path.startswith(mount_root) else path
            found = _walk(root, mount, rel, _v1)
        else:
            continue
        if found[0] is not None and (best[0] is None or found[0] < best[0]):
            best = found
    return best


def _walk(root: Path, mount: Path, path: str, read: Callable[[Path], float | None]
          ) -> tuple[float | None, str]:
    """The smallest quota from ``mount/path`` up to ``mount`` (a missing level is skipped).

    Inside a container without a cgroup namespace the path names the host's hierarchy, which
    the container does not have: its own cgroup is then mounted at ``mount`` itself.
    """
    best: tuple[float | None, str] = (None, "")
    d = mount / path.strip("/") if path.strip("/") else mount
    while True:
        q = read(d)
        if q is not None and (best[0] is None or q < best[0]):
            best = (q, "/" + str(d.relative_to(root)))
        if d == mount or mount not in d.parents:
            return best
        d = d.parent


def _v2(d: Path) -> float | None:
    """``cpu.max``: ``"QUOTA PERIOD"`` in microseconds, or ``"max PERIOD"``."""
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1(d: Path) -> float | None:
    """``cpu.cfs_quota_us`` (``-1``: none) over ``cpu.cfs_period_us``."""
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
        return None if quota < 0 else _ratio(quota, period)
    except (OSError, ValueError):
        return None


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def _v1_mount(root: Path) -> tuple[Path, str]:
    """Where the v1 ``cpu`` controller is mounted, and which cgroup is its root there.

    From ``/proc/self/mountinfo`` (field 4 is the mount's root in the hierarchy, field 5
    its mount point; after ``-`` come the type and the super options, which name the
    controllers); ``/sys/fs/cgroup/cpu`` when it says nothing.
    """
    try:
        for line in (root / "proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] == "cgroup" \
                    and "cpu" in tail[2].split(","):
                return root / fields[4].lstrip("/"), fields[3].rstrip("/")
    except OSError:
        pass
    return root / "sys/fs/cgroup/cpu", ""
