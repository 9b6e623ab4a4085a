"""Worker threads pinned one per CPU (``tenantkv.datapath.cpu_pinning``).

Checked: each thread a pool starts is pinned to the next CPU of the process's affinity mask,
round robin; a cache's loader and sealing threads are so pinned after a store and a load (and
are not with ``pin_workers=False``: the control); a CPU the process may not use leaves the thread
unpinned and is logged once, never raised (a pool initializer that raises breaks the pool).

Claims (each test in a claim directory of its own under ``tmp_path``, over CPU numbers it names,
so that no test depends on this host's CPUs nor on other processes' claims): real processes
claim disjoint CPUs, a process finding too few free claims none and runs unpinned, and a CPU is
free again once its process exits or its cache closes; a process's pools share its CPUs; a
forked child leaves its parent's claims alone; symlinks, FIFOs and other users' files in the
directory are skipped, an untrustworthy directory refused; under a CPU quota pools pin only
with a named claim directory. Speed is not checked here: docs/perf.md has the measurements.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tenantkv
from tenantkv.datapath import cpu_pinning
from tenantkv.datapath.cpu_pinning import CpuPinning, allowed_cpus, claims_in, pinning_for_pool
from tenantkv.host_cpus import HostCpus
from tests.helpers import store_and_load_checked

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="the platform has no thread affinity"
)


def _affinity_of_new_thread(pinning: CpuPinning) -> set[int]:
    """The affinity mask of a new thread after ``pinning`` pinned it."""
    seen: list[set[int]] = []

    def run() -> None:
        pinning.pin_current_thread()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_threads_are_pinned_round_robin_over_the_allowed_cpus() -> None:
    cpus = allowed_cpus()
    assert cpus == sorted(os.sched_getaffinity(0))
    pinning = CpuPinning()
    got = [_affinity_of_new_thread(pinning) for _ in range(len(cpus) + 1)]
    want = [{cpus[i % len(cpus)]} for i in range(len(cpus) + 1)]
    assert got == want and pinning.pinned == len(cpus) + 1 and pinning.failed == 0
    # The thread that pinned others keeps its own mask.
    assert os.sched_getaffinity(0) == set(cpus)


def test_a_cpu_that_cannot_be_used_leaves_the_thread_unpinned_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    full = set(allowed_cpus())
    pinning = CpuPinning([max(full) + 4096])  # no such CPU: the kernel refuses the mask
    with caplog.at_level(logging.WARNING, logger="tenantkv"):
        assert _affinity_of_new_thread(pinning) == full
        assert _affinity_of_new_thread(pinning) == full
    assert pinning.failed == 2 and pinning.pinned == 0
    warnings = [r for r in caplog.records if "runs unpinned" in r.getMessage()]
    assert len(warnings) == 1


def _affinities(pool: ThreadPoolExecutor, pinning: CpuPinning | None = None) -> list[set[int]]:
    """The affinity of every thread ``pool`` started; with ``pinning``, once each of them ran
    the initializer (a thread the pool just started may not have yet)."""
    deadline = time.monotonic() + 5
    while pinning is not None and pinning.pinned + pinning.failed < len(pool._threads):
        assert time.monotonic() < deadline, "a started thread never ran the pool's initializer"
        time.sleep(0.01)
    threads = list(pool._threads)  # ThreadPoolExecutor's started threads
    assert threads, "the pool started no thread"
    return [os.sched_getaffinity(t.native_id) for t in threads if t.native_id is not None]


@pytest.mark.usefixtures("index")
def test_a_caches_worker_threads_are_pinned_one_per_cpu(tmp_path: Path) -> None:
    cpus = allowed_cpus()
    with tenantkv.open(tmp_path / "pinned", cpu_claim_dir=tmp_path / "claims") as kv:
        store_and_load_checked(kv)
        runtime = kv.context.runtime
        pools = [
            (runtime.load_executor, runtime.load_pinning),
            (runtime.seal_executor, runtime.seal_pinning),
        ]
        for pool, pinning in pools:
            assert pinning is not None
            affinities = _affinities(pool, pinning)
            assert pinning.pinned == len(affinities) and pinning.failed == 0
            assert all(len(mask) == 1 and mask <= set(cpus) for mask in affinities)
            # A pool's threads share a CPU only once every CPU has one of them.
            assert len({min(mask) for mask in affinities}) == min(len(affinities), len(cpus))
    # Control: unpinned threads keep the process's whole mask.
    with tenantkv.open(tmp_path / "unpinned", pin_workers=False) as kv:
        store_and_load_checked(kv)
        runtime = kv.context.runtime
        assert runtime.load_pinning is None and runtime.seal_pinning is None
        for pool in (runtime.load_executor, runtime.seal_executor):
            assert all(mask == set(cpus) for mask in _affinities(pool))


@pytest.mark.usefixtures("index")
def test_a_pool_with_more_threads_than_cpus_is_left_unpinned(tmp_path: Path) -> None:
    # Which thread takes a task is arbitrary: two workers of one load could share a CPU.
    cpus, claims = allowed_cpus(), tmp_path / "claims"
    control = pinning_for_pool(len(cpus), claims)  # as many threads as CPUs
    assert control is not None and sorted(control.cpus) == cpus
    control.release()
    assert pinning_for_pool(len(cpus) + 1, claims) is None
    with tenantkv.open(
        tmp_path / "cache", load_workers=len(cpus) + 1, seal_workers=1, cpu_claim_dir=claims
    ) as kv:
        store_and_load_checked(kv)
        runtime = kv.context.runtime
        assert runtime.load_pinning is None
        assert all(mask == set(cpus) for mask in _affinities(runtime.load_executor))
        assert runtime.seal_pinning is not None  # one sealing thread: pinned
        assert all(
            len(mask) == 1 for mask in _affinities(runtime.seal_executor, runtime.seal_pinning)
        )


def test_pin_workers_takes_only_a_boolean() -> None:
    with pytest.raises(tenantkv.InvalidRequestError, match="pin_workers"):
        tenantkv.CacheConfig(pin_workers="yes")  # type: ignore[arg-type]
    from_env = tenantkv.CacheConfig.from_env({"TENANTKV_PIN_WORKERS": "0"})
    assert from_env.pin_workers is False
    assert tenantkv.CacheConfig().pin_workers is True


# ---- claims ------------------------------------------------------------------------------------

#: CPU numbers no host has: claims are files and locks, so any numbers do (nothing is pinned).
FAKE = (1000, 1001)


def _host(cpus: tuple[int, ...] = FAKE, quota: float | None = None) -> HostCpus:
    return HostCpus(allowed=cpus, quota=quota, host=len(cpus))


def _held_elsewhere(claims: Path, cpu: int) -> bool:
    """Whether some open file (another process's, or a pool's of this one) locks ``cpu``'s
    claim file: a lock of this process's own second open file conflicts with it too."""
    try:
        fd = os.open(claims / str(cpu), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


#: A process that builds a pinning over the CPUs it is given, prints them (or "unpinned") and
#: holds them until its stdin has a line. It runs the real modules without the package's
#: __init__ (which imports torch): a child then starts in milliseconds instead of seconds.
CHILD = """
import sys, types
from pathlib import Path
for name, folder in (("tkv", "tenantkv"), ("tkv.datapath", "tenantkv/datapath")):
    package = types.ModuleType(name)
    package.__path__ = [str(Path(sys.argv[1]) / folder)]
    sys.modules[name] = package
from tkv.datapath.cpu_pinning import pinning_for_pool
from tkv.host_cpus import HostCpus
cpus = tuple(int(cpu) for cpu in sys.argv[4].split(","))
pinning = pinning_for_pool(int(sys.argv[3]), Path(sys.argv[2]), host=HostCpus(cpus, None, 2))
print(",".join(map(str, pinning.cpus)) if pinning is not None else "unpinned", flush=True)
sys.stdin.readline()
"""


class _Child:
    """A process holding a pool's claims (see ``CHILD``) until :meth:`exit`."""

    def __init__(self, claims: Path, threads: int, cpus: tuple[int, ...] = FAKE) -> None:
        repo = Path(__file__).resolve().parent.parent
        args = [str(repo), str(claims), str(threads), ",".join(map(str, cpus))]
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line, f"the child printed nothing (exit status {self.process.poll()})"
        self.cpus = [] if line == "unpinned" else [int(cpu) for cpu in line.split(",")]

    def exit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0


@pytest.fixture
def children() -> Iterator[list[_Child]]:
    started: list[_Child] = []
    yield started
    for child in started:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def test_processes_claim_disjoint_cpus_and_a_cpu_is_free_again_once_its_process_exits(
    tmp_path: Path, children: list[_Child]
) -> None:
    claims = tmp_path / "claims"
    children.append(_Child(claims, 2))  # positive control: a single process gets both CPUs
    assert sorted(children[0].cpus) == list(FAKE)
    children[0].exit()
    children += [_Child(claims, 1), _Child(claims, 1)]
    assert sorted(children[1].cpus + children[2].cpus) == list(FAKE)  # disjoint, one each
    children.append(_Child(claims, 1))
    assert children[3].cpus == []  # none free: unpinned
    children[1].exit()  # its CPU is free again, with no cleanup
    children.append(_Child(claims, 1))
    assert children[4].cpus == children[1].cpus
    for child in children[2:]:
        child.process.kill()  # a crash frees its CPUs too
        child.process.wait()
    assert not any(_held_elsewhere(claims, cpu) for cpu in FAKE)


def test_a_process_finding_too_few_free_cpus_claims_none(
    tmp_path: Path, children: list[_Child]
) -> None:
    claims = tmp_path / "claims"
    cpus = (1000, 1001, 1002)
    children.append(_Child(claims, 1, cpus))
    assert children[0].cpus == [1000]
    assert pinning_for_pool(3, claims, host=_host(cpus)) is None  # two free of three
    # It gave back the two it could claim: another process still gets them.
    children.append(_Child(claims, 2, cpus))
    assert children[1].cpus == [1001, 1002]


def test_a_processs_pools_share_its_cpus_until_the_last_is_released(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    cpus = (1000, 1001, 1002)
    seal = pinning_for_pool(1, claims, host=_host(cpus))
    load = pinning_for_pool(2, claims, host=_host(cpus))
    assert seal is not None and load is not None
    assert seal.cpus == [1000] and load.cpus == [1000, 1001]  # its own first, then a free one
    assert claims_in(claims).held() == [1000, 1001] and not _held_elsewhere(claims, 1002)
    load.release()
    load.release()  # once only
    assert claims_in(claims).held() == [1000] and not _held_elsewhere(claims, 1001)
    assert _held_elsewhere(claims, 1000)
    seal.release()
    assert claims_in(claims).held() == [] and not _held_elsewhere(claims, 1000)


def test_a_collected_pinning_gives_its_cpus_back(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    pinning = pinning_for_pool(2, claims, host=_host())
    assert pinning is not None and _held_elsewhere(claims, 1000)
    del pinning
    assert claims_in(claims).held() == [] and not _held_elsewhere(claims, 1000)


@pytest.mark.usefixtures("index")
def test_a_cache_holds_its_claims_until_it_closes(tmp_path: Path, children: list[_Child]) -> None:
    claims, cpus = tmp_path / "claims", allowed_cpus()
    with tenantkv.open(tmp_path / "cache", cpu_claim_dir=claims) as kv:
        runtime = kv.context.runtime
        assert runtime.load_pinning is not None and runtime.seal_pinning is not None
        held = set(runtime.load_pinning.cpus) | set(runtime.seal_pinning.cpus)
        assert held and held <= set(cpus) and all(_held_elsewhere(claims, c) for c in held)
        children.append(_Child(claims, 1, tuple(held)))
        assert children[-1].cpus == []  # another process finds none free
    assert not any(_held_elsewhere(claims, cpu) for cpu in cpus)
    # Control: the same process, once the cache is closed, gets them.
    children.append(_Child(claims, len(held), tuple(held)))
    assert sorted(children[-1].cpus) == sorted(held)


def test_a_forked_child_leaves_its_parents_claims_alone(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    pinning = pinning_for_pool(1, claims, host=_host())
    assert pinning is not None
    pid = os.fork()
    if pid == 0:  # the child: it forgot the claims, and closing its copies unlocked nothing
        ok = claims_in(claims).held() == []
        pinning.release()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _held_elsewhere(claims, pinning.cpus[0])
    pinning.release()
    assert not _held_elsewhere(claims, pinning.cpus[0])


def test_a_child_forked_during_a_claim_does_not_keep_the_directory_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = tmp_path / "claims"
    claim_file = cpu_pinning._claim_file
    children: list[int] = []

    def fork_then_claim(dir_fd: int, cpu: int) -> int | None:
        if not children:  # a thread of the process forks while the directory is locked
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children.append(pid)
        return claim_file(dir_fd, cpu)

    monkeypatch.setattr(cpu_pinning, "_claim_file", fork_then_claim)
    try:
        pinning = pinning_for_pool(1, claims, host=_host())
        assert pinning is not None  # control: the claim itself went through
        fd = os.open(claims, os.O_RDONLY | os.O_DIRECTORY)
        try:  # the child still runs, holding a copy of the descriptor; the lock is free
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        pinning.release()
    finally:
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert children


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make another user's directory")
def test_another_users_claim_directory_is_refused_even_if_sticky(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    claims.chmod(0o1777)
    os.chown(claims, 65534, 65534)  # its owner could remove our claim files and take our CPUs
    with caplog.at_level(logging.WARNING, logger="tenantkv"):
        assert pinning_for_pool(1, claims, host=_host()) is None
    assert any("claim directory" in r.getMessage() for r in caplog.records)
    os.chown(claims, 0, 0)  # control: root's sticky directory is shared by the host's users
    pinning = pinning_for_pool(1, claims, host=_host())
    assert pinning is not None
    pinning.release()


def test_the_claim_directory_is_sticky_and_holds_cpu_numbers_only(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    pinning = pinning_for_pool(2, claims, host=_host())
    assert pinning is not None
    assert stat.S_IMODE(claims.stat().st_mode) == 0o1777
    assert sorted(p.name for p in claims.iterdir()) == ["1000", "1001"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in claims.iterdir())
    pinning.release()
    assert sorted(p.name for p in claims.iterdir()) == ["1000", "1001"]  # files stay


def test_symlinks_and_fifos_in_the_claim_directory_are_skipped(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir(mode=0o700)
    target = tmp_path / "target"
    (claims / "1000").symlink_to(target)  # followed, a claim would create the target
    os.mkfifo(claims / "1001")  # opened without O_NONBLOCK, a claim would wait for a writer
    cpus = (1000, 1001, 1002)
    pinning = pinning_for_pool(1, claims, host=_host(cpus))
    assert pinning is not None and pinning.cpus == [1002]
    assert not target.exists()
    assert (claims / "1000").is_symlink() and stat.S_ISFIFO((claims / "1001").lstat().st_mode)
    pinning.release()
    # Control: the same CPUs in a clean directory, the first is taken.
    clean = pinning_for_pool(1, tmp_path / "clean", host=_host(cpus))
    assert clean is not None and clean.cpus == [1000]
    clean.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make another user's file")
def test_another_users_claim_file_is_skipped(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir(mode=0o1777)
    claims.chmod(0o1777)
    (claims / "1000").touch(mode=0o600)
    os.chown(claims / "1000", 65534, 65534)  # nobody's, unlocked: still not ours to take
    pinning = pinning_for_pool(1, claims, host=_host())
    assert pinning is not None and pinning.cpus == [1001]
    pinning.release()
    os.chown(claims / "1000", os.geteuid(), os.getegid())  # control: ours again, taken
    pinning = pinning_for_pool(1, claims, host=_host())
    assert pinning is not None and pinning.cpus == [1000]
    pinning.release()


@pytest.mark.parametrize("kind", ["symlink", "writable", "file"])
def test_an_untrustworthy_claim_directory_leaves_pools_unpinned(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    claims = tmp_path / "claims"
    if kind == "symlink":
        claims.symlink_to(real, target_is_directory=True)
    elif kind == "writable":  # anyone could swap its files, and it is not sticky
        claims.mkdir()
        claims.chmod(0o777)
    else:
        claims.touch()
    with caplog.at_level(logging.WARNING, logger="tenantkv"):
        assert pinning_for_pool(1, claims, host=_host()) is None
    assert any("claim directory" in r.getMessage() for r in caplog.records)
    assert list(real.iterdir()) == []
    # Control: the directory it pointed to, used directly, is fine.
    control = pinning_for_pool(1, real, host=_host())
    assert control is not None
    control.release()


def test_under_a_cpu_quota_pools_pin_only_with_a_named_claim_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_pinning, "default_claim_dir", lambda: tmp_path / "default")
    cpus = (1000, 1001, 1002, 1003)
    # A container limited to 2 CPUs' time on 4: its neighbours' claims are out of sight.
    assert pinning_for_pool(2, host=_host(cpus, quota=2.0)) is None
    named = pinning_for_pool(2, tmp_path / "shared", host=_host(cpus, quota=2.0))
    assert named is not None and named.cpus == [1000, 1001]
    named.release()
    # Controls: no quota, or a quota as large as the mask: the default directory serves.
    for quota in (None, 4.0):
        default = pinning_for_pool(2, host=_host(cpus, quota=quota))
        assert default is not None and default.cpus == [1000, 1001]
        assert (tmp_path / "default" / "1000").exists()
        default.release()


def test_cpu_claim_dir_is_a_setting() -> None:
    from_env = tenantkv.CacheConfig.from_env({"TENANTKV_CPU_CLAIM_DIR": "/run/tenantkv-cpus"})
    assert from_env.cpu_claim_dir == Path("/run/tenantkv-cpus")
    assert tenantkv.CacheConfig().cpu_claim_dir is None


def test_claims_wait_for_another_claim_in_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Serialised, two processes starting together cannot each take one CPU of the other's pair
    # (both would then find too few free and run unpinned).
    claims = tmp_path / "claims"
    first = pinning_for_pool(1, claims, host=_host())  # creates the directory
    assert first is not None
    first.release()
    dir_fd = os.open(claims, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)  # another process's claim in progress
        threading.Timer(0.3, fcntl.flock, (dir_fd, fcntl.LOCK_UN)).start()
        started = time.monotonic()
        waited = pinning_for_pool(2, claims, host=_host())
        assert waited is not None and time.monotonic() - started >= 0.25
        waited.release()
        # A lock never let go (a stuck or hostile process) delays a claim, never stops it.
        monkeypatch.setattr(cpu_pinning, "CLAIM_WAIT_S", 0.1)
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        with caplog.at_level(logging.INFO, logger="tenantkv"):
            stuck = pinning_for_pool(2, claims, host=_host())
        assert stuck is not None and any("without" in r.getMessage() for r in caplog.records)
        stuck.release()
    finally:
        os.close(dir_fd)
