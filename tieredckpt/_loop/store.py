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

With a remote, each committed step is queued for the uploader, which never
blocks the loop nor raises into it (uploader.py): when uploads lag only the
newest waiting step is sent. Local rotation never evicts a step the remote
does not hold (or that was superseded). A restore prefers the local copy when
it verifies and otherwise downloads the remote one (also onto a machine with
nothing local).

Opening, in order: the run directory's lock (one writer per run; runlock.py)
-> one probe of the remote (a missing bucket or refused credentials fail here,
before any training; an unreachable remote only warns) -> the remote writer
lease (one writer per prefix; lease.py) -> the uploader thread. A reader
(``read_only=True``) takes neither lock nor lease and never writes anything.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._format import layout, tree
from .._format.codec import MAX_LEVEL
from .._format.layout import CODECS
from .._format.manifest import ShardManifest
from .._format.phases import collecting
from .._format.shardfile import VERIFY_MODES
from .._format.tree import Staged
from .._tiers import folder
from .._tiers.lease import WriterLease
from .._tiers.local import LocalTier
from .._tiers.placement import Targets
from .._tiers.ranks import RankGroup, commit_rank, node_key
from .._tiers.remote import PART_SIZE, RemoteTier
from .._tiers.restore import Restorer, load_into
from .._tiers.retention import Policy
from .._tiers.runlock import RunLock
from .._tiers.sharded import check_user_value, fill_sha256, save_sharded
from .._tiers.transport import REQUEST_TIMEOUT
from .._tiers.uploader import MODES as UPLOAD_MODES
from .._tiers.uploader import Uploader
from ..errors import (
    BackgroundSaveError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DiskFullError,
    DistributedCommitError,
    RemoteError,
    TieredCkptError,
    WriterConflictError,
)
from .handoff import CopyAborted
from .runlog import RunLog, fork_run
from .signals import Requests, handle_signals
from .staging import Stager, StepHold, Unstaged
from .stats import Stats

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from .config import StoreConfig
    from .dcp import TieredReader, TieredWriter

UPLOAD_GROUP_TIMEOUT = 24 * 3600.0  # ranks wait for each other's uploads through long outages
# What close() may still spend on the remote once it stops waiting for uploads (after SIGTERM:
# Kubernetes sends SIGKILL 30 s after SIGTERM by default, systemd 90 s).
EXIT_TIMEOUT = 2.0
SAVE_ERROR_MODES = ("raise", "warn")

log = logging.getLogger("tieredckpt")

@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path | None  # the local directory, or None when only the remote holds it
    size: int
    created_unix: float
    world_size: int
    local: bool = True
    remote: bool = False
    upload: str | None = None  # pending / uploading / retrying / failed / None


def _background_priority() -> None:
    """Lower this thread's CPU priority by 10 nice levels (and that of the threads it starts, which inherit it):
    the sha256 of a committed step must not slow the next save's copy on the training loop,
    which shares the cores with it. Linux sets nice values per thread; elsewhere, or where
    not allowed, nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (AttributeError, OSError):
        pass


class SaveHandle:
    """The pending background write of one save."""

    def __init__(self, step: int, future: Future, hold: StepHold | None = None) -> None:
        self.step = step
        self._future = future
        self._hold = hold

    def done(self) -> bool:
        return self._future.done()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """With ``overlap=True``: block until the background copy of the state is done (the
        live tensors may change from then on). True once it is."""
        return self._hold.wait(timeout) if self._hold is not None else True

    def wait(self, timeout: float | None = None) -> ShardManifest:
        """Block until committed; raise BackgroundSaveError if the write failed."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise
        except Exception as exc:
            self.raised = True  # the store will not raise it a second time
            raise BackgroundSaveError(f"saving step {self.step} failed: {exc}") from exc

    raised = False


