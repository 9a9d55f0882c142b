"""CheckpointStore: the object a training loop holds. Orchestration only.

    with CheckpointStore("runs/lm", every=100) as store, store.handle_signals():
        state = store.restore(into={"model": model, "optim": opt})
        start = state["step"] if state else 0
        for step in range(start + 1, total + 1):
            loss = train_step()
            store.log_loss(step, loss)
            if store.step_end(step, lambda: {"model": model, "optim": opt, "step": step}):
                break                                     # SIGTERM: saved, now exit 0

A save blocks only while the state is copied into reused staging buffers; a
single background writer encodes, checksums and commits it with the local
tier's atomic protocol, fsyncs the loss history first, then rotates. The next
save waits for the previous write (at most one staged copy exists). A failed
background write is raised, once, at the next ``save``, ``wait`` or ``close``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import BackgroundSaveError, CheckpointExistsError, IncompatibleStateError
from .local import LocalTier
from .manifest import ShardManifest
from .runlog import RunLog, fork_run
from .signals import Requests, handle_signals
from .staging import Stager

@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    size: int
    created_unix: float
    world_size: int


class SaveHandle:
    """The pending background write of one save."""

    def __init__(self, step: int, future: Future) -> None:
        self.step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> ShardManifest:
        """Block until committed; raise BackgroundSaveError if the write failed."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise
        except Exception as exc:
            raise BackgroundSaveError(f"saving step {self.step} failed: {exc}") from exc


class CheckpointStore(AbstractContextManager):
    def __init__(self, local: str | os.PathLike, remote: str | None = None, *, keep_local: int = 3,
                 every: int = 100, verify: str = "crc") -> None:
        if remote is not None:
            raise ValueError("remote tiers are not supported by this version of tieredckpt yet; pass remote=None")
        if type(keep_local) is not int or keep_local < 1:
            raise ValueError(f"keep_local must be an int >= 1, got {keep_local!r}")
        if type(every) is not int or every < 0:
            raise ValueError(f"every must be an int >= 0 (0: only on request), got {every!r}")
        self.local = LocalTier(local)
        self.run = RunLog(local)
        self.keep_local = keep_local
        self.every = every
        self.verify = verify
        self.requests = Requests()
        self._stager = Stager()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredckpt-writer")
        self._pending: SaveHandle | None = None
        self._closed = False

    # ---- saving -----------------------------------------------------------------------

    def save(self, step: int, state: Any, *, user: dict | None = None) -> SaveHandle:
        """Snapshot ``state`` and write it in the background; returns at once after the copy."""
        self._check_open()
        self._finish_pending()  # back-pressure, and the previous failure surfaces here
        if (self.local.step_path(step) / "manifest.json").exists():
            raise CheckpointExistsError(f"{self.local.step_path(step)}: step {step} is already committed")
        self.requests.clear_save()  # a signal from now on asks for another save
        staged = self._stager.stage(state)
        future = self._writer.submit(self._write, step, staged, user)
        self._pending = SaveHandle(step, future)
        return self._pending

    def _write(self, step: int, staged, user) -> ShardManifest:
        # Runs on the writer thread. Order: loss history durable up to this step ->
        # checkpoint committed atomically -> latest moved -> old steps rotated out.
        self.run.sync()
        manifest = self.local.save(step, [staged], user=user)
        self.local.rotate(self.keep_local)
        return manifest

    def should_save(self, step: int) -> bool:
        """Cadence (``step % every == 0``) or a pending SIGUSR1/SIGTERM request."""
        return (self.every > 0 and step % self.every == 0) or self.requests.save_requested()

    def should_stop(self) -> bool:
        return self.requests.stop_requested()

    def step_end(self, step: int, state: Any | Callable[[], Any]) -> bool:
        """The step boundary: save if due (``state`` may be a callable), return True to stop.

        On a stop request the checkpoint is committed before this returns.
        """
        if self.should_save(step):
            handle = self.save(step, state() if callable(state) else state)
            if self.should_stop():
                handle.wait()
        return self.should_stop()

    def handle_signals(self):
        """Context manager: SIGTERM -> save and stop, SIGUSR1 -> save and go on."""
        return handle_signals(self.requests)

    def log_loss(self, step: int, loss: float, **extra: Any) -> None:
        self.run.append_loss(step, loss, **extra)

    # ---- waiting --------------------------------------------------------------------

    def wait(self) -> None:
        """Block until the pending write is committed; raise its failure if it failed."""
        self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        """Finish the pending write, release the writer; raise a pending failure."""
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self.run.close()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # already failing: finish what was staged, but never mask the original error
            self.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointStore is closed")

    # ---- restoring ------------------------------------------------------------------

    def restore(self, step: int | None = None, *, into: dict | None = None,
                mark_resume: bool = True) -> Any:
        """The newest (or the named) committed checkpoint's state, verified.

        Returns None when the run has no checkpoint yet and no step was named.
        ``into`` maps top-level keys to objects with ``load_state_dict`` (a model,
        an optimizer...), which are loaded from the matching saved entries; every
        key is checked before any object is touched. ``mark_resume`` records the
        resume in the loss history so replayed steps can be told apart.
        """
        self._check_open()
        self._finish_pending()
        resolved = step if step is not None else self.local.latest_step()
        if resolved is None:
            return None
        (state,) = self.local.load(resolved, world_size=1, verify=self.verify)
        if into:
            _load_into(state, into, self.local.require(resolved))
        if mark_resume:
            self.run.mark_resume(resolved)
        return state

    def latest_step(self) -> int | None:
        return self.local.latest_step()

    def list(self) -> list[CheckpointInfo]:
        out = []
        for step in self.local.steps():
            m = self.local.manifest(step)
            out.append(CheckpointInfo(step, self.local.step_path(step), m.total_size, m.created_unix, m.world_size))
        return out

    # ---- side files -------------------------------------------------------------------

    def pivot(self, step: int, note: str = "") -> Path:
        """Archive samples and bandit state (never the loss history) and start them clean."""
        return self.run.pivot(step, note)

    def fork(self, step: int, new_run_dir: str | os.PathLike) -> Path:
        """Copy checkpoint ``step`` into a new run directory with its provenance."""
        self._finish_pending()
        return fork_run(self.local.root, step, new_run_dir)


def _load_into(state: Any, into: dict, where: Path) -> None:
    """Load saved entries into live objects, after checking all of them (no half-loaded state)."""
    if not isinstance(state, dict):
        raise IncompatibleStateError(f"{where}: the saved state is not a dict; cannot load into {list(into)}")
    missing = [key for key in into if key not in state]
    if missing:
        raise IncompatibleStateError(f"{where}: the checkpoint has no entries {missing} (it has {list(state)})")
    for key, target in into.items():
        if isinstance(target, torch.nn.Module):
            _check_module_state(target, state[key], f"{where} [{key!r}]")
    for key, target in into.items():
        target.load_state_dict(state[key])


def _check_module_state(module: torch.nn.Module, saved: Any, where: str) -> None:
    expected = module.state_dict()
    if not isinstance(saved, dict):
        raise IncompatibleStateError(f"{where}: saved entry is a {type(saved).__name__}, not a state dict")
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise IncompatibleStateError(f"{where}: keys differ from the model's: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in expected.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise IncompatibleStateError(f"{where}: {name!r} is {got} in the checkpoint, {tuple(tensor.shape)} in the model")
