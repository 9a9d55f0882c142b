"""Bit-for-bit comparison of two states: what "restored exactly" means here.

Tensors must match in dtype, shape and every byte (so NaN payloads and -0.0
count); plain values must match in type and value; containers in type, length,
key order and key types.
"""

from __future__ import annotations

from typing import Any

import torch


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """A description of the first place where ``a`` and ``b`` differ, or None if identical."""
    where = path or "<root>"
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)):
        return f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        if a.numel() and not _bytes(a).equal(_bytes(b)):
            return f"{where}: tensor bytes differ"
        return None
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()) or [type(k) for k in a] != [type(k) for k in b]:
            return f"{where}: keys {list(a)[:8]} != {list(b)[:8]}"
        for key in a:
            diff = first_difference(a[key], b[key], f"{path}/{key!r}")
            if diff:
                return diff
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if a != b and not (isinstance(a, float) and a != a and b != b):
        return f"{where}: {a!r} != {b!r}"
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
