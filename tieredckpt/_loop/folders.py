"""Folder steps on the store: a framework's checkpoint folder committed as a step
(``save_files``) and brought back (``restore_files``); the files' own work is _tiers/folder.py."""

from __future__ import annotations

import time
from pathlib import Path

from .._format.manifest import ShardManifest
from .._format.phases import collecting
from .._tiers import folder
from .._tiers.sharded import check_user_value
from ..errors import DiskFullError
from .handle import SaveHandle
from .parts import StoreParts
from .saving import after_commit, finish_pending, ready_for


def save_files(s: StoreParts, step: int, directory: Path, user: dict | None, link: bool) -> SaveHandle:
    """CheckpointStore.save_files: staged on the caller's thread, committed on the writer's."""
    if s.ranks is not None:
        raise ValueError("save_files runs in one process: open this store with distributed=False on "
                         "the rank that owns the folder")
    entered = time.monotonic()
    ready_for(s, step)
    user = check_user_value(user)
    s.requests.clear_save()
    staged = _stage_with_room(s, step, directory, link)
    cost = {"blocked_s": time.monotonic() - entered, "staging_s": time.monotonic() - entered}
    try:
        future = s._writer.submit(_write_folder, s, step, staged, user, cost)
    except BaseException:
        folder.discard(staged)
        raise
    s._pending = SaveHandle(step, future)
    s._stats.blocked(cost["blocked_s"])
    return s._pending


def _stage_with_room(s: StoreParts, step: int, directory: Path, link: bool) -> folder.Staged:
    """folder.stage; a full disk while copying (no hard link possible) makes room by the
    rotation rules, as a save does, and stages once more."""
    s.local.clear_leftover(step)
    newest = s.local.latest_step()
    previous = s.local.step_path(newest) if newest is not None else None
    try:
        return folder.stage(directory, s.local.step_path(step), link, previous)
    except DiskFullError:
        if not s._room.make_room(step, None):
            raise
        return folder.stage(directory, s.local.step_path(step), link, previous)


def _write_folder(s: StoreParts, step: int, staged: folder.Staged, user: dict, cost: dict) -> ShardManifest:
    # The writer thread: loss history durable -> the staged files fsynced, checksummed and
    # committed (folder.commit: the manifest last, then the rename) -> after_commit.
    s.run.sync()
    s.local.clean_stale_once()
    wall = s._training_seconds()
    started = time.perf_counter()
    try:
        with collecting() as spent:
            manifest = folder.commit(staged, step, wall, user)
    except Exception as exc:
        s._stats.save_failed(step, f"{type(exc).__name__}: {exc}")
        raise
    after_commit(s, step, manifest, cost, time.perf_counter() - started, spent)
    return manifest


def restore_files(s: StoreParts, step: int | None, to: Path) -> int | None:
    """CheckpointStore.restore_files; a step fetched from the remote is evictable like any uploaded one."""
    s._check_open()
    finish_pending(s)
    before = set(s.local.steps())
    step = s._restorer.restore_files(step, to)
    if step is not None and s.uploader is not None and step not in before and step in s.local.steps():
        s.uploader.downloaded(step)
    return step
