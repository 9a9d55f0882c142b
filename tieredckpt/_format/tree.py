"""Turning nested state into (a JSON skeleton, a list of tensors) and back.

The skeleton is plain JSON; tensors are replaced by ``{"@t": index}``. Container
types and dict key types survive the round trip: an optimizer's ``{0: ...}``
comes back with int keys, ``betas`` comes back as a tuple, a module's
``OrderedDict`` comes back with its ``_metadata``. Nothing is ever pickled, and
decoding only builds dicts, lists, tuples and the tensors it is handed.

    node := null | bool | int | float | str
          | {"@t": i}                       tensor number i (two leaves may name one tensor:
                                            tied weights, stored once, restored as one)
          | {"@v": [i, offset, shape, stride]}   a view of tensor i, which covers its whole
                                            storage (offset and strides in its elements):
                                            stored once, restored as a view of it
          | {"@l": [node, ...]}             list
          | {"@u": [node, ...]}             tuple
          | {"@d": [[key, node], ...]}      dict, key is a JSON scalar
          | {"@o": [[key, node], ...], "m": node}   OrderedDict (+ _metadata)
          | {"@p": {...}}                   a DTensor's piece (pieces.py)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError
from .pieces import PIECE_TAG, Chunk, describe, is_dtensor

_SCALARS = (type(None), bool, int, float, str)
_MAX_DEPTH = 200


@dataclass
class Staged:
    """A flattened state: its JSON skeleton, its tensors, a name per tensor. The store's staging
    copy is one (tensors owned by the stager); a shard is written from one. ``handoff``: the
    store's copy is still running while its writer starts, and the writer takes the bytes from
    it (see _loop/handoff.py); None: the tensors hold them already."""
    skeleton: Any
    tensors: list[torch.Tensor]
    names: list[str]
    handoff: Any = None
    pieces: set[int] | None = None  # the tensors that are DTensor pieces, where the walk said (None: unknown)
    structure: Any = None  # a treecache.Structure: the same object for every save of one structure

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def flatten(state: Any) -> tuple[Any, list[torch.Tensor], list[str]]:
    """Split ``state`` into a JSON skeleton, its tensors, and a readable name per tensor."""
    skeleton, tensors, names, _ = flatten_with_pieces(state)
    return skeleton, tensors, names


def flatten_with_pieces(state: Any) -> tuple[Any, list[torch.Tensor], list[str], set[int]]:
    """:func:`flatten`, and the indices of the tensors that are DTensor pieces (known from the
    walk: finding them again in the skeleton costs a second walk of it, 5 us a tensor)."""
    flat = _Flattener()
    skeleton = flat.walk(state, ())
    flat.make_views()
    pieces = {n["t"] for n in flat.piece_nodes if n.get("t") is not None}
    return skeleton, flat.tensors, flat.names, pieces


class _Flattener:
    """The walk of :func:`flatten` (a class, not a recursive closure: a closure that calls
    itself is a reference cycle, and would keep the tensors alive until the GC runs)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self.used: set[str] = set()
        self.aliases: dict[tuple, int] = {}  # in storages met twice: the same view -> its index
        self.nodes: list[list[dict]] = []  # per tensor, the skeleton nodes naming it
        self.storages: dict[tuple, list[int]] = {}  # (device or None, storage address, dtype) -> its tensors
        self.piece_nodes: list[dict] = []  # the DTensor piece nodes met (their "t" is renumbered with the rest)

    def name_for(self, path: tuple) -> str:
        base = "/".join(map(str, path)) or "tensor"
        name, n = base, 1
        while name in self.used:
            name, n = f"{base}#{n}", n + 1
        self.used.add(name)
        return name

    def walk(self, obj: Any, path: tuple) -> Any:
        if len(path) > _MAX_DEPTH:
            raise UnsupportedStateError(f"state nested deeper than {_MAX_DEPTH} levels at {_where(path)}")
        if type(obj) is torch.Tensor:  # the common leaf first: exactly a Tensor is no DTensor
            return self.tensor_node(obj, path)
        if is_dtensor(obj) or isinstance(obj, Chunk):  # before Tensor: a DTensor is one
            local, node = describe(obj, _where(path))
            node["t"] = None
            self.piece_nodes.append(node)
            if local is not None:  # a piece is never a view: it stays a tensor of its own
                self.tensors.append(local)
                self.names.append(self.name_for(path))
                self.nodes.append([node])
                node["t"] = len(self.tensors) - 1
            return {PIECE_TAG: node}
        if isinstance(obj, torch.Tensor):
            return self.tensor_node(obj, path)
        if isinstance(obj, _SCALARS):
            return _check_scalar(obj)
        if isinstance(obj, dict):
            items = [[_check_key(k, path), self.walk(v, path + (k,))] for k, v in obj.items()]
            if isinstance(obj, OrderedDict):
                meta = getattr(obj, "_metadata", None)
                return {"@o": items, "m": self.walk(meta, path + ("_metadata",))}
            return {"@d": items}
        if isinstance(obj, (list, tuple)):
            tag = "@u" if isinstance(obj, tuple) else "@l"
            return {tag: [self.walk(v, path + (i,)) for i, v in enumerate(obj)]}
        raise UnsupportedStateError(
            f"cannot store a {type(obj).__module__}.{type(obj).__qualname__} at {_where(path)}: "
            "state may hold tensors, None, bool, int, float, str, and lists/tuples/dicts of them "
            "(convert it, e.g. numpy arrays with torch.from_numpy)"
        )

    def tensor_node(self, t: torch.Tensor, path: tuple) -> dict:
        index = self.tensor(t, path)
        node = {"@t": index}
        self.nodes[index].append(node)  # make_views may turn it into a view of another tensor
        return node

    def tensor(self, t: torch.Tensor, path: tuple) -> int:
        """The index ``t`` is stored under: a tensor seen before (tied weights) keeps its own.

        Tensors are grouped by storage (``make_views`` needs that anyway); only in a storage
        met before is the full view (offset, shape, strides) compared, through ``aliases``:
        the usual tensor, alone in its storage, costs one dict lookup, not a key of seven."""
        group_key = _storage_key(t)
        if group_key is None:
            return self._append(t, path)
        group = self.storages.get(group_key)
        if group is None:  # the usual tensor: alone in its storage so far
            index = self._append(t, path)
            self.storages[group_key] = [index]
            return index
        if len(group) == 1:  # this storage again (tied weights, or a view of it): key the first one too
            self.aliases[_view_key(group_key, self.tensors[group[0]])] = group[0]
        key = _view_key(group_key, t)
        if key in self.aliases:  # tied weights: stored once, restored shared
            return self.aliases[key]
        index = self._append(t, path)
        self.aliases[key] = index
        group.append(index)
        return index

    def _append(self, t: torch.Tensor, path: tuple) -> int:
        self.tensors.append(t)
        self.names.append(self.name_for(path))
        self.nodes.append([])
        return len(self.tensors) - 1

    def make_views(self) -> None:
        """Tensors viewing the storage of another tensor of the state that covers all of it,
        contiguous from its start (a slice, a transpose or a reshape saved beside its base),
        become ``{"@v": ...}`` nodes of that base and leave the list of tensors: their bytes
        are the base's. In a state without such, this is one pass over a dict."""
        gone: set[int] = set()
        for indices in self.storages.values():
            if len(indices) < 2:
                continue
            base = next((i for i in indices if _covers_storage(self.tensors[i])), None)
            for i in indices if base is not None else ():
                if i != base:
                    t = self.tensors[i]
                    for node in self.nodes[i]:
                        node.clear()
                        node["@v"] = [base, t.storage_offset(), list(t.shape), list(t.stride())]
                    gone.add(i)
        if gone:
            self._compact(gone)

    def _compact(self, gone: set[int]) -> None:
        """Drop the tensors in ``gone`` and renumber every node."""
        keep = [i for i in range(len(self.tensors)) if i not in gone]
        new = {old: n for n, old in enumerate(keep)}
        for old in keep:
            for node in self.nodes[old]:
                node["@t" if "@t" in node else "t"] = new[old]  # a piece's node numbers it as "t"
        for old in gone:
            for node in self.nodes[old]:
                node["@v"][0] = new[node["@v"][0]]
        self.tensors = [self.tensors[i] for i in keep]
        self.names = [self.names[i] for i in keep]
        self.nodes = [self.nodes[i] for i in keep]


