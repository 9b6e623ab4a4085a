"""The CPUs a process can use (``tenantkv.host_cpus``): its affinity mask bounded by its cgroup
CPU quota, read from fake cgroup trees under ``tmp_path`` (v2 with a quota and with ``max``, a
quota on an ancestor, a container's own mount, v1, missing files, garbage), and from this host.

Each fake tree is checked against the count it must give and against a control (the same tree
with no quota), so a parser that never finds a quota, or always finds one, fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenantkv.host_cpus import HostCpus, allowed_cpus, cgroup_quota, host_cpus, usable_cpu_count

EIGHT = list(range(8))


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def _cpus(tmp_path: Path, mask: list[int] = EIGHT) -> HostCpus:
    return host_cpus(
        proc_cgroup=tmp_path / "proc-self-cgroup",
        cgroup_root=tmp_path / "cgroup",
        affinity=lambda: mask,
    )


def test_v2_quota_bounds_the_mask_rounded_up(tmp_path: Path) -> None:
    _write(tmp_path / "proc-self-cgroup", "0::/kubepods/pod1/ctr\n")
    cpu_max = tmp_path / "cgroup/kubepods/pod1/ctr/cpu.max"
    _write(cpu_max, "150000 100000\n")  # 1.5 CPUs' worth
    cpus = _cpus(tmp_path)
    assert cpus.quota == 1.5 and cpus.count == 2 and cpus.quota_bounded
    _write(cpu_max, "max 100000\n")  # control: no quota, the mask counts
    cpus = _cpus(tmp_path)
    assert cpus.quota is None and cpus.count == 8 and not cpus.quota_bounded


def test_v2_the_tightest_quota_along_the_ancestors_counts(tmp_path: Path) -> None:
    _write(tmp_path / "proc-self-cgroup", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path / "cgroup/kubepods/pod1/cpu.max", "300000 100000\n")
    _write(tmp_path / "cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert _cpus(tmp_path).count == 3
    _write(tmp_path / "cgroup/kubepods/pod1/ctr/cpu.max", "200000 100000\n")
    assert _cpus(tmp_path).count == 2


def test_v2_inside_a_container_the_mount_root_is_the_process_cgroup(tmp_path: Path) -> None:
    # No cgroup namespace: /proc/self/cgroup names the host's path, which is not mounted here.
    _write(tmp_path / "proc-self-cgroup", "0::/system.slice/docker-abc.scope\n")
    _write(tmp_path / "cgroup/cpu.max", "400000 100000\n")
    assert _cpus(tmp_path).count == 4


def test_a_cgroup_folder_it_may_not_search_counts_as_no_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "proc-self-cgroup", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path / "cgroup/kubepods/pod1/ctr/cpu.max", "200000 100000\n")
    assert _cpus(tmp_path).count == 2  # control: readable, the quota counts

    def denied(*_: object) -> bool:  # as a stat under /sys/fs/cgroup that a sandbox refuses
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os.path, "isdir", denied)
    monkeypatch.setattr(Path, "is_dir", denied)
    cpus = _cpus(tmp_path)
    assert cpus.quota is None and cpus.count == 8


def test_v1_cfs_quota_over_period(tmp_path: Path) -> None:
    _write(
        tmp_path / "proc-self-cgroup",
        "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
    )
    folder = tmp_path / "cgroup/cpu,cpuacct/docker/abc"
    _write(folder / "cpu.cfs_quota_us", "250000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    assert _cpus(tmp_path).count == 3
    _write(folder / "cpu.cfs_quota_us", "-1\n")  # control: v1's "no quota"
    assert _cpus(tmp_path).quota is None and _cpus(tmp_path).count == 8


def test_a_quota_above_the_mask_leaves_the_mask(tmp_path: Path) -> None:
    _write(tmp_path / "proc-self-cgroup", "0::/\n")
    _write(tmp_path / "cgroup/cpu.max", "1600000 100000\n")
    cpus = _cpus(tmp_path, [2, 3])  # taskset -c 2,3 under a 16-CPU quota
    assert cpus.quota == 16 and cpus.count == 2 and not cpus.quota_bounded


def test_a_tiny_quota_still_gives_one_cpu(tmp_path: Path) -> None:
    _write(tmp_path / "proc-self-cgroup", "0::/\n")
    _write(tmp_path / "cgroup/cpu.max", "1000 100000\n")
    assert _cpus(tmp_path).count == 1


def test_missing_files_leave_the_mask(tmp_path: Path) -> None:
    assert _cpus(tmp_path).quota is None and _cpus(tmp_path).count == 8  # no /proc file
    _write(tmp_path / "proc-self-cgroup", "0::/a\n3:cpu:/a\n")  # no cgroup files
    assert _cpus(tmp_path).quota is None and _cpus(tmp_path).count == 8
    _write(tmp_path / "cgroup/cpu/a/cpu.cfs_quota_us", "100000\n")  # v1 period missing
    assert _cpus(tmp_path).quota is None


@pytest.mark.parametrize(
    "content",
    [
        "lots of cpus\n",
        "0 100000\n",
        "-5 100000\n",
        "100000 0\n",
        "100000\n",
        "1.5 1\n",
        "",
        b"\xff\xfe\x00garbage",
    ],
)
def test_garbled_cgroup_files_count_as_no_quota(tmp_path: Path, content: str | bytes) -> None:
    _write(tmp_path / "proc-self-cgroup", "0::/\n")
    _write(tmp_path / "cgroup/cpu.max", content)
    assert _cpus(tmp_path).quota is None and _cpus(tmp_path).count == 8


@pytest.mark.parametrize("proc", ["nonsense\n", "0::relative\n", "::\n", b"\xff\xfe", "0:cpu\n"])
def test_a_garbled_proc_cgroup_counts_as_no_quota(tmp_path: Path, proc: str | bytes) -> None:
    _write(tmp_path / "proc-self-cgroup", proc)
    _write(tmp_path / "cgroup/cpu.max", "100000 100000\n")  # would bound to 1 if reached
    assert _cpus(tmp_path).quota is None and _cpus(tmp_path).count == 8


def test_an_unknown_mask_falls_back_to_the_hosts_count(tmp_path: Path) -> None:
    cpus = _cpus(tmp_path, [])
    assert cpus.count == (os.cpu_count() or 1) and not cpus.quota_bounded
    _write(tmp_path / "proc-self-cgroup", "0::/\n")
    _write(tmp_path / "cgroup/cpu.max", "100000 100000\n")
    assert _cpus(tmp_path, []).count == 1  # the quota still bounds it


def test_this_process() -> None:
    # Whatever this host is: the mask is the affinity call's, the count within it.
    cpus = host_cpus()
    if hasattr(os, "sched_getaffinity"):
        assert list(cpus.allowed) == allowed_cpus() == sorted(os.sched_getaffinity(0))
    assert 1 <= usable_cpu_count() == cpus.count <= (len(cpus.allowed) or os.cpu_count() or 1)
    assert cgroup_quota() == cpus.quota
