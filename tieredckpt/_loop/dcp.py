"""torch.distributed.checkpoint (DCP) on the store's tiers.

    dcp.save(state, storage_writer=store.dcp_writer(step))
    dcp.async_save(state, storage_writer=store.dcp_writer(step))
    dcp.load(state, storage_reader=store.dcp_reader())          # newest step, any tier

DCP keeps its planners, ``get_state_dict``/``set_state_dict`` and ``Stateful``; the
store keeps the bytes. Each rank's ``write_data`` hands the items DCP planned for it
to ``store.save`` as one shard, so a DCP checkpoint is committed like any other
step: one atomic commit for all ranks (a rank that fails or dies commits nothing),
a checksummed manifest, ``latest``, rotation, upload, prefer-local restore and
fresh-machine restore. DCP's ``finish`` then has nothing left to do.

A rank's shard holds (no pickle anywhere)::

    {"dcp": {"version": 1,
             "tensors": [[fqn, piece], ...],   each chunk as a piece of its global tensor
             "bytes": [[fqn, value], ...],     non-tensor entries as plain values
             "mappings": [[fqn, path], ...]}}  DCP's planner data (flattened key paths)

DCP serializes non-tensor entries with ``torch.save``; the writer loads each back
with ``weights_only=True`` (plain values only) and stores the value, and the reader
serializes the stored value again for DCP's planner. Nothing read from a checkpoint
is unpickled: the planner only ever sees bytes made here from plain values.
"""

from __future__ import annotations

import functools
import io
import os
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageMeta, WriteResult

from .._format import tree
from .._format.boxes import Box
from .._format.pieces import Chunk, piece_box
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedStateError
from .restoring import latest_step
from .saving import commit_unstaged

if TYPE_CHECKING:
    from .parts import StoreParts

VERSION = 1


