"""Copying state off the live tensors into buffers that are reused across saves.

This copy is the only part of a save the training loop waits for, and the writer
starts beside it: what the writer reaches while the loop waits it reads from the
live tensors, uncopied (see handoff.py). The buffers
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
from typing import Any

import torch

from .._format.pieces import is_dtensor, local_tensor
from .._format.shardfile import STORED_DTYPES, write_order
from .._format.tree import Staged
from .._format.treecache import FlattenCache, Structure
from .handoff import Handoff

SMALL = 64 << 10  # bytes: tensors up to this size are staged side by side in one buffer


class Stager:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._flat: torch.Tensor | None = None  # the small tensors' buffer, in write order
        self._pin = torch.cuda.is_available()
        self._flattens = FlattenCache()
        self._fitted: Structure | None = None  # the structure the buffers, order and parts are for
        self._order: list[int] = []
        self._layout: tuple | None = None  # the handoff's parts, for a save of _fitted with nothing deferred

    def stage_split(self, state: Any, defer: set[int]) -> Snapshot:
        """A snapshot of ``state`` (plain values by value, tensors into the reused buffers), not
        yet copied: ``copy_now`` copies every tensor whose storage is not in ``defer`` (data
        pointers), ``copy_rest`` the deferred rest. Its ``staged`` may be handed to the writer
        before either runs (see handoff.py)."""
        skeleton, tensors, names, pieces, structure = self._flattens.flatten(to_state_dict(state))
        if structure is not None and structure is self._fitted:  # the last save's shapes and order
            fresh, order = set(), self._order
        else:
            order = write_order(skeleton, tensors, pieces)  # the order the writer reads them in
            fresh = self._fit_buffers(tensors, order)
            self._fitted, self._order, self._layout = structure, order, None
        later = {i for i in order if _storage(tensors[i]) in defer} if defer else set()
        layout = self._layout if not later else None
        snapshot = Snapshot(skeleton, tensors, list(self._buffers), names, order, later, fresh, pieces,
                            structure, layout, self._flat)
        if structure is not None and not fresh and not later:
            self._layout = snapshot.handoff.layout  # the same for every such save of it from now on
        return snapshot

    def _fit_buffers(self, tensors: list[torch.Tensor], order: list[int]) -> set[int]:
        """One buffer per tensor, the last save's where its shape and dtype still fit; the
        indices of those made new. The small tensors' buffers are views of one buffer, laid
        out in write order, so the writer takes runs of them as one part (handoff.py): made
        anew whenever one of them does not fit. One pass, one comparison per tensor (a state
        of 100,000 tensors pays per-tensor Python costs 100,000 times)."""
        old = self._buffers
        fits = [i < len(old) and old[i].shape == t.shape and old[i].dtype == t.dtype for i, t in enumerate(tensors)]
        small = {i for i, t in enumerate(tensors)
                 if t.dtype in STORED_DTYPES and t.numel() * t.element_size() <= SMALL}
        new: list[torch.Tensor | None] = [old[i] if fits[i] else None for i in range(len(tensors))]
        if not small:
            self._flat = None
        elif self._flat is None or not all(fits[i] for i in small):
            pin = self._pin and any(tensors[i].device.type == "cuda" for i in small)
            self._flat, views = _side_by_side(tensors, [i for i in order if i in small], pin)
            for i, view in views.items():
                new[i] = view
        fresh = {i for i in range(len(tensors)) if not fits[i] or (i in small and new[i] is not old[i])}
        for i, t in enumerate(tensors):
            if new[i] is None:
                new[i] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                     pin_memory=self._pin and t.device.type == "cuda")
        self._buffers = new
        return fresh


def _side_by_side(tensors: list[torch.Tensor], which: list[int], pin: bool) -> tuple[torch.Tensor, dict]:
    """One byte buffer holding a buffer for each of tensors ``which``, in that order, each at an
    offset aligned to its element size (in write order, widest first, that is no padding)."""
    offsets, end = {}, 0
    for i in which:
        size = tensors[i].element_size()
        offsets[i] = start = -(-end // size) * size
        end = start + tensors[i].numel() * size
    flat = torch.empty(end, dtype=torch.uint8, device="cpu", pin_memory=pin)
    views = {i: flat[start:start + tensors[i].numel() * tensors[i].element_size()]
             .view(tensors[i].dtype).view(tensors[i].shape) for i, start in offsets.items()}
    return flat, views


class Snapshot:
    """One save's staging copy: ``copy_now`` on save()'s thread, ``copy_rest`` (the deferred
    tensors) on the writer's; ``staged`` is written while they run (see handoff.py)."""

    def __init__(self, skeleton, tensors, buffers, names, order: list[int], later: set[int],
                 fresh: set[int], pieces: set[int] | None = None, structure: Structure | None = None,
                 layout: tuple | None = None, flat: torch.Tensor | None = None) -> None:
        self.handoff = Handoff(tensors, buffers, order, later, fresh, layout, flat)
        self._now = set(order) - later
        self._later = later
        self.staged = Staged(skeleton, buffers, names, handoff=self.handoff, pieces=pieces, structure=structure)
        self.settled = threading.Event()  # save() is done with it: copied, or failed, and its cost recorded

    @property
    def reads_live(self) -> bool:
        """Whether the writer may read live tensors (new buffers), so starts beside the copy."""
        return self.handoff.reads_live

    def copy_now(self) -> None:
        self.handoff.copy_now(self._now)

    def copy_rest(self) -> None:
        self.handoff.copy_all(self._later)


class Unstaged:
    """What the writer takes when there is no staging copy: the caller's own tensors, unchanged
    until the commit (the DCP writer)."""

    reads_live = False

    def __init__(self, staged: Staged) -> None:
        self.staged = staged
        self.settled = threading.Event()
        self.settled.set()

    def copy_rest(self) -> None:
        pass


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
    if isinstance(state, dict):  # a tensor value needs no call (100,000 of them: 20 ms)
        items = [(k, v if type(v) is _Tensor else to_state_dict(v)) for k, v in state.items()]
        out = OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(v if type(v) is _Tensor else to_state_dict(v) for v in state)
    return state


_Tensor = torch.Tensor
