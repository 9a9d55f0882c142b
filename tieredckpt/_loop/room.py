"""Rotation and making room: which local steps may go, and evicting them -- after a commit
(keep_local) or before a write that would not fit (a full disk)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .._tiers.local import LocalTier
from .._tiers.uploader import Uploader
from ..errors import warn_user
from .sha256fill import Sha256Fill

log = logging.getLogger("tieredckpt")


class Room:
    """Keeps the last ``keep_local`` steps, never evicting one the remote does not hold (or
    that was superseded there: Uploader.evictable) nor the newest committed one.
    ``active()``: this process rotates the directory (a writer, and its node's leader)."""

    def __init__(self, local: LocalTier, keep_local: int, sha256: Sha256Fill, active: Callable[[], bool]) -> None:
        self.local, self.keep_local, self.sha256, self.active = local, keep_local, sha256, active
        self.uploader: Uploader | None = None  # set once the store has one
        self._lock = threading.Lock()
        self._warned = False

    def protected(self) -> set[int]:
        """Local steps rotation must keep: those the remote does not hold yet (Uploader.evictable)."""
        if self.uploader is None:
            return set()
        return set(self.local.steps()) - self.uploader.evictable()

    def rotate(self) -> None:
        if not self.active():
            return
        with self._lock:
            self.local.rotate(self.keep_local, protected=self.protected())

    def make_room(self, step: int, nbytes: int | None) -> list[int]:
        """Before writing ``step``: evict what rotation evicts anyway once it commits -- the oldest
        local steps beyond ``keep_local - 1``; never the newest committed step, and with a remote
        only steps it holds or that were superseded -- until about ``nbytes`` (plus a margin for
        headers and the manifest) are free; ``None``: every step those rules allow."""
        if not self.active():
            return []
        need = None if nbytes is None else nbytes + max(1 << 20, nbytes // 50)
        if need is not None and self.local.free_bytes() >= need:
            return []  # the usual case: one statvfs, no listing of steps or of the uploader's state
        self.sha256.await_removed()  # a rotated step still being hashed holds its blocks
        with self._lock:
            evicted = self.local.make_room(need, self.keep_local - 1, self.protected())
        self.sha256.await_removed()
        if evicted:
            log.info("step %d: rotated out step(s) %s before writing it, to make room", step, evicted)
            self._warn_once()
        return evicted

    def _warn_once(self) -> None:
        if self._warned:
            return
        self._warned = True
        message = (f"{self.local.root}: the disk holds fewer than keep_local + 1 = {self.keep_local + 1} "
                   f"checkpoints of this size; old steps are rotated out before each save instead of "
                   f"after, so a crash mid-save leaves {self.keep_local - 1} committed local step(s), "
                   f"not {self.keep_local} (free more space or lower keep_local to avoid this)")
        warn_user(message)
