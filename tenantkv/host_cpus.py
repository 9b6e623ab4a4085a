"""How many CPUs this process may use: the defaults of worker counts and the read-ahead window.

``os.cpu_count()`` counts the host's CPUs. Inside a container, or under ``taskset``, a process
may run on far fewer: a cpuset narrows its affinity mask, and a cgroup CPU quota caps the CPU
time it gets however many CPUs it may run on (Docker's ``--cpus``, a Kubernetes CPU limit). Sized
by the host, a cache started one sealing and one loader thread per host CPU, more threads than
CPUs it could use; and, its pools larger than its affinity mask, it left them unpinned
(``tenantkv.datapath.cpu_pinning``) without a word.

So the usable count is the affinity mask (``os.sched_getaffinity``, which honours cpusets and
``taskset``) bounded by the quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, the tightest along the process's cgroup and its ancestors), rounded up
(1.5 CPUs' worth of quota keeps two threads busy part of the time), at least 1. Where the
platform cannot tell (no affinity call, no cgroup files), ``os.cpu_count()`` stands in. The
files' locations are parameters so that tests can hand in fake cgroup trees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: Where the kernel lists the process's cgroups, one line per hierarchy.
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: Where the cgroup file systems are mounted (v2 at the root; v1 one folder per controller).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: v1 folders that may hold the ``cpu`` controller (Docker and systemd mount it in either).
_V1_CPU_FOLDERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


@dataclass(frozen=True)
class HostCpus:
    """The CPUs this process may run on, and the CPU time its cgroup quota grants."""

    #: The affinity mask, sorted (empty where the platform cannot tell).
    allowed: tuple[int, ...]
    #: CPUs' worth of CPU time the cgroup quota grants per period (None: no quota, or unknown).
    quota: float | None
    #: The host's CPUs (``os.cpu_count()``), the fallback where the mask is unknown.
    host: int

    @property
    def count(self) -> int:
        """The CPUs the process can keep busy: its mask bounded by its quota, at least 1."""
        count = len(self.allowed) or self.host
        if self.quota is not None:
            count = min(count, math.ceil(self.quota))
        return max(1, count)

    @property
    def quota_bounded(self) -> bool:
        """Whether the quota, not the mask, sets :attr:`count`: the process then shares the
        CPUs of its mask with processes it may not see (other containers, say)."""
        return self.quota is not None and math.ceil(self.quota) < len(self.allowed)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order (empty where the platform cannot tell)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return []
    try:
        return sorted(getaffinity(0))
    except OSError:
        return []


def host_cpus(
    *,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
    affinity: Callable[[], list[int]] = allowed_cpus,
) -> HostCpus:
    """This process's CPUs, read now (a mask or a quota may change while a process runs)."""
    return HostCpus(
        allowed=tuple(affinity()),
        quota=cgroup_quota(proc_cgroup=proc_cgroup, cgroup_root=cgroup_root),
        host=os.cpu_count() or 1,
    )


def usable_cpu_count() -> int:
    """The CPUs this process can keep busy (see the module docstring)."""
    return host_cpus().count


def cgroup_quota(
    *, proc_cgroup: Path = PROC_SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT
) -> float | None:
    """CPUs' worth of the tightest CPU quota over the process's cgroups and their ancestors
    (v2 and v1 alike), or None where there is none or it cannot be read. A file that is
    missing, unreadable or garbled counts as no quota: a wrong guess would only size the pools,
    and the mask still bounds them."""
    try:
        return _tightest_quota(proc_cgroup.read_text().splitlines(), cgroup_root)
    except (OSError, UnicodeDecodeError):  # unreadable, or a folder it may not search
        return None


def _tightest_quota(lines: list[str], cgroup_root: Path) -> float | None:
    quotas: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # cgroup v2: one tree
            quotas += _quotas(cgroup_root, path, _read_cpu_max)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's tree
            for folder in _V1_CPU_FOLDERS:
                if os.path.isdir(cgroup_root / folder):
                    quotas += _quotas(cgroup_root / folder, path, _read_cfs_quota)
                    break
    return min(quotas) if quotas else None


def _quotas(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas set on ``path`` and its ancestors below ``mount``."""
    return [quota for folder in _cgroup_folders(mount, path) if (quota := read(folder))]


def _cgroup_folders(mount: Path, path: str) -> Iterator[Path]:
    """The folders of the cgroup ``path`` and of its ancestors, under ``mount``. Inside a
    container without a cgroup namespace the path is the host's, and the container sees only
    its own cgroup, mounted at ``mount``: where the path is not there, the mount's root is the
    process's cgroup."""
    leaf = mount.joinpath(*[part for part in path.split("/") if part not in ("", ".", "..")])
    if not os.path.isdir(leaf):  # (Path.is_dir raises on EACCES before Python 3.13)
        yield mount
        return
    folder = leaf
    while True:
        yield folder
        if folder == mount:
            return
        folder = folder.parent


def _read_cpu_max(folder: Path) -> float | None:
    """cgroup v2 ``cpu.max``: ``"<quota> <period>"`` in microseconds, ``"max <period>"``
    where there is no quota."""
    fields = _read_words(folder / "cpu.max")
    if fields is None or len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _read_cfs_quota(folder: Path) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: no quota) over ``cpu.cfs_period_us``."""
    quota = _read_words(folder / "cpu.cfs_quota_us")
    period = _read_words(folder / "cpu.cfs_period_us")
    if quota is None or period is None or len(quota) != 1 or len(period) != 1:
        return None
    return _ratio(quota[0], period[0])


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` where both are positive integers, else None (-1, garbage)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read_words(file: Path) -> list[str] | None:
    try:
        return file.read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
