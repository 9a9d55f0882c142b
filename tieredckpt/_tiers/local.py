"""The local tier: a run directory of committed checkpoints on fast disk.

Owns listing (a step exists iff ``step_NNNNNN/manifest.json`` exists), the
``latest`` pointer, rotation and the cleanup of a crashed writer's scratch.
Writing one checkpoint is sharded.save_sharded's job; the order here is:

  1. save_sharded commits ``step_NNNNNN/`` atomically (data, manifest, rename);
  2. only then ``latest`` is replaced atomically to name it (never ahead of data);
  3. only then rotation deletes old steps -- never the one ``latest`` names nor
     any step the caller protects -- each by rename-then-delete.
A crash between any two steps leaves a consistent run directory.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .._format import layout
from .._format.atomic import atomic_write_bytes, building, clean_stale, fsync_dir, remove_dir
from .._format.manifest import ShardManifest
from ..errors import CheckpointNotFoundError, NotARunDirectoryError
from .retention import KeepLast, Policy, plan_eviction
from .sharded import (
    load_sharded,
    read_manifest,
    save_sharded,
    verify_checkpoint,
    verify_checkpoint_files,
    write_manifest,
)


class LocalTier:
    def __init__(self, root: str | os.PathLike, *, create: bool = True, must_exist: bool = True) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise NotARunDirectoryError(f"{self.root}: is a file, not a run directory")
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif must_exist and not self.root.is_dir():
            raise CheckpointNotFoundError(f"{self.root}: no such run directory")
        self._cleaned = False

    def step_path(self, step: int) -> Path:
        return self.root / layout.step_dir_name(step)

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Scratch and half-deleted dirs never appear.

        A step directory we may not look into is listed (so that reading it reports
        why it fails, instead of the run silently going back to an older step)."""
        found: list[int] = []
        if not self.root.is_dir():
            return found
        for entry in os.scandir(self.root):
            step = layout.parse_step_dir(entry.name)
            if step is None:
                continue
            if _has_manifest(Path(entry.path)):
                found.append(step)
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def latest_pointer(self) -> int | None:
        """The step the ``latest`` file names (DeepSpeed-style), if any."""
        try:
            return layout.parse_step_dir((self.root / layout.LATEST).read_text().strip())
        except FileNotFoundError:
            return None

    def save(self, step: int, states: Sequence[Any], **kwargs) -> ShardManifest:
        self.clean_stale_once()
        manifest = save_sharded(states, self.step_path(step), step, **kwargs)
        self.update_latest()
        return manifest

    def update_latest(self) -> None:
        """Point ``latest`` at the newest committed step (atomic replace); none left: remove it."""
        newest = self.latest_step()
        if newest is None:
            if (self.root / layout.LATEST).exists():
                os.unlink(self.root / layout.LATEST)
        elif newest != self.latest_pointer():
            atomic_write_bytes(self.root / layout.LATEST, (layout.step_dir_name(newest) + "\n").encode())

    def download(self, step: int, remote, verify: str = "crc", progress=None) -> ShardManifest:
        """Bring remote ``step`` here with the same protocol as a save: parts into scratch,
        every file verified against the manifest, the manifest last, the atomic rename."""
        upload = remote.upload_manifest(step)
        manifest = upload.shard_manifest
        self.clear_leftover(step)
        with building(self.step_path(step)) as tmp:
            remote.fetch_files(upload, upload.files, tmp, progress)
            verify_checkpoint_files(tmp, manifest, full=verify == "sha256")
            write_manifest(tmp, manifest)
        self.update_latest()
        return manifest

    def clear_leftover(self, step: int) -> None:
        """A step directory without a manifest is not a checkpoint: move it aside so the
        step number can be written again (it is kept under quarantine/, never deleted)."""
        path = self.step_path(step)
        if path.is_dir() and not (path / layout.MANIFEST).exists():
            self.quarantine(step, "a step directory without a manifest (an interrupted copy)")

    def quarantine(self, step: int, reason: str) -> Path:
        """Move step ``step`` aside to ``quarantine/`` (one atomic rename) with a note of why."""
        where = self.root / layout.QUARANTINE
        where.mkdir(exist_ok=True)
        dest = where / f"{layout.step_dir_name(step)}.{int(time.time())}"
        n = 1
        while dest.exists():
            dest, n = where / f"{layout.step_dir_name(step)}.{int(time.time())}-{n}", n + 1
        os.rename(self.step_path(step), dest)
        fsync_dir(self.root)
        fsync_dir(where)
        try:
            (dest / "QUARANTINED.txt").write_text(reason + "\n")
        except OSError:
            pass
        if self.latest_pointer() == step:
            self.update_latest()
        return dest

    def manifest(self, step: int | None) -> ShardManifest:
        return read_manifest(self.require(step))

    def load(self, step: int | None = None, world_size: int = 1, verify: str = "crc") -> list[Any]:
        return load_sharded(self.require(step), world_size, verify=verify)

    def verify(self, step: int, full: bool = False) -> ShardManifest:
        return verify_checkpoint(self.require(step), full=full)

    def rotate(self, policy: Policy | int, protected: Iterable[int] = ()) -> list[int]:
        """Delete what ``policy`` (or keep-last-N) drops, except protected steps and ``latest``."""
        if isinstance(policy, int):
            policy = KeepLast(policy)
        keep = set(protected)
        pointer = self.latest_pointer()
        if pointer is not None:
            keep.add(pointer)
        doomed = plan_eviction(self.steps(), policy, keep)
        for step in doomed:
            remove_dir(self.step_path(step))
        return doomed

    def make_room(self, need: int | None, keep: int, protected: Iterable[int] = ()) -> list[int]:
        """Before a write: evict, oldest first, what rotation would evict once it commits -- steps
        beyond the newest ``keep`` that nobody protects, never the one ``latest`` names nor the
        newest committed one -- until ``need`` bytes are free (``None``: every such step).

        Each eviction is rotation's rename-then-delete, so a kill mid-way leaves only scratch.
        Returns the steps evicted (none when the space is there already)."""
        if need is not None and self.free_bytes() >= need:
            return []
        steps = self.steps()
        keepset = set(protected) | {s for s in (self.latest_pointer(), steps[-1] if steps else None) if s is not None}
        evicted = []
        for step in plan_eviction(steps, KeepLast(max(keep, 1)), keepset):
            if need is not None and self.free_bytes() >= need:
                break
            remove_dir(self.step_path(step))
            evicted.append(step)
        return evicted

    def free_bytes(self) -> int:
        """What the run directory's filesystem has free for us (``statvfs``' f_bavail)."""
        return shutil.disk_usage(self.root).free

    def clean_stale_once(self) -> None:
        """A crashed writer's scratch goes at our first save."""
        if not self._cleaned:
            self.clean_stale()
            self._cleaned = True

    def clean_stale(self) -> list[str]:
        return clean_stale(self.root)

    def require(self, step: int | None) -> Path:
        """The directory of committed ``step`` (newest when None), or CheckpointNotFoundError."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"{self.root}: the run has no committed checkpoint")
        path = self.step_path(step)
        if not _has_manifest(path):
            have = self.steps()
            raise CheckpointNotFoundError(
                f"{path}: no committed checkpoint for step {step} (have: {have[-5:] if have else 'none'})")
        return path


def _has_manifest(step_dir: Path) -> bool:
    """True when the step directory holds a manifest -- or may: one we cannot look into
    (EACCES, ENOTDIR...) counts, so that reading it says what is wrong instead of the
    run silently going back to an older step."""
    try:
        os.lstat(step_dir / layout.MANIFEST)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True
