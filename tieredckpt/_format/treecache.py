"""Reusing the last save's flatten while a state's structure has not changed.

Every save of a run usually has the same keys, containers, shapes, dtypes and aliasing (tied
weights, views); only tensor bytes and a few scalars (a learning rate, a step count) differ.
Flattening a state of 100,000 tensors from scratch costs ~0.5 s of the loop's time (a name,
a node, a storage lookup per tensor: tree.py); checking that nothing changed costs a fraction
of that, so a save whose structure repeats the last one takes the last one's skeleton, names
and tensor order, with only its scalars written in again.

What "unchanged" means, exactly (anything else is a full flatten, and a new :class:`Structure`):

- the same containers in the same order: each dict's type, keys and key types (``1`` and
  ``True`` compare equal but are stored differently), each list's or tuple's type and length,
  a tensor or a scalar at each leaf, the same depth;
- every tensor exactly a ``torch.Tensor`` (no DTensor, Parameter or other subclass: those take
  the full walk) with the same data pointer, storage offset, dtype, shape, strides and device,
  so the same tensors share the same storages (which decides tied tensors and views); where
  a storage is shared, also its size (which decides whether a tensor covers it: tree.py's
  views).

The :class:`Structure` returned with a reused flatten is the same object each time: the
writer keeps what depends only on the structure (the header's tensor entries) on it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from . import tree

_TENSOR, _SCALAR = 0, 1
_Tensor = torch.Tensor
_SCALARS = (type(None), bool, int, float, str)


class Structure:
    """One structure of state: its flatten's skeleton (whose scalar slots are rewritten per
    save), names and tensor order. ``header`` is the writer's to fill (shardfile.py)."""

    def __init__(self, sig: list, skeleton: Any, names: list[str], slots: list, pick: list[int],
                 meta: list, shared: list[tuple[int, int]]) -> None:
        self.sig, self.skeleton, self.names = sig, skeleton, names
        self.slots = slots  # (container, key) of each scalar leaf, in walk order
        self.pick = pick  # per stored tensor, where it first appears among the walk's tensors
        self.meta, self.shared = meta, shared
        self.header: Any = None


class FlattenCache:
    """The last structure a store's saves had; ``flatten`` reuses it when a state repeats it.

    A structure is kept once two saves in a row had it (the same signature and tensors), and
    reused from the third: a run that builds new tensors for every save never pays for keeping
    one. ``hits`` counts reuses."""

    def __init__(self) -> None:
        self._last: tuple[list, list | None] | None = None  # the last save's signature and tensors' metadata
        self._structure: Structure | None = None
        self.hits = 0

    def flatten(self, state: Any) -> tuple[Any, list[torch.Tensor], list[str], set[int], Structure | None]:
        """tree.flatten_with_pieces, and the Structure when it is kept (None: flattened afresh,
        and not kept)."""
        scanned = _scan(state)
        if scanned is None:  # something the quick walk does not know: the full walk decides
            self._last = self._structure = None
            return (*tree.flatten_with_pieces(state), None)
        sig, tensors, scalars = scanned
        # The tensors' metadata is read on a run's first save and where the signature repeats:
        # a run whose structure changes at every save pays for the signature alone.
        meta = _meta(tensors) if self._last is None or sig == self._last[0] else None
        known = self._structure
        if known is not None and meta is not None and meta == known.meta and _same_storages(tensors, known):
            self.hits += 1
            for (container, key), value in zip(known.slots, scalars):
                container[key] = tree._check_scalar(value)
            return known.skeleton, [tensors[p] for p in known.pick], known.names, set(), known
        skeleton, stored, names, pieces = tree.flatten_with_pieces(state)
        repeated = meta is not None and self._last is not None and meta == self._last[1]
        self._last, self._structure = (sig, meta), None
        if repeated and meta is not None and not pieces:
            self._structure = _structure_of(sig, skeleton, names, tensors, meta)
        return skeleton, stored, names, pieces, self._structure


