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
returns (exit 0); SIGUSR1: a checkpoint, and training goes on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from ._format.atomic import atomic_write_bytes
from ._loop.signals import Requests
from ._loop.store import CheckpointStore, SaveHandle
from .errors import CheckpointNotFoundError, UnsupportedStateError

__all__ = ["TieredCheckpointIO", "TieredModelCheckpoint", "load_checkpoint"]

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


# ---- pointers -------------------------------------------------------------------------------

def write_pointer(path: Path, step: int) -> None:
    body = {"format": POINTER_FORMAT, "version": 1, "step": step, "store": STORE_DIR}
    atomic_write_bytes(path, (json.dumps(body) + "\n").encode())


def read_pointer(path: Path) -> int | None:
    """The step a pointer names; None when ``path`` is not one of ours (a foreign .ckpt)."""
    with open(path, "rb") as f:
        head = f.read(MAX_POINTER + 1)
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

    ``local``: the store's run directory (default: ``.tieredckpt`` inside the directory of the
    first checkpoint path Lightning passes). ``remote``: any fsspec URL. ``drop_unsupported``:
    leave values that cannot be stored without pickle out of the checkpoint, with a warning,
    instead of refusing the save. ``store_options``: passed to the store (``keep_local``,
    ``keep_remote``, ``remote_options``...)."""

    def __init__(self, local: str | os.PathLike | None = None, remote: str | None = None, *,
                 drop_unsupported: bool = False, **store_options) -> None:
        self.local, self.remote, self.drop_unsupported = local, remote, drop_unsupported
        self.options = store_options
        self.store: CheckpointStore | None = None
        self.requests = Requests()
        self._handle: SaveHandle | None = None

    def store_for(self, directory: str | os.PathLike) -> CheckpointStore:
        """The store (opened on first use) for checkpoints in ``directory``. Ranks other than 0 read."""
        if self.store is None or self.store._closed:
            local = Path(self.local) if self.local is not None else Path(directory) / STORE_DIR
            self.store = CheckpointStore(local, self.remote, **{"every": 0, "distributed": False,
                                                                "read_only": _rank() != 0, **self.options})
        return self.store

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        store = self.store_for(path.parent)
        plain = to_plain(checkpoint, self.drop_unsupported)
        step = int(checkpoint.get("global_step", 0))
        if step not in store.local.steps() and not self._is_pending(step):
            self._handle = store.save(step, plain, user={"lightning": {"file": path.name}})
        path.parent.mkdir(parents=True, exist_ok=True)
        write_pointer(path, step)

    def _is_pending(self, step: int) -> bool:
        return self._handle is not None and self._handle.step == step

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
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
            raise CheckpointNotFoundError(f"{path}: names step {step}, which no tier holds")
        return from_plain(state)

    def remove_checkpoint(self, path) -> None:
        """Remove Lightning's pointer; the store's retention decides what data goes."""
        path = Path(path)
        if path.is_symlink() or (path.is_file() and read_pointer(path) is not None):
            path.unlink()

    def wait(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()

    def teardown(self) -> None:
        if self.store is not None:
            self.wait()
            self.store.close(drain_uploads=not self.requests.stop_requested())
            self.store = None

    def restore_pointers(self, directory: str | os.PathLike) -> list[Path]:
        """Write back the pointer of every step the store holds (on any tier) that ``directory``
        lacks, under the file name it was saved as, and ``last.ckpt`` to the newest."""
        directory = Path(directory)
        store = self.store_for(directory)
        written = []
        infos = store.list()
        for info in infos:
            name = _saved_name(store, info.step)
            if name and not (directory / name).exists():
                directory.mkdir(parents=True, exist_ok=True)
                write_pointer(directory / name, info.step)
                written.append(directory / name)
        if infos:
            last = directory / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
            if not last.exists() or _pointed(last) != infos[-1].step:
                directory.mkdir(parents=True, exist_ok=True)
                if last.is_symlink():
                    last.unlink()
                write_pointer(last, infos[-1].step)
                written.append(last)
        return written


def _pointed(path: Path) -> int | None:
    try:
        return read_pointer(path)
    except OSError:
        return None


def _saved_name(store: CheckpointStore, step: int) -> str | None:
    try:
        if step in store.local.steps():
            user = store.local.manifest(step).user
        else:
            user = store.remote.upload_manifest(step).shard_manifest.user
    except Exception:  # noqa: BLE001 - a name is a convenience; the step still restores
        return None
    name = (user.get("lightning") or {}).get("file")
    return name if isinstance(name, str) and "/" not in name and name not in ("", ".", "..") else None


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def load_checkpoint(path: str | os.PathLike, local: str | os.PathLike | None = None, remote: str | None = None,
                    **store_options) -> dict:
    """The checkpoint dict a pointer names (what ``torch.load`` of a ``.ckpt`` would give), for
    code that reads checkpoints outside a Trainer: ``Model.load_state_dict(ckpt["state_dict"])``."""
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
        _plugin(trainer).restore_pointers(directory)
        return super()._find_last_checkpoints(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        plugin = _plugin(trainer)
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            for signum in self._previous:  # Lightning's own SIGTERM handler is replaced while we train:
                signal.signal(signum, plugin.requests._handler(None))  # a save at a step boundary instead
        except ValueError:
            self._previous = {}
            log.warning("training off the main thread: SIGTERM/SIGUSR1 are not handled")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
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

    def on_train_end(self, trainer, pl_module) -> None:
        for signum, handler in getattr(self, "_previous", {}).items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        super().on_train_end(trainer, pl_module)


def _plugin(trainer) -> TieredCheckpointIO:
    plugin = trainer.strategy.checkpoint_io
    if not isinstance(plugin, TieredCheckpointIO):
        raise TypeError("TieredModelCheckpoint needs Trainer(plugins=[TieredCheckpointIO(...)]); the Trainer's "
                        f"checkpoint plugin is {type(plugin).__name__}")
    return plugin
