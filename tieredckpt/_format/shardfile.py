"""The pickle-free file one rank's state is written in.

The layout is safetensors-compatible, so other tools can read our shards:

    [u64 LE header length N][N bytes JSON header, space padded][raw tensor bytes]

The header maps tensor names to ``{"dtype", "shape", "data_offsets"}``, and its
``__metadata__["tieredckpt"]`` holds the state's JSON skeleton (see tree.py), so
nested dicts, int keys, tuples and plain values come back exactly. Tensors are
laid out largest item size first and the data section starts on a 64-byte
boundary, so every tensor can be a zero-copy view of one read buffer.

A write is one streaming pass of large sequential writes; crc32c and sha256 are
computed over the bytes as they go out (see checksum.py). A read loads the file
into one buffer, verifies it, validates the untrusted header, then makes views.
Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from ..errors import ChecksumMismatchError, CorruptCheckpointError, UnsupportedStateError
from . import tree
from .atomic import write_all
from .checksum import CHUNK, Digest, StreamDigest, crc32c_update, crc_hex, digest_buffer
from .directwrite import MIN_DIRECT, enable_direct, write_direct
from .gcpause import gc_paused
from .memview import byte_view
from .phases import phase
from .safefile import open_checked
from .shardheader import header_length, parse_header

FORMAT_KEY = "tieredckpt"
FORMAT_VERSION = 1
_ALIGN = 64

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _attr, _name in [("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")]:
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
STORED_DTYPES = frozenset(_DTYPE_NAMES)  # what a shard can hold (after the dtypes this torch may lack)

VERIFY_MODES = ("none", "crc", "sha256")
CRC_BLOCK = 1 << 20  # the unit a piecewise read verifies (pieces shards: a crc32c per block)


def block_crcs(data: memoryview) -> list[str]:
    """crc32c of each CRC_BLOCK of ``data`` (the last one shorter)."""
    return [crc_hex(crc32c_update(data[o:o + CRC_BLOCK])) for o in range(0, len(data), CRC_BLOCK)]


def write_shard(path: str | os.PathLike, state: Any, *, sha256: bool = True) -> Digest:
    """Write ``state`` to a new file at ``path`` (must not exist), fsynced. Returns its digest."""
    skeleton, tensors, names = tree.flatten(state)
    return write_flattened(path, skeleton, tensors, names, sha256=sha256)


def write_order(skeleton, tensors: list[torch.Tensor], pieces: set | None = None) -> list[int]:
    """The order tensors are laid out in a shard.

    Largest item size first keeps every tensor aligned. A state with DTensor pieces is read
    piece by piece when resharded (no rank reads whole shards it does not need): its plain
    tensors (step counts, RNG), which every restoring rank reads, come first, next to the header.
    """
    pieces = _piece_tensors(skeleton) if pieces is None else pieces
    widths = [t.element_size() for t in tensors]
    order = []
    for piece in (False, True):  # a stable sort by (piece?, -width), in comprehensions: no key call per tensor
        for width in sorted(set(widths), reverse=True):
            order += [i for i, w in enumerate(widths) if w == width and (i in pieces) is piece]
    return order


def _piece_tensors(skeleton) -> set:
    return {n.get("t") for _, n in tree.piece_nodes(skeleton) if isinstance(n, dict)}


def write_flattened(path, skeleton, tensors: list[torch.Tensor], names: list[str], *,
                    sha256: bool = True, handoff=None, pieces: set | None = None, structure=None) -> Digest:
    """Write already-flattened state (see :func:`tree.flatten`) in one streaming pass.

    ``handoff`` (the store's staging copy, still running: _loop/handoff.py) gives the tensors'
    bytes in the order written, each part once it is there. The cyclic garbage collector
    waits meanwhile (gcpause.py: the views and header entries, a few per tensor, are no
    cycles, and collections walking the whole process cost a 100,000-tensor write seconds).
    ``structure`` (treecache.Structure: the same object while names, dtypes, shapes and order
    stay the same) keeps the header's tensor entries from one save to the next."""
    with gc_paused():
        return _write_flattened(path, skeleton, tensors, names, sha256, handoff, pieces, structure)


def _write_flattened(path, skeleton, tensors, names, sha256, handoff, pieces, structure) -> Digest:
    pieces = _piece_tensors(skeleton) if pieces is None else pieces
    # The order is the header's entries' and the arrays' (a handoff streams in its own, the
    # same): not needed where a structure's entries are kept and the handoff streams.
    order = [] if handoff is not None and structure is not None and structure.header is not None \
        else write_order(skeleton, tensors, pieces)
    arrays: list[memoryview] = []  # each tensor's bytes, where nothing else gives them
    if handoff is not None and not pieces:  # the staging buffers, streamed by the handoff: dense CPU tensors
        _check_dtypes(tensors, names)
        size = sum(t.numel() * t.element_size() for t in tensors)
    else:
        arrays = [_as_bytes(t, name) for t, name in zip(tensors, names)]  # checked, not yet read
        size = sum(map(len, arrays))
    # With DTensor pieces each tensor carries a crc32c per CRC_BLOCK of its bytes, so a rank
    # that needs part of a piece reads and verifies only the blocks that part lies in -- one more
    # pass over the bytes, on the writer thread, before the header that records them.
    crcs = None
    if pieces:
        if handoff is not None:
            handoff.wait_copied()
        crcs = [block_crcs(a) for a in arrays]
    header_bytes = _encode_header(skeleton, tensors, names, order, crcs, structure)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        direct = len(header_bytes) + size >= MIN_DIRECT and enable_direct(fd)
        # The O_DIRECT writer copies each view into its own buffers before it asks for the next,
        # so a handoff may give it live tensors; the page-cache one checksums views later.
        data = handoff.stream(live_ok=direct) if handoff is not None else (arrays[i] for i in order)
        with closing(data):  # a handoff's live tensor is let go of, also when the write fails
            parts = itertools.chain([memoryview(header_bytes)], data)  # the file, in order
            done = write_direct(fd, parts, sha256) if direct else _write_buffered(fd, parts, sha256)
        with phase("fsync"):
            os.fsync(fd)  # durable before anyone may name this file in a manifest
    finally:
        os.close(fd)
    if crcs is not None:  # read piece by piece, the header is checked on its own against the manifest
        done = dataclasses.replace(done, header_crc32c=crc_hex(crc32c_update(header_bytes)))
    return done


BATCH = 1 << 20  # bytes: small views are joined into writes of about this size


def _write_buffered(fd: int, pieces: Iterable[memoryview], sha256: bool) -> Digest:
    """Through the page cache, straight from the tensors' memory, checksummed beside the writes.
    Views smaller than BATCH are joined (one copy of small bytes) into writes of about BATCH:
    100,000 small tensors are 100 writes, not 100,000 (a joined batch is a new bytes object,
    so the checksum threads may read it after the next one is made)."""
    digest = StreamDigest(sha256=sha256)
    small: list[memoryview] = []
    pending = 0

    def put(chunk) -> None:
        digest.update(chunk)
        write_all(fd, chunk)
    try:
        for view in pieces:
            if len(view) < BATCH:
                small.append(view)
                pending += len(view)
                if pending < BATCH:
                    continue
            if small:
                put(b"".join(small) if len(small) > 1 else small[0])
                small, pending = [], 0
                if len(view) < BATCH:
                    continue
            for start in range(0, len(view), CHUNK):
                put(view[start:start + CHUNK])
        if small:
            put(b"".join(small))
    except BaseException:
        digest.abort()
        raise
    return digest.finish()


def _as_bytes(t: torch.Tensor, name: str) -> memoryview:
    if t.dtype not in _DTYPE_NAMES:
        raise _unstorable(name, t.dtype)
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise UnsupportedStateError(f"tensor {name!r} is {t.layout}/{t.device.type}: only dense tensors are stored")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return byte_view(t)


def _check_dtypes(tensors: list[torch.Tensor], names: list[str]) -> None:
    for dtype in {t.dtype for t in tensors} - STORED_DTYPES:
        raise _unstorable(next(n for t, n in zip(tensors, names) if t.dtype == dtype), dtype)


def _unstorable(name: str, dtype: torch.dtype) -> UnsupportedStateError:
    return UnsupportedStateError(f"tensor {name!r} has dtype {dtype}, which tieredckpt cannot store")


def _encode_header(skeleton, tensors, names, order, crcs=None, structure=None) -> bytes:
    """The safetensors-style header: an entry per tensor, then our metadata (the tree). The
    entries and the names depend on the structure only: with one, they are encoded once and
    kept on it (``structure.header``); the tree, whose scalars change, is encoded every time."""
    cached = structure.header if structure is not None and crcs is None else None
    if cached is None:
        cached = (_encode_entries(tensors, names, order), json.dumps(names, separators=(",", ":")))
        if structure is not None and crcs is None:
            structure.header = cached
    entries, names_json = cached
    meta = {"version": FORMAT_VERSION, "tree": skeleton}
    if crcs is not None:
        meta["crcs"], meta["crc_block"] = crcs, CRC_BLOCK
    meta_json = json.dumps(meta, separators=(",", ":"))[:-1] + ',"names":' + names_json + "}"
    raw = ("{" + entries + '"__metadata__":' + json.dumps({FORMAT_KEY: meta_json}, separators=(",", ":")) + "}").encode()
    padded = raw.ljust(-(-(8 + len(raw)) // _ALIGN) * _ALIGN - 8, b" ")  # data starts 64-aligned
    return len(padded).to_bytes(8, "little") + padded


def _encode_entries(tensors, names, order) -> str:
    """``"name":{dtype, shape, data_offsets},`` for each tensor in file order (a trailing comma:
    the metadata entry follows)."""
    header: dict[str, Any] = {}
    offset = 0
    for i in order:
        nbytes = tensors[i].numel() * tensors[i].element_size()
        header[names[i]] = {"dtype": _DTYPE_NAMES[tensors[i].dtype], "shape": list(tensors[i].shape),
                            "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":"))[1:-1]
    return encoded + "," if encoded else ""


def read_shard(path: str | os.PathLike, *, size: int | None = None, crc32c: str | None = None,
               sha256: str | None = None, verify: str = "crc") -> Any:
    """Read, verify and decode a shard. Raises before returning anything if it is bad.

    ``verify``: "crc" checks crc32c (fast), "sha256" checks both, "none" checks
    only sizes and structure. Expected values come from the manifest.
    """
    buf = read_verified(path, size=size, crc32c=crc32c, sha256=sha256, verify=verify)
    return decode(buf, str(path))


def read_verified(path, *, size=None, crc32c=None, sha256=None, verify="crc") -> torch.Tensor:
    """The file's bytes as one uint8 tensor, after size and checksum checks.

    The file is opened once through safefile (a regular file, no symlink) and the
    tensor is a private copy-on-write mapping of that descriptor: no copy, no fresh
    pages, and writes to it never reach the file. Committed shards are immutable,
    and the mapping stays valid if rotation unlinks the file.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    path = Path(path)
    with open_checked(path.parent, path.name, 1 << 62, "shard") as f:
        if size is not None and f.size != size:
            raise ChecksumMismatchError(
                f"{path}: {f.size} bytes on disk but the manifest records {size} "
                f"({'truncated or partial write' if f.size < size else 'file grew'})")
        buf = f.map()
    if verify == "none":
        return buf
    got = digest_buffer(buf, sha256=verify == "sha256")
    if crc32c is not None and got.crc32c != crc32c:
        raise ChecksumMismatchError(f"{path}: crc32c {got.crc32c} does not match the manifest's {crc32c} (corrupt)")
    if verify == "sha256" and sha256 and got.sha256 != sha256:  # "": not recorded yet, crc32c stands
        raise ChecksumMismatchError(f"{path}: sha256 {got.sha256} does not match the manifest's {sha256} (corrupt)")
    return buf


def decode(buf: torch.Tensor, source: str) -> Any:
    """Turn a verified file buffer into state. ``source`` names the file in errors."""
    size = buf.numel()
    n = header_length(bytes(byte_view(buf[:8])) if size >= 8 else b"", size, source)
    header = parse_header(bytes(byte_view(buf[8:8 + n])), size - 8 - n, source)
    data = buf[8 + n:]
    meta = header.pop("__metadata__", {})
    unknown = sorted({entry["dtype"] for entry in header.values()} - set(_DTYPES))
    if unknown:
        raise CorruptCheckpointError(f"{source}: dtypes {unknown} are not supported by this torch {torch.__version__}")
    by_name = {name: _view(data, entry) for name, entry in header.items()}
    if FORMAT_KEY not in meta:
        return by_name  # a plain safetensors file: a flat {name: tensor} dict
    try:
        info = json.loads(meta[FORMAT_KEY])
        skeleton, names = info["tree"], info["names"]
        version = info["version"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: unreadable tieredckpt metadata ({exc})") from None
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{source}: shard format version {version!r} is not supported (expected {FORMAT_VERSION})")
    if not isinstance(names, list) or not all(isinstance(x, str) and x in by_name for x in names):
        raise CorruptCheckpointError(f"{source}: metadata names tensors that the header does not hold")
    return tree.unflatten(skeleton, [by_name[x] for x in names], source)


def _view(data: torch.Tensor, entry: dict) -> torch.Tensor:
    """A zero-copy tensor over its bytes, with a storage of its own (offset 0).

    As torch's own mmap loading does, each tensor gets a slice of the mapping as its
    own storage: some torch APIs (torch.set_rng_state among them) misread a
    tensor that sits at an offset inside a larger storage.
    """
    dtype = _DTYPES[entry["dtype"]]
    start, end = entry["data_offsets"]
    if start == end:
        return torch.empty(entry["shape"], dtype=dtype)
    base = data.storage_offset()
    storage = data.untyped_storage()[base + start:base + end]
    if storage.data_ptr() % torch.empty((), dtype=dtype).element_size():
        storage = storage.clone()  # misaligned (a foreign file): copy into an aligned buffer
    return torch.empty(0, dtype=dtype).set_(storage, 0, entry["shape"])
