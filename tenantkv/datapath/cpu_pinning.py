"""Worker threads pinned one per CPU, on CPUs no other process on the host has claimed, so that a
load's (or a store's) workers never queue behind each other, nor behind another engine's.

Why pin: a load's workers are woken together (the stream starts them, then each wakes the other
when it releases the interpreter lock). Linux then often queued the second behind the first on
one CPU while the other CPU idled, and it waited there for the first's time slice (EEVDF's base
slice is 3 ms) before it ran: per-thread scheduler statistics of 8K-token loads on a 2-core VM
showed one worker runnable but not running for 2-4 ms before the first layer in most loads, and
the first layer's median at 6.9 ms (max 9.1). With each loader thread pinned to a CPU of its
own, those waits were gone: median 4.6-4.9 ms, max 5.5-5.9 (docs/perf.md, "Loader threads
pinned"). Stores seal on a pool of their own, and pinned, its threads stored 8K prefixes
1.12-1.27x as fast.

Why claim: production hosts run one engine process per GPU, each with a cache. Pinned round
robin from the first CPU of its mask, every process put its threads on the same first CPUs and
left the rest idle: worse than not pinning at all. So a pool pins only to CPUs its process has
*claimed*: one lock file per CPU in a claim directory (``/dev/shm/tenantkv-cpus/`` by default,
the temp dir's ``tenantkv-cpus`` where there is no ``/dev/shm``; ``CacheConfig.cpu_claim_dir``),
locked with ``flock(LOCK_EX | LOCK_NB)`` and held open while a pool of the process pins to it.
A lock belongs to its open file, so a process that exits or crashes frees its CPUs with no
cleanup, and the files stay (deleting a lock file would let two processes lock two files of one
name). A pool of ``n`` threads takes the CPUs its process already holds first (a process's
pools and caches share its CPUs, as before claims), then claims free ones in mask order; where
fewer than ``n`` are free, it claims none and runs unpinned, as does a pool larger than the
process's mask (which of its threads takes a task is arbitrary, so two workers of one load could
land on threads pinned to one CPU and share it while another idles). So two engine processes on
one host pin to disjoint CPUs, and a third that finds none free runs unpinned. The claims go
back when the cache closes (``Runtime.shutdown``). To see them: ``lslocks | grep tenantkv-cpus``
lists each claimed CPU's file with the process holding it.

Where claims cannot see the neighbours: containers have a ``/dev/shm`` and a temp dir of their
own. A container given a cpuset pins within it, disjoint from its neighbours' by construction;
one with only a CPU quota (Docker's ``--cpus``, a Kubernetes CPU limit) may run on every CPU of
the host, as its neighbours may, and its claims would not keep them apart. So where the cgroup
quota, not the mask, bounds the process (``HostCpus.quota_bounded``), pools pin only to claims in
a directory the configuration names (one the host mounts into every container), else they run
unpinned; a log line at INFO says so.

The claim directory may be shared by the host's users: created ``1777`` (sticky, as ``/tmp``),
so anyone may claim but only a file's owner may remove it. It is used only if it is a real
directory (opened with ``O_NOFOLLOW``), owned by this user or root (its owner may remove any
file in it, sticky or not: users who share one have root create it, ``install -d -m 1777``), and
not writable by others unless sticky. Files are named by CPU number only and opened relative
to the directory with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink or a FIFO planted there is never
followed nor waited on); a file that is not a regular file of this user's (another user's claim,
live or not) is skipped, its CPU left to that user. Nothing is ever written into the files. The
worst a hostile local user can do is hold the files (or the directory's lock) first, and so keep
this process's pools unpinned (or delay a claim by ``CLAIM_WAIT_S``).

Claims are serialised by a lock on the directory itself (waited for ``CLAIM_WAIT_S`` at most),
so two processes starting together do not each take one CPU of the other's pair and both end up
unpinned. A child forked from a process closes its copies of the claim files (the parent's claims
hold; the child claims its own). Pinning is best effort: where the platform has no
``sched_setaffinity`` or ``flock`` or refuses them, threads run unpinned and a warning is logged
once. ``CacheConfig.pin_workers=False`` turns it all off (where an engine pins its own busy
threads to the same CPUs, say, and the scheduler should be free to move loads and stores away
from them).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from ..host_cpus import HostCpus, allowed_cpus, host_cpus

try:
    import fcntl
except ImportError:  # not a POSIX platform: no claims, so no pinning
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("tenantkv")

__all__ = [
    "CLAIM_DIR_NAME",
    "CpuClaims",
    "CpuPinning",
    "allowed_cpus",
    "claims_in",
    "default_claim_dir",
    "pinning_for_pool",
]

#: The claim directory's name under ``/dev/shm`` (or the temp dir).
CLAIM_DIR_NAME = "tenantkv-cpus"
#: How long a claim waits for another process's claim in the same directory to finish.
CLAIM_WAIT_S = 1.0


def default_claim_dir() -> Path:
    """``/dev/shm/tenantkv-cpus`` (memory, emptied at boot), else the temp dir's."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / CLAIM_DIR_NAME


