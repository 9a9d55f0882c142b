"""Restoring a state that holds DTensor pieces: each rank reads only the pieces it needs.

    assemble(open_file, manifest, rank, targets, source) -> this rank's state

Order of work, for one rank:
  1. every shard's header is read (two small reads per file) and its skeleton's
     piece nodes indexed by their path in the state (pieces.py);
  2. the base skeleton -- this rank's own shard, or rank 0's when the world grew --
     gives the state's structure and its plain values (RNG, step counts, hyper-
     parameters), as the rank saved them;
  3. for every DTensor leaf, the target says which box of the global tensor this
     rank wants (its own mesh and placements, or the whole tensor for a plain
     model); boxes.cover names the saved pieces that overlap it, and only those
     are read, each checked against its own crc32c before any byte is used;
  4. the result is wrapped as the target wants it (a DTensor on the target's mesh).
Nothing is loaded into a live object here: load_into does that after every key
and shape checks, so a bad piece leaves the model untouched.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._format import tree
from .._format.boxes import Box, cover
from .._format.checksum import crc32c_update, crc_hex
from .._format.manifest import ShardEntry, ShardManifest
from .._format.memview import byte_view
from .._format.pieces import piece_box
from .._format.safefile import open_checked
from .._format.shardfile import _DTYPES, FORMAT_KEY, FORMAT_VERSION
from .._format.shardheader import header_length, parse_header
from ..errors import ChecksumMismatchError, CorruptCheckpointError
from .placement import Targets


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; every byte a restore reads from a shard passes here."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"fd {fd}: file shrank while being read")
        done += n
    return done


class PieceFile:
    """One shard file opened for reading tensor by tensor, each checked on its own.

    ``ensure(start, end)``, when given, is called before any byte range is read: a shard
    fetched from the remote is a sparse file whose parts arrive only when first needed."""

    def __init__(self, path: Path, entry: ShardEntry, verify: str,
                 ensure: Callable[[int, int], None] | None = None) -> None:
        self.path, self.verify = path, verify
        self.ensure = ensure or (lambda start, end: None)
        self.f = open_checked(path.parent, path.name, 1 << 62, f"shard of rank {entry.rank}")
        try:
            if self.f.size != entry.size:
                raise ChecksumMismatchError(f"{path}: {self.f.size} bytes on disk but the manifest records "
                                            f"{entry.size} (truncated or partial write)")
            self._read_header(entry)
            if self.crcs is None and verify != "none" or verify == "sha256":
                self._check_whole(entry)  # no per-tensor checksums (or the strict mode): the file as one
        except BaseException:
            self.f.close()
            raise

    def _read_header(self, entry: ShardEntry) -> None:
        source = str(self.path)
        self.ensure(0, 8)
        first8 = os.pread(self.f.fd, 8, 0)
        n = header_length(first8, self.f.size, source)
        self.ensure(8, 8 + n)
        raw = os.pread(self.f.fd, n, 8)
        if entry.header_crc32c and self.verify != "none" and \
                crc_hex(crc32c_update(raw, crc32c_update(first8))) != entry.header_crc32c:
            raise ChecksumMismatchError(f"{self.path}: its header fails the manifest's crc32c (corrupt)")
        header = parse_header(raw, self.f.size - 8 - n, source)
        self.data_start = 8 + n
        try:
            info = json.loads(header.pop("__metadata__", {})[FORMAT_KEY])
            self.skeleton, self.names, version = info["tree"], info["names"], info["version"]
            self.crcs, self.block = info.get("crcs"), info.get("crc_block")
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{source}: unreadable tieredckpt metadata ({exc})") from None
        if version != FORMAT_VERSION or not isinstance(self.names, list) or \
                not all(isinstance(x, str) and x in header for x in self.names):
            raise CorruptCheckpointError(f"{source}: metadata does not match the header's tensors")
        if self.crcs is not None and (not isinstance(self.crcs, list) or len(self.crcs) != len(self.names)
                                      or not all(isinstance(c, list) for c in self.crcs)
                                      or type(self.block) is not int or self.block < 4096):
            raise CorruptCheckpointError(f"{source}: per-tensor checksums do not match its {len(self.names)} tensors")
        self.header = header

    def _check_whole(self, entry: ShardEntry) -> None:
        self.ensure(0, self.f.size)
        got = self.f.digest(sha256=self.verify == "sha256")
        if got.crc32c != entry.crc32c or (self.verify == "sha256" and entry.sha256 and got.sha256 != entry.sha256):
            raise ChecksumMismatchError(f"{self.path}: its checksum does not match the manifest's (corrupt)")

    def tensor(self, index: int) -> torch.Tensor:
        """Tensor ``index`` of this shard, read alone into fresh memory and verified."""
        dtype, shape, start, end = self._entry(index)
        out = torch.empty(shape, dtype=dtype)
        view = byte_view(out.view(-1)) if out.numel() else memoryview(b"")
        if len(view) != end - start:
            raise CorruptCheckpointError(f"{self.path}: tensor {self.names[index]!r} has the wrong size")
        self._read(index, view, 0)
        return out

    def part(self, index: int, piece: Box, want: Box) -> torch.Tensor:
        """The ``want`` box (global coordinates, inside ``piece``) of tensor ``index`` (which holds
        ``piece``): only the CRC_BLOCKs that the box's bytes lie in are read and verified."""
        dtype, shape, start, end = self._entry(index)
        if tuple(shape) != piece.shape:
            raise CorruptCheckpointError(f"{self.path}: tensor {self.names[index]!r} is {tuple(shape)}, "
                                         f"its piece node says {piece.shape}")
        if self.crcs is None or want == piece or want.numel == 0:
            return self.tensor(index)[want.relative_to(piece)]
        item = torch.empty((), dtype=dtype).element_size()
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        rel = [o - p for o, p in zip(want.offset, piece.offset)]
        first = sum(r * s for r, s in zip(rel, strides))
        last = sum((r + n - 1) * s for r, n, s in zip(rel, want.shape, strides))
        lo, hi = first * item // self.block * self.block, min(-(-(last + 1) * item // self.block) * self.block, end - start)
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        self._read(index, byte_view(buf), lo)
        seg = buf[first * item - lo:(last + 1) * item - lo].view(dtype)
        return torch.as_strided(seg, want.shape, strides)

    def _entry(self, index: int):
        entry = self.header[self.names[index]]
        if entry["dtype"] not in _DTYPES:
            raise CorruptCheckpointError(f"{self.path}: dtype {entry['dtype']} is not supported here")
        start, end = entry["data_offsets"]
        return _DTYPES[entry["dtype"]], entry["shape"], start, end

    def _read(self, index: int, view: memoryview, at: int) -> None:
        """Bytes [at, at + len(view)) of tensor ``index`` into ``view``, each whole CRC_BLOCK checked
        (``at`` is a block boundary; the range ends at one or at the tensor's end)."""
        _, _, start, end = self._entry(index)
        where = self.data_start + start + at
        self.ensure(where, where + len(view))
        _pread_into(self.f.fd, view, where)
        if self.crcs is None or self.verify != "crc":
            return
        crcs, first = self.crcs[index], at // self.block
        if len(crcs) != -(-(end - start) // self.block):
            raise CorruptCheckpointError(f"{self.path}: tensor {self.names[index]!r} has {len(crcs)} block checksums "
                                         f"for {end - start} bytes")
        for n, o in enumerate(range(0, len(view), self.block)):
            if crc_hex(crc32c_update(view[o:o + self.block])) != crcs[first + n]:
                raise ChecksumMismatchError(f"{self.path}: tensor {self.names[index]!r} fails its crc32c (corrupt)")

    def close(self) -> None:
        self.f.close()


def assemble(open_file: Callable[[int], PieceFile], manifest: ShardManifest, rank: int, targets: Targets,
             source: str) -> Any:
    """This rank's state, its DTensor leaves built from the saved pieces that overlap what it wants
    (the caller closes the files ``open_file`` opened)."""
    files = [open_file(r) for r in range(manifest.world_size)]  # 1. headers (and checks) of every shard
    index: dict[tuple, list[tuple[int, dict]]] = defaultdict(list)
    for r, f in enumerate(files):
        for path, node in tree.piece_nodes(f.skeleton):
            if isinstance(node, dict) and node.get("t") is not None:
                index[path].append((r, node))
    base = files[rank if rank < len(files) else 0]  # 2. structure and plain values

    def plain(i: int, path: tuple) -> torch.Tensor:
        t = base.tensor(i)
        want = targets.want(path, tuple(t.shape))
        if want is None:
            return t
        box, wrap = want  # a plain saved tensor into a sharded target: this rank's part of it
        return wrap(t[box.relative_to(Box((0,) * t.dim(), tuple(t.shape)))].clone())

    def piece(path: tuple, node: dict) -> torch.Tensor:  # 3. + 4.
        _, whole, dtype = piece_box(node, str(base.path))
        want = targets.want(path, whole.shape)
        box, wrap = want if want is not None else (whole, lambda t: t)
        saved = []
        for r, n in index.get(path, []):
            b, g, d = piece_box(n, f"{files[r].path}")
            if g != whole or d != dtype:
                raise CorruptCheckpointError(f"{source}: {_name(path)} is {g.shape}/{d} in rank {r}'s shard, "
                                             f"{whole.shape}/{dtype} in rank {rank}'s")
            saved.append((r, n, b))
        out = torch.empty(box.shape, dtype=dtype)
        for i, part in cover([b for _, _, b in saved], box, f"{source}: {_name(path)}"):
            r, n, b = saved[i]
            t = files[r].part(_index(n["t"], files[r]), b, part)
            if t.dtype != dtype:
                raise CorruptCheckpointError(f"{files[r].path}: piece of {_name(path)} is {t.dtype}, "
                                             f"its node says {dtype}")
            out[part.relative_to(box)] = t
        return wrap(out)

    return tree.unflatten(base.skeleton, plain, str(base.path), count=len(base.names), on_piece=piece)


def _index(t: Any, f: PieceFile) -> int:
    if type(t) is not int or not 0 <= t < len(f.names):
        raise CorruptCheckpointError(f"{f.path}: piece names tensor {t!r} of {len(f.names)}")
    return t


def _name(path: tuple) -> str:
    return "/".join(str(p) for p in path)
