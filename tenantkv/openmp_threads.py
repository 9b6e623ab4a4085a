"""One OpenMP thread for torch's kernels on the cache's own threads.

Why: torch's CPU kernels run on OpenMP (libgomp in PyTorch's Linux builds). A thread that runs
a parallel kernel (a copy of a few hundred KB, a finiteness check, a gather) becomes the master
of an OpenMP team of its own, whose threads live as long as that thread does. libgomp then
manages more threads than the process has CPUs, and from then on every thread of every team,
the model's own included, spins only briefly at a barrier before it sleeps in the kernel (its
"throttled" spin, meant for oversubscribed processes): the model's forward pays a sleep and a
wake-up at most of its parallel regions, for as long as the process lives.

Measured on a 2-core VM: a loop of small matmuls and copies on the main thread ran 2.3x slower,
with ~5 voluntary context switches per iteration against none, once another thread had run one
4M-element copy; in vLLM's CPU engine a later turn's forward with tenantkv's connector slept
~64 times a step against none with ExampleConnector's, even when no load ran inside it (docs/
perf.md, "vLLM: the OpenMP teams of the cache's threads").

The cache's threads (the load and sealing pools, the bookkeeping thread, the vLLM connector's
save and asynchronous-load threads) already work in parallel with one another, so a team inside
each of them would only oversubscribe the CPUs further: each runs torch's kernels on itself
alone. The engine's threads (its model, its scheduler) are left as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("tenantkv")

#: Whether :func:`use_one_openmp_thread` acts (the benchmarks turn it off for their same-run
#: baseline: the cache's threads then start OpenMP teams as torch's default allows).
ONE_THREAD_ON_CACHE_THREADS = True


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """The OpenMP runtime's ``omp_set_num_threads`` that torch loaded (its symbols are global:
    torch loads its dependencies with ``RTLD_GLOBAL``), or None where there is none to find."""
    try:
        setter = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):  # no OpenMP runtime, or no dlopen(NULL)
        return None
    setter.argtypes = [ctypes.c_int]
    setter.restype = None
    return setter


def use_one_openmp_thread() -> bool:
    """Make torch's CPU kernels run on the calling thread alone from now on (they start no
    OpenMP team of their own). True if that holds afterwards. Never raises: it is meant as a
    thread pool's initializer, where an exception would break the pool."""
    if not ONE_THREAD_ON_CACHE_THREADS:
        return False
    try:
        # ATen sets each thread's OpenMP count on the thread's first parallel kernel (to the
        # process's count): done now, so that it cannot undo the count set below.
        torch.get_num_threads()
        setter = _omp_set_num_threads()
        if setter is not None:
            setter(1)  # this thread's count only (an OpenMP setting per thread)
        single = torch.get_num_threads() == 1
    except Exception as err:  # a pool's thread must start whatever happens here
        logger.debug("could not keep torch on one thread: %s", err)
        return False
    if not single:
        logger.debug("torch's kernels on this thread may still start OpenMP teams")
    return single


def pool_initializer(
    then: Callable[[], object] | None = None,
) -> Callable[[], None]:
    """A thread pool initializer: :func:`use_one_openmp_thread`, then ``then`` (e.g. pinning
    the thread to a CPU)."""

    def initialize() -> None:
        use_one_openmp_thread()
        if then is not None:
            then()

    return initialize