def _done(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class TieredWriter(StorageWriter):
    """A DCP storage writer that commits into ``store`` as step ``step``: made by
    ``store.dcp_writer(step)``, passed to ``dcp.save`` or ``dcp.async_save`` on every rank.

    :param store: the ``CheckpointStore``.
    :param step: the step number.
    :param extra: a plain tree kept beside this rank's entries (``read_extra`` returns it).
    :param user: JSON metadata for the manifest."""

    def __init__(self, store: StoreParts, step: int, extra: Any = None, user: dict | None = None) -> None:
        super().__init__()
        self.store, self.step, self.extra, self.user = store, step, extra, user
        self._mappings: dict = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._mappings = dict(plan.planner_data or {}) if isinstance(plan.planner_data, dict) else {}
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        tensors, values, results = [], [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise UnsupportedStateError(f"DCP entry {fqn!r}: the planner gave {type(data).__name__}, not bytes")
                values.append([fqn, _plain_value(data, fqn)])
                size = data.getbuffer().nbytes
            else:
                if not isinstance(data, torch.Tensor) or item.tensor_data is None:
                    raise UnsupportedStateError(f"DCP entry {fqn!r}: the planner gave {type(data).__name__}, not a tensor")
                chunk = item.tensor_data.chunk
                tensor = data.detach()
                if tuple(tensor.shape) != tuple(chunk.sizes):
                    raise UnsupportedStateError(f"DCP entry {fqn!r}: chunk of {tuple(chunk.sizes)} holds a tensor "
                                                f"of {tuple(tensor.shape)}")
                tensors.append([fqn, Chunk(tensor, tuple(item.tensor_data.size), tuple(chunk.offsets))])
                size = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        mappings = [[k, list(v)] for k, v in self._mappings.items()]
        state = {"dcp": {"version": VERSION, "tensors": tensors, "bytes": values, "mappings": mappings}}
        if self.extra is not None:  # a plain tree beside this rank's entries (TieredReader.read_extra)
            state["extra"] = self.extra
        commit_unstaged(self.store, self.step, state, self.user)  # every rank: one commit for the whole world
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # committed by every rank in write_data

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class TieredReader(StorageReader):
    """A DCP storage reader of ``store``'s step ``step``: made by ``store.dcp_reader()``,
    passed to ``dcp.load``.

    :param store: the ``CheckpointStore``.
    :param step: the step (default: the newest on any tier)."""

    def __init__(self, store: StoreParts, step: int | None = None) -> None:
        super().__init__()
        self.store, self.step = store, step
        self._stack: ExitStack | None = None
        self._chunks: dict[tuple, tuple[Any, dict]] = {}
        self._values: dict[str, Any] = {}
        self._extra: Any = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_extra(self) -> Any:
        """The plain tree a writer kept as ``extra`` (the lowest rank's that has one; None when
        none did), its tensors read and verified."""
        self.read_metadata()
        try:
            return _materialize(self._extra)
        finally:
            self._close()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._close()
        step = self.step if self.step is not None else latest_step(self.store)
        if step is None:
            raise CheckpointNotFoundError(f"{self.store.local.root}: no checkpoint on any tier to load")
        self._stack = ExitStack()
        try:
            files, where = self._stack.enter_context(self.store._restorer.opened_pieces(step))
            return self._index(files, where)
        except BaseException:
            self._close()
            raise

    def _index(self, files, where: str) -> Metadata:
        """Every rank's entries: chunks by (fqn, offsets), plain values, and DCP's planner data."""
        meta: dict[str, Any] = {}
        mappings: dict[str, tuple] = {}
        self._chunks, self._values, self._extra = {}, {}, None
        for f in files:
            saved = tree.unflatten(f.skeleton, functools.partial(_ref, f), str(f.path), count=len(f.names),
                                   on_piece=functools.partial(_piece, f))
            dcp = saved.get("dcp") if isinstance(saved, dict) else None
            if not isinstance(dcp, dict) or dcp.get("version") != VERSION:
                raise CorruptCheckpointError(f"{f.path}: not written by tieredckpt's DCP writer "
                                             "(restore it with store.restore instead)")
            if self._extra is None:
                self._extra = saved.get("extra")
            for fqn, (pf, node) in _pairs(dcp.get("tensors"), f):
                box, whole, dtype = piece_box(node, str(pf.path))
                entry = meta.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                                   torch.Size(whole.shape), []))
                if not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != whole.shape:
                    raise CorruptCheckpointError(f"{pf.path}: DCP entry {fqn!r} differs between ranks")
                key = (fqn, box.offset)
                if key not in self._chunks:
                    self._chunks[key] = (pf, node)
                    entry.chunks.append(ChunkStorageMetadata(torch.Size(box.offset), torch.Size(box.shape)))
            for fqn, value in _pairs(dcp.get("bytes"), f):
                meta.setdefault(fqn, BytesStorageMetadata())
                self._values[fqn] = value
            for fqn, path in _pairs(dcp.get("mappings"), f):
                mappings[fqn] = tuple(path) if isinstance(path, list) else path
        return Metadata(state_dict_metadata=meta, planner_data=mappings)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        if self._stack is None:
            self.read_metadata()
        try:
            # Every chunk the plan names is read and verified first, and only then copied into
            # the state DCP loads into: a bad chunk raises before any live tensor is touched.
            parts: dict[int, torch.Tensor] = {}
            values = {}
            for n, item in enumerate(plan.items):
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    if fqn not in self._values:
                        raise CorruptCheckpointError(f"DCP entry {fqn!r} is not in the checkpoint")
                    values[fqn] = _materialize(self._values[fqn])
                else:
                    parts[n] = self._part(fqn, tuple(item.storage_index.offset or ()), item)
            for n, item in enumerate(plan.items):
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    buffer = io.BytesIO()
                    torch.save(values[fqn], buffer)  # plain values, made here
                    buffer.seek(0)
                    planner.load_bytes(item, buffer)
                    continue
                target = planner.resolve_tensor(item).detach()
                if target.shape != parts[n].shape:
                    raise CorruptCheckpointError(f"DCP entry {fqn!r}: the plan wants {tuple(target.shape)}, "
                                                 f"the checkpoint holds {tuple(parts[n].shape)}")
                target.copy_(parts[n])
                planner.commit_tensor(item, target)
        finally:
            self._close()
        return _done(None)

    def _part(self, fqn: str, offset: tuple, item) -> torch.Tensor:
        """What a read item wants of a saved chunk: only the blocks it lies in are read, verified."""
        if (fqn, offset) not in self._chunks:
            raise CorruptCheckpointError(f"DCP entry {fqn!r}: no saved chunk at offset {offset}")
        f, node = self._chunks[(fqn, offset)]
        t = node.get("t")
        if type(t) is not int or not 0 <= t < len(f.names):
            raise CorruptCheckpointError(f"{f.path}: chunk of {fqn!r} names tensor {t!r}")
        box, _, dtype = piece_box(node, str(f.path))
        starts, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if len(starts) != len(box.shape) or any(s + n > b for s, n, b in zip(starts, lengths, box.shape)):
            raise CorruptCheckpointError(f"DCP entry {fqn!r}: the plan reads {lengths} at {starts} of a "
                                         f"{box.shape} chunk")
        want = Box(tuple(o + s for o, s in zip(box.offset, starts)), lengths)
        part = f.part(t, box, want)
        if part.dtype != dtype:
            raise CorruptCheckpointError(f"{f.path}: chunk of {fqn!r} is {part.dtype}, its entry says {dtype}")
        return part

    def _close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class _Ref:
    """A tensor of a shard file, read (and verified) only when a value holding it is loaded."""

    def __init__(self, file, index: int) -> None:
        self.file, self.index = file, index


def _ref(file, index: int, path: tuple) -> _Ref:
    return _Ref(file, index)


def _piece(file, path: tuple, node: dict) -> tuple:
    return file, node


def _pairs(value: Any, f) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                               for p in value):
        raise CorruptCheckpointError(f"{f.path}: malformed DCP entry list")
    return value


def _plain_value(data: io.BytesIO, fqn: str) -> Any:
    """A DCP byte entry (torch.save output) as the plain value it holds, or a clear refusal."""
    data.seek(0)
    try:
        value = torch.load(data, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - named in the refusal
        raise UnsupportedStateError(f"DCP entry {fqn!r} is not plain data ({type(exc).__name__}); tieredckpt "
                                    "stores nothing it would have to unpickle") from None
    tree.flatten(value)  # refuses what the pickle-free format cannot hold, naming where
    return value


def _materialize(value: Any) -> Any:
    """A stored plain value with its tensor references read (verified)."""
    if isinstance(value, _Ref):
        return value.file.tensor(value.index)
    if isinstance(value, dict):
        return type(value)((k, _materialize(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_materialize(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v) for v in value)
    return value
