"""CheckpointStore: the object a training loop holds -- the list of what a user can do. The work
lives in the modules named after it: opening.py, saving.py (and room.py, sha256fill.py),
folders.py, restoring.py, closing.py, forks.py; the tiers below them in _tiers/.

    with CheckpointStore("runs/lm", every=100) as store, store.handle_signals():
        state = store.restore(into={"model": model, "optim": opt})
        start = state["step"] if state else 0
        for step in range(start + 1, total + 1):
            loss = train_step()
            store.log_loss(step, loss)
            if store.step_end(step, lambda: {"model": model, "optim": opt, "step": step}):
                break                                     # SIGTERM: saved, now exit 0

A save blocks only while the state is copied into reused staging buffers (saving.py). With a
remote, each committed step is queued for the uploader, which never blocks the loop nor raises
into it (_tiers/uploader.py): when uploads lag only the newest waiting step is sent. Local
rotation never evicts a step the remote does not hold (or that was superseded; room.py). A
restore prefers the local copy when it verifies and otherwise downloads the remote one (also
onto a machine with nothing local). A reader (``read_only=True``) takes neither lock nor lease
and never writes anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._format import layout
from .._format.manifest import ShardManifest
from .._tiers.lease import WriterLease
from .._tiers.local import LocalTier
from .._tiers.ranks import RankGroup, node_key
from .._tiers.remote import PART_SIZE, RemoteTier
from .._tiers.restore import Restorer
from .._tiers.retention import Policy
from .._tiers.runlock import RunLock
from .._tiers.transport import REQUEST_TIMEOUT
from .._tiers.uploader import Uploader
from ..errors import RemoteError, warn_user
from . import closing, folders, forks, opening, restoring, saving
from .handle import CheckpointInfo, SaveHandle
from .room import Room
from .runlog import RunLog
from .sha256fill import Sha256Fill
from .signals import Requests, handle_signals
from .staging import Stager, StepHold
from .stats import Stats

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from .config import StoreConfig
    from .dcp import TieredReader, TieredWriter

__all__ = ["CheckpointInfo", "CheckpointStore", "SaveHandle"]

UPLOAD_GROUP_TIMEOUT = 24 * 3600.0  # ranks wait for each other's uploads through long outages
# What close() may still spend on the remote once it stops waiting for uploads (after SIGTERM:
# Kubernetes sends SIGKILL 30 s after SIGTERM by default, systemd 90 s).
EXIT_TIMEOUT = 2.0
# What close() may spend after SIGTERM sending the step just saved to the remote, before that: a
# preempted node rarely comes back, so a step left local is lost. 20 s + exit_timeout + the save
# fit in Kubernetes' default 30 s grace.
UPLOAD_ON_EXIT = 20.0


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
                 exit_timeout: float = EXIT_TIMEOUT, upload_on_exit: float = UPLOAD_ON_EXIT,
                 on_save_error: str = "raise",
                 read_only: bool = False, takeover: bool = False, allow_unfenced: bool = False, remote_fs: AbstractFileSystem | None = None,
                 distributed: bool | None = None, stall_budget: float = 0.02,
                 on_stats: Callable[[dict], None] | None = None, overlap: bool = False,
                 orphan_grace: float | None = 3600.0, storage_options: dict | None = None,
                 fs: AbstractFileSystem | None = None) -> None:
        """Open (or create) a run's store.

        :param local: the run directory on this machine's disk (a path, never a URL; created
            when missing).
        :param remote: where steps are copied in the background: any fsspec URL
            (``s3://bucket/prefix``, ``file:///mnt/nas/run``, ``gs://...``, ``memory://...``).
            None: local only.
        :param keep_local: how many committed steps stay on local disk (the newest ones; a step
            not yet on the remote is kept until it is).
        :param every: the save interval in steps, for ``should_save(step)`` and ``step_end``
            (0: only on request, a SIGUSR1 or SIGTERM).
        :param verify: what a restore checks before a byte reaches the model: "crc" (crc32c of
            every shard, default), "sha256" (also the sha256, slower) or "none".
        :param remote_options: options for the remote's fsspec filesystem (s3fs: ``key``,
            ``secret``, ``endpoint_url``, ``client_kwargs``...). Credentials are never logged.
        :param keep_remote: which steps the remote keeps: ``KeepLast(n)``, ``KeepEvery(k)`` or
            ``AnyOf(...)`` of them. None: every step.
        :param compression: how uploads are compressed: "zstd-dtype" (by each tensor's dtype,
            default), "zstd-planes" (fp32 byte planes), "zstd", or None (raw). Local steps are
            never compressed.
        :param compression_level: the zstd level (1-22; 1 keeps up with the network).
        :param uploads: "newest" (default: when uploads lag, only the newest waiting step is
            sent; older waiting ones are superseded, KeepEvery milestones excepted) or "all"
            (every step is sent; ``save`` waits while more than ``max_pending_uploads`` wait).
        :param max_pending_uploads: with ``uploads="all"``, how many steps may wait for upload
            before ``save`` blocks (None: no limit).
        :param upload_backoff: ``(first, cap[, slow])`` seconds between retries: a transient
            error is retried after ``first`` seconds, doubling up to ``cap``; an error a retry
            does not fix (access denied, no bucket) every ``slow`` seconds.
        :param request_timeout: seconds one remote request may take, plus one second per MB it
            moves.
        :param audit_interval: seconds between an idle uploader's checks that the remote still
            holds its newest upload (a damaged or deleted step is sent again).
        :param on_upload_error: ``fn(step, exc)``, called on the uploader's thread when an upload
            fails in a way retrying does not fix.
        :param upload_part_size: bytes per uploaded object part (default 64 MiB); unchanged
            parts are never sent twice.
        :param close_timeout: seconds ``close()`` waits for pending uploads when it drains them
            (None: no limit).
        :param exit_timeout: seconds ``close()`` may spend on the remote after the drain (or
            after ``upload_on_exit``): requests in flight are cancelled and the writer lease
            released within it. The next start resumes every upload that did not finish.
        :param upload_on_exit: after SIGTERM (a preemption: the node may never come back), the
            seconds ``close()`` spends uploading the step just saved, first and alone, before it
            exits (default 20: with the save and ``exit_timeout`` it fits Kubernetes' 30 s
            grace; 0: none).
        :param on_save_error: "raise" (default): a failed background write is raised once, at
            the next ``save``, ``wait`` or ``close``; "warn": it is logged and the loop goes on
            (the next save tries again; ``stats()``, ``upload_status()`` and ``tieredckpt ls``
            report it). A full disk is met first by evicting what rotation would evict anyway.
        :param read_only: a reader (an eval job, a notebook): lists and restores, never writes,
            deletes or takes the writer's lease.
        :param takeover: become the remote's writer even if another writer's lease has not
            lapsed (the other writer is fenced off and never writes there again).
        :param allow_unfenced: open for writing even where the server ignores or refuses
            conditional writes (If-None-Match/If-Match), which is found out at open. There a
            second writer is not fenced off, so only when one writer ever runs. By default such
            a server is refused at open, with this said.
        :param remote_fs: the same as ``fs`` (the older name).
        :param distributed: one shard per rank of the torch.distributed world (default: when a
            process group of more than one rank is initialized). Every rank creates its store at
            the same point.
        :param stall_budget: the share of wall-clock time ``save()`` may block the loop before a
            warning says so (default 0.02: 2%).
        :param on_stats: ``fn(record)``, called with every save's and upload's cost record (see
            ``stats()``; also written to ``RUN_DIR/.events.jsonl``).
        :param overlap: the default of ``save(..., overlap=)``.
        :param orphan_grace: seconds after which objects on the remote that no committed step
            names (parts of an upload a crash cut short) are deleted by the remote's writer; it
            looks at most once per that interval. None leaves them to ``tieredckpt gc``.
        :param storage_options: the same as ``remote_options``, under fsspec's name.
        :param fs: an fsspec filesystem instance for the remote, used instead of one made from
            ``remote`` (which is still required: it names the prefix).
        :raises WriterConflictError: another live writer holds the run directory or the remote.
        :raises ValueError: an option out of range, or a URL given as ``local``.
        """
        opening.check_local(local, remote)
        remote_options = opening.alias("storage_options", storage_options, "remote_options", remote_options)
        remote_fs = opening.alias("fs", fs, "remote_fs", remote_fs)
        if remote_fs is not None and not remote:
            raise ValueError("fs= (remote_fs=) is the remote's filesystem and needs remote= (its URL); "
                             "without a remote it would be ignored")
        opening.check_options(compression, compression_level, keep_local, every, verify, uploads, exit_timeout,
                              upload_on_exit, on_save_error, orphan_grace, stall_budget)
        self.read_only = read_only
        self._fell_back_to_reading = False  # a writer on a directory that cannot be written
        self.local = LocalTier(local, create=not read_only, must_exist=not (read_only and remote))
        self.run = RunLog(local, create=not read_only)  # side files: written by rank 0 only
        self._join_ranks(distributed)
        self.keep_local = keep_local
        self.every = every
        self.verify = verify
        self.close_timeout, self.exit_timeout = close_timeout, float(exit_timeout)
        self.upload_on_exit = float(upload_on_exit)
        self.on_save_error = on_save_error
        self.requests = Requests()
        self._stats = Stats(self.local.root / layout.EVENTS_FILE if self.rank == 0 and not read_only else None,
                            float(stall_budget), on_stats)
        self._stager = Stager()
        self._hold = StepHold()
        self.overlap = overlap
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredckpt-writer")
        self._sha256 = Sha256Fill(self.local)
        self._room = Room(self.local, keep_local, self._sha256, lambda: self._node_leader and not self.read_only)
        self._pending: SaveHandle | None = None
        self._closed = False
        self._wall_base, self._wall_start = 0.0, time.monotonic()  # training time, carried across resumes
        self._lock = RunLock(self.local.root)
        self.remote: RemoteTier | None = None
        self.uploader: Uploader | None = None
        try:
            opening.agree(self.ranks, self._take_lock, "locking the run directory")
            if remote:
                self.remote = RemoteTier(remote, remote_options, fs=remote_fs, part_size=upload_part_size,
                                         request_timeout=request_timeout)
                lease = opening.agree(self.ranks, lambda: self._open_remote(takeover, allow_unfenced), "opening the remote")
                if not read_only:
                    self.uploader = self._room.uploader = Uploader(
                        self.local, self.remote, codec=compression or "raw", level=compression_level, mode=uploads,
                        max_pending=max_pending_uploads, backoff=(upload_backoff[0], upload_backoff[1]),
                        slow_retry=upload_backoff[2] if len(upload_backoff) > 2 else 60.0,
                        audit_interval=audit_interval, keep_remote=keep_remote,
                        lease=lease, on_uploaded=lambda step: saving.on_uploaded(self, step), on_error=on_upload_error,
                        before_commit=lambda step: self._sha256.fill(step, quiet=False), orphan_grace=orphan_grace,
                        ranks=RankGroup(timeout_seconds=UPLOAD_GROUP_TIMEOUT) if self.ranks is not None else None)
        except BaseException:
            closing.release(self)
            raise
        self._restorer = Restorer(self.local, self.remote, self.ranks, verify, self._node_leader, self.read_only)
        self._start()

    def _join_ranks(self, distributed: bool | None) -> None:
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

    def _take_lock(self) -> None:
        if self.read_only or not self._node_leader:
            return
        if not opening.take_lock(self._lock, self.local):
            self.read_only = self._fell_back_to_reading = True

    def _open_remote(self, takeover: bool, allow_unfenced: bool) -> WriterLease | None:
        assert self.remote is not None  # called only when the store has one
        answered = opening.probe(self.remote, self.read_only)
        if self.read_only or self.rank != 0:
            return None
        return opening.take_lease(self.remote, takeover, answered, allow_unfenced)

    def _start(self) -> None:
        if not self.read_only and self.ranks is None:
            for step in self.local.steps():  # a crash after a commit left its sha256 to record
                self._sha256.submit(step)
        if self.uploader is not None:
            self.uploader.start()  # it rotates once it knows what the remote holds
        elif self.remote is None:
            self._room.rotate()  # keep_local applies from the start (a smaller one frees disk at once)

    @classmethod
    def from_config(cls, config: StoreConfig | dict | str | os.PathLike, section: str = "checkpoint",
                    **overrides: Any) -> CheckpointStore:
        """A store from a config file's checkpoint section.

        :param config: a ``StoreConfig``, a dict (the section itself), a ``StoreConfig.from_env()``,
            or the path of a .toml, .yaml/.yml or .json file.
        :param section: the section of the file that holds the options (``[checkpoint]``).
        :param overrides: options that replace the file's, including those a file cannot hold
            (``on_upload_error``, ``on_stats``, ``fs``)."""
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
        call ``handle.wait_copied()`` first.

        :param step: the step number; a committed step is never overwritten.
        :param state: a tree of tensors, numbers, strings, lists, tuples, dicts and objects with
            ``state_dict()`` (models, optimizers, schedulers); nothing pickled.
        :param user: JSON metadata kept in the manifest (``tieredckpt inspect`` shows it).
        :param param_span: this rank's ``(offset, numel)`` of the flat parameter space.
        :param overlap: copy the optimizers' tensors in the background (default: the store's).
        :returns: a ``SaveHandle``: ``wait()`` for the commit, ``wait_copied()`` for the copy.
        :raises CheckpointExistsError: ``step`` is already committed.
        :raises UnsupportedStateError: a value the format does not store (named by its place).
        :raises BackgroundSaveError: the previous save's background write failed."""
        return saving.save(self, step, state, user, param_span, overlap)

    def commit_unstaged(self, step: int, state: Any, user: dict | None = None) -> ShardManifest:
        """Write ``state`` as ``step`` on the writer thread and wait for the commit, with no staging
        copy: for a caller that leaves the tensors unchanged until this returns (the DCP writer,
        inside ``dcp.save``, or on ``dcp.async_save``'s own staged copy). Every rank calls it.

        :param step: the step number.
        :param state: the tree to write, as for ``save``.
        :param user: JSON metadata for the manifest."""
        return saving.commit_unstaged(self, step, state, user)

    def save_files(self, step: int, directory: str | os.PathLike, *, user: dict | None = None,
                   link: bool = False) -> SaveHandle:
        """Commit a snapshot of the folder ``directory`` -- ordinary files in any tree, such as a
        framework's checkpoint folder -- as step ``step``, with everything a ``save`` gets: the
        atomic commit, ``latest``, rotation, upload, prefer-local restore (``restore_files``).

        Returns once every file is copied into the step's scratch (a reflink where the
        filesystem has them, else an in-kernel copy): the snapshot is frozen from then on, and
        the folder may be rewritten in place, changed or deleted. Its files are fsynced,
        checksummed and committed in the background (``handle.wait()``). Refused by name, with
        nothing saved: a symlink, FIFO, device or socket in the folder, a file name that could
        leave the step, an empty folder. One process only (``distributed=False`` in a
        multi-rank run: the rank that owns the folder saves it).

        ``link=True`` hard-links the files instead (no data copied), and requires of the
        caller that no file of the folder is ever opened for writing again: write each
        checkpoint into a new folder and only delete old ones (as the Hugging Face Trainer
        does). A file rewritten in place would write through into the committed step; the
        damage is found (a warning at the next save, the crc32c of every restore and upload),
        but where no other tier holds that step it is lost.

        :param step: the step number.
        :param directory: the folder to commit.
        :param user: JSON metadata for the manifest.
        :param link: hard-link instead of copying (see above)."""
        return folders.save_files(self, step, Path(directory), user, link)

    def restore_files(self, step: int | None = None, *, to: str | os.PathLike) -> int | None:
        """Bring back the newest (or the named) folder step's files into ``to``, a new or empty
        directory: from the local copy when every file passes its crc32c, otherwise from the
        remote (also onto a machine with nothing local). ``to`` appears whole or not at all.
        Returns the step restored, or None when no tier holds any step (and none was named).
        A newer step that fails its checks on every tier is named in a warning and the next
        older one is used, as ``restore`` does.

        :param step: the step (default: the newest).
        :param to: the directory to create (or an empty one)."""
        return folders.restore_files(self, step, Path(to))

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: the cadence (``step % every == 0``) or a pending SIGUSR1
        or SIGTERM request.

        :param step: the step just finished."""
        return (self.every > 0 and step % self.every == 0) or self.requests.save_requested()

    def should_stop(self) -> bool:
        """True once SIGTERM asked the run to stop (inside ``handle_signals``): save this step, close, exit."""
        return self.requests.stop_requested()

    def step_end(self, step: int, state: Any | Callable[[], Any], *,
                 param_span: tuple[int, int] | None = None) -> bool:
        """The step boundary: save if due (``state`` may be a callable), return True to stop.

        On a stop request the checkpoint is committed before this returns.

        :param step: the step just finished.
        :param state: the state to save, or a function that returns it (called only when due).
        :param param_span: as for ``save``.
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
        """Append a loss to the run's history (``RUN_DIR/.loss.json``, kept across resumes,
        uploaded with the run and drawn by ``tieredckpt plot``).

        :param step: the step.
        :param loss: its loss.
        :param extra: more numbers to keep with it (``lr=...``)."""
        self._check_writable()
        if self.rank == 0:
            self.run.append_loss(step, loss, **extra)

    # ---- waiting and closing ------------------------------------------------------------

    def wait(self, uploads: bool = False, timeout: float | None = None) -> bool:
        """Block until the pending save is committed (and with ``uploads``, uploaded).

        :param uploads: also wait until every committed step is on the remote.
        :param timeout: seconds to wait at most (None: no limit).
        :returns: False when ``timeout`` passed first.
        :raises BackgroundSaveError: the write failed."""
        return closing.wait(self, uploads, timeout)

    def close(self, drain_uploads: bool | None = None, *, preempted: bool | None = None) -> None:
        """Finish the pending write, release the run; raise what failed.

        Pending uploads are drained (up to ``close_timeout``) unless ``drain_uploads``
        is False -- the default after SIGTERM or when leaving the ``with`` block on an
        exception: the next start resumes them. ``preempted`` (default: whether SIGTERM
        asked this store to stop): the newest committed step is uploaded first and alone,
        within ``upload_on_exit`` seconds, since a preempted node rarely comes back. Then
        requests in flight are cancelled and the lease released within ``exit_timeout``:
        a hanging remote never holds the exit up. Uploads that failed for good are
        raised here, every step of them, as one UploadError.

        :param drain_uploads: wait for pending uploads (default: yes, unless stopping on
            SIGTERM or an exception).
        :param preempted: send the newest step first, within ``upload_on_exit``.
        """
        closing.close(self, drain_uploads, preempted)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            closing.close_on_error(self)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointStore is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise PermissionError(f"{self.local.root}: this store was opened read_only=True; it never writes")

    def _training_seconds(self) -> float:
        """The run's training time so far, carried across resumes (a manifest's wall_clock_seconds)."""
        return self._wall_base + time.monotonic() - self._wall_start

    def _resume_clock(self, seconds: float) -> None:
        self._wall_base, self._wall_start = seconds, time.monotonic()

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

        :param step: the step (default: the newest that loads and verifies).
        :param into: top-level keys mapped to objects with ``load_state_dict``.
        :param mark_resume: record the resume in the loss history.
        :param reshard: re-split a checkpoint written by another number of ranks (ZeRO-style
            "flat" state) for this world; without it a world-size change is refused.
        :returns: the saved state (with ``into``, its objects are loaded too), or None.
        :raises CheckpointNotFoundError: the named step is on no tier.
        :raises IncompatibleStateError: a saved entry does not fit its object; nothing was loaded.
        """
        return restoring.restore(self, step, into, mark_resume, reshard)

    def dcp_writer(self, step: int, extra: Any = None, user: dict | None = None) -> TieredWriter:
        """A torch.distributed.checkpoint StorageWriter that commits into this store as ``step``:
        ``dcp.save(state, storage_writer=store.dcp_writer(step))`` (or ``dcp.async_save``), on
        every rank. The step is committed, rotated and uploaded like one ``save()`` wrote.
        ``extra``: a plain tree (tensors, numbers, strings, lists, dicts) kept beside this rank's
        entries, outside DCP's planner; ``store.dcp_reader(step).read_extra()`` gives it back.
        ``user``: JSON metadata for the manifest, as ``save(user=...)`` (the same on every rank).

        :param step: the step number.
        :param extra: the plain tree kept beside this rank's entries.
        :param user: JSON metadata for the manifest."""
        from .dcp import TieredWriter
        self._check_writable()
        return TieredWriter(self, step, extra, user)

    def dcp_reader(self, step: int | None = None) -> TieredReader:
        """A torch.distributed.checkpoint StorageReader of ``step`` (default: the newest on any
        tier): ``dcp.load(state, storage_reader=store.dcp_reader())``. Local copies are preferred;
        a missing or corrupt one is read from the remote (also on a machine with nothing local).

        :param step: the step (default: the newest)."""
        from .dcp import TieredReader
        self._check_open()
        return TieredReader(self, step)

    # ---- what is where ----------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step on any tier (a constant number of remote requests)."""
        return restoring.latest_step(self)

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
                warn_user(f"cannot list the remote: {exc}")
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
        summary = self._stats.summary()
        failures = {"save_failures": summary["save_failures"], "last_save_failure": summary["last_save_failure"]}
        if self.uploader is None:
            return {"remote": self.remote.display_url if self.remote else None, "newest_local": newest_local,
                    **failures}
        status = self.uploader.summary()
        status["newest_local"] = newest_local
        status.update(failures)
        uploaded = status["newest_uploaded"]
        status["lag_steps"] = None if newest_local is None else newest_local - (uploaded if uploaded is not None else 0)
        status["steps"] = {step: {k: entry[k] for k in ("state", "bytes_sent", "bytes_referenced", "upload_s")
                                  if k in entry} for step, entry in self.uploader.status().items()}
        return status

    # ---- side files and forks -----------------------------------------------------------

    def pivot(self, step: int, note: str = "") -> Path:
        """Archive the run's side files (samples, bandit state; never the loss history) under
        ``archive/pivot_step_NNNNNN/`` and start them clean: a change of course at ``step``.

        :param step: the step of the change.
        :param note: why, kept with the archive.
        :returns: the archive's directory."""
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
        new run with that remote finds the step there and sends nothing.

        :param step: the step to copy.
        :param new_run_dir: the new run's directory (one that holds no checkpoints yet).
        :param remote: the new run's remote.
        :param remote_options: its filesystem options.
        :returns: the new run's directory."""
        return forks.fork(self, step, Path(new_run_dir), remote, remote_options)
