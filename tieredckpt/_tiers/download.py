"""Reading a committed remote step's parts back: into a caller's scratch files, or to check them.

Every read is bounded by what the upload manifest declares before anything is allocated, its
stored bytes' crc32c is checked before they are decoded, and decoding streams into the file
with the raw bytes' crc32c checked on the way. A part that fails a check has left bytes only in
the caller's scratch file, which the caller discards (or fetches the part again).

Requests are transport.py's; which parts a step has is the upload manifest's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._format.atomic import naming_a_full_disk
from .._format.checksum import crc32c_update, crc_hex
from .._format.uploadmanifest import PartEntry, UploadedFile, UploadManifest
from ..errors import CorruptCheckpointError, MissingShardError, RemoteNotFoundError
from .framepool import FramePool
from .onethread import one_thread
from .transport import Transport


class PartReader:
    """Fetches and checks the parts of one remote root through its transport."""

    def __init__(self, t: Transport, concurrency: int) -> None:
        self.t = t
        self.concurrency = concurrency

    def fetch_files(self, upload: UploadManifest, files: list[UploadedFile], dest: Path,
                    progress: Callable[[int], None] | None = None) -> None:
        """Fetch every part of ``files`` in parallel into new files under ``dest``, fsynced.

        ``dest`` is a scratch directory the caller commits (or discards); a full disk there is a
        DiskFullError naming it and the step's size."""
        with naming_a_full_disk(dest.parent, f"the download of step {upload.step}", lambda: sum(f.size for f in files)):
            self._fetch_into(upload, files, dest, progress)

    def _fetch_into(self, upload: UploadManifest, files: list[UploadedFile], dest: Path, progress) -> None:
        jobs, fds = [], []
        try:
            for f in files:
                if "/" in f.path:  # a folder step's files/...: the path was checked to stay inside
                    (dest / f.path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest / f.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                fds.append(fd)
                os.ftruncate(fd, f.size)
                jobs += [(fd, part) for part in f.parts]
            frames = FramePool(0)  # compressed parts land here before decoding, each sized to its part
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="tieredckpt-download") as pool:
                for _ in pool.map(lambda job: self._fetch_part(upload, job[0], job[1], progress, frames), jobs):
                    pass
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def fetch_part(self, upload: UploadManifest, fd: int, part: PartEntry) -> None:
        """One part, verified (stored and decoded crc32c), written at its offset into ``fd``."""
        self._fetch_part(upload, fd, part, None, FramePool(0))

    def _fetch_part(self, upload: UploadManifest, fd: int, part: PartEntry, progress, frames: FramePool) -> None:
        rel = upload.part_rel(part)
        try:
            if upload.codec == "raw" and part.stored_size and part.raw_crc32c == part.stored_crc32c:
                self._stream_raw(rel, fd, part)
            else:  # decoded only after its stored bytes pass their crc32c (a forged raw entry too)
                self._fetch_decoded(rel, fd, part, upload.codec, frames)
        except RemoteNotFoundError:
            raise MissingShardError(f"{self.t.where(rel)}: part missing on the remote (the step was deleted "
                                    "meanwhile, or the remote is damaged)") from None
        if progress:
            progress(part.raw_size)

    def _stream_raw(self, rel: str, fd: int, part: PartEntry) -> None:
        """A raw part written at its offset as it arrives, never buffered whole: its stored bytes are
        its raw bytes, so one check covers both."""
        self._stream_checked(rel, part, lambda chunk, at: pwrite_all(fd, chunk, part.offset + at))

    def _stream_checked(self, rel: str, part: PartEntry, put: Callable[[Any, int], None]) -> int:
        """Stream a part's stored bytes to ``put(chunk, position in the part)``, never more than the
        manifest declares, their crc32c computed on the way and checked at the end; returns the size."""
        at: dict = {}

        def open_sink():  # one per attempt: a retry after a broken body starts over
            at.update(size=0, crc=0)

            def write(chunk) -> None:
                end = at["size"] + len(chunk)
                if end > part.stored_size:  # get_stream refuses this too; never past the part
                    raise CorruptCheckpointError(f"{self.t.where(rel)}: larger than the {part.stored_size} "
                                                 "bytes its manifest records (corrupt remote object)")
                put(chunk, at["size"])
                at["crc"] = crc32c_update(chunk, at["crc"])
                at["size"] = end
            return write
        size = self.t.get_stream(rel, part.stored_size, open_sink)
        self._check_stored(rel, part, size, crc_hex(at["crc"]))
        return size

    def _fetch_decoded(self, rel: str, fd: int, part: PartEntry, codec: str, frames: FramePool) -> None:
        """A compressed part: streamed into a reused buffer (never fresh memory), its stored crc32c
        checked, then decoded into the file with the crc32c of its raw bytes checked on the way. The
        buffer goes back only after success: after a failure a request may still be writing into it."""
        from .._format.codec import decode_into  # torch: only when something is fetched
        buf = frames.take(part.stored_size)
        view = memoryview(buf)

        def put(chunk, at: int) -> None:
            view[at:at + len(chunk)] = chunk
        size = self._stream_checked(rel, part, put)
        crc, offset = 0, part.offset

        def write(chunk: memoryview) -> None:
            nonlocal crc, offset
            crc = crc32c_update(chunk, crc)
            pwrite_all(fd, chunk, offset)
            offset += len(chunk)
        with one_thread():
            decode_into(view[:size], codec, part.raw_size, write, self.t.where(rel))
        if crc_hex(crc) != part.raw_crc32c:
            raise CorruptCheckpointError(f"{self.t.where(rel)}: decoded bytes fail their crc32c (corrupt remote object)")
        frames.give(buf)

    def _check_stored(self, rel: str, part: PartEntry, size: int, crc: str) -> None:
        if size != part.stored_size or crc != part.stored_crc32c:
            raise CorruptCheckpointError(
                f"{self.t.where(rel)}: {size} bytes with crc32c {crc}, the upload manifest records "
                f"{part.stored_size} bytes with {part.stored_crc32c} (corrupt remote object)")

    def damage(self, upload: UploadManifest, sample_bytes: int = 16 << 20) -> dict[str, str]:
        """What of a committed step does not read back as its upload manifest records:
        {object (relative to the root): why}, empty when nothing was found. Every part is checked
        for being there at its recorded size (one listing per directory), and a bounded sample --
        the smallest parts first, up to ``sample_bytes`` in all, the smallest always -- is read
        back and its crc32c checked. A cheap look, not a full verify: a restore checks every byte."""
        parts = sorted({upload.part_rel(p): p for f in upload.files for p in f.parts}.items(),
                       key=lambda item: item[1].stored_size)
        listed: dict[str, int] = {}
        for directory in sorted({rel.rsplit("/", 1)[0] for rel, _ in parts}):
            listed.update({f"{directory}/{name}": size for name, size in self.t.list_files(directory).items()})
        bad = {rel: (f"{self.t.where(rel)}: missing" if rel not in listed else
                     f"{self.t.where(rel)}: {listed[rel]} bytes, the upload manifest records {p.stored_size}")
               for rel, p in parts if listed.get(rel) != p.stored_size}
        budget = sample_bytes
        for i, (rel, part) in enumerate(parts):
            if rel in bad or (i and part.stored_size > budget):
                continue
            budget -= part.stored_size
            try:
                self._stream_checked(rel, part, lambda chunk, at: None)
            except RemoteNotFoundError:
                bad[rel] = f"{self.t.where(rel)}: missing"
            except CorruptCheckpointError as exc:
                bad[rel] = str(exc)
        return bad


def pwrite_all(fd: int, data, offset: int) -> None:
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)
