"""PyTorch Lightning on the tiers (``pip install tieredckpt[lightning]``).

    from tieredckpt.lightning import TieredCheckpointIO, TieredModelCheckpoint
    trainer = Trainer(plugins=[TieredCheckpointIO(remote="s3://bucket/runs/x")],
                      callbacks=[TieredModelCheckpoint(save_last=True, every_n_train_steps=100)])
    trainer.fit(model, ckpt_path="last")          # resumes on a fresh machine too

Every checkpoint Lightning saves goes through the store: pickle-free (tensors in shard
files, everything else plain values), atomic, verified, written in the background and
uploaded. Lightning still sees one file per checkpoint under the name it chose
(``epoch=1-step=200.ckpt``, ``last.ckpt``): a *pointer* of a few bytes of JSON naming
the store's step, so that ``ModelCheckpoint``'s naming, ``save_top_k``, ``monitor``,
``save_last`` (also ``"link"``) and ``ckpt_path="last"`` keep working. On a machine
whose checkpoint directory lacks them, ``TieredModelCheckpoint`` writes the pointers
back from the store (local or remote) before Lightning looks for ``last``.

Removing a checkpoint (``save_top_k``) removes its pointer only: the store's own
``keep_local`` and ``keep_remote`` decide what is deleted, so nothing the remote still
needs is ever removed by Lightning. SIGTERM (with ``TieredModelCheckpoint``): a
checkpoint at the next step boundary, committed, then Lightning stops and ``fit``
returns (exit 0); SIGUSR1: a checkpoint, and training goes on (on every rank when sent to one).

``ckpt_path="best"`` in a process that never trained: ``checkpoint.find_best(trainer)``
ranks the checkpoints any tier holds by the scores recorded when they were saved.
FSDP2 / tensor parallel: ``strategy=TieredModelParallelStrategy()`` sends Lightning's
distributed checkpoints through the store's DCP writer (restorable at any world size).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import stat
import warnings
from collections import OrderedDict
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from ._format.atomic import atomic_write_bytes, fsync_dir, fsync_file
from ._loop.signals import Requests
from ._loop.store import CheckpointStore, SaveHandle
from .errors import CheckpointNotFoundError, RemoteError, RemoteNotFoundError, UnsupportedStateError, warn_user

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["TieredCheckpointIO", "TieredModelCheckpoint", "TieredModelParallelStrategy", "load_checkpoint"]

log = logging.getLogger("tieredckpt")
STORE_DIR = ".tieredckpt"  # the store's run directory inside the checkpoint directory
POINTER_FORMAT = "tieredckpt-pointer"
MAX_POINTER = 4096
CLASS_KEY = "@tieredckpt.class"  # a class stored by name (only those in ALLOWED_CLASSES)
ALLOWED_CLASSES = {
    "builtins.dict": lambda: dict,
    "collections.OrderedDict": lambda: OrderedDict,
    "lightning.fabric.utilities.data.AttributeDict": lambda: _attribute_dict(),
}


def _attribute_dict():
    from lightning.fabric.utilities.data import AttributeDict
    return AttributeDict


# ---- the checkpoint dict as plain values --------------------------------------------------

def to_plain(value: Any, drop_unsupported: bool = False, where: str = "checkpoint") -> Any:
    """Lightning's checkpoint dict as what the store keeps: tensors, plain scalars, lists, tuples
    and dicts. Dict subclasses (AttributeDict, OmegaConf containers) become dicts, allow-listed
    classes (``hparams_type``) their names; anything else is an UnsupportedStateError naming its
    key, or dropped with a warning when ``drop_unsupported``."""
    if isinstance(value, (torch.Tensor, type(None), bool, int, float, str)):
        return value
    if isinstance(value, type):
        name = f"{value.__module__}.{value.__qualname__}"
        if name in ALLOWED_CLASSES:
            return {CLASS_KEY: name}
        return _unsupported(where, f"the class {name}", drop_unsupported)
    if _is_omegaconf(value):
        from omegaconf import OmegaConf
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            plain = to_plain(item, drop_unsupported, f"{where}[{key!r}]")
            if plain is not _DROPPED:
                out[key] = plain
        return out
    if isinstance(value, (list, tuple)):
        items = [to_plain(item, drop_unsupported, f"{where}[{i}]") for i, item in enumerate(value)]
        items = [item for item in items if item is not _DROPPED]
        return tuple(items) if isinstance(value, tuple) else items
    return _unsupported(where, f"a {type(value).__module__}.{type(value).__qualname__}", drop_unsupported)


_DROPPED = object()


def _unsupported(where: str, what: str, drop: bool) -> Any:
    message = (f"{where} holds {what}, which cannot be stored without pickle; store plain values "
               "(numbers, strings, lists, dicts, tensors) there, or pass TieredCheckpointIO(drop_unsupported=True) "
               "to leave such values out with a warning")
    if not drop:
        raise UnsupportedStateError(message)
    warnings.warn(f"{where}: {what} left out of the checkpoint (drop_unsupported=True)", RuntimeWarning, stacklevel=2)
    return _DROPPED


def _is_omegaconf(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("omegaconf") and type(value).__name__ in ("DictConfig", "ListConfig")


def from_plain(value: Any) -> Any:
    """The inverse of ``to_plain``: class names from the allow-list back to classes (nothing is
    imported by a name read from a checkpoint unless the allow-list holds it)."""
    if isinstance(value, dict):
        if set(value) == {CLASS_KEY} and value[CLASS_KEY] in ALLOWED_CLASSES:
            return ALLOWED_CLASSES[value[CLASS_KEY]]()
        return type(value)((k, from_plain(v)) for k, v in value.items())
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    return value


# ---- what the manifest says of a Lightning checkpoint ---------------------------------------

def lightning_user(checkpoint: dict[str, Any], path: Path) -> dict:
    """The manifest's ``user`` for a checkpoint: the file name Lightning gave it and, per monitored
    quantity, the score ModelCheckpoint recorded for it (what ``find_best`` ranks by)."""
    scores = {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(key, str) and "ModelCheckpoint" in key and isinstance(state, dict)):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if isinstance(monitor, str) and isinstance(score, (torch.Tensor, int, float)):
            value = float(score)
            if value == value and abs(value) != float("inf"):  # JSON holds finite numbers only
                scores[monitor] = value
    return {"lightning": {"file": path.name, "scores": scores}}


# ---- pointers -------------------------------------------------------------------------------

def write_pointer(path: Path, step: int, durable: bool = True) -> None:
    """Replace ``path`` with a pointer to ``step``, atomically. ``durable=False`` leaves the
    fsyncs to :func:`sync_pointer` (the plugin runs it once the step commits, off the loop: with
    the step's own write in flight an fsync here waits behind it). Until then a power loss may
    lose the pointer, never the step; TieredModelCheckpoint writes lost pointers back."""
    body = {"format": POINTER_FORMAT, "version": 1, "step": step, "store": STORE_DIR}
    atomic_write_bytes(path, (json.dumps(body) + "\n").encode(), durable)


def sync_pointer(path: Path) -> None:
    """Make a pointer written with ``durable=False`` durable (quietly: Lightning may have removed it)."""
    try:
        fsync_file(path)
        fsync_dir(path.parent)
    except OSError:
        pass


def read_pointer(path: Path) -> int | None:
    """The step a pointer names; None when ``path`` is not one of ours (a foreign .ckpt, or not a
    regular file: a FIFO planted under a checkpoint's name is never waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a symlink is followed: save_last="link" makes them
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, MAX_POINTER + 1)
    finally:
        os.close(fd)
    if len(head) > MAX_POINTER or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or type(doc.get("step")) is not int:
        return None
    return doc["step"]


# ---- the plugin ------------------------------------------------------------------------------

class TieredCheckpointIO(CheckpointIO):
    """Lightning's checkpoints through a :class:`~tieredckpt.CheckpointStore`.

    Use it with :class:`TieredModelCheckpoint` in place of Lightning's ``ModelCheckpoint``:
    only that one finds the store's steps on a machine whose checkpoint directory is empty.

    :param local: the store's run directory (default: ``.tieredckpt`` inside the directory of
        the first checkpoint path Lightning passes).
    :param remote: any fsspec URL (None: the local tier only).
    :param drop_unsupported: leave values that cannot be stored without pickle out of the
        checkpoint, with a warning, instead of refusing the save.
    :param store_options: passed to :class:`~tieredckpt.CheckpointStore` (``keep_local``,
        ``keep_remote``, ``remote_options``...)."""

    def __init__(self, local: str | os.PathLike | None = None, remote: str | None = None, *,
                 drop_unsupported: bool = False, **store_options: Any) -> None:
        self.local, self.remote, self.drop_unsupported = local, remote, drop_unsupported
        self.options = store_options
        self.store: CheckpointStore | None = None
        self.requests = Requests()
        self._handle: SaveHandle | None = None
        self._checked_start = False

    def store_for(self, directory: str | os.PathLike, distributed: bool = False) -> CheckpointStore:
        """The store (opened on first use) for checkpoints in ``directory``: rank 0 writes and the
        other ranks read, or, ``distributed`` (TieredModelParallelStrategy), every rank writes its shard.

        :param directory: the directory of Lightning's checkpoint paths.
        :param distributed: every rank writes its own shard."""
        if self.store is None or self.store._closed:
            self.store = CheckpointStore(self._local(directory), self.remote, **{
                "every": 0, "distributed": distributed, "read_only": not distributed and _rank() != 0,
                **self.options})
        return self.store

    def _local(self, directory: str | os.PathLike) -> Path:
        return Path(self.local) if self.local is not None else Path(directory) / STORE_DIR

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None) -> None:
        path = Path(path)
        store = self.store_for(path.parent)
        plain = to_plain(checkpoint, self.drop_unsupported)
        step = int(checkpoint.get("global_step", 0))
        if not self._checked_start:
            self._checked_start = True
            _warn_if_started_over(store, step)
        if step not in store.local.steps() and not self._is_pending(step):
            self._handle = store.save(step, plain, user=lightning_user(checkpoint, path))
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._handle is not None and self._is_pending(step):  # made durable once the step commits
            write_pointer(path, step, durable=False)  # (on the writer's thread)
            self._handle._future.add_done_callback(functools.partial(_sync_when_done, path))
        else:
            write_pointer(path, step)

    def _is_pending(self, step: int) -> bool:
        return self._handle is not None and self._handle.step == step

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        path = Path(path)
        step = read_pointer(path)
        if step is None:
            if weights_only is not True:
                raise UnsupportedStateError(
                    f"{path}: not a tieredckpt checkpoint (a torch.save file?); it is not unpickled. Load it "
                    "with weights_only=True to read its tensors and plain values only")
            return torch.load(path, map_location=map_location, weights_only=True)
        store = self.store_for(path.resolve().parent)
        self.wait()
        state = store.restore(step, mark_resume=False)
        if state is None:
            raise CheckpointNotFoundError(
                f"{path}: names step {step}, which no tier holds (a save killed before its commit, or a step "
                "retention removed); TieredModelCheckpoint repairs the pointers before ckpt_path='last' resolves")
        return from_plain(state)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove Lightning's pointer; the store's retention decides what data goes.

        :param path: the checkpoint path Lightning names."""
        path = Path(path)
        if path.is_symlink() or (path.is_file() and read_pointer(path) is not None):
            path.unlink()

    def wait(self) -> None:
        """Block until the pending save is committed (raises what failed)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()

    def teardown(self) -> None:
        if self.store is not None:
            self.wait()
            self.store.close(preempted=self.requests.stop_requested())  # SIGTERM: the newest step goes up
            self.store = None

    def restore_pointers(self, directory: str | os.PathLike, drop_uncommitted: bool = False) -> list[Path]:
        """Write back the pointer of every step the store holds (on any tier) that ``directory``
        lacks, under the file name it was saved as, and ``last.ckpt`` to the newest. Runs on every
        rank (Lightning resolves ``ckpt_path`` on each, before the process group exists): a reader
        lists the tiers, and ranks writing the same pointer each replace it atomically.
        ``drop_uncommitted`` (a run about to resume, no save of its own pending): remove pointers
        to steps newer than any tier holds, left by a save killed before its commit.

        :param directory: Lightning's checkpoint directory.
        :param drop_uncommitted: see above.
        :returns: the pointers written."""
        return self._restore(Path(directory), drop_uncommitted)[0]

    def _restore(self, directory: Path, drop_uncommitted: bool) -> tuple[list[Path], dict[int, dict]]:
        """restore_pointers, and what each held step's manifest says of it (each read once)."""
        with self._listing(directory) as store:
            infos = store.list() if store is not None else []
            if drop_uncommitted:
                _drop_newer(directory, infos[-1].step if infos else None)
            local = store.local.steps() if store is not None else []
            saved = {info.step: _saved(store, info.step, local) for info in infos}
            return _write_pointers(directory, saved), saved

    def _listing(self, directory: Path) -> CheckpointStore | nullcontext:
        """The open store, or a reader of the tiers (None when there is nothing anywhere yet)."""
        if self.store is not None and not self.store._closed:
            return nullcontext(self.store)
        reading = {k: v for k, v in self.options.items() if k in ("remote_options", "remote_fs")}
        local = self._local(directory)
        for remote in (self.remote, None):
            if remote is None and not local.is_dir():
                return nullcontext(None)  # a first run: nothing saved anywhere yet
            try:
                return CheckpointStore(local, remote, read_only=True, distributed=False, **reading)
            except RemoteNotFoundError:  # a file:// remote the first save will create: nothing there yet
                continue
        return nullcontext(None)