def _scan(state: Any) -> tuple[list, list[torch.Tensor], list] | None:
    """(signature, tensors, scalars) of ``state`` in walk order; None where it holds anything
    but exact tensors, scalars, dicts, lists and tuples, or nests too deeply."""
    sig: list = []
    tensors: list[torch.Tensor] = []
    scalars: list = []
    if not isinstance(state, (dict, list, tuple, _Tensor)):
        return None  # a scalar alone has no slot to rewrite
    return (sig, tensors, scalars) if _scan_into(state, sig, tensors, scalars, 0) else None


def _scan_into(obj: Any, sig: list, tensors: list, scalars: list, depth: int) -> bool:
    if type(obj) is _Tensor:
        sig.append(_TENSOR)
        tensors.append(obj)
        return True
    if isinstance(obj, _SCALARS):
        sig.append(_SCALAR)
        scalars.append(obj)
        return True
    if depth > tree._MAX_DEPTH or isinstance(obj, _Tensor):
        return False
    if isinstance(obj, dict):
        sig += (type(obj), tuple(obj), tuple(map(type, obj)))
        for value in obj.values():
            if type(value) is _Tensor:  # the usual value, without a call
                sig.append(_TENSOR)
                tensors.append(value)
            elif not _scan_into(value, sig, tensors, scalars, depth + 1):
                return False
        if isinstance(obj, tree.OrderedDict):  # its _metadata is walked after its items, as tree.py does
            return _scan_into(getattr(obj, "_metadata", None), sig, tensors, scalars, depth + 1)
        return True
    if isinstance(obj, (list, tuple)):
        sig += (type(obj), len(obj))
        return all(_scan_into(v, sig, tensors, scalars, depth + 1) for v in obj)
    return False


def _meta(tensors: list[torch.Tensor]) -> list | None:
    """What decides a tensor's place in a skeleton: pointer, offset, dtype, shape, strides,
    device; None where a tensor has no such (a layout without strides: the full walk names it)."""
    try:
        return [(t.data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride(), t.device) for t in tensors]
    except (RuntimeError, NotImplementedError):
        return None


def _same_storages(tensors: list[torch.Tensor], known: Structure) -> bool:
    """The shared storages' sizes are still those the structure was made with."""
    return all(tensors[p].untyped_storage().nbytes() == n for p, n in known.shared)


def _structure_of(sig: list, skeleton: Any, names: list[str], tensors: list[torch.Tensor],
                  meta: list) -> Structure:
    """The Structure of a skeleton just made from ``tensors`` (the walk's, in order)."""
    slots: list = []
    leaves: list[dict] = []
    _collect(skeleton, slots, leaves)
    pick: dict[int, int] = {}
    for position, node in enumerate(leaves):
        if "@t" in node:
            pick.setdefault(node["@t"], position)
    keys = [(m[5], m[0] - m[1] * t.element_size(), m[2]) for m, t in zip(meta, tensors)]  # storages
    counts = Counter(keys)
    shared = [(p, tensors[p].untyped_storage().nbytes()) for p, k in enumerate(keys) if counts[k] > 1]
    if len(leaves) != len(tensors) or sorted(pick) != list(range(len(names))):
        raise AssertionError("the skeleton does not mirror the state's walk")  # a bug here, not bad input
    return Structure(sig, skeleton, names, slots, [pick[i] for i in range(len(names))], meta, shared)


def _collect(node: dict, slots: list, leaves: list) -> None:
    """The scalar slots and tensor leaves of a skeleton, in the order _scan walks the state
    (dict values in order, then an OrderedDict's metadata; list items in order)."""
    if "@t" in node or "@v" in node:
        leaves.append(node)
        return
    if "@d" in node or "@o" in node:
        for pair in node["@d"] if "@d" in node else node["@o"]:
            _child(pair, 1, slots, leaves)
        if "@o" in node:
            _child(node, "m", slots, leaves)
        return
    seq = node["@l"] if "@l" in node else node["@u"]
    for i in range(len(seq)):
        _child(seq, i, slots, leaves)


def _child(container: Any, key: Any, slots: list, leaves: list) -> None:
    if isinstance(container[key], dict):
        _collect(container[key], slots, leaves)
    else:
        slots.append((container, key))
