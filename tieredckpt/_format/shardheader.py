"""A shard file's header: reading and validating it, without torch.

    [u64 LE header length N][N bytes JSON header, space padded][raw tensor bytes]

The header maps tensor names to ``{"dtype", "shape", "data_offsets"}`` (the
safetensors layout) plus ``__metadata__``. It is untrusted: its length, every
entry's dtype, shape and offsets are checked against the file's real size, and
overlapping tensors or shapes whose strides would overflow are refused, before
anything is allocated. The command line's read-only commands use this module
alone, so they start without importing torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CorruptCheckpointError
from .safefile import open_checked

MAX_HEADER = 256 << 20
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def read_header(path: str | os.PathLike) -> dict:
    """The parsed, validated header of a shard file (tensor index and metadata), read safely."""
    path = Path(path)
    with open_checked(path.parent, path.name, 1 << 62, "shard") as f:
        n = header_length(os.pread(f.fd, 8, 0), f.size, str(path))
        raw = os.pread(f.fd, n, 8)
    return parse_header(raw, f.size - 8 - n, str(path))


FLOAT_WIDTHS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # dtypes whose bytes split into planes


def float_spans(path: str | os.PathLike) -> list[tuple[int, int, int]]:
    """(start, end, element width) in the file of every floating-point tensor, in order:
    what the zstd-dtype codec splits into byte planes. Everything else is bytes."""
    return sorted((start, end, FLOAT_WIDTHS[dtype]) for start, end, dtype in tensor_spans(path)
                  if dtype in FLOAT_WIDTHS)


def tensor_spans(path: str | os.PathLike) -> list[tuple[int, int, str]]:
    """(start, end, dtype) in the file of every non-empty tensor of a safetensors-format file, in order."""
    path = Path(path)
    with open_checked(path.parent, path.name, 1 << 62, "shard") as f:
        n = header_length(os.pread(f.fd, 8, 0), f.size, str(path))
        header = parse_header(os.pread(f.fd, n, 8), f.size - 8 - n, str(path))
    spans = [(8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1], e["dtype"])
             for k, e in header.items() if k != "__metadata__"]
    return sorted(s for s in spans if s[1] > s[0])


def header_length(first8: bytes, size: int, source: str) -> int:
    if len(first8) < 8:
        raise CorruptCheckpointError(f"{source}: {size} bytes is too short to be a shard file")
    n = int.from_bytes(first8, "little")
    if n < 2 or n > size - 8 or n > MAX_HEADER:
        raise CorruptCheckpointError(f"{source}: header length {n} is impossible for a {size}-byte file")
    return n


def parse_header(raw: bytes, data_len: int, source: str) -> dict:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{source}: header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{source}: __metadata__ must map names to strings")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        spans.append(_check_entry(name, entry, data_len, source))
    spans.sort()
    for (_, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CorruptCheckpointError(f"{source}: tensors {n0!r} and {n1!r} overlap")
    return header


def _check_entry(name, entry, data_len, source):
    def bad(why):
        return CorruptCheckpointError(f"{source}: tensor {name!r}: {why}")
    if not isinstance(entry, dict):
        raise bad("index entry is not an object")
    itemsize = DTYPE_SIZES.get(entry.get("dtype"))
    if itemsize is None:
        raise bad(f"unknown dtype {entry.get('dtype')!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
        raise bad(f"invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise bad(f"invalid data_offsets {offsets!r}")
    start, end = offsets
    numel, extent = 1, 1
    for d in shape:
        numel *= d
        extent *= max(d, 1)
    if extent >= 2**62:  # torch computes strides from the nonzero dims: refuse before it overflows
        raise bad(f"shape {shape} is too large for any tensor")
    if not 0 <= start <= end <= data_len:
        raise bad(f"data_offsets {offsets} fall outside the {data_len}-byte data section")
    if end - start != numel * itemsize:
        raise bad(f"{end - start} bytes cannot hold shape {shape} of {entry['dtype']}")
    return (start, end, name)
