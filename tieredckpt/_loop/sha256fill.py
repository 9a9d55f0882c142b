"""The sha256 of a committed step, recorded off the save's path, on a thread of its own below
the training loop's priority (a step is committed with crc32c alone; sharded.fill_sha256)."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .._tiers.local import LocalTier
from .._tiers.sharded import fill_sha256
from ..errors import CheckpointNotFoundError, TieredCkptError

log = logging.getLogger("tieredckpt")


def _background_priority() -> None:
    """Lower this thread's CPU priority by 10 nice levels (and that of the threads it starts, which inherit it):
    the sha256 of a committed step must not slow the next save's copy on the training loop,
    which shares the cores with it. Linux sets nice values per thread; elsewhere, or where
    not allowed, nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (AttributeError, OSError):
        pass


class Sha256Fill:
    """One background thread that records the sha256 of committed steps, one at a time."""

    def __init__(self, local: LocalTier) -> None:
        self.local = local
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredckpt-sha256",
                                           initializer=_background_priority)
        self._lock = threading.Lock()
        self._filling: int | None = None  # the step being read now (under _lock)

    def submit(self, step: int) -> None:
        self.executor.submit(self.fill, step)

    def flush(self) -> None:
        """Wait until every step submitted so far has its sha256 recorded."""
        self.executor.submit(lambda: None).result()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

    def fill(self, step: int, quiet: bool = True) -> None:
        """Record the sha256 of a step committed with crc32c alone (one process; many ranks record
        it in the commit). Runs on the sha256 thread after each commit, and on the uploader's
        before the remote's commit marker embeds the manifest (``quiet=False``: a shard whose
        crc32c fails is an upload error, so no remote copy is committed from it)."""
        with self._lock:
            self._filling = step
            try:
                fill_sha256(self.local.step_path(step))
            except CheckpointNotFoundError:
                pass  # rotated away meanwhile (the read stops within a chunk)
            except (TieredCkptError, OSError) as exc:
                if not self.local.step_path(step).exists():
                    return  # rotated away while it was read
                if not quiet:
                    raise
                log.warning("step %d: its sha256 could not be recorded: %s", step, exc)
            finally:
                self._filling = None

    def await_removed(self) -> None:
        """Wait while the fill still reads a step rotation has removed: its mapping keeps the
        deleted shards' blocks allocated until it ends, and the fill notices the removal within
        one chunk (fill_sha256). The fill of a kept step is not waited for."""
        filling = self._filling
        if filling is not None and not self.local.step_path(filling).exists():
            with self._lock:
                pass
