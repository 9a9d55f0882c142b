"""Remote objects shared between steps: where a shard is cut into parts, and which object
already holds a part's bytes.

**Cuts.** A shard file is header, then tensors from a 64-byte-aligned start (shardfile.py).
Parts are cut at the data's start and at both ends of every tensor of ``ALONE`` bytes or
more, then every ``part_size`` bytes inside each piece. A tensor's parts therefore hold the
same bytes from one checkpoint to the next when the tensor did not change, wherever the
header's length (the skeleton's plain values: step counts, learning rates) moves it in the
file. Smaller tensors share parts with their neighbours (sending them again is cheap; a
part per bias would cost a request each).

**Reuse.** ``ObjectIndex`` holds what the uploader knows the remote holds: for each part of
the steps it sent or read, the object, its stored size and crc32c, and where its raw bytes
lie in that step's local shard. A part about to be sent whose raw crc32c and size match an
entry is compared byte for byte with those local bytes (a crc32c alone can collide); only
then is the object referenced instead of sent. Without a local copy to compare with, the
part is sent: a reused object is one whose bytes we have seen equal, never one we guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from .._format import layout
from .._format.uploadmanifest import PartEntry, UploadedFile
from ..errors import CorruptCheckpointError

ALONE = 1 << 20  # tensors at least this large get parts of their own


def part_bounds(size: int, tensors: Sequence[tuple[int, int]], part_size: int,
                alone: int = ALONE) -> list[tuple[int, int]]:
    """(start, end) of each part of a ``size``-byte file whose tensors lie at ``tensors``
    ((start, end) in the file); contiguous, covering every byte, none longer than ``part_size``."""
    if size == 0:
        return [(0, 0)]
    cuts = {0, size}
    if tensors:
        cuts.add(min(start for start, _ in tensors))  # the header apart: it changes every step
    cuts.update(edge for start, end in tensors if end - start >= alone for edge in (start, end))
    edges = sorted(c for c in cuts if 0 <= c <= size)
    return [(at, min(at + part_size, end)) for start, end in zip(edges, edges[1:])
            for at in range(start, end, part_size)]


@dataclass(frozen=True)
class Known:
    """An object the remote holds, as a step that references it recorded it."""
    entry: PartEntry
    step: int
    file: str  # the shard's path inside that step's directory


class ObjectIndex:
    """Objects of the remote's kept steps, by the (raw crc32c, raw size, codec) of their bytes."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int, str], list[Known]] = {}
        self._steps: dict[int, list[tuple[str, int, str]]] = {}

    def add(self, step: int, codec: str, files: Sequence[UploadedFile]) -> None:
        """Record the objects of a committed step (schema 2 parts only)."""
        if step in self._steps:
            return
        keys = []
        for f in files:
            for part in f.parts:
                if layout.parse_object(part.path) is None:
                    continue  # a schema-1 part lives in its step's directory: never shared
                key = (part.raw_crc32c, part.raw_size, codec)
                self._by_key.setdefault(key, []).append(Known(part, step, f.path))
                keys.append(key)
        self._steps[step] = keys

    def forget(self, step: int) -> None:
        """The step was deleted from the remote: its entries go (objects other steps still name stay)."""
        for key in set(self._steps.pop(step, [])):
            kept = [k for k in self._by_key.get(key, []) if k.step != step]
            if kept:
                self._by_key[key] = kept
            else:
                self._by_key.pop(key, None)

    def forget_objects(self, rels: AbstractSet[str]) -> None:
        """These objects are damaged on the remote: no later step may name them again."""
        for key, known in list(self._by_key.items()):
            kept = [k for k in known if k.entry.path not in rels]
            if kept:
                self._by_key[key] = kept
            else:
                self._by_key.pop(key)

    def has(self, step: int) -> bool:
        return step in self._steps

    def candidates(self, raw_crc32c: str, raw_size: int, codec: str) -> list[Known]:
        return list(self._by_key.get((raw_crc32c, raw_size, codec), ()))


class Reuse:
    """For one upload: finds an object already holding a part's exact bytes.

    ``local_step(step)`` is the directory of a committed local step (None if there is none);
    its file is read to compare with (partsource.open_source)."""

    def __init__(self, index: ObjectIndex, codec: str, local_step: Callable[[int], Path | None]) -> None:
        self.index, self.codec, self.local_step = index, codec, local_step
        self._maps: dict[Path, Any] = {}  # path -> partsource's source, or None
        self.compared = 0  # bytes compared (for the stats)

    def find(self, raw, offset: int, raw_crc32c: str) -> PartEntry | None:
        """An entry referencing an object with the bytes of ``raw`` (a uint8 tensor, the part at
        ``offset``), or None: the part is then sent."""
        import torch
        n = raw.numel()
        for known in self.index.candidates(raw_crc32c, n, self.codec):
            theirs = self._bytes(known, n)
            if theirs is not None:
                self.compared += n
                if torch.equal(theirs, raw):
                    return replace(known.entry, offset=offset, sent=False)
        return None

    def _bytes(self, known: Known, n: int):
        directory = self.local_step(known.step)
        if directory is None:
            return None
        path = directory / known.file
        if path not in self._maps:
            self._maps[path] = _source_or_none(path, owned=not known.file.startswith(FOLDER_FILES))
        source = self._maps[path]
        start = known.entry.offset
        if source is None or start + n > source.size:
            return None
        try:
            return source[start:start + n]
        except (CorruptCheckpointError, OSError):  # shrank meanwhile: nothing to compare with
            return None


FOLDER_FILES = layout.FOLDER_FILES_DIR + "/"  # a folder step's files: maybe a framework's hard links


def _source_or_none(path: Path, owned: bool):
    """Where to read a kept step's bytes from (partsource.py: a mapping of a shard the store
    alone owns, preads of a folder step's file that a framework may truncate), or None."""
    from .partsource import open_source
    try:
        return open_source(path, path.stat().st_size, owned)
    except (OSError, RuntimeError):  # rotated away meanwhile: nothing to compare with
        return None
