"""DTensors in a saved state: each rank stores its local piece and where it lies.

A DTensor (FSDP2 parameters and optimizer state, tensor-parallel weights) is saved
as a piece node in the state's skeleton (tree.py)::

    {"@p": {"g": global shape, "o": global offset, "s": local shape, "d": dtype,
            "t": tensor index | null}}

``t`` is null on the copies of a replicated piece that this rank does not write:
along every mesh dimension where the tensor is replicated, only coordinate 0
writes it, so a replicated tensor is stored once, not once per rank. Nothing
about the mesh itself is stored: a restore computes the pieces it wants from the
target's own mesh and placements and reads the saved pieces that overlap them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError
from .boxes import Box

PIECE_TAG = "@p"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


@dataclass
class Chunk:
    """A piece of a global tensor given explicitly (a DCP chunk): stored like a DTensor's."""
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


def is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and isinstance(obj, torch.Tensor)


def local_tensor(dt: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the attribute skips an autograd call per leaf)."""
    local = getattr(dt, "_local_tensor", None)
    return dt.to_local() if local is None else local


def describe(dt: Any, where: str) -> tuple[torch.Tensor | None, dict]:
    """(the local tensor this rank writes, or None; the piece node's fields) of a DTensor or Chunk."""
    if isinstance(dt, Chunk):
        return dt.tensor, _node(dt.global_shape, dt.offset, dt.tensor.shape, dt.tensor.dtype, where)
    layout = _layout(dt, where)
    local = local_tensor(dt)
    if tuple(local.shape) != layout[0]:
        raise UnsupportedStateError(f"{where}: local tensor {tuple(local.shape)} is not the {layout[0]} piece "
                                    f"its placements {dt.placements} describe (padded shards are not supported)")
    shape, offset, writes = layout
    return (local if writes else None), _node(dt.shape, offset, shape, local.dtype, where)


_LAYOUTS: dict = {}  # DTensor spec -> (local shape, global offset, writes): the same every save


def _layout(dt: Any, where: str) -> tuple[tuple, tuple, bool]:
    spec = getattr(dt, "_spec", None)
    if spec is not None and spec in _LAYOUTS:
        return _LAYOUTS[spec]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements, mesh = dt.placements, dt.device_mesh
    if any(p.is_partial() for p in placements):
        raise UnsupportedStateError(f"{where}: a DTensor with a Partial placement {placements} holds unreduced "
                                    "values; redistribute it (e.g. to Replicate) before saving")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedStateError(f"{where}: this rank is not in the DTensor's mesh {mesh}")
    shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    # along every mesh dimension where the tensor is replicated only coordinate 0 writes it
    writes = all(c == 0 for c, p in zip(coordinate, placements) if p.is_replicate())
    layout = (tuple(int(x) for x in shape), tuple(int(x) for x in offset), writes)
    if spec is not None:
        if len(_LAYOUTS) > 65536:
            _LAYOUTS.clear()
        _LAYOUTS[spec] = layout
    return layout


def _node(global_shape, offset, shape, dtype: torch.dtype, where: str) -> dict:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedStateError(f"{where}: a sharded tensor of dtype {dtype} cannot be stored")
    return {"g": [int(x) for x in global_shape], "o": [int(o) for o in offset], "s": [int(x) for x in shape],
            "d": name}


def piece_box(info: Any, source: str) -> tuple[Box, Box, torch.dtype]:
    """(the piece's box, the global tensor's box, dtype) from an untrusted piece node."""
    try:
        g, o, s, d = info["g"], info["o"], info["s"], info["d"]
        ok = all(isinstance(v, list) and all(type(x) is int and x >= 0 for x in v) for v in (g, o, s)) \
            and len(g) == len(o) == len(s) and d in _DTYPES \
            and all(a + b <= c for a, b, c in zip(o, s, g))
    except (TypeError, KeyError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"{source}: malformed DTensor piece {str(info)[:120]!r}")
    return Box(tuple(o), tuple(s)), Box((0,) * len(g), tuple(g)), _DTYPES[d]
