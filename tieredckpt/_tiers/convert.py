"""Converting between the flat ``step_NNNNNN.bin`` file and a checkpoint in a run directory.

The flat format itself (reading, writing, model <-> flat) is _format/flat.py; this
module only moves a flat checkpoint into or out of a run directory, through the
local tier's commit protocol.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._format.flat import FLAT_KEY, read_flat, write_flat
from ..errors import UnsupportedStateError
from .local import LocalTier


def flat_to_checkpoint(flat_path: str | os.PathLike, run_dir: str | os.PathLike) -> int:
    """Convert ``step_NNNNNN.bin`` into a committed tieredckpt checkpoint; returns the step."""
    flat = read_flat(flat_path)
    state = {FLAT_KEY: {"step": flat.step, "weights": flat.weights, "m": flat.m, "v": flat.v}}
    LocalTier(run_dir).save(flat.step, [state], user={"converted_from": Path(flat_path).name})
    return flat.step


def checkpoint_to_flat(run_dir: str | os.PathLike, out_path: str | os.PathLike, step: int | None = None) -> int:
    """Write a checkpoint that holds flat state (see flat_to_checkpoint) as ``step_NNNNNN.bin``."""
    (state,) = LocalTier(run_dir, create=False).load(step, world_size=1)
    flat = state.get(FLAT_KEY) if isinstance(state, dict) else None
    if not isinstance(flat, dict) or not {"step", "weights", "m", "v"} <= set(flat):
        raise UnsupportedStateError(
            f"{run_dir}: step {step} does not hold flat state ('{FLAT_KEY}' with step, weights, m, v); "
            "save one with tieredckpt.flat_state(model, optimizer) or convert from a .bin")
    write_flat(out_path, flat["step"], flat["weights"], flat["m"], flat["v"])
    return flat["step"]