def _warn_if_started_over(store: CheckpointStore, step: int) -> None:
    """Warn when the first save of a process is of a step older than the newest the tiers hold:
    the run started over instead of resuming, which is what Lightning's own ``ModelCheckpoint``
    does on a machine whose checkpoint directory is empty."""
    if store.read_only:
        return
    try:
        newest = store.latest_step()
    except RemoteError:  # the remote's own warnings say so; this is only a hint
        return
    if newest is not None and newest > step:
        warn_user(f"{store.local.root}: this run saves step {step}, but the store already holds step {newest}: "
                  "it started over instead of resuming. To resume from the store on any machine, use "
                  "tieredckpt.lightning.TieredModelCheckpoint in place of ModelCheckpoint and fit(..., ckpt_path=\"last\")")


def _drop_newer(directory: Path, newest: int | None) -> None:
    """Pointers are written when a save starts, so a kill before its commit leaves one naming a
    step no tier holds: gone before the run resumes (only ours; a foreign .ckpt stays)."""
    for path in directory.glob(f"*{ModelCheckpoint.FILE_EXTENSION}") if directory.is_dir() else []:
        step = _pointed(path)
        if step is not None and (newest is None or step > newest):
            log.warning("%s names step %d, whose save did not commit: removed", path, step)
            path.unlink(missing_ok=True)


