"""What a restore wants for each tensor: the targets' own sharding, read off live objects.

``Targets(into)`` looks at the objects a restore loads into:
  - a module: each entry of its ``state_dict()`` -- a DTensor (FSDP2, tensor
    parallel) wants its local box on its mesh, a plain tensor the whole tensor;
  - an optimizer: its state follows its parameters' sharding (``state/<i>/exp_avg``
    of parameter i is sharded as parameter i is), also when it has not stepped yet.

``want(path, global_shape)`` -> (box of the global tensor, wrap) or None (the whole
tensor, as a plain tensor). ``wrap`` turns the assembled local tensor into what the
target holds: a DTensor on the target's mesh with the target's placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._format.boxes import Box
from .._format.pieces import is_dtensor

Want = tuple[Box, Callable[[torch.Tensor], Any]]


class Targets:
    def __init__(self, into: dict | None = None) -> None:
        self._exact: dict[tuple, torch.Tensor] = {}
        self._params: dict[tuple, list[torch.Tensor]] = {}
        for key, obj in (into or {}).items():
            if isinstance(obj, torch.nn.Module):
                for name, value in obj.state_dict().items():
                    self._exact[(key, name)] = value
            elif isinstance(obj, torch.optim.Optimizer):
                self._params[(key, "state")] = [p for g in obj.param_groups for p in g["params"]]
        self.sharded = any(is_dtensor(v) for v in self._exact.values()) or \
            any(is_dtensor(p) for ps in self._params.values() for p in ps)

    def want(self, path: tuple, global_shape: tuple[int, ...]) -> Want | None:
        like = self._exact.get(path)
        if like is None and len(path) == 4 and path[:2] in self._params:
            params = self._params[path[:2]]
            like = params[path[2]] if type(path[2]) is int and 0 <= path[2] < len(params) else None
        if like is None or not is_dtensor(like) or tuple(like.shape) != tuple(global_shape):
            return None
        return dtensor_want(like)


def dtensor_want(like: torch.Tensor) -> Want:
    """The box ``like``'s rank holds of its global tensor, and how to wrap a local tensor like it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mesh, placements, shape, stride = like.device_mesh, like.placements, like.shape, like.stride()
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    box = Box(tuple(int(o) for o in offset), tuple(int(s) for s in local))

    def wrap(t: torch.Tensor) -> Any:
        return DTensor.from_local(t.to(like.device), mesh, placements, run_check=False, shape=shape, stride=stride)
    return box, wrap