class CheckpointStore(AbstractContextManager):
    """A run's checkpoints on the tiers: atomic, verified, pickle-free commits on local disk,
    a background upload to a remote, rotation, and restores that prefer the local copy and
    fall back to the remote (also on a machine with nothing local).

        with CheckpointStore("runs/lm", "s3://bucket/runs/lm") as store:
            saved = store.restore(into={"model": model, "optim": opt})
            ...
            store.save(step, {"model": model, "optim": opt, "step": step})

    One writer per run directory and remote (a second raises WriterConflictError; open
    readers with ``read_only=True``). See ``__init__`` for every option, and
    ``from_config`` to read them from a TOML file."""

    def __init__(self, local: str | os.PathLike, remote: str | None = None, *, keep_local: int = 3,
                 every: int = 100, verify: str = "crc", remote_options: dict | None = None,
                 keep_remote: Policy | None = None, compression: str | None = "zstd-dtype",
                 compression_level: int = 1, uploads: str = "newest", max_pending_uploads: int | None = 2,
                 upload_backoff: tuple[float, ...] = (0.5, 10.0, 60.0), request_timeout: float = REQUEST_TIMEOUT,
                 audit_interval: float = 60.0,
                 on_upload_error: Callable[[int | None, Exception], None] | None = None,
                 upload_part_size: int = PART_SIZE, close_timeout: float | None = 600.0,
                 exit_timeout: float = EXIT_TIMEOUT, on_save_error: str = "raise",
                 read_only: bool = False, takeover: bool = False, remote_fs: AbstractFileSystem | None = None,
                 distributed: bool | None = None, stall_budget: float = 0.02,
                 on_stats: Callable[[dict], None] | None = None, overlap: bool = False,
                 orphan_grace: float | None = 3600.0) -> None:
        """``local``: the run directory. ``remote``: any fsspec URL (s3://bucket/prefix,
        file:///mnt/nas/run, memory://...), with ``remote_options`` passed to fsspec/s3fs.
        ``compression``: "zstd-dtype" (float-aware by each tensor's dtype, default),
        "zstd-planes" (fp32 planes for every byte, the earlier default), "zstd" or None for uploads.
        ``uploads``: "newest" (default: when uploads lag, only the newest waiting step is sent;
        older waiting ones are superseded, KeepEvery milestones of ``keep_remote`` excepted) or
        "all" (every step; ``save`` waits while more than ``max_pending_uploads`` are waiting).
        ``upload_backoff``: (first, cap[, slow]) seconds between retries: transient errors from
        ``first`` doubling to ``cap``; errors retrying does not fix every ``slow`` seconds.
        ``request_timeout``: seconds one remote request may take (plus 1 s per MB it moves).
        ``audit_interval``: how often an idle uploader checks that the remote still holds its
        newest upload. ``on_upload_error(step, exc)``: called on the uploader thread when an
        upload fails in a way retrying does not fix (access denied, no bucket, another writer).
        ``read_only``: a reader (eval job, notebook): lists and restores, never writes or deletes.
        ``takeover``: become the remote's writer even if another writer's lease has not lapsed.
        ``distributed``: one shard per rank of the torch.distributed world (default: when
        a process group of more than one rank is initialized); every rank must create
        its store at the same point.
        ``stall_budget``: the share of wall-clock time ``save()`` may block the loop before a
        warning says so (default 2%). ``on_stats(record)``: called with every save's and
        upload's cost record (see ``stats()`` and RUN_DIR/.events.jsonl).
        ``overlap``: the default of ``save(..., overlap=)`` (see there).
        ``close_timeout``: how long ``close()`` waits for pending uploads when it drains them.
        ``exit_timeout``: what ``close()`` may spend on the remote after that -- or at once after
        SIGTERM, when it does not drain: requests in flight are cancelled and the writer lease is
        released within it (default 2 s; an unreleased lease lapses). The next start resumes
        every upload that did not finish.
        ``on_save_error``: "raise" (default) raises a failed background write, once, at the next
        ``save``, ``wait`` or ``close``; "warn" logs it and goes on (the next save tries again), for
        a loop that must never stop over a checkpoint -- ``stats()``, ``upload_status()`` and
        ``tieredckpt ls`` report the failures. Either way a full disk is met by evicting, before
        the write, what rotation would evict after it (see ``_make_room``).
        ``orphan_grace``: objects on the remote that no committed step names (the parts of an upload
        a crash cut short) are deleted by this store, the remote's writer, once they are this many
        seconds old; it looks after an upload commits, at most once per that interval (default an
        hour). None leaves them to ``tieredckpt gc``."""
        codec = compression or "raw"
        if codec not in CODECS:
            raise ValueError(f"compression must be one of {CODECS[1:]} or None, got {compression!r}")
        if type(compression_level) is not int or not 1 <= compression_level <= MAX_LEVEL:
            raise ValueError(f"compression_level must be an int in [1, {MAX_LEVEL}], got {compression_level!r}")
        if type(keep_local) is not int or keep_local < 1:
            raise ValueError(f"keep_local must be an int >= 1, got {keep_local!r}")
        if type(every) is not int or every < 0:
            raise ValueError(f"every must be an int >= 0 (0: only on request), got {every!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if uploads not in UPLOAD_MODES:
            raise ValueError(f"uploads must be one of {UPLOAD_MODES}, got {uploads!r}")
        if not isinstance(exit_timeout, (int, float)) or isinstance(exit_timeout, bool) or exit_timeout < 0:
            raise ValueError(f"exit_timeout must be a number of seconds >= 0, got {exit_timeout!r}")
        if on_save_error not in SAVE_ERROR_MODES:
            raise ValueError(f"on_save_error must be one of {SAVE_ERROR_MODES}, got {on_save_error!r}")
        if orphan_grace is not None and (not isinstance(orphan_grace, (int, float)) or isinstance(orphan_grace, bool)
                                         or not orphan_grace >= 0):
            raise ValueError(f"orphan_grace must be a number of seconds >= 0 or None, got {orphan_grace!r}")
        if not isinstance(stall_budget, (int, float)) or not 0 < stall_budget <= 1:
            raise ValueError(f"stall_budget must be a share of time in (0, 1], got {stall_budget!r}")
        self.read_only = read_only
        self.local = LocalTier(local, create=not read_only, must_exist=not (read_only and remote))
        self.run = RunLog(local, create=not read_only)  # side files: written by rank 0 only
        # One checkpoint group per thread that issues collectives, so they never interleave:
        # the caller's (step-boundary flags, restore), the writer's (commits), the uploader's.
        self.ranks = RankGroup() if (RankGroup.active() if distributed is None else distributed) else None
        self._commit_ranks = RankGroup() if self.ranks is not None else None
        self.rank = self.ranks.rank if self.ranks else 0
        self._node_leader = True
        self._node_ranks = 1  # ranks whose shards share this run directory (the leader makes their room)
        if self.ranks is not None:  # the lowest rank sharing this directory rotates it
            nodes = self.ranks.all_gather_json(node_key(self.local.root))
            self._node_leader = nodes.index(nodes[self.rank]) == self.rank
            self._node_ranks = nodes.count(nodes[self.rank])
        self.keep_local = keep_local
        self.every = every
        self.verify = verify
        self.close_timeout, self.exit_timeout = close_timeout, float(exit_timeout)
        self.on_save_error = on_save_error
        self._room_warned = False
        self.requests = Requests()
        self._stats = Stats(self.local.root / layout.EVENTS_FILE if self.rank == 0 and not read_only else None,
                            float(stall_budget), on_stats)
        self._stager = Stager()
        self._hold = StepHold()
        self.overlap = overlap
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredckpt-writer")
        # sha256 of a committed step, recorded off the save's path (sharded.fill_sha256)
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredckpt-sha256",
                                            initializer=_background_priority)
        self._fill_lock = threading.Lock()
        self._filling: int | None = None  # the step the sha256 fill reads now (under _fill_lock)
        self._pending: SaveHandle | None = None
        self._closed = False
        self._rotate_lock = threading.Lock()
        self._wall_base, self._wall_start = 0.0, time.monotonic()  # training time, carried across resumes
        self._lock = RunLock(self.local.root)
        self.remote: RemoteTier | None = None
        self.uploader: Uploader | None = None
        try:
            self._agree(self._take_lock, "locking the run directory")
            if remote:
                self.remote = RemoteTier(remote, remote_options, fs=remote_fs, part_size=upload_part_size,
                                         request_timeout=request_timeout)
                lease = self._agree(lambda: self._open_remote(takeover), "opening the remote")
                if not read_only:
                    self.uploader = Uploader(
                        self.local, self.remote, codec=codec, level=compression_level, mode=uploads,
                        max_pending=max_pending_uploads, backoff=(upload_backoff[0], upload_backoff[1]),
                        slow_retry=upload_backoff[2] if len(upload_backoff) > 2 else 60.0,
                        audit_interval=audit_interval, keep_remote=keep_remote,
                        lease=lease, on_uploaded=self._on_uploaded, on_error=on_upload_error,
                        before_commit=lambda step: self._fill(step, quiet=False), orphan_grace=orphan_grace,
                        ranks=RankGroup(timeout_seconds=UPLOAD_GROUP_TIMEOUT) if self.ranks is not None else None)
        except BaseException:
            self._release()
            raise
        self._restorer = Restorer(self.local, self.remote, self.ranks, verify, self._node_leader, self.read_only)
        if not self.read_only and self.ranks is None:
            for step in self.local.steps():  # a crash after a commit left its sha256 to record
                self._finisher.submit(self._fill, step)
        if self.uploader is not None:
            self.uploader.start()  # it rotates once it knows what the remote holds
        elif self.remote is None:
            self._rotate()  # keep_local applies from the start (a smaller one frees disk at once)

    def _take_lock(self) -> None:
        if self.read_only or not self._node_leader:
            return
        try:
            self._lock.acquire()
        except WriterConflictError as exc:
            if not exc.read_only_dir:
                raise
            _warn(f"{exc}; opened as a reader (restores work, saves do not)")
            self.read_only = self._fell_back_to_reading = True
            return
        self.local.clean_stale_once()  # what a killed save or restore left behind

    def _open_remote(self, takeover: bool) -> WriterLease | None:
        """Fail fast on what no retry fixes (no bucket, access denied, another writer);
        a remote that does not answer only delays uploads (the uploader keeps trying)."""
        remote = self.remote
        assert remote is not None  # called only when the store has one
        try:
            remote.t.probe(create=not self.read_only)
        except RemoteError as exc:
            if not exc.transient:
                raise
            log.warning("%s: unreachable now (%s); local saves and restores go on, uploads start "
                        "when it answers", remote.display_url, exc)
            self._remote_down = True
        if self.read_only or self.rank != 0:
            return None
        lease = WriterLease(remote.t, floor=remote.newest_generation)
        if not getattr(self, "_remote_down", False):
            try:
                lease.acquire(takeover=takeover)
            except RemoteError as exc:
                if not exc.transient:
                    raise
                log.warning("%s: cannot record this writer yet (%s); retried in the background",
                            remote.display_url, exc)
        return lease

    def _agree(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on this rank; with many ranks, if it failed anywhere, raise everywhere."""
        if self.ranks is None:
            return fn()
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        outcomes = self.ranks.all_gather_json(f"{type(error).__name__}: {error}" if error else None)
        if error is not None:
            raise error
        failed = [(r, o) for r, o in enumerate(outcomes) if o]
        if failed:
            raise DistributedCommitError(f"{what}: rank {failed[0][0]} failed ({failed[0][1]})")
        return result

    @classmethod
    def from_config(cls, config: StoreConfig | dict | str | os.PathLike, section: str = "checkpoint",
                    **overrides: Any) -> CheckpointStore:
        """A store from a StoreConfig, a dict (the checkpoint section), or a .toml/.yaml/.json path."""
        from .config import StoreConfig
        if isinstance(config, (str, os.PathLike)):
            config = StoreConfig.load(config, section)
        elif isinstance(config, dict):
            config = StoreConfig.from_dict(config)
        kwargs = {**config.store_kwargs(), **overrides}
        return cls(kwargs.pop("local"), kwargs.pop("remote"), **kwargs)

    # ---- saving -----------------------------------------------------------------------

    def save(self, step: int, state: Any, *, user: dict | None = None,
             param_span: tuple[int, int] | None = None, overlap: bool | None = None) -> SaveHandle:
        """Snapshot ``state`` and write it in the background; returns at once after the copy.

        With many ranks every rank calls it for the same step with its own shard;
        ``param_span`` = (offset, numel) of this rank's slice of the flat parameter
        space (default: shards laid end to end in rank order).

        ``overlap=True``: what the ``torch.optim.Optimizer`` objects in ``state`` own
        (their parameters and state) is copied in the background, and their next
        ``step()`` waits until it is; everything else is copied before this returns.
        Pass the optimizer object itself (``{"optim": opt}``), not ``opt.state_dict()``.
        Code other than ``step()`` that changes parameters in place before then must
        call ``handle.wait_copied()`` first."""
        entered = time.monotonic()
        self._ready_for(step)
        user = check_user_value(user)  # a bad one is refused here, not in the background
        self.requests.clear_save()  # a signal from now on asks for another save
        staging = time.monotonic()
        defer = self._hold.owned(state) if (self.overlap if overlap is None else overlap) else set()
        snapshot = self._stager.stage_split(state, defer)
        cost = {"blocked_s": 0.0, "staging_s": 0.0}
        # The writer starts before the copy and writes each part as it is copied (staging.Snapshot):
        # the previous write is finished (_ready_for), so the buffers are ours. A copy that fails
        # stops the writer before its commit, and save() raises: nothing of this step is committed.
        if defer:
            self._hold.hold()  # released on the writer thread once the rest is copied
        try:
            future = self._writer.submit(self._write, step, snapshot, user, param_span, cost, bool(defer))
        except BaseException:
            self._hold.release()
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
        self._pending = SaveHandle(step, future, self._hold)
        self._stats.blocked(cost["blocked_s"])
        return self._pending

    def _ready_for(self, step: int) -> None:
        """What a save waits for and checks before it stages anything."""
        self._check_writable()
        self._finish_pending()  # back-pressure, and the previous failure surfaces here
        if self.uploader is not None:
            self.uploader.wait_for_room()  # uploads="all" only; never raises
        if (self.local.step_path(step) / layout.MANIFEST).exists():
            raise CheckpointExistsError(f"{self.local.step_path(step)}: step {step} is already committed")

    def commit_unstaged(self, step: int, state: Any, user: dict | None = None) -> ShardManifest:
        """Write ``state`` as ``step`` on the writer thread and wait for the commit, with no staging
        copy: for a caller that leaves the tensors unchanged until this returns (the DCP writer,
        inside ``dcp.save``, or on ``dcp.async_save``'s own staged copy). Every rank calls it."""
        self._ready_for(step)
        snapshot = Unstaged(Staged(*tree.flatten(state)))
        future = self._writer.submit(self._write, step, snapshot, user, None, {"blocked_s": 0.0, "staging_s": 0.0})
        self._pending = SaveHandle(step, future)
        return self._pending.wait()

    def _write(self, step: int, snapshot, user, param_span, cost: dict, deferred: bool = False) -> ShardManifest:
        # Runs on the writer thread, beside save()'s copy. Order: (overlap) the deferred copy, then
        # the optimizers' step() may go on -> loss history durable up to this step ->
        # checkpoint committed atomically (on every rank: ranks.commit_rank), each part written
        # once save() has copied it -> latest moved -> queued for upload -> old steps rotated out.
        staged = snapshot.staged
        if not snapshot.reads_live:
            snapshot.settled.wait()  # buffers already ours: the copy is quick on all cores, left alone
        self.run.sync()
        self.local.clean_stale_once()
        if deferred:
            copy_started = time.perf_counter()
            try:
                snapshot.copy_rest()
            finally:
                self._hold.release()
            cost["deferred_s"] = time.perf_counter() - copy_started
        wall = self._wall_base + time.monotonic() - self._wall_start  # the run's training time so far
        started = time.perf_counter()
        try:
            with collecting() as spent:  # fsync and commit seconds, measured where they happen
                if self.ranks is None:
                    self.local.clear_leftover(step)  # a step dir without a manifest is moved aside, not in our way
                    manifest = self._commit_with_room(step, staged, user, wall)
                else:  # each node makes its own room first; a rank that cannot fails the commit for all
                    assert self._commit_ranks is not None  # made with self.ranks
                    self._make_room(step, staged.nbytes * self._node_ranks)
                    manifest = commit_rank(self.local.root, step, staged, self._commit_ranks,
                                           param_span=param_span, user=user, wall_clock_seconds=wall)
        except CopyAborted:
            raise  # save() raised the copy's own error to its caller
        except Exception as exc:
            self._stats.save_failed(step, f"{type(exc).__name__}: {exc}")
            raise
        write_s = time.perf_counter() - started
        snapshot.settled.wait()  # save() has recorded the copy's cost
        self._after_commit(step, manifest, cost, write_s, spent)
        return manifest

    def _after_commit(self, step: int, manifest: ShardManifest, cost: dict, write_s: float, spent) -> None:
        """Committed. What follows can only warn: the checkpoint is safe whatever happens next."""
        try:
            self._stats.saved(step, cost, write_s, spent,
                              manifest.shards[self.rank].size if self.ranks is not None else manifest.total_size)
            if self._node_leader:
                self.local.update_latest()
            if self.ranks is None:  # committed with crc32c; sha256 next, on a thread of its own
                self._finisher.submit(self._fill, step)
            if self.uploader is not None:
                self.uploader.enqueue(step)
            self._rotate()
        except Exception as exc:  # noqa: BLE001
            log.warning("step %d is committed, but the work after it failed: %s", step, exc)

    # ---- folders of files -------------------------------------------------------------

    def save_files(self, step: int, directory: str | os.PathLike, *, user: dict | None = None,
                   link: bool = True) -> SaveHandle:
        """Commit a snapshot of the folder ``directory`` -- ordinary files in any tree, such as a
        framework's checkpoint folder -- as step ``step``, with everything a ``save`` gets: the
        atomic commit, ``latest``, rotation, upload, prefer-local restore (``restore_files``).

        Returns once every file is hard-linked into the step's scratch (copied where no link can
        be made, or with ``link=False``): from then on the folder may be changed or deleted. Its
        files are fsynced, checksummed and committed in the background (``handle.wait()``).
        Refused by name, with nothing saved: a symlink, FIFO, device or socket in the folder, a
        file name that could leave the step, an empty folder. A file rewritten *in place* after
        this returns would write through a hard link; use ``link=False`` for a folder whose files
        are changed in place (frameworks write new files). One process only (``distributed=False``
        in a multi-rank run: the rank that owns the folder saves it)."""
        if self.ranks is not None:
            raise ValueError("save_files runs in one process: open this store with distributed=False on "
                             "the rank that owns the folder")
        entered = time.monotonic()
        self._ready_for(step)
        user = check_user_value(user)
        self.requests.clear_save()
        staged = self._stage_with_room(step, Path(directory), link)
        cost = {"blocked_s": time.monotonic() - entered, "staging_s": time.monotonic() - entered}
        try:
            future = self._writer.submit(self._write_folder, step, staged, user, cost)
        except BaseException:
            folder.discard(staged)
            raise
        self._pending = SaveHandle(step, future)
        self._stats.blocked(cost["blocked_s"])
        return self._pending

    def _stage_with_room(self, step: int, directory: Path, link: bool) -> folder.Staged:
        """folder.stage; a full disk while copying (no hard link possible) makes room by the
        rotation rules, as a save does, and stages once more."""
        self.local.clear_leftover(step)
        newest = self.local.latest_step()
        previous = self.local.step_path(newest) if newest is not None else None
        try:
            return folder.stage(directory, self.local.step_path(step), link, previous)
        except DiskFullError:
            if not self._make_room(step, None):
                raise
            return folder.stage(directory, self.local.step_path(step), link, previous)

    def _write_folder(self, step: int, staged: folder.Staged, user: dict, cost: dict) -> ShardManifest:
        # The writer thread: loss history durable -> the staged files fsynced, checksummed and
        # committed (folder.commit: the manifest last, then the rename) -> _after_commit.
        self.run.sync()
        self.local.clean_stale_once()
        wall = self._wall_base + time.monotonic() - self._wall_start
        started = time.perf_counter()
        try:
            with collecting() as spent:
                manifest = folder.commit(staged, step, wall, user)
        except Exception as exc:
            self._stats.save_failed(step, f"{type(exc).__name__}: {exc}")
            raise
        self._after_commit(step, manifest, cost, time.perf_counter() - started, spent)
        return manifest

    def restore_files(self, step: int | None = None, *, to: str | os.PathLike) -> int | None:
        """Bring back the newest (or the named) folder step's files into ``to``, a new or empty
        directory: from the local copy when every file passes its crc32c, otherwise from the
        remote (also onto a machine with nothing local). ``to`` appears whole or not at all.
        Returns the step restored, or None when no tier holds any step (and none was named).
        A newer step that fails its checks on every tier is named in a warning and the next
        older one is used, as ``restore`` does."""
        self._check_open()
        self._finish_pending()
        before = set(self.local.steps())
        step = self._restorer.restore_files(step, Path(to))
        if step is not None and self.uploader is not None and step not in before and step in self.local.steps():
            self.uploader.downloaded(step)
        return step

    def _commit_with_room(self, step: int, staged, user, wall: float) -> ShardManifest:
        """save_sharded, with room made first; a full disk mid-write (the estimate was short, or
        another process filled the disk) has removed its scratch: room is made by the same rules
        and the step written once more. Nothing rotation protects is ever evicted for it."""
        self._make_room(step, staged.nbytes)

        def write() -> ShardManifest:
            return save_sharded([staged], self.local.step_path(step), step, user=user,
                                wall_clock_seconds=wall, sha256=False)
        try:
            return write()
        except DiskFullError:
            if staged.handoff is not None and staged.handoff.read_live:
                raise  # its first parts came from live tensors, which have moved on: the next save retries
            if not self._make_room(step, None):
                raise  # nothing may be evicted: today's clear error, nothing committed touched
            return write()

    def _make_room(self, step: int, nbytes: int | None) -> list[int]:
        """Before writing ``step``: evict what rotation evicts anyway once it commits -- the oldest
        local steps beyond ``keep_local - 1``; never the newest committed step, and with a remote
        only steps it holds or that were superseded -- until about ``nbytes`` (plus a margin for
        headers and the manifest) are free; ``None``: every step those rules allow."""
        if not self._node_leader or self.read_only:
            return []
        need = None if nbytes is None else nbytes + max(1 << 20, nbytes // 50)
        if need is not None and self.local.free_bytes() >= need:
            return []  # the usual case: one statvfs, no listing of steps or of the uploader's state
        self._await_fill_of_removed()  # a rotated step still being hashed holds its blocks
        with self._rotate_lock:
            evicted = self.local.make_room(need, self.keep_local - 1, self._protected())
        self._await_fill_of_removed()
        if evicted:
            log.info("step %d: rotated out step(s) %s before writing it, to make room", step, evicted)
            if not self._room_warned:
                self._room_warned = True
                _warn(f"{self.local.root}: the disk holds fewer than keep_local + 1 = {self.keep_local + 1} "
                      f"checkpoints of this size; old steps are rotated out before each save instead of "
                      f"after, so a crash mid-save leaves {self.keep_local - 1} committed local step(s), "
                      f"not {self.keep_local} (free more space or lower keep_local to avoid this)")
        return evicted

    def _protected(self) -> set[int]:
        """Local steps rotation must keep: those the remote does not hold yet (Uploader.evictable)."""
        if self.uploader is None:
            return set()
        return set(self.local.steps()) - self.uploader.evictable()

    def _fill(self, step: int, quiet: bool = True) -> None:
        """Record the sha256 of a step committed with crc32c alone (one process; many ranks record
        it in the commit). Runs on the sha256 thread after each commit, and on the uploader's
        before the remote's commit marker embeds the manifest (``quiet=False``: a shard whose
        crc32c fails is an upload error, so no remote copy is committed from it)."""
        with self._fill_lock:
            self._filling = step
            try:
                fill_sha256(self.local.step_path(step))
            except CheckpointNotFoundError:
                pass  # rotated away meanwhile (the read stops within a chunk)
            except (TieredCkptError, OSError) as exc:
                if not self.local.step_path(step).exists():
                    return  # rotated away while it was read
                if not quiet:
                    raise
                log.warning("step %d: its sha256 could not be recorded: %s", step, exc)
            finally:
                self._filling = None

    def _await_fill_of_removed(self) -> None:
        """Wait while the sha256 fill still reads a step rotation has removed: its mapping keeps
        the deleted shards' blocks allocated until it ends, and the fill notices the removal
        within one chunk (fill_sha256). The fill of a kept step is not waited for."""
        filling = self._filling
        if filling is not None and not self.local.step_path(filling).exists():
            with self._fill_lock:
                pass

    def _on_uploaded(self, step: int) -> None:
        """The uploader's word that ``step`` is on the remote (-1: it read what the remote holds)."""
        if step >= 0:
            info = self.uploader.status().get(step, {}) if self.uploader is not None else {}
            if "upload_s" in info and self.uploader is not None and self.uploader.leader:
                try:
                    created = self.local.manifest(step).created_unix
                except (OSError, ValueError):  # rotated out meanwhile: no lag to tell
                    created = 0.0
                self._stats.uploaded(step, info["upload_s"], max(0.0, time.time() - created) if created else 0.0,
                                     info.get("bytes_sent") or 0)
        self._rotate()

    def _rotate(self) -> None:
        """Keep the last ``keep_local`` steps, never evicting one the remote does not hold
        (or that was superseded there) -- see Uploader.evictable."""
        if not self._node_leader or self.read_only:
            return
        with self._rotate_lock:
            self.local.rotate(self.keep_local, protected=self._protected())

    def should_save(self, step: int) -> bool:
        """Cadence (``step % every == 0``) or a pending SIGUSR1/SIGTERM request."""
        return (self.every > 0 and step % self.every == 0) or self.requests.save_requested()

    def should_stop(self) -> bool:
        return self.requests.stop_requested()

    def step_end(self, step: int, state: Any | Callable[[], Any], *,
                 param_span: tuple[int, int] | None = None) -> bool:
        """The step boundary: save if due (``state`` may be a callable), return True to stop.

        On a stop request the checkpoint is committed before this returns.
        """
        save_now, stop = self.should_save(step), self.should_stop()
        if self.ranks is not None:  # a signal to any one rank: every rank saves this step
            save_now, stop = self.ranks.any([save_now, stop])
            if stop:
                self.requests.request_stop()
        if save_now:
            handle = self.save(step, state() if callable(state) else state, param_span=param_span)
            if stop:
                handle.wait()
        return stop

    def handle_signals(self) -> AbstractContextManager[Requests]:
        """Context manager: SIGTERM -> save and stop, SIGUSR1 -> save and go on."""
        return handle_signals(self.requests)

    def log_loss(self, step: int, loss: float, **extra: Any) -> None:
        self._check_writable()
        if self.rank == 0:
            self.run.append_loss(step, loss, **extra)

    # ---- waiting --------------------------------------------------------------------

    def wait(self, uploads: bool = False, timeout: float | None = None) -> bool:
        """Block until the pending write is committed; with ``uploads``, also until every
        committed step is uploaded or ``timeout`` passes (False then). Raises a failed
        write (BackgroundSaveError), and with ``uploads`` an UploadError when a step
        failed in a way retrying does not fix."""
        self._finish_pending()
        self._finisher.submit(lambda: None).result()  # every committed step's sha256 recorded
        if uploads and self.uploader is not None:
            return self.uploader.drain(timeout)
        return True

    def _finish_pending(self) -> None:
        """Wait for the previous write; raise its failure unless its handle already did."""
        pending, self._pending = self._pending, None
        if pending is None or pending.raised:
            return
        try:
            pending.wait()
        except BackgroundSaveError as exc:
            if self.on_save_error == "raise":
                raise
            log.error("%s; training goes on (on_save_error='warn') and the next save tries again", exc)

    def close(self, drain_uploads: bool | None = None) -> None:
        """Finish the pending write, release the run; raise what failed.

        Pending uploads are drained (up to ``close_timeout``) unless ``drain_uploads``
        is False -- the default after SIGTERM or when leaving the ``with`` block on an
        exception: the next start resumes them. Then, or at once when not draining,
        requests in flight are cancelled and the lease released within ``exit_timeout``:
        a hanging remote never holds the exit up. Uploads that failed for good are
        raised here, every step of them, as one UploadError.
        """
        if self._closed:
            return
        if drain_uploads is None:
            drain_uploads = not self.should_stop()
        try:
            self._finish_pending()
            if self.uploader is not None:
                if drain_uploads and not self.uploader.drain(self.close_timeout):
                    log.warning("closing with uploads still pending (%s); the next start resumes them",
                                self.uploader.pending())
                self.uploader.raise_error()
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        """Stop the threads and let go of the run directory and the remote (never raises)."""
        try:
            if self.uploader is not None:
                self.uploader.close(self.exit_timeout)  # nothing waits on the network past it
            self._writer.shutdown(wait=True)
            self._finisher.shutdown(wait=True)
            self._hold.release_all()
            self.run.close()
            if self.remote is not None:
                self.remote.close()
        finally:
            self._lock.release()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # already failing: commit what was staged, leave uploads, never mask the error
            self.close(drain_uploads=False)
        except Exception:  # noqa: BLE001
            log.exception("while closing after an error")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointStore is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise PermissionError(f"{self.local.root}: this store was opened read_only=True; it never writes")

    # ---- restoring ------------------------------------------------------------------

    def restore(self, step: int | None = None, *, into: dict | None = None,
                mark_resume: bool = True, reshard: bool = False) -> Any:
        """The newest (or the named) committed checkpoint's state, verified.

        Returns None only when the run has no checkpoint on any tier and no step was
        named; a remote that cannot be asked is an error then, never an empty run.
        With no step named, a newer step that does not load and verify (on either tier)
        is named in a warning, moved to ``quarantine/`` and the next older one is used.
        ``into`` maps top-level keys to objects with ``load_state_dict`` (a model,
        an optimizer...), which are loaded from the matching saved entries; every
        key is checked before any object is touched. ``mark_resume`` records the
        resume in the loss history so replayed steps can be told apart.
        ``reshard``: a checkpoint written by another number of ranks is re-split
        for this world (ZeRO-style "flat" state, see _tiers/reshard.py); without
        it a world-size change is refused.
        """
        self._check_open()
        self._finish_pending()
        if self.rank == 0 and self.remote is not None and not self.read_only:
            self._fetch_side_files()
        before = set(self.local.steps())
        step, state = self._restorer.restore(step, reshard, Targets(into) if into else None)
        if step is None:
            return None
        if self.uploader is not None and step not in before and step in self.local.steps():
            self.uploader.downloaded(step)  # the remote holds it: rotation may evict it like any uploaded step
        self._resumed_from(step)
        if into:
            load_into(state, into, self.local.step_path(step))
        if mark_resume and self.rank == 0:
            if getattr(self, "_fell_back_to_reading", False):
                _warn(f"{self.local.root}: cannot be written; the resume is not recorded in the loss history")
            elif not self.read_only:
                self.run.mark_resume(step)
        return state

    def dcp_writer(self, step: int, extra: Any = None, user: dict | None = None) -> TieredWriter:
        """A torch.distributed.checkpoint StorageWriter that commits into this store as ``step``:
        ``dcp.save(state, storage_writer=store.dcp_writer(step))`` (or ``dcp.async_save``), on
        every rank. The step is committed, rotated and uploaded like one ``save()`` wrote.
        ``extra``: a plain tree (tensors, numbers, strings, lists, dicts) kept beside this rank's
        entries, outside DCP's planner; ``store.dcp_reader(step).read_extra()`` gives it back.
        ``user``: JSON metadata for the manifest, as ``save(user=...)`` (the same on every rank)."""
        from .dcp import TieredWriter
        self._check_writable()
        return TieredWriter(self, step, extra, user)

    def dcp_reader(self, step: int | None = None) -> TieredReader:
        """A torch.distributed.checkpoint StorageReader of ``step`` (default: the newest on any
        tier): ``dcp.load(state, storage_reader=store.dcp_reader())``. Local copies are preferred;
        a missing or corrupt one is read from the remote (also on a machine with nothing local)."""
        from .dcp import TieredReader
        self._check_open()
        return TieredReader(self, step)

    def _resumed_from(self, step: int) -> None:
        """Carry the run's training time on from the restored checkpoint."""
        try:
            if step in self.local.steps():
                self._wall_base = self.local.manifest(step).wall_clock_seconds
                self._wall_start = time.monotonic()
        except TieredCkptError:
            pass

    def _fetch_side_files(self) -> None:
        """Complete the run's side files from the remote (each missing one, a longer loss history)."""
        if self.remote is None:
            return
        self.run.close()  # the loss history may be replaced; reopen it afterwards
        try:
            self.remote.get_side_files(self.local.root, warn=_warn)
        except RemoteError as exc:
            _warn(f"could not fetch the run's side files: {exc}")

    def latest_step(self) -> int | None:
        """The newest committed step on any tier (a constant number of remote requests)."""
        steps = [s for s in (self.local.latest_step(),) if s is not None]
        if self.remote is not None:
            newest = self.remote.newest_step()
            steps += [newest] if newest is not None else []
        return max(steps) if steps else None

    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint on either tier, oldest first, with where it lives.

        When the remote cannot be listed (an outage) the local ones are listed with
        their upload state, and a warning says so."""
        local = set(self.local.steps())
        remote: set[int] = set()
        if self.remote is not None:
            try:
                remote = set(self.remote.steps())
            except RemoteError as exc:
                _warn(f"cannot list the remote: {exc}")
        status = self.uploader.status() if self.uploader is not None else {}
        out = []
        for step in sorted(local | remote):
            m = self.local.manifest(step) if step in local or self.remote is None \
                else self.remote.upload_manifest(step).shard_manifest
            upload = status.get(step, {}).get("state") if step not in remote and self.remote else None
            out.append(CheckpointInfo(step, self.local.step_path(step) if step in local else None, m.total_size,
                                      m.created_unix, m.world_size, step in local, step in remote, upload))
        return out

    def stats(self) -> dict:
        """What checkpoints have cost this process's loop: ``blocked_share`` (time ``save()``
        blocked over wall-clock time since the store opened), and medians, maxima and totals
        of each save's blocked, staging, write, fsync and commit seconds and bytes, and of each
        upload's seconds, lag (local commit to remote commit) and bytes sent."""
        return self._stats.summary()

    def upload_status(self) -> dict:
        """How far the remote lags: newest local and uploaded steps, what waits, the last error;
        and per step this process uploaded (``"steps"``), its state, ``bytes_sent`` (what the upload
        wrote) and ``bytes_referenced`` (what the step is made of on the remote: the difference is
        objects of earlier steps whose bytes did not change)."""
        newest_local = self.local.latest_step()
        if self.uploader is None:
            return {"remote": self.remote.display_url if self.remote else None, "newest_local": newest_local,
                    **self._save_failures()}
        summary = self.uploader.summary()
        summary["newest_local"] = newest_local
        summary.update(self._save_failures())
        uploaded = summary["newest_uploaded"]
        summary["lag_steps"] = None if newest_local is None else newest_local - (uploaded if uploaded is not None else 0)
        summary["steps"] = {step: {k: entry[k] for k in ("state", "bytes_sent", "bytes_referenced", "upload_s")
                                   if k in entry} for step, entry in self.uploader.status().items()}
        return summary

    def _save_failures(self) -> dict:
        summary = self._stats.summary()
        return {"save_failures": summary["save_failures"], "last_save_failure": summary["last_save_failure"]}

    # ---- side files -------------------------------------------------------------------

    def pivot(self, step: int, note: str = "") -> Path:
        """Archive samples and bandit state (never the loss history) and start them clean."""
        self._check_writable()
        return self.run.pivot(step, note)

    def fork(self, step: int, new_run_dir: str | os.PathLike, *, remote: str | None = None,
             remote_options: dict | None = None) -> Path:
        """Copy checkpoint ``step`` into a new run directory with its provenance.

        With ``remote`` (the new run's remote: a new prefix on this store's remote storage, such as
        another prefix of the same bucket), the step is committed there too, without sending its
        bytes: the storage copies each of the step's objects itself (S3 CopyObject; a disk copies
        the file), and only the manifests travel. The copies belong to the new run, so retention in
        either run never breaks the other. The step must be on this store's remote already
        (``wait(uploads=True)``); ``remote_options`` default to this store's. A store opened on the
        new run with that remote finds the step there and sends nothing."""
        self._finish_pending()
        if remote is None:
            return fork_run(self.local.root, step, new_run_dir)
        if self.remote is None or not self.remote.is_committed(step):
            raise CheckpointNotFoundError(
                f"fork(remote=...): step {step} is not on this store's remote "
                f"({self.remote.display_url if self.remote else 'none configured'}); "
                "wait(uploads=True) for it first")
        return self._fork_remote(step, Path(new_run_dir), remote, remote_options)

    def _fork_remote(self, step: int, new_run_dir: Path, url: str, options: dict | None) -> Path:
        """Order: the new remote's lease taken and the remote found empty (nothing is written
        anywhere before) -> the local fork -> the step's objects copied by the storage -> its
        marker committed under that lease -> latest and the side files -> the lease let go.

        All or nothing up to the marker: if the copy or the commit fails, the local fork this call
        made is removed again, so the same call can be retried; the remote keeps only objects no
        step names (``tieredckpt gc``), never a partial step. After the marker the fork exists in
        both places: a failure of latest or the side files is warned of, not raised (the new run's
        store writes both with its next upload)."""
        assert self.remote is not None
        child = RemoteTier(url, self.remote.t.options if options is None else options,
                           request_timeout=self.remote.t.request_timeout)
        try:
            _require_empty(child)  # before taking its lease: a live run's remote is refused for what it is
            lease = WriterLease(child.t, floor=child.newest_generation)
            lease.acquire()
            try:
                _require_empty(child)  # and under it: nobody committed there meanwhile
                root = fork_run(self.local.root, step, new_run_dir)
                try:
                    child.copy_step_from(self.remote, step, writer=lease.identity(), fence=lambda: lease.fence(commit=True))
                except BaseException:
                    shutil.rmtree(root, ignore_errors=True)  # ours, made above: nothing of the user's is in it
                    raise
                _finish_fork(child, step, root)
            finally:
                lease.release()
        finally:
            child.close()
        return root


def _finish_fork(child: RemoteTier, step: int, root: Path) -> None:
    try:
        child.write_latest(step)
        child.put_side_files(root)
    except RemoteError as exc:
        _warn(f"fork: step {step} is committed on {child.display_url} and in {root}, but its latest pointer or "
              f"side files were not written ({exc}); a store opened on the new run writes them with its next upload")


def _require_empty(remote: RemoteTier) -> None:
    if remote.step_dirs():
        raise CheckpointExistsError(f"{remote.display_url}: already holds checkpoints; a fork's remote must be "
                                    "a new prefix")


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
