"""Where an upload reads a file's parts from, and the check that what was sent is what was committed.

A shard file of a ``save()`` step is the store's alone (written by it, renamed into place,
never truncated: rotation unlinks, which leaves an open mapping valid), so its parts are
sliced out of one read-only mapping with no copy. A folder step's file may be a hard link
of a framework's file (``save_files(link=True)``), which that framework can truncate and
rewrite at any moment; a mapping of it would then kill the whole training process with
SIGBUS on the next page touched. Its parts are read with ``pread`` into a buffer of their
own instead (one copy, bounded by the parts in flight), and a read that comes up short is
an error naming the file.

Whichever the source, the crc32c of every part is computed anyway (it names the object);
:class:`SentCheck` chains them into the crc32c of the whole file and compares it with the
step's manifest, so bytes that changed on disk after the commit (a rewrite through a hard
link, a bad sector, a hostile edit) fail that step's upload by name instead of being
committed on the remote as the step.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._format.checksum import crc32c_combine, crc_hex, map_file
from ..errors import ChecksumMismatchError, CorruptCheckpointError


class PreadSource:
    """A file read part by part with ``pread``: ``source[start:end]`` is a new uint8 tensor."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size, self.fd = path, size, -1
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))

    def __getitem__(self, where: slice):
        import torch
        start, end = where.start, where.stop
        buf = bytearray(end - start)
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = os.preadv(self.fd, [view[got:]], start + got)
            if n == 0:
                raise CorruptCheckpointError(f"{self.path}: shrank while being read for the upload (it is "
                                             f"{start + got} bytes now, the step recorded {self.size}): "
                                             "truncated or rewritten in place by another process")
            got += n
        return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a reader dropped without close() (the dedup compare's cache)
        self.close()


class _Mapped:
    def __init__(self, path: Path, size: int) -> None:
        self.size = size
        self.mapping = map_file(path, size)

    def __getitem__(self, where: slice):
        return self.mapping[where]

    def close(self) -> None:
        self.mapping = None


def open_source(path: Path, size: int, owned: bool):
    """The parts' source for one file: a mapping when the store alone owns the file, else preads."""
    return _Mapped(path, size) if owned else PreadSource(path, size)


class SentCheck:
    """The crc32c of a file chained from its parts' crc32c, in order, against the manifest's."""

    def __init__(self, path: Path, size: int, expected: str) -> None:
        self.path, self.size, self.expected = path, size, expected
        self.crc, self.length = 0, 0

    def add(self, part_crc: str, part_size: int) -> None:
        value = int(part_crc, 16)
        self.crc = value if self.length == 0 else crc32c_combine(self.crc, value, part_size)
        self.length += part_size

    def verify(self) -> None:
        got = crc_hex(self.crc)
        if self.length != self.size or (self.expected and got != self.expected):
            raise ChecksumMismatchError(
                f"{self.path}: read for the upload as {self.length} bytes with crc32c {got}, but the step "
                f"committed {self.size} bytes with crc32c {self.expected}: it changed on disk after the commit "
                "(rewritten in place, or damaged); this step's upload fails and nothing of it is committed")