def pinning_for_pool(
    threads: int, claim_dir: Path | None = None, *, host: HostCpus | None = None
) -> CpuPinning | None:
    """The pinning of a pool of ``threads`` threads: one claimed CPU each, or None (unpinned)
    where the process may run on fewer CPUs, fewer are free of other processes' claims, or its
    CPU quota leaves its neighbours out of sight and no ``claim_dir`` is named (see the module
    docstring). ``host`` stands in for this process's CPUs in tests."""
    try:
        return _claimed_pinning(threads, claim_dir, host)
    except Exception as err:  # pinning is best effort: it never keeps a cache from opening
        logger.warning("a pool of %d threads runs unpinned: %s", threads, err)
        return None


def _claimed_pinning(
    threads: int, claim_dir: Path | None, host: HostCpus | None
) -> CpuPinning | None:
    host = host_cpus() if host is None else host
    candidates = [cpu for cpu in host.allowed if cpu >= 0]
    if threads <= 0 or threads > len(candidates) or fcntl is None:
        return None
    if claim_dir is None and host.quota_bounded:
        logger.info(
            "a pool of %d threads runs unpinned: a CPU quota of %.1f CPUs shares %d CPUs with "
            "processes whose claims cannot be seen (set cpu_claim_dir to a directory they share)",
            threads,
            host.quota,
            len(candidates),
        )
        return None
    claims = claims_in(default_claim_dir() if claim_dir is None else claim_dir)
    cpus = claims.claim(threads, candidates)
    if cpus is None:
        logger.info(
            "a pool of %d threads runs unpinned: fewer CPUs are free of other processes' "
            "claims in %s",
            threads,
            claims.directory,
        )
        return None
    return CpuPinning(cpus, claims=claims)


class CpuPinning:
    """Pins each thread that calls :meth:`pin_current_thread` to the next CPU, round robin.

    Meant as a thread pool's ``initializer``: it never raises, since an initializer that raises
    breaks the pool. With ``claims``, the CPUs were claimed for it, and :meth:`release` (or the
    pinning's collection) gives them back."""

    def __init__(
        self, cpus: Sequence[int] | None = None, *, claims: CpuClaims | None = None
    ) -> None:
        self.cpus = allowed_cpus() if cpus is None else list(cpus)
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._warned = False
        #: How many threads were pinned, and how many could not be.
        self.pinned = 0
        self.failed = 0
        self._release = (
            None if claims is None else weakref.finalize(self, claims.release, self.cpus)
        )

    def release(self) -> None:
        """Give back the CPUs claimed for this pinning (once; a no-op without claims). Threads
        pinned already stay where they are: they are the pool's, which is shut down by then."""
        if self._release is not None:
            self._release()

    def pin_current_thread(self) -> None:
        """Pin the calling thread to the next CPU (a thread of its own while there are CPUs)."""
        setaffinity = getattr(os, "sched_setaffinity", None)
        if not self.cpus or setaffinity is None:
            return
        with self._lock:
            cpu = self.cpus[next(self._next) % len(self.cpus)]
        try:
            setaffinity(0, {cpu})  # 0: the calling thread (Linux sets affinity per thread)
        except (OSError, ValueError) as err:
            with self._lock:
                self.failed += 1
                warn, self._warned = not self._warned, True
            if warn:
                logger.warning(
                    "a worker thread runs unpinned: pinning it to CPU %d failed: %s", cpu, err
                )
            return
        with self._lock:
            self.pinned += 1