def _write_pointers(directory: Path, saved: dict[int, dict]) -> list[Path]:
    """The pointers ``directory`` lacks, under each step's saved name, and last.ckpt to the newest."""
    written = []
    for step, meta in saved.items():
        name = _file_name(meta)
        if name and not (directory / name).exists():
            directory.mkdir(parents=True, exist_ok=True)
            write_pointer(directory / name, step)
            written.append(directory / name)
    if saved:
        newest = max(saved)
        last = directory / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
        if not last.exists() or _pointed(last) != newest:
            directory.mkdir(parents=True, exist_ok=True)
            write_pointer(last, newest)  # a rename: replaces a symlink (save_last="link") itself
            written.append(last)
    return written


def _scores(saved: dict[int, dict], monitor: str) -> dict[int, tuple[float, str]]:
    """{step: (score, file name)} of the steps with a ``monitor`` score recorded."""
    found = {}
    for step, meta in saved.items():
        score, name = (meta.get("scores") or {}).get(monitor), _file_name(meta)
        if isinstance(score, (int, float)) and name:
            found[step] = (float(score), name)
    return found


def _pointed(path: Path) -> int | None:
    try:
        return read_pointer(path)
    except OSError:
        return None


def _sync_when_done(path: Path, future) -> None:
    sync_pointer(path)


