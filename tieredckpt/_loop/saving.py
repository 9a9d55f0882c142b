"""Saving: the copy on the loop, then the write, commit and what follows it on the writer thread.

A save blocks only while the state is copied into reused staging buffers; a single background
writer encodes, checksums and commits it with the local tier's atomic protocol, fsyncs the loss
history first, then rotates. The next save waits for the previous write (at most one staged copy
exists). A failed background write is raised, once, at the next ``save``, ``wait`` or ``close``."""

from __future__ import annotations

import logging
import time
from concurrent.futures import wait as futures_wait
from typing import Any

from .._format import layout, tree
from .._format.gcpause import gc_paused
from .._format.manifest import ShardManifest
from .._format.phases import collecting
from .._format.tree import Staged
from .._tiers.ranks import commit_rank
from .._tiers.sharded import check_user_value, save_sharded
from ..errors import BackgroundSaveError, CheckpointExistsError, DiskFullError
from .handle import SaveHandle
from .handoff import CopyAborted
from .parts import StoreParts
from .staging import Unstaged

log = logging.getLogger("tieredckpt")


def save(s: StoreParts, step: int, state: Any, user: dict | None,
         param_span: tuple[int, int] | None, overlap: bool | None) -> SaveHandle:
    """CheckpointStore.save: snapshot ``state`` and write it in the background."""
    entered = time.monotonic()
    ready_for(s, step)
    user = check_user_value(user)  # a bad one is refused here, not in the background
    s.requests.clear_save()  # a signal from now on asks for another save
    staging = time.monotonic()
    defer = s._hold.owned(state) if (s.overlap if overlap is None else overlap) else set()
    with gc_paused():  # a few objects per tensor, no cycles: no collection while the loop waits
        snapshot = s._stager.stage_split(state, defer)
        return _start_write(s, step, snapshot, defer, user, param_span, entered, staging)


def _start_write(s: StoreParts, step: int, snapshot, defer: set, user, param_span, entered: float,
                 staging: float) -> SaveHandle:
    cost = {"blocked_s": 0.0, "staging_s": 0.0}
    # The writer starts before the copy and writes each part as it is copied (staging.Snapshot):
    # the previous write is finished (ready_for), so the buffers are ours. A copy that fails
    # stops the writer before its commit, and save() raises: nothing of this step is committed.
    if defer:
        s._hold.hold()  # released on the writer thread once the rest is copied
    try:
        future = s._writer.submit(write, s, step, snapshot, user, param_span, cost, bool(defer))
    except BaseException:
        s._hold.release()
        raise
    try:
        snapshot.copy_now()
    except BaseException:
        snapshot.handoff.fail()  # also when it came after the last part was copied
        snapshot.settled.set()
        futures_wait([future])  # stopped at a missing part (CopyAborted); the buffers are free again
        raise
    now = time.monotonic()
    cost.update(blocked_s=now - entered, staging_s=now - staging)
    snapshot.settled.set()  # cost is complete: the writer may record it
    s._pending = SaveHandle(step, future, s._hold)
    s._stats.blocked(cost["blocked_s"])
    return s._pending


def ready_for(s: StoreParts, step: int) -> None:
    """What a save waits for and checks before it stages anything."""
    s._check_writable()
    finish_pending(s)  # back-pressure, and the previous failure surfaces here
    if s.uploader is not None:
        s.uploader.wait_for_room()  # uploads="all" only; never raises
    if (s.local.step_path(step) / layout.MANIFEST).exists():
        raise CheckpointExistsError(f"{s.local.step_path(step)}: step {step} is already committed")


def finish_pending(s: StoreParts) -> None:
    """Wait for the previous write; raise its failure unless its handle already did."""
    pending, s._pending = s._pending, None
    if pending is None or pending.raised:
        return
    try:
        pending.wait()
    except BackgroundSaveError as exc:
        if s.on_save_error == "raise":
            raise
        log.error("%s; training goes on (on_save_error='warn') and the next save tries again", exc)


def commit_unstaged(s: StoreParts, step: int, state: Any, user: dict | None) -> ShardManifest:
    """CheckpointStore.commit_unstaged: the write on the writer thread with no staging copy."""
    ready_for(s, step)
    snapshot = Unstaged(Staged(*tree.flatten(state)))
    future = s._writer.submit(write, s, step, snapshot, user, None, {"blocked_s": 0.0, "staging_s": 0.0})
    s._pending = SaveHandle(step, future)
    return s._pending.wait()


