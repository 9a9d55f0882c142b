"""Checksums computed while bytes stream past: crc32c inline, sha256 beside it.

crc32c runs at ~16 GB/s on one core here and sha256 at ~2 GB/s (SHA-NI), which
is the disk's own durable rate. Each runs on its own thread (both release the
GIL), so neither adds to the writer's time; on two cores the write's memcpy,
crc32c and sha256 overlap. Chunks handed
to :class:`StreamDigest` must not change until :meth:`StreamDigest.finish`.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass

import crc32c as _crc32c
import torch

from .memview import byte_view

CHUNK = 16 << 20  # large sequential I/O: 16 MiB


def crc32c_update(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def crc_hex(value: int) -> str:
    return f"{value:08x}"


@dataclass(frozen=True)
class Digest:
    size: int
    crc32c: str
    sha256: str | None


class StreamDigest:
    """Feed chunks with :meth:`update`; :meth:`finish` returns the :class:`Digest`.

    crc32c and sha256 each run on a thread of their own (both release the GIL),
    so the caller's thread only hands chunks over and goes on writing or reading.
    """

    def __init__(self, sha256: bool = True) -> None:
        self._size = 0
        self._crc = 0
        self._sha = hashlib.sha256() if sha256 else None
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._start(self._crc_update, "crc32c")
        if sha256:
            self._start(self._sha.update, "sha256")  # type: ignore[union-attr]

    def _start(self, consume, name: str) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=self._loop, args=(q, consume), name=f"tieredckpt-{name}", daemon=True)
        thread.start()
        self._queues.append(q)
        self._threads.append(thread)

    @staticmethod
    def _loop(q: queue.SimpleQueue, consume) -> None:
        while (chunk := q.get()) is not None:
            consume(chunk)

    def _crc_update(self, chunk) -> None:
        self._crc = _crc32c.crc32c(chunk, self._crc)

    def update(self, chunk) -> None:
        self._size += len(chunk)
        for q in self._queues:
            q.put(chunk)

    def finish(self) -> Digest:
        self.abort()
        return Digest(self._size, crc_hex(self._crc), self._sha.hexdigest() if self._sha else None)

    def abort(self) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._queues, self._threads = [], []


def map_file(path: str | os.PathLike, size: int) -> torch.Tensor:
    """A private (copy-on-write) read mapping of a file as a uint8 tensor."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def digest_buffer(buf: torch.Tensor, sha256: bool) -> Digest:
    """Digest of a uint8 tensor's bytes, in chunks (sha256 on its own thread)."""
    digest = StreamDigest(sha256=sha256)
    view = byte_view(buf)
    for start in range(0, len(view), CHUNK):
        digest.update(view[start:start + CHUNK])
    return digest.finish()


def file_digest(path: str | os.PathLike, sha256: bool) -> Digest:
    """Digest of a whole file, read through a mapping (no copies)."""
    return digest_buffer(map_file(path, os.stat(path).st_size), sha256)
