"""Which saved pieces of a tensor cover which part of a wanted piece: the one resharding planner.

A piece is an n-D box of a global tensor: ``Box(offset, shape)``, both in elements
per dimension. A DTensor's local shard is one (its global offset and local shape),
a ZeRO-style flat shard is a 1-D one (``param_shard_offset``, ``param_shard_numel``),
and a plain tensor is the box at offset 0 covering all of it.

    cover(pieces, want) -> [(piece index, overlap box)]   pieces that together fill ``want``

Planning is pure (no torch, no I/O) and refuses pieces that do not tile the wanted
box exactly once. Pieces with the same box (a tensor replicated over a submesh and
written by each copy) are read once: the first one counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from ..errors import CorruptCheckpointError


@dataclass(frozen=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices of a tensor that holds ``outer``."""
        return tuple(slice(o - p, o - p + s) for o, p, s in zip(self.offset, outer.offset, self.shape))


def overlap(a: Box, b: Box) -> Box | None:
    """The box both cover, or None when they share no element."""
    if len(a.offset) != len(b.offset):
        return None
    lo = [max(x, y) for x, y in zip(a.offset, b.offset)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a.offset, a.shape, b.offset, b.shape)]
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return Box(tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi)))


def cover(pieces: Sequence[Box], want: Box, what: str = "tensor") -> list[tuple[int, Box]]:
    """The pieces (by index) that overlap ``want`` and the overlap of each; together they fill
    ``want`` exactly once, or CorruptCheckpointError names what is missing or doubled."""
    if want.numel == 0:
        return []
    seen: set[Box] = set()
    used: list[tuple[int, Box]] = []
    for i, piece in enumerate(pieces):
        if piece in seen or piece.numel == 0:
            continue
        seen.add(piece)
        part = overlap(piece, want)
        if part is not None:
            used.append((i, part))
    for n, (_, a) in enumerate(used):
        for _, b in used[n + 1:]:
            if overlap(a, b) is not None:
                raise CorruptCheckpointError(f"{what}: saved pieces {a} and {b} overlap; the checkpoint's "
                                             "shards do not tile the tensor")
    covered = sum(part.numel for _, part in used)
    if covered != want.numel:
        raise CorruptCheckpointError(f"{what}: the saved pieces cover {covered} of the {want.numel} elements "
                                     f"wanted at {want} (a shard is missing)")
    return used
