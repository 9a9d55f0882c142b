"""Capture and restore every global random generator a training run draws from.

Python's ``random``, NumPy's legacy global generator (when NumPy is installed),
torch's CPU generator and every CUDA device's generator (when present). Saving
this beside the model makes a resumed run replay the same dropout masks and
the same data order. Everything is stored as plain values and tensors.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """Every global generator's state (Python, NumPy when installed, torch CPU, each CUDA
    device) as plain values and tensors, to save beside the model; ``restore_rng`` puts it back."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured; generators absent here are skipped."""
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value):
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy
