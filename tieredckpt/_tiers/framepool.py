"""Buffers that encoded parts are written into, reused from one part to the next.

A fresh 64 MiB buffer costs a page fault per 4 KiB the first time it is written (on
this VM, 0.2-0.7 s per GB); the encoded frames of every upload reuse a handful instead.
A buffer goes back to the pool only after the request that sent it has returned
successfully: after a failure (a timeout may leave the request running on the event
loop) it is dropped, so nothing still reading it can ever see it overwritten.
"""

from __future__ import annotations

import threading


class FramePool:
    """At most as many buffers as parts are encoded or in flight at once. ``size`` is a full
    part's buffer: a part of more than half of it gets one (so the slightly smaller last part of
    one step and the full parts of the next share buffers); a smaller part, as the only part of a
    small checkpoint is, gets one of its size class (see take), so a 10 MB model holds 16 MB, not 65 MiB."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, need: int) -> bytearray:
        """A buffer of at least ``need`` bytes: a returned one if it is large enough, else a new one
        (one of ``size`` for a part of more than half of it, else the power of two at or above
        what it needs, at least 1 MiB: parts cut at tensor edges vary in size, and buffers of a few
        classes serve the next ones instead of each slightly larger part replacing one). A returned buffer too small is let go then, so the pool
        never holds more buffers than were in use at once."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= need:
                    return self._free.pop(i)
            if self._free:
                self._free.pop()
        if need > self.size:  # beyond a part (a download's pool sizes to each part): 1/16 to spare
            return bytearray(need + need // 16)
        return bytearray(self.size if need > self.size // 2 else min(self.size, _size_class(need)))

    def give(self, buf: bytearray) -> None:
        """``buf`` is no longer read by anything: the next part may be written into it."""
        with self._lock:
            self._free.append(buf)

    def clear(self) -> None:
        """Let every buffer go (the memory goes back once nothing else holds it)."""
        with self._lock:
            self._free.clear()


def _size_class(need: int) -> int:
    return max(1 << 20, 1 << max(need - 1, 0).bit_length())
