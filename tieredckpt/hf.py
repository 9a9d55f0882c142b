"""Hugging Face Trainer and accelerate on the tiers (``pip install tieredckpt[hf]``).

    from tieredckpt.hf import TieredCheckpointCallback
    callback = TieredCheckpointCallback(remote="s3://bucket/runs/x")
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_path())   # None on a first run; a fresh machine resumes

Each ``checkpoint-N/`` the Trainer saves is committed as step N with
``CheckpointStore.save_files`` (hard links, ``link=True``: the Trainer writes each
checkpoint into a new folder and only deletes old ones, so its save is not copied) and
uploaded in the background. When the Trainer is built on a machine whose
``output_dir`` lacks the newest step, the callback restores it into
``output_dir/checkpoint-N/`` right then (``on_init_end``), before ``train`` looks
for a checkpoint. SIGTERM asks the Trainer to save and stop at the next step
boundary (exit 0, the step committed locally); SIGUSR1 asks for a save.

accelerate, two lines:

    tieredckpt.hf.save_state(accelerator, store, step)     # instead of accelerator.save_state()
    step = tieredckpt.hf.load_state(accelerator, store)    # instead of accelerator.load_state()
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ._loop.signals import Requests, handle_signals
from ._loop.store import CheckpointStore, SaveHandle
from .errors import CheckpointExistsError

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["TieredCheckpointCallback", "prepare_resume", "save_state", "load_state"]

log = logging.getLogger("tieredckpt")
STORE_DIR = ".tieredckpt"  # the store's run directory inside output_dir: same filesystem, so links work
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def _store(output_dir: str | os.PathLike, remote: str | None, local: str | os.PathLike | None,
           options: dict) -> CheckpointStore:
    options = {"every": 0, "distributed": False, **options}
    return CheckpointStore(local if local is not None else Path(output_dir) / STORE_DIR, remote, **options)


def _restore_newest(store: CheckpointStore, output_dir: Path) -> Path | None:
    """The newest step into ``output_dir/checkpoint-N`` unless a folder of that name is there."""
    newest = store.latest_step()
    if newest is None:
        return None
    target = output_dir / checkpoint_name(newest)
    if target.is_dir() and any(target.iterdir()):
        return target  # the Trainer's own folder: nothing to bring back
    store.restore_files(newest, to=target)
    log.info("restored step %d into %s", newest, target)
    return target


TRAINER_STATE = "trainer_state.json"  # the Trainer writes it last into checkpoint-N/


def set_aside_incomplete(output_dir: Path, committed: int | None) -> list[Path]:
    """Rename (never delete) every ``checkpoint-N/`` newer than the newest committed step whose
    ``trainer_state.json`` is missing or not JSON: a Trainer killed inside its own save left it,
    and ``resume_from_checkpoint=True`` would pick it (the highest N) and fail on it at every
    relaunch. Set aside as ``checkpoint-N.incomplete`` (a name the Trainer never matches), the
    Trainer resumes from the newest committed step instead. Returns the new names."""
    moved = []
    for folder in sorted(output_dir.glob("checkpoint-*")) if output_dir.is_dir() else []:
        found = _CHECKPOINT.match(folder.name)
        if not found or not folder.is_dir() or folder.is_symlink():
            continue
        if (committed is not None and int(found.group(1)) <= committed) or _trainer_state_ok(folder):
            continue
        aside = _free_name(folder.with_name(folder.name + ".incomplete"))
        folder.rename(aside)
        log.warning("%s: incomplete (no readable %s: the Trainer was stopped inside its save) and newer than every "
                    "committed step; set aside as %s so that the Trainer resumes from the newest committed step",
                    folder, TRAINER_STATE, aside.name)
        moved.append(aside)
    return moved


def _trainer_state_ok(folder: Path) -> bool:
    import json
    try:
        json.loads((folder / TRAINER_STATE).read_bytes())
        return True
    except (OSError, ValueError):
        return False


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def prepare_resume(output_dir: str | os.PathLike, remote: str | None = None, local: str | os.PathLike | None = None,
                   **store_options: Any) -> Path | None:
    """Bring the newest step of the run back into ``output_dir/checkpoint-N/`` (from the local
    store or the remote) so that ``trainer.train(resume_from_checkpoint=True)`` finds it; the
    callback does this by itself when the Trainer is built. Returns the folder, or None when
    no tier holds a step.

    :param output_dir: the Trainer's ``output_dir``.
    :param remote: the store's remote URL.
    :param local: the store's run directory (default ``output_dir/.tieredckpt``).
    :param store_options: passed to the store."""
    with _store(output_dir, remote, local, store_options) as store:
        set_aside_incomplete(Path(output_dir), store.latest_step())
        return _restore_newest(store, Path(output_dir))


def _legacy_order(legacy: tuple, remote: Any, local: Any) -> tuple[Any, Any]:
    """``TieredCheckpointCallback("s3://b/run", "/nvme/x")``: the older positional order, (remote, local)."""
    if len(legacy) > 2 or (remote is not None and legacy) or (local is not None and len(legacy) > 1):
        raise TypeError("TieredCheckpointCallback takes remote= and local= as keywords (given twice, or too many arguments)")
    warnings.warn("TieredCheckpointCallback(remote, local) by position is deprecated: pass remote=... and local=... "
                  "by keyword (the same keywords as CheckpointStore and TieredCheckpointIO)",
                  DeprecationWarning, stacklevel=3)
    return legacy[0], (legacy[1] if len(legacy) > 1 else local)


class TieredCheckpointCallback(TrainerCallback):
    """Put every checkpoint a ``transformers.Trainer`` saves on the tiers, and bring the newest
    back on a machine that lacks it.

    In a multi-process run the main process owns the store; every process waits for the
    others before it commits (their per-rank files are in the folder then).

    :param remote: any fsspec URL (None: the local tier only).
    :param local: the store's run directory (default ``output_dir/.tieredckpt``).
    :param restore: bring the newest step back into ``output_dir`` when the Trainer is built,
        so that ``resume_from_checkpoint=callback.resume_path()`` finds it.
    :param store_options: passed to :class:`~tieredckpt.CheckpointStore` (``keep_local``,
        ``keep_remote``, ``remote_options``, ``upload_on_exit``...).

    ``remote`` and ``local`` are keywords, as in every entry point of tieredckpt; the old
    positional order ``(remote, local)`` still works, with a DeprecationWarning."""

    def __init__(self, *legacy: Any, remote: str | None = None, local: str | os.PathLike | None = None,
                 restore: bool = True, **store_options: Any) -> None:
        if legacy:
            remote, local = _legacy_order(legacy, remote, local)
        self.remote, self.local, self.restore, self.options = remote, local, restore, store_options
        self.store: CheckpointStore | None = None
        self.requests = Requests()
        self._signals = ExitStack()
        self._handle: SaveHandle | None = None
        self._output: Path | None = None

    def _open(self, args) -> CheckpointStore | None:
        if not _is_main(args):
            return None
        if self.store is None or self.store._closed:
            self.store = _store(args.output_dir, self.remote, self.local, self.options)
        return self.store

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        store = self._open(args)
        if store is not None:
            set_aside_incomplete(_output_dir(args), store.latest_step())
            if self.restore:
                _restore_newest(store, _output_dir(args))
        _barrier()
        self._output = _output_dir(args)

    def resume_path(self) -> str | None:
        """What to pass as ``trainer.train(resume_from_checkpoint=...)``: the newest
        ``checkpoint-N/`` in ``output_dir`` once the Trainer is built (the callback brought the
        newest step back there if it was missing), or None on a run's very first start, where
        ``resume_from_checkpoint=True`` would raise transformers' "No valid checkpoint found"."""
        if self._output is None:
            raise RuntimeError("resume_path() is known once the Trainer is built with this callback")
        from transformers.trainer_utils import get_last_checkpoint
        return get_last_checkpoint(str(self._output)) if self._output.is_dir() else None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._open(args)
        try:
            _set_aside_jit_checkpoint(args)
            self._signals.enter_context(handle_signals(self.requests))
        except RuntimeError:  # not the main thread: no signals, the rest works
            log.warning("the Trainer runs off the main thread: SIGTERM/SIGUSR1 are not handled")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.requests.stop_requested():
            control.should_save = control.should_training_stop = True
        elif self.requests.save_requested():
            control.should_save = True
            self.requests.clear_save()
        if control.should_save:
            self._clear_for_save(args, state.global_step)

    def _clear_for_save(self, args, step: int) -> None:
        """The Trainer is about to write ``checkpoint-<step>/``; if a folder of that name exists and
        its step is committed, remove it first, so that the Trainer writes new files instead of
        writing through hard links into the committed step."""
        store, folder = self.store, Path(args.output_dir) / checkpoint_name(step)
        if store is None or not folder.is_dir() or not _is_main(args):
            return
        self._wait()
        if step in store.local.steps():
            shutil.rmtree(folder)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        _barrier()  # every process's files (rng_state_<rank>.pth) are in the folder now
        store = self.store if _is_main(args) else None
        if store is None:
            return
        folder = _output_dir(args) / checkpoint_name(state.global_step)
        try:
            self._handle = store.save_files(state.global_step, folder, link=True,
                                            user={"hf": {"global_step": state.global_step, "folder": folder.name}})
        except CheckpointExistsError:
            log.warning("step %d is already committed in %s; this save of %s is not stored again",
                        state.global_step, store.local.root, folder)
        if self.requests.stop_requested():
            self._wait()  # about to stop: committed before train() returns

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._signals.close()
        if self.store is not None:
            stopping = self.requests.stop_requested()
            self.store.close(preempted=stopping)  # after SIGTERM: the newest step within upload_on_exit
            self.store = None

    def _wait(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()


def _output_dir(args: TrainingArguments) -> Path:
    if args.output_dir is None:
        raise ValueError("TieredCheckpointCallback needs TrainingArguments(output_dir=...): the Trainer's folders go there")
    return Path(args.output_dir)


def _set_aside_jit_checkpoint(args) -> None:
    """``enable_jit_checkpoint`` (transformers >= 4.57) installs its own SIGTERM handler: 3 s
    after the signal it saves ``checkpoint-N/`` by calling the Trainer's save directly, past
    every callback's ``on_save`` -- a second save of the step this callback is already saving
    at the next step boundary, into the folder it hard-links, never committed nor uploaded.
    This callback's SIGTERM does what JIT checkpointing is for (save the current step, stop),
    and commits and uploads it; so the JIT handler is taken out of the chain (its own original
    handler is chained instead), and the Trainer's JIT callback, never triggered, does nothing.
    Raises RuntimeError off the main thread, as installing any handler does."""
    import signal
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("signal handlers can only be installed from the main thread")
    handler = signal.getsignal(signal.SIGTERM)
    manager = getattr(handler, "__self__", None)
    if not getattr(args, "enable_jit_checkpoint", False) or type(manager).__name__ != "CheckpointManager":
        return
    original = getattr(manager, "_original_sigterm_handler", None)
    signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)
    log.info("enable_jit_checkpoint: SIGTERM is handled by tieredckpt's callback (the step saved at the next "
             "step boundary is committed and sent to the remote); the Trainer's JIT handler is not chained")