class CpuClaims:
    """This process's claims in one directory: for each CPU it holds, the open locked file and
    how many of its pools pin to it. One per directory per process (:func:`claims_in`), since
    two open files of one process lock each other out like two processes'."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._warned = False

    def held(self) -> list[int]:
        """The CPUs this process holds here, in order."""
        with self._lock:
            return sorted(self._held)

    def claim(self, count: int, candidates: Sequence[int]) -> list[int] | None:
        """``count`` CPUs of ``candidates`` for one pool: those this process holds first, then
        free ones, claimed now; or None, claiming nothing, where not enough are free."""
        with self._lock:
            chosen = [cpu for cpu in candidates if cpu in self._held][:count]
            claimed: list[int] = []
            if len(chosen) < count:
                try:
                    dir_fd = _open_claim_dir(self.directory)
                except OSError as err:
                    self._warn(f"cannot use the CPU claim directory {self.directory}: {err}")
                    return None
                try:
                    serialised = _lock_dir(dir_fd)
                    for cpu in candidates:
                        if len(chosen) == count:
                            break
                        if cpu not in self._held and (fd := _claim_file(dir_fd, cpu)) is not None:
                            self._held[cpu] = _Held(fd)
                            chosen.append(cpu)
                            claimed.append(cpu)
                    if not serialised:
                        logger.info("claimed CPUs without the claim directory's lock")
                finally:
                    # Unlocked before it is closed: a child forked meanwhile holds a copy of the
                    # descriptor, and with it the lock, until it exits.
                    with contextlib.suppress(OSError):
                        fcntl.flock(dir_fd, fcntl.LOCK_UN)
                    os.close(dir_fd)
            if len(chosen) < count:
                for cpu in claimed:
                    _unlock(self._held.pop(cpu).fd)
                return None
            for cpu in chosen:
                self._held[cpu].pools += 1
            return chosen

    def release(self, cpus: Sequence[int]) -> None:
        """One pool's CPUs back; a CPU no pool pins to any longer is unlocked for others."""
        with self._lock:
            for cpu in cpus:
                held = self._held.get(cpu)
                if held is None:  # forgotten in a forked child
                    continue
                held.pools -= 1
                if held.pools <= 0:
                    del self._held[cpu]
                    _unlock(held.fd)

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited files without unlocking them (the lock is
        the parent's open file's, shared with the child's copy: unlocking would free the
        parent's CPUs)."""
        self._lock = threading.Lock()
        for held in self._held.values():
            os.close(held.fd)
        self._held.clear()

    def _warn(self, message: str) -> None:
        warn, self._warned = not self._warned, True
        if warn:
            logger.warning("worker threads run unpinned: %s", message)


class _Held:
    """A claimed CPU: its locked file, and how many pools of this process pin to it."""

    __slots__ = ("fd", "pools")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pools = 0


_registry_lock = threading.Lock()
_registry: dict[Path, CpuClaims] = {}


def claims_in(directory: Path | str) -> CpuClaims:
    """This process's claims in ``directory`` (one object per directory)."""
    key = Path(os.path.abspath(directory))
    with _registry_lock:
        claims = _registry.get(key)
        if claims is None:
            claims = _registry[key] = CpuClaims(key)
        return claims


def _forget_claims_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    for claims in _registry.values():
        claims._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_claims_in_child)


def _open_claim_dir(directory: Path) -> int:
    """The claim directory, opened (created ``1777`` if missing); an OSError where it is not a
    directory this process can trust (see the module docstring)."""
    created = False
    try:
        os.mkdir(directory, 0o700)  # opened up below, once it is known to be ours
        created = True
    except FileExistsError:
        pass
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if created and info.st_uid == os.geteuid():
            os.fchmod(fd, 0o1777)
            info = os.fstat(fd)
        mode, sticky = info.st_mode, bool(info.st_mode & stat.S_ISVTX)
        if not stat.S_ISDIR(mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
        # Its owner may remove or replace any file in it, sticky or not: only this user's or
        # root's directory is trusted, and one others may write to only if it is sticky.
        if info.st_uid not in (os.geteuid(), 0) or (mode & 0o022 and not sticky):
            raise PermissionError(
                errno.EPERM,
                "others may replace its files (owned by another user, or writable by others "
                "and not sticky)",
                str(directory),
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_dir(dir_fd: int) -> bool:
    """Take the claim directory's lock, waiting ``CLAIM_WAIT_S`` at most; False where it could
    not be had (claims then go on without it: at worst two processes starting together both find
    too few CPUs and run unpinned)."""
    assert fcntl is not None
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        except OSError:
            return False


def _claim_file(dir_fd: int, cpu: int) -> int | None:
    """The CPU's claim file, open and locked by this process; None where another process holds
    it, or it is not a regular file of this user's (never followed, never waited on)."""
    assert fcntl is not None
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(str(cpu), flags, 0o600, dir_fd=dir_fd)
    except OSError:  # a symlink (ELOOP), another user's file (EACCES), ...
        return None
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:  # BlockingIOError: a live process holds it
        pass
    os.close(fd)
    return None


def _unlock(fd: int) -> None:
    """Unlock and close a claim file: the CPU is free for other processes."""
    assert fcntl is not None
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
