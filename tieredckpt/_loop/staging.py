"""Copying state off the live tensors into buffers that are reused across saves.

This copy is the only part of a save the training loop waits for. The buffers
are allocated on the first save (pinned when CUDA is present, so GPU -> CPU
copies are fast and asynchronous) and reused while shapes and dtypes stay the
same: on this kind of VM freshly touched memory costs ~10x a copy into memory
that is already ours (see shared/benchmarking.md).

One set of buffers exists; the store never stages again until the previous
write has finished with them (back-pressure: at most one staged copy).

Overlapped staging (``save(..., overlap=True)``) splits the copy: what an
optimizer in the state owns -- its parameters and its state tensors, which only
its ``step()`` changes -- is copied on the writer thread while the loop runs the
next forward and backward; everything else (buffers such as BatchNorm's running
statistics, which a forward pass changes, RNG state, plain values) is copied at
once. A step pre-hook on each such optimizer holds its next ``step()`` until the
deferred copy is done, so the checkpoint is exactly the state at the saved step.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .._format import tree
from .._format.pieces import is_dtensor, local_tensor
from .._format.tree import Staged


class Stager:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._pin = torch.cuda.is_available()

    def stage_split(self, state: Any, defer: set[int]) -> tuple[Staged, Callable[[], None]]:
        """Snapshot ``state`` (plain values by value, tensors into the reused buffers): every
        tensor whose storage is not in ``defer`` (data pointers) now; return the snapshot
        and the function that copies the deferred rest into it."""
        skeleton, tensors, names = tree.flatten(to_state_dict(state))
        buffers = [self._buffer(i, t) for i, t in enumerate(tensors)]
        del self._buffers[len(tensors):]
        later = [i for i, t in enumerate(tensors) if t.untyped_storage().data_ptr() in defer] if defer else []
        now = sorted(set(range(len(tensors))) - set(later))
        _copy(buffers, tensors, now)
        return Staged(skeleton, buffers, names), lambda: _copy(buffers, tensors, later)

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


def _copy(buffers: list[torch.Tensor], tensors: list[torch.Tensor], which: list[int]) -> None:
    any_cuda = False
    with torch.no_grad():
        for i in which:
            buffers[i].copy_(tensors[i].detach(), non_blocking=tensors[i].device.type == "cuda")
            any_cuda |= tensors[i].device.type == "cuda"
    if any_cuda:
        torch.cuda.synchronize()  # the snapshot is complete before anyone may change the sources


class StepHold:
    """Holds ``step()`` of the optimizers found in saved states while a deferred copy runs.

    One pre-hook per optimizer, registered on its first overlapped save and kept until
    ``release_all`` (removing a hook from another thread could race ``step()`` iterating
    them). Outside a deferred copy the hook costs one Event check."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def owned(self, state: Any) -> set[int]:
        """Storage pointers of what the optimizers in ``state`` own (parameters, their state);
        each such optimizer gets its hook."""
        owned: set[int] = set()
        for opt in _optimizers(state):
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(self._hold)
            for group in opt.param_groups:
                owned |= {_storage(p) for p in group["params"]}
            for per_param in opt.state.values():
                owned |= {_storage(v) for v in per_param.values() if isinstance(v, torch.Tensor)}
        return owned

    def hold(self) -> None:
        self._idle.clear()

    def release(self) -> None:
        self._idle.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    def release_all(self) -> None:
        self._idle.set()
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks = weakref.WeakKeyDictionary()

    def _hold(self, optimizer, args, kwargs) -> None:
        self._idle.wait()


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's bytes live: a DTensor (FSDP2) is saved as its local piece."""
    return (local_tensor(t) if is_dtensor(t) else t).untyped_storage().data_ptr()


def _optimizers(state: Any) -> list:
    """The optimizer objects a state holds (before state_dict()), found where a state nests."""
    if isinstance(state, torch.optim.Optimizer):
        return [state]
    if isinstance(state, dict):
        return [o for v in state.values() for o in _optimizers(v)]
    if isinstance(state, (list, tuple)):
        return [o for v in state for o in _optimizers(v)]
    return []


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
