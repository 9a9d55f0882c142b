"""Resharding N -> M ranks over the flat parameter space: plan first, then move bytes.

ZeRO-style state: rank r owns elements ``[offset_r, offset_r + numel_r)`` of the
flattened parameters (the manifest's ``param_shard_offset`` / ``param_shard_numel``),
and holds, under the key ``"flat"``, one 1-D tensor of ``numel_r`` elements per
partitioned quantity (parameters, AdamW m, v, ...). Everything outside
``"flat"`` is replicated (step, hyperparameters) and must be equal on every rank.

    plan(src_spans, dst_spans)   -> [Copy(src_rank, src_start, dst_rank, dst_start, length)]
    reshard(states, src_spans, dst_world_size) -> (new states, new spans)

Planning is pure and checks that both layouts tile the same range exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._format import layout
from .._format.boxes import Box, cover
from .._format.compare import first_difference
from ..errors import UnsupportedStateError

FLAT_KEY = layout.PARTITIONED_KEY
Span = tuple[int, int]  # (offset, numel)


@dataclass(frozen=True)
class Copy:
    src_rank: int
    src_start: int  # element index inside the source shard
    dst_rank: int
    dst_start: int  # element index inside the destination shard
    length: int


def even_spans(total: int, world_size: int) -> list[Span]:
    """Split ``total`` elements over ``world_size`` ranks, the first ``total % world_size`` one larger."""
    if world_size < 1 or total < 0:
        raise ValueError(f"cannot split {total} elements over {world_size} ranks")
    base, extra = divmod(total, world_size)
    spans, offset = [], 0
    for rank in range(world_size):
        numel = base + (rank < extra)
        spans.append((offset, numel))
        offset += numel
    return spans


def check_tiling(spans: Sequence[Span], what: str) -> int:
    """The total size if ``spans`` (in rank order) tile ``[0, total)`` with no gap or overlap."""
    offset = 0
    for rank, (start, numel) in enumerate(spans):
        if start != offset or numel < 0:
            raise UnsupportedStateError(
                f"{what}: rank {rank} owns [{start}, +{numel}) but the flat space continues at {offset}; "
                "the spans must tile the flat parameter space in rank order")
        offset += numel
    return offset


def plan(src_spans: Sequence[Span], dst_spans: Sequence[Span]) -> list[Copy]:
    """Which element ranges of which source shard land where in which destination shard
    (the 1-D case of boxes.cover, the planner DTensor pieces use too)."""
    total = check_tiling(src_spans, "source layout")
    if check_tiling(dst_spans, "target layout") != total:
        raise UnsupportedStateError(f"source holds {total} elements, the target layout {sum(n for _, n in dst_spans)}")
    sources = [Box((start,), (numel,)) for start, numel in src_spans]
    copies = []
    for d, (start, numel) in enumerate(dst_spans):
        for s, part in cover(sources, Box((start,), (numel,)), "flat parameter space"):
            copies.append(Copy(s, part.offset[0] - src_spans[s][0], d, part.offset[0] - start, part.shape[0]))
    return copies


def reshard(states: Sequence[dict], src_spans: Sequence[Span], dst_world_size: int,
            dst_spans: Sequence[Span] | None = None) -> tuple[list[dict], list[Span]]:
    """Re-split ZeRO-style rank states from ``len(states)`` ranks to ``dst_world_size``."""
    if len(states) != len(src_spans):
        raise ValueError(f"{len(states)} states but {len(src_spans)} spans")
    total = check_tiling(src_spans, "source layout")
    dst_spans = list(dst_spans) if dst_spans is not None else even_spans(total, dst_world_size)
    copies = plan(src_spans, dst_spans)
    keys = _partitioned_keys(states, src_spans)
    replicated = _replicated(states)
    out = []
    for _, numel in dst_spans:
        flat = {k: torch.empty(numel, dtype=dtype) for k, dtype in keys.items()}
        out.append({**replicated, FLAT_KEY: flat})
    for c in copies:  # now just move bytes
        for key in keys:
            out[c.dst_rank][FLAT_KEY][key][c.dst_start:c.dst_start + c.length] = \
                states[c.src_rank][FLAT_KEY][key][c.src_start:c.src_start + c.length]
    return out, dst_spans


def _partitioned_keys(states, spans) -> dict[str, torch.dtype]:
    keys: dict[str, torch.dtype] = {}
    for rank, (state, (_, numel)) in enumerate(zip(states, spans)):
        flat = state.get(FLAT_KEY) if isinstance(state, dict) else None
        if not isinstance(flat, dict):
            raise UnsupportedStateError(f"rank {rank}: state has no '{FLAT_KEY}' dict of partitioned tensors; "
                                        "only ZeRO-style flat state can be resharded")
        names = {k: v.dtype for k, v in flat.items() if isinstance(v, torch.Tensor)}
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != numel:
                raise UnsupportedStateError(
                    f"rank {rank}: '{FLAT_KEY}/{key}' must be a 1-D tensor of {numel} elements "
                    f"(its param_shard_numel) to be resharded, got "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
        if rank == 0:
            keys = names
        elif names != keys:
            raise UnsupportedStateError(f"rank {rank}: partitioned tensors {sorted(names)} differ from rank 0's {sorted(keys)}")
    return keys


def _replicated(states) -> dict[str, Any]:
    first = {k: v for k, v in states[0].items() if k != FLAT_KEY}
    for rank, state in enumerate(states[1:], start=1):
        other = {k: v for k, v in state.items() if k != FLAT_KEY}
        diff = first_difference(first, other)
        if diff is not None:
            raise UnsupportedStateError(f"rank {rank}: replicated value {diff} differs from rank 0's, "
                                        "so it cannot be carried over to a new world size")
    return first