def _saved(store: CheckpointStore, step: int, local_steps: list[int]) -> dict:
    """What the manifest of ``step`` says of it as a Lightning checkpoint ({} when nothing)."""
    try:
        if step in local_steps or store.remote is None:
            user = store.local.manifest(step).user
        else:
            user = store.remote.upload_manifest(step).shard_manifest.user
    except Exception:  # noqa: BLE001 - a name is a convenience; the step still restores
        return {}
    saved = user.get("lightning") if isinstance(user, dict) else None
    return saved if isinstance(saved, dict) else {}


def _file_name(saved: dict) -> str | None:
    name = saved.get("file")
    return name if isinstance(name, str) and "/" not in name and name not in ("", ".", "..") else None


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def load_checkpoint(path: str | os.PathLike, local: str | os.PathLike | None = None, remote: str | None = None,
                    **store_options: Any) -> dict:
    """The checkpoint dict a pointer names (what ``torch.load`` of a ``.ckpt`` would give), for
    code that reads checkpoints outside a Trainer: ``Model.load_state_dict(ckpt["state_dict"])``.

    :param path: the ``.ckpt`` pointer (it need not exist on this machine's disk: the store's
        steps are found on the remote too).
    :param local: the store's run directory (default: ``.tieredckpt`` beside ``path``).
    :param remote: the store's remote URL.
    :param store_options: passed to the store (``remote_options``...)."""
    io = TieredCheckpointIO(local, remote, read_only=True, **store_options)
    try:
        return io.load_checkpoint(path)
    finally:
        io.teardown()