def write(s: StoreParts, step: int, snapshot, user, param_span, cost: dict, deferred: bool = False) -> ShardManifest:
    # Runs on the writer thread, beside save()'s copy. Order: (overlap) the deferred copy, then
    # the optimizers' step() may go on -> loss history durable up to this step ->
    # checkpoint committed atomically (on every rank: ranks.commit_rank), each part written
    # once save() has copied it -> latest moved -> queued for upload -> old steps rotated out.
    staged = snapshot.staged
    if not snapshot.reads_live:
        snapshot.settled.wait()  # buffers already ours: the copy is quick on all cores, left alone
    s.run.sync()
    s.local.clean_stale_once()
    if deferred:
        copy_started = time.perf_counter()
        try:
            snapshot.copy_rest()
        finally:
            s._hold.release()
        cost["deferred_s"] = time.perf_counter() - copy_started
    wall = s._training_seconds()
    started = time.perf_counter()
    try:
        with collecting() as spent:  # fsync and commit seconds, measured where they happen
            if s.ranks is None:
                s.local.clear_leftover(step)  # a step dir without a manifest is moved aside, not in our way
                manifest = _commit_with_room(s, step, staged, user, wall)
            else:  # each node makes its own room first; a rank that cannot fails the commit for all
                assert s._commit_ranks is not None  # made with s.ranks
                s._room.make_room(step, staged.nbytes * s._node_ranks)
                manifest = commit_rank(s.local.root, step, staged, s._commit_ranks,
                                       param_span=param_span, user=user, wall_clock_seconds=wall)
    except CopyAborted:
        raise  # save() raised the copy's own error to its caller
    except Exception as exc:
        s._stats.save_failed(step, f"{type(exc).__name__}: {exc}")
        raise
    write_s = time.perf_counter() - started
    snapshot.settled.wait()  # save() has recorded the copy's cost
    after_commit(s, step, manifest, cost, write_s, spent)
    return manifest


def _commit_with_room(s: StoreParts, step: int, staged, user, wall: float) -> ShardManifest:
    """save_sharded, with room made first; a full disk mid-write (the estimate was short, or
    another process filled the disk) has removed its scratch: room is made by the same rules
    and the step written once more. Nothing rotation protects is ever evicted for it."""
    s._room.make_room(step, staged.nbytes)

    def attempt() -> ShardManifest:
        return save_sharded([staged], s.local.step_path(step), step, user=user,
                            wall_clock_seconds=wall, sha256=False)
    try:
        return attempt()
    except DiskFullError:
        if staged.handoff is not None and staged.handoff.read_live:
            raise  # its first parts came from live tensors, which have moved on: the next save retries
        if not s._room.make_room(step, None):
            raise  # nothing may be evicted: today's clear error, nothing committed touched
        return attempt()


def after_commit(s: StoreParts, step: int, manifest: ShardManifest, cost: dict, write_s: float, spent) -> None:
    """Committed. What follows can only warn: the checkpoint is safe whatever happens next."""
    try:
        s._stats.saved(step, cost, write_s, spent,
                       manifest.shards[s.rank].size if s.ranks is not None else manifest.total_size)
        if s._node_leader:
            s.local.update_latest()
        if s.ranks is None:  # committed with crc32c; sha256 next, on a thread of its own
            s._sha256.submit(step)
        if s.uploader is not None:
            s.uploader.enqueue(step)
        s._room.rotate()
    except Exception as exc:  # noqa: BLE001
        log.warning("step %d is committed, but the work after it failed: %s", step, exc)


def on_uploaded(s: StoreParts, step: int) -> None:
    """The uploader's word that ``step`` is on the remote (-1: it read what the remote holds):
    its cost recorded, and rotation may now evict what the remote holds."""
    if step >= 0 and s.uploader is not None and s.uploader.leader:
        info = s.uploader.status().get(step, {})
        if "upload_s" in info:
            try:
                created = s.local.manifest(step).created_unix
            except (OSError, ValueError):  # rotated out meanwhile: no lag to tell
                created = 0.0
            s._stats.uploaded(step, info["upload_s"], max(0.0, time.time() - created) if created else 0.0,
                              info.get("bytes_sent") or 0)
    s._room.rotate()
