"""Copying state off the live tensors into buffers that are reused across saves.

This copy is the only part of a save the training loop waits for. The buffers
are allocated on the first save (pinned when CUDA is present, so GPU -> CPU
copies are fast and asynchronous) and reused while shapes and dtypes stay the
same: on this kind of VM freshly touched memory costs ~10x a copy into memory
that is already ours (see shared/benchmarking.md).

One set of buffers exists; the store never stages again until the previous
write has finished with them (back-pressure: at most one staged copy).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .._format import tree
from .._format.tree import Staged


class Stager:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._pin = torch.cuda.is_available()

    def stage(self, state: Any) -> Staged:
        """Snapshot ``state`` (plain values by value, tensors into the reused buffers)."""
        skeleton, tensors, names = tree.flatten(to_state_dict(state))
        staged = []
        any_cuda = False
        with torch.no_grad():
            for i, t in enumerate(tensors):
                buf = self._buffer(i, t)
                buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
                any_cuda |= t.device.type == "cuda"
                staged.append(buf)
        if any_cuda:
            torch.cuda.synchronize()  # the snapshot is complete before the loop goes on
        del self._buffers[len(tensors):]
        return Staged(skeleton, staged, names)

    def _buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        if i < len(self._buffers):
            buf = self._buffers[i]
            if buf.shape == t.shape and buf.dtype == t.dtype:
                return buf
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                          pin_memory=self._pin and t.device.type == "cuda")
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf


def to_state_dict(state: Any) -> Any:
    """Replace objects that have ``state_dict()`` (modules, optimizers, schedulers) by their state."""
    if isinstance(state, torch.Tensor):
        return state
    if hasattr(state, "state_dict") and callable(state.state_dict) and not isinstance(state, dict):
        return state.state_dict()
    if isinstance(state, dict):
        items = [(k, to_state_dict(v)) for k, v in state.items()]
        out = OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(to_state_dict(v) for v in state)
    return state