Fetch = Callable[[int, tuple], Any]
OnPiece = Callable[[tuple, dict], Any]


def _storage_key(t: torch.Tensor) -> tuple | None:
    """The storage a tensor views, with its dtype: (device, or None on the CPU, address, dtype).
    None where a storage has no address to compare (empty, meta) or a layout has no one storage.
    Called once per tensor of every save: its reads are the cheap ones (``t.device`` makes an
    object)."""
    if t.layout is not _STRIDED or t.is_meta or t.numel() == 0:
        return None  # sparse and other layouts are refused later, by name
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return (None if t.is_cpu else t.device, ptr, t.dtype)


def _view_key(group_key: tuple, t: torch.Tensor) -> tuple:
    """What makes two tensors the same bytes: one storage (``group_key``), viewed at the same
    offset with the same shape and strides (a state dict's tied weights are such pairs)."""
    return (group_key, t.storage_offset(), tuple(t.shape), t.stride())


_STRIDED = torch.strided


def _covers_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def unflatten(skeleton: Any, tensors: list[torch.Tensor] | Fetch, source: str = "checkpoint", *,
              count: int | None = None, on_piece: OnPiece | None = None) -> Any:
    """Rebuild the state from a skeleton read from ``source`` (untrusted) and its tensors.

    ``tensors`` is the list of tensors, or ``fetch(index, path)`` returning tensor
    ``index`` (of ``count``) for the leaf at ``path``. A DTensor piece node becomes
    ``on_piece(path, node)``; by default the piece this rank stored (or None)."""
    if not callable(tensors):
        listed = tensors
        tensors, count = (lambda i, path: listed[i]), len(listed)
    builder = _Builder(tensors, count or 0, source, on_piece)
    try:
        return builder.build(skeleton, ())
    except RecursionError as exc:
        raise builder.bad("nested too deeply") from exc