def _is_main(args) -> bool:
    return getattr(args, "process_index", 0) == 0


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---- accelerate -------------------------------------------------------------------------

ITERATION_KEY = "accelerate_iteration"


def save_state(accelerator: Accelerator, store: CheckpointStore | None, step: int, output_dir: str | os.PathLike | None = None,
               **save_kwargs: Any) -> SaveHandle | None:
    """``accelerator.save_state`` committed as ``step`` of ``store``; every process calls it, the
    main process passes its store (the others may pass None). Without ``output_dir`` and without
    automatic checkpoint naming, the folder is a scratch directory the store's step replaces
    (hard-linked: nothing else writes there). A folder of the caller's, or accelerate's own
    ``checkpoint_N``, is copied (reflinked where the filesystem can): accelerate rewrites a
    fixed folder's files in place at the next save, and the committed step must not change.

    :param accelerator: the ``accelerate.Accelerator``.
    :param store: the main process's ``CheckpointStore`` (None on the others).
    :param step: the step number.
    :param output_dir: the folder ``save_state`` writes (default: a scratch directory).
    :param save_kwargs: passed to ``accelerator.save_state``.
    :returns: the main process's ``SaveHandle`` (None on the others)."""
    naming = accelerator.project_configuration.automatic_checkpoint_naming
    scratch = None
    if output_dir is None and not naming:
        root = store.local.root if store is not None else Path(accelerator.project_dir or ".")
        scratch = output_dir = root / f".accelerate-{step}"
    iteration = accelerator.project_configuration.iteration
    where = Path(accelerator.save_state(None if naming else str(output_dir), **save_kwargs))
    accelerator.wait_for_everyone()
    handle = None
    if accelerator.is_main_process and store is not None:
        handle = store.save_files(step, where, user={ITERATION_KEY: iteration}, link=scratch is not None)
    accelerator.wait_for_everyone()
    if scratch is not None and accelerator.is_main_process:
        shutil.rmtree(scratch, ignore_errors=True)  # the step holds its own links to every file
    return handle


def load_state(accelerator: Accelerator, store: CheckpointStore, step: int | None = None, **load_kwargs: Any) -> int | None:
    """The newest (or named) step of ``store`` loaded with ``accelerator.load_state``; the step, or
    None when the run has none. One process per node restores the folder; with automatic
    checkpoint naming the next save continues the iteration count.

    :param accelerator: the ``accelerate.Accelerator``.
    :param store: the ``CheckpointStore``.
    :param step: the step (default: the newest).
    :param load_kwargs: passed to ``accelerator.load_state``."""
    target = store.local.root / f".accelerate-restore-{os.getpid()}"
    restored = None
    try:
        if accelerator.is_local_main_process:
            restored = store.restore_files(step, to=target)
        accelerator.wait_for_everyone()
        if not target.is_dir():
            return None
        accelerator.load_state(str(target), **load_kwargs)
        if restored is not None:
            iteration = store.local.manifest(restored).user.get(ITERATION_KEY)
            if accelerator.project_configuration.automatic_checkpoint_naming and isinstance(iteration, int):
                accelerator.project_configuration.iteration = iteration + 1
        return restored
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            shutil.rmtree(target, ignore_errors=True)
