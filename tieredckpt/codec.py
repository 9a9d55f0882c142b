"""Codecs for bytes sent to the remote tier: raw, zstd, and float-aware zstd.

``zstd-planes`` is tuned for fp32 weights and AdamW state. Each little-endian
float32 is 4 bytes; nearly all of the redundancy is in the top byte (sign and
7 exponent bits), the three mantissa-heavy bytes are close to random. So the
top bytes are gathered into one plane and zstd-compressed, and the other three
are stored as they are: the same ratio as compressing every plane (1.16-1.25x
measured here) for a quarter of the zstd work. Frame layout:

    [u64 LE length of compressed top plane][zstd(top plane)][low 3 bytes x n][tail < 4 bytes]

Every codec is a pure function of its input; decoding checks sizes and maps
zstd errors to CorruptCheckpointError naming the object.
"""

from __future__ import annotations

import struct
import warnings

import torch
import zstandard

from .errors import CorruptCheckpointError
from .memview import byte_view

CODECS = ("raw", "zstd", "zstd-planes")
_LEN = struct.Struct("<Q")


def encode(raw: torch.Tensor, codec: str, level: int = 1) -> bytes:
    """Encode a contiguous uint8 tensor (e.g. a slice of a mapped shard file)."""
    if codec == "raw":
        return bytes(byte_view(raw))
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=level).compress(byte_view(raw))
    if codec == "zstd-planes":
        return _encode_planes(raw, level)
    raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")


def decode(stored: bytes, codec: str, raw_size: int, source: str) -> bytes | bytearray:
    """The raw bytes of one stored object; raises CorruptCheckpointError if they cannot be."""
    try:
        if codec == "raw":
            out = stored
        elif codec == "zstd":
            out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_size)
        elif codec == "zstd-planes":
            out = _decode_planes(stored, raw_size, source)
        else:
            raise CorruptCheckpointError(f"{source}: unknown codec {codec!r}")
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{source}: cannot decompress ({exc})") from None
    if len(out) != raw_size:
        raise CorruptCheckpointError(f"{source}: decodes to {len(out)} bytes, expected {raw_size}")
    return out


def _encode_planes(raw: torch.Tensor, level: int) -> bytes:
    n = raw.numel() // 4
    words = raw[:4 * n].view(n, 4)
    top = byte_view(words[:, 3].contiguous())
    low = byte_view(words[:, :3].contiguous())
    packed = zstandard.ZstdCompressor(level=level).compress(top)
    return b"".join((_LEN.pack(len(packed)), packed, low, bytes(byte_view(raw[4 * n:]))))


def _decode_planes(stored: bytes, raw_size: int, source: str) -> bytearray:
    n = raw_size // 4
    if len(stored) < _LEN.size:
        raise CorruptCheckpointError(f"{source}: truncated plane frame")
    (packed_len,) = _LEN.unpack_from(stored)
    body = memoryview(stored)[_LEN.size:]
    if packed_len > len(body) or len(body) - packed_len != 3 * n + raw_size % 4:
        raise CorruptCheckpointError(f"{source}: plane frame sizes do not add up")
    top = zstandard.ZstdDecompressor().decompress(body[:packed_len], max_output_size=n)
    if len(top) != n:
        raise CorruptCheckpointError(f"{source}: top plane has the wrong length")
    out = bytearray(raw_size)
    if n:
        words = torch.frombuffer(out, dtype=torch.uint8, count=4 * n).view(n, 4)
        words[:, 3] = _read_only_view(top, 0, n)
        words[:, :3] = _read_only_view(stored, _LEN.size + packed_len, 3 * n).view(n, 3)
    out[4 * n:] = body[packed_len + 3 * n:]
    return out


def _read_only_view(data: bytes, offset: int, count: int) -> torch.Tensor:
    """A uint8 tensor over immutable bytes, without copying; only ever read from."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we never write to it
        return torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=count)
