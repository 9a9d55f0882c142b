"""Restoring through the store: the newest (or the named) step from the best tier, the run's
side files completed from the remote, the objects loaded, and the resume recorded."""

from __future__ import annotations

from typing import Any

from .._tiers.placement import Targets
from .._tiers.restore import load_into
from ..errors import RemoteError, TieredCkptError, warn_user
from .parts import StoreParts
from .saving import finish_pending


def restore(s: StoreParts, step: int | None, into: dict | None, mark_resume: bool, reshard: bool) -> Any:
    """CheckpointStore.restore."""
    s._check_open()
    finish_pending(s)
    if s.rank == 0 and s.remote is not None and not s.read_only:
        _fetch_side_files(s)
    before = set(s.local.steps())
    step, state = s._restorer.restore(step, reshard, Targets(into) if into else None)
    if step is None:
        return None
    if s.uploader is not None and step not in before and step in s.local.steps():
        s.uploader.downloaded(step)  # the remote holds it: rotation may evict it like any uploaded step
    _resumed_from(s, step)
    if into:
        load_into(state, into, s.local.step_path(step))
    if mark_resume and s.rank == 0:
        if s._fell_back_to_reading:
            warn_user(f"{s.local.root}: cannot be written; the resume is not recorded in the loss history")
        elif not s.read_only:
            s.run.mark_resume(step)
    return state


def latest_step(s: StoreParts) -> int | None:
    """The newest committed step on any tier (a constant number of remote requests)."""
    steps = [step for step in (s.local.latest_step(),) if step is not None]
    if s.remote is not None:
        newest = s.remote.newest_step()
        steps += [newest] if newest is not None else []
    return max(steps) if steps else None


def _resumed_from(s: StoreParts, step: int) -> None:
    """Carry the run's training time on from the restored checkpoint."""
    try:
        if step in s.local.steps():
            s._resume_clock(s.local.manifest(step).wall_clock_seconds)
    except TieredCkptError:
        pass


def _fetch_side_files(s: StoreParts) -> None:
    """Complete the run's side files from the remote (each missing one, a longer loss history)."""
    if s.remote is None:
        return
    s.run.close()  # the loss history may be replaced; reopen it afterwards
    try:
        s.remote.get_side_files(s.local.root, warn=warn_user)
    except RemoteError as exc:
        warn_user(f"could not fetch the run's side files: {exc}")