# ---- the callback -----------------------------------------------------------------------------

class TieredModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that finds its checkpoints in the store, so ``ckpt_path="last"`` works on
    a machine whose checkpoint directory is empty, and that saves on SIGTERM / SIGUSR1 at the
    next step boundary. Takes ModelCheckpoint's arguments; needs TieredCheckpointIO as the
    Trainer's checkpoint plugin."""

    def _find_last_checkpoints(self, trainer) -> set[str]:
        directory = self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        _plugin(trainer).restore_pointers(directory, drop_uncommitted=True)
        return super()._find_last_checkpoints(trainer)

    def find_best(self, trainer: Trainer) -> str:
        """The best checkpoint any tier holds by this callback's ``monitor`` and ``mode`` (the
        scores recorded when each was saved), its pointer written back; also sets
        ``best_model_path``, so ``ckpt_path="best"`` works after it, in a process that never
        trained: ``trainer.test(model, ckpt_path=checkpoint.find_best(trainer))``.

        :param trainer: the Trainer whose strategy has ``TieredCheckpointIO`` as its plugin.
        :returns: the best checkpoint's path."""
        if self.monitor is None:
            raise ValueError("find_best ranks checkpoints by a score: use TieredModelCheckpoint(monitor=...)")
        directory = Path(self._ModelCheckpoint__resolve_ckpt_dir(trainer))
        _, saved = _plugin(trainer)._restore(directory, drop_uncommitted=False)
        scored = _scores(saved, self.monitor)
        if not scored:
            raise CheckpointNotFoundError(f"{directory}: no checkpoint on any tier has a {self.monitor!r} score")
        pick = min if self.mode == "min" else max
        step = pick(sorted(scored), key=lambda s: scored[s][0])
        self.best_model_path = str(directory / scored[step][1])
        return self.best_model_path

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        plugin = _plugin(trainer)
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            for signum in self._previous:  # Lightning's own SIGTERM handler is replaced while we train:
                signal.signal(signum, plugin.requests._handler(None))  # a save at a step boundary instead
        except ValueError:
            self._previous = {}
            log.warning("training off the main thread: SIGTERM/SIGUSR1 are not handled")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        requests = _plugin(trainer).requests
        save, stop = requests.save_requested(), requests.stop_requested()
        if trainer.world_size > 1:  # a signal to any one rank: every rank saves and stops
            save = trainer.strategy.reduce_boolean_decision(save, all=False)
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not save:
            return
        requests.clear_save()
        monitor = self._monitor_candidates(trainer)
        if self._last_global_step_saved != trainer.global_step:
            name = self.CHECKPOINT_NAME_LAST if self.save_last else None
            self._save_checkpoint(trainer, self.format_checkpoint_name(monitor, name))
        if stop:
            requests.request_stop()
            _plugin(trainer).wait()  # committed before fit returns
            trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for signum, handler in getattr(self, "_previous", {}).items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        super().on_train_end(trainer, pl_module)