def piece_nodes(skeleton: Any) -> list[tuple[tuple, dict]]:
    """(path, node) of every DTensor piece in a skeleton (untrusted: malformed parts are skipped
    here and refused by unflatten)."""
    found: list[tuple[tuple, dict]] = []
    stack: list[tuple[Any, tuple]] = [(skeleton, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or len(path) > _MAX_DEPTH:
            continue
        if PIECE_TAG in node:
            found.append((path, node[PIECE_TAG]))
        for tag in ("@l", "@u"):
            if isinstance(node.get(tag), list):
                stack.extend((v, path + (i,)) for i, v in enumerate(node[tag]))
        for tag in ("@d", "@o"):
            if isinstance(node.get(tag), list):
                stack.extend((pair[1], path + (pair[0],)) for pair in node[tag]
                             if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _SCALARS))
    return found


class _Builder:
    """The walk of :func:`unflatten` (a class for the same reason as _Flattener)."""

    def __init__(self, fetch: Fetch, count: int, source: str, on_piece: OnPiece | None) -> None:
        self.fetch, self.count, self.source = fetch, count, source
        self.on_piece = on_piece  # never a bound method of self: a cycle would keep mapped tensors alive

    def bad(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: invalid state tree: {why}")

    def _index(self, index: Any) -> int:
        if type(index) is not int or not 0 <= index < self.count:
            raise self.bad(f"tensor reference {index!r} out of range (have {self.count})")
        return index

    def _stored_piece(self, path: tuple, node: dict) -> Any:
        index = node.get("t") if isinstance(node, dict) else None
        return None if index is None else self.fetch(self._index(index), path)

    def build(self, node: Any, path: tuple) -> Any:
        if len(path) > _MAX_DEPTH:
            raise self.bad(f"nested deeper than {_MAX_DEPTH} levels")
        if isinstance(node, _SCALARS):
            return node
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise self.bad(f"unexpected node {str(node)[:80]!r}")
        if "@t" in node:
            return self.fetch(self._index(node["@t"]), path)
        if "@v" in node:
            return self._view(node["@v"], path)
        if PIECE_TAG in node:
            if not isinstance(node[PIECE_TAG], dict):
                raise self.bad("piece node does not hold an object")
            if self.on_piece is None:
                return self._stored_piece(path, node[PIECE_TAG])
            return self.on_piece(path, node[PIECE_TAG])
        if "@l" in node or "@u" in node:
            seq = node.get("@l", node.get("@u"))
            if not isinstance(seq, list):
                raise self.bad("list node does not hold a list")
            out = [self.build(v, path + (i,)) for i, v in enumerate(seq)]
            return tuple(out) if "@u" in node else out
        if "@d" in node or "@o" in node:
            return self._dict(node, path)
        raise self.bad(f"unknown node tag {sorted(node)!r}")

    def _view(self, spec: Any, path: tuple) -> Any:
        """A view of a stored tensor, checked to lie inside it before it is made (untrusted)."""
        if not (isinstance(spec, list) and len(spec) == 4 and type(spec[1]) is int and
                all(isinstance(x, list) and len(x) <= 64 and all(type(v) is int and v >= 0 for v in x)
                    for x in spec[2:]) and len(spec[2]) == len(spec[3]) and spec[1] >= 0):
            raise self.bad(f"malformed view {str(spec)[:80]!r}")
        base = self.fetch(self._index(spec[0]), path)
        if not isinstance(base, torch.Tensor):  # a lazy reader's reference (DCP's writer makes no views)
            raise self.bad(f"a view of tensor {spec[0]} where tensors are read lazily")
        offset, shape, stride = spec[1], spec[2], spec[3]
        last = offset + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else offset - 1
        if not base.is_contiguous() or last >= base.numel():
            raise self.bad(f"a view of tensor {spec[0]} reaches element {last}, past its {base.numel()}")
        return base.as_strided(shape, stride, base.storage_offset() + offset)

    def _dict(self, node: dict, path: tuple) -> dict:
        pairs = node.get("@d", node.get("@o"))
        if not isinstance(pairs, list):
            raise self.bad("dict node does not hold a list of pairs")
        result = OrderedDict() if "@o" in node else {}
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _SCALARS)):
                raise self.bad(f"malformed dict entry {str(pair)[:80]!r}")
            result[pair[0]] = self.build(pair[1], path + (pair[0],))
        if "@o" in node and node.get("m") is not None:
            result._metadata = self.build(node["m"], path + ("_metadata",))  # type: ignore[attr-defined]
        return result


def _check_scalar(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and type(value) is not int:
        return int(value)  # IntEnum and friends: store the number
    if isinstance(value, float) and type(value) is not float:
        return float(value)  # numpy.float64 is a float subclass
    if isinstance(value, str) and type(value) is not str:
        return str(value)
    return value


def _check_key(key: Any, path: tuple) -> Any:
    if isinstance(key, _SCALARS):
        return _check_scalar(key)
    raise UnsupportedStateError(
        f"cannot store dict key {key!r} ({type(key).__name__}) at {_where(path)}: "
        "keys must be str, int, float, bool or None"
    )


def _where(path: tuple) -> str:
    return "/".join(str(p) for p in path) if path else "the top level"
