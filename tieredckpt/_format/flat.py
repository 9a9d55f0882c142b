"""The flat single-run format ``step_NNNNNN.bin`` and its conversions.

    [int32 step][int32 n_params][n x f32 weights][n x f32 Adam m][n x f32 Adam v]

little-endian, exactly ``8 + 12 * n`` bytes. Parameter order is the model's
``parameters()`` order. Conversions:

    model + AdamW  <-> FlatCheckpoint   (model_to_flat / flat_to_model)
    step_NNNNNN.bin <-> a run directory's checkpoint: _tiers/convert.py

Files are written atomically (sibling temp, fsync, rename, fsync dir), and a
read validates the header against the file size before touching any tensor.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointNotFoundError, FlatFormatError, UnsupportedStateError
from . import layout
from .atomic import atomic_write_chunks
from .memview import byte_view

_HEADER = struct.Struct("<ii")
_INT32_MAX = 2**31 - 1
FLAT_KEY = layout.FLAT_FILE_KEY  # marks a checkpoint converted from/to a flat file


@dataclass
class FlatCheckpoint:
    step: int
    weights: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor

    @property
    def n_params(self) -> int:
        """The number of parameters (of ``weights``)."""
        return self.weights.numel()


def flat_size(n_params: int) -> int:
    return _HEADER.size + 12 * n_params


def write_flat(path: str | os.PathLike, step: int, weights: torch.Tensor | Sequence[float], m: torch.Tensor | Sequence[float],
               v: torch.Tensor | Sequence[float]) -> None:
    """Write a flat checkpoint atomically. Arrays must be 1-D float32 of equal length."""
    arrays = [_as_f32(a, name) for a, name in ((weights, "weights"), (m, "m"), (v, "v"))]
    n = arrays[0].numel()
    if any(a.numel() != n for a in arrays):
        raise ValueError(f"weights, m and v differ in length: {[a.numel() for a in arrays]}")
    if type(step) is not int or not 0 <= step <= _INT32_MAX or n > _INT32_MAX:
        raise ValueError(f"step {step!r} and n_params {n} must fit a non-negative int32")
    # the old file or the complete new one, never a mix
    atomic_write_chunks(path, [_HEADER.pack(step, n), *(byte_view(a) for a in arrays if n)])


def read_flat(path: str | os.PathLike) -> FlatCheckpoint:
    """Read and validate a flat checkpoint; a bad file raises FlatFormatError naming it."""
    path = Path(path)
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such flat checkpoint") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise FlatFormatError(f"{path}: {size} bytes is shorter than the 8-byte header")
        step, n = _HEADER.unpack(head)
        if step < 0 or n < 0:
            raise FlatFormatError(f"{path}: header says step {step}, n_params {n}; both must be >= 0")
        if size != flat_size(n):
            raise FlatFormatError(
                f"{path}: {size} bytes, but n_params {n} needs exactly {flat_size(n)} (8 + 12 x n)"
                + ("; truncated?" if size < flat_size(n) else ""))
        data = torch.empty(3 * n, dtype=torch.float32)
        if n and f.readinto(byte_view(data)) != 12 * n:
            raise FlatFormatError(f"{path}: file shrank while being read")
    return FlatCheckpoint(step, data[:n], data[n:2 * n], data[2 * n:])


def _as_f32(a, name: str) -> torch.Tensor:
    t = torch.as_tensor(a)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    return t.detach().cpu().contiguous()


# ---- model + AdamW <-> flat -------------------------------------------------

def model_to_flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  step: int | None = None) -> FlatCheckpoint:
    """Flatten weights and AdamW's m, v in ``model.parameters()`` order.

    ``step`` defaults to AdamW's own step count (it must agree across parameters).
    Parameters not yet stepped contribute zeros for m and v.
    """
    params = _checked_params(model, optimizer)
    weights, ms, vs, counts = [], [], [], set()
    for _, p in params:
        state = optimizer.state.get(p, {})
        weights.append(p.detach().reshape(-1))
        ms.append(state["exp_avg"].reshape(-1) if "exp_avg" in state else torch.zeros(p.numel()))
        vs.append(state["exp_avg_sq"].reshape(-1) if "exp_avg_sq" in state else torch.zeros(p.numel()))
        counts.add(int(state["step"]) if "step" in state else 0)
    if step is None:
        if len(counts) > 1:
            raise ValueError(f"AdamW step counts differ across parameters {sorted(counts)}; pass step=")
        step = counts.pop() if counts else 0
    def cat(xs):
        return torch.cat([x.detach().cpu().float() for x in xs]) if xs else torch.zeros(0)

    return FlatCheckpoint(step, cat(weights), cat(ms), cat(vs))


def flat_to_model(flat: FlatCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load weights, m, v and the step count so that AdamW continues exactly."""
    params = _checked_params(model, optimizer)
    total = sum(p.numel() for _, p in params)
    if total != flat.n_params:
        raise FlatFormatError(f"checkpoint holds {flat.n_params} params, the model has {total}")
    offset = 0
    with torch.no_grad():
        for _, p in params:
            n = p.numel()
            p.copy_(flat.weights[offset:offset + n].view_as(p))
            state = optimizer.state[p]
            step_dtype = state["step"].dtype if "step" in state else _scalar_dtype()
            state["step"] = torch.tensor(float(flat.step), dtype=step_dtype)
            state["exp_avg"] = flat.m[offset:offset + n].view_as(p).clone().to(p.device)
            state["exp_avg_sq"] = flat.v[offset:offset + n].view_as(p).clone().to(p.device)
            offset += n


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _checked_params(model, optimizer) -> list[tuple[str, torch.nn.Parameter]]:
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise UnsupportedStateError("the flat format has no room for AMSGrad's max_exp_avg_sq")
    params = list(model.named_parameters())
    for name, p in params:
        if p.dtype != torch.float32:
            raise UnsupportedStateError(f"parameter {name!r} is {p.dtype}; the flat format holds float32 only")
        if id(p) not in in_optimizer:
            raise UnsupportedStateError(f"parameter {name!r} is not in the optimizer; the flat format needs m and v for every parameter")
    return params


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int | None = None) -> dict:
    """A checkpoint state holding the flat layout, convertible to ``step_NNNNNN.bin``."""
    flat = model_to_flat(model, optimizer, step)
    return {FLAT_KEY: {"step": flat.step, "weights": flat.weights, "m": flat.m, "v": flat.v}}