def _plugin(trainer) -> TieredCheckpointIO:
    return _strategy_plugin(trainer.strategy, "TieredModelCheckpoint")


# ---- FSDP2 / tensor parallel -------------------------------------------------------------------

class TieredModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) with its distributed
    checkpoints on the tiers: every rank's pieces go through the store's DCP writer as one
    committed step (a rank that fails commits nothing), uploaded like any other, and restore at
    any world size, on a fresh machine too. Lightning's own sharded checkpoint is a directory of
    DCP files plus a ``torch.save`` pickle of the rest, written in place; here the rest is plain
    values kept beside rank 0's pieces and the file Lightning sees is a pointer.

        Trainer(strategy=TieredModelParallelStrategy(), plugins=[TieredCheckpointIO(remote=...)],
                callbacks=[TieredModelCheckpoint(...)])

    Takes ModelParallelStrategy's arguments. With ``save_distributed_checkpoint=False`` the
    gathered full state is saved by rank 0 through TieredCheckpointIO."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from torch.distributed.checkpoint import save
        plugin = _strategy_plugin(self)
        path = Path(self.broadcast(str(filepath)))
        store = plugin.store_for(path.parent, distributed=True)
        step = int(checkpoint.get("global_step", 0))
        pieces = {"state_dict": checkpoint.pop("state_dict"),
                  **{f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}}
        rest = to_plain(checkpoint, plugin.drop_unsupported)  # on every rank: all refuse alike
        # Order: every rank's pieces committed as one step (inside dcp.save) -> rank 0 points
        # Lightning's file name at it -> barrier. A crash before the commit leaves the previous
        # step and its pointer; a crash after it, a committed step that restore_pointers names.
        if not self.broadcast(step in store.local.steps()):  # the same step again ("last"): a pointer only
            save(pieces, storage_writer=store.dcp_writer(step, rest if self.global_rank == 0 else None,
                                                         lightning_user(checkpoint, path)))
        if self.global_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_pointer(path, step)
        self.barrier("TieredModelParallelStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        step = read_pointer(path) if path.is_file() else None
        if step is None:
            if weights_only is not True:
                raise UnsupportedStateError(
                    f"{path}: not a tieredckpt checkpoint; its metadata is a pickle and is not read. Load it "
                    "with weights_only=True to read tensors and plain values only")
            return super().load_checkpoint(path, weights_only=True)
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )
        store = _strategy_plugin(self).store_for(path.resolve().parent, distributed=True)
        module, lightning_module = self.model, self.lightning_module
        assert module is not None and lightning_module is not None  # Lightning connects them before a load
        rest = from_plain(store.dcp_reader(step).read_extra())
        # One dcp.load for the model and every optimizer: the reader verifies every chunk this
        # rank needs before it copies any into a live tensor, so a bad piece loads nothing.
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module),
                 **{f"optimizer_{i}": get_optimizer_state_dict(module, o) for i, o in enumerate(self.optimizers)}}
        load(state, storage_reader=store.dcp_reader(step))
        module.load_state_dict(state["state_dict"], strict=lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        return rest if isinstance(rest, dict) else {}

    def teardown(self) -> None:
        # ModelParallelStrategy's teardown leaves the checkpoint plugin open: close the store
        # (uploads drained) before the process group goes.
        plugin = self.checkpoint_io
        if isinstance(plugin, TieredCheckpointIO):
            plugin.teardown()
        super().teardown()


def _strategy_plugin(strategy, needed_by: str = "TieredModelParallelStrategy") -> TieredCheckpointIO:
    plugin = strategy.checkpoint_io
    if not isinstance(plugin, TieredCheckpointIO):
        raise TypeError(f"{needed_by} needs Trainer(plugins=[TieredCheckpointIO(...)]); the Trainer's "
                        f"checkpoint plugin is {type(plugin).__name__}")
    return plugin
