"""Background codec work runs its torch ops on the calling thread alone, never on OpenMP's team.

torch runs an op over many elements on its OpenMP team, whose threads spin-wait after
each op for the next one. A zstd-dtype upload encodes on a background thread, on cores
shared with the training loop, the HTTP client and (here) the S3 server; that spinning
cost 0.5-0.7 s of CPU per GB uploaded on this machine, as much as the encoding itself
(``OMP_NUM_THREADS=1`` or ``OMP_WAIT_POLICY=passive`` for the whole process removed it
alike). For work whose CPU is the cost, not its latency, one thread is the right size.

OpenMP keeps the thread count per thread (an ICV), so setting it for the calling thread,
and restoring it after, touches neither the training loop's threads nor torch's global
setting. With no OpenMP runtime to be found (another platform, another torch build),
``one_thread()`` changes nothing: the ops then run as torch decides, only at a CPU cost.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

_NAMES = ("libgomp", "libiomp5", "libomp")


@contextmanager
def one_thread() -> Iterator[None]:
    """Within the block, torch ops issued by this thread run on this thread only."""
    runtime = _runtime()
    if runtime is None:
        yield
        return
    import torch
    torch.get_num_threads()  # torch sets a thread's OpenMP count the first time it asks: ask first
    before = runtime.omp_get_max_threads()
    runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        runtime.omp_set_num_threads(before)


@functools.lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch is using: a loaded library of a known name, torch's own first."""
    import torch
    torch_dir = os.path.dirname(torch.__file__)
    try:
        with open("/proc/self/maps") as maps:
            paths = {fields[5] for fields in map(str.split, maps) if len(fields) >= 6}
    except OSError:
        return None
    loaded = sorted((not p.startswith(torch_dir), p) for p in paths
                    if os.path.basename(p).startswith(_NAMES))
    for _, path in loaded:
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same instance torch calls
            lib.omp_get_max_threads.restype = ctypes.c_int
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None
