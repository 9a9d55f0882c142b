"""The background uploader: committed local steps go to the remote, however long it takes.

A queue of committed local steps and one worker thread. The training loop never
waits for it (unless ``mode="all"`` asks for back-pressure) and never sees its
errors: they are retried, shown in the status, and raised at ``close()``.

Which step goes next (``mode``):
  "newest" (default)  the newest step still waiting; older waiting ones are
                      *superseded* (recorded, never uploaded, free for rotation),
                      except steps the remote policy pins (KeepEvery milestones),
                      which are owed and go after it;
  "all"               every step, oldest first; ``save`` waits while more than
                      ``max_pending`` are waiting (the remote slows training down).

One upload is a *round*, the same on one process and on many ranks (a world of
one exchanges with itself):
  1. rank 0 makes sure it owns the remote (lease.py) and audits it; every rank
     proposes its step; all take the oldest proposal, so each rank has it;
  2. each rank sends its own shard's parts (rank 0 also the side files);
  3. all exchange how it went; if every rank succeeded rank 0 confirms every
     part by a listing and writes upload.json (the commit marker), then latest;
  4. all learn the outcome. On failure every rank waits the same backoff:
     transient errors (outage, 5xx, throttling, timeouts) from ``backoff[0]``
     doubling to ``backoff[1]``; permanent ones (access denied, no bucket,
     another writer) every ``slow_retry`` seconds, reported to ``on_error``
     and raised at ``close()`` -- each failed step, not just the first.

What is uploaded is what the remote says: at start, the remote's newest step
and the upload manifest of each local step are read (a constant number of
requests, whatever the remote holds); only newer steps and pinned ones are
queued. While idle, rank 0 re-checks that the newest uploaded step is still
there; a wiped or damaged remote is noticed, and its local copies become
pending again. Retention deletes and the cleanup of abandoned half-uploads
are queued and retried; they never fail an upload, and only the lease owner
deletes anything.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .._format import layout
from .._format.atomic import atomic_write_bytes
from .._format.uploadmanifest import PartEntry, UploadedFile
from ..errors import RemoteError, TieredCkptError, UploadError, WriterConflictError
from .lease import WriterLease
from .local import LocalTier
from .objects import ObjectIndex, Reuse
from .remote import PartsMissingError, RemoteTier, describe_writer, forget_part
from .retention import Policy, pins, plan_eviction

log = logging.getLogger("tieredckpt")
MODES = ("newest", "all")


class Uploader:
    def __init__(self, local: LocalTier, remote: RemoteTier, *, codec: str = "zstd-dtype", level: int = 1,
                 mode: str = "newest", max_pending: int | None = 2, backoff: tuple[float, float] = (0.5, 10.0),
                 slow_retry: float = 60.0, audit_interval: float = 60.0, keep_remote: Policy | None = None,
                 lease: WriterLease | None = None, on_uploaded: Callable[[int], None] | None = None,
                 on_error: Callable[[int | None, Exception], None] | None = None,
                 progress: Callable[[int], None] | None = None, ranks=None,
                 before_commit: Callable[[int], object] | None = None, orphan_grace: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"uploads must be one of {MODES}, got {mode!r}")
        self.local, self.remote = local, remote
        self.before_commit = before_commit  # completes the local manifest the remote's embeds
        self.codec, self.level, self.mode = codec, level, mode
        self.max_pending, self.backoff, self.slow_retry = max_pending, backoff, slow_retry
        self._round_started = 0.0  # when the current (or last) attempt began, monotonic
        self._finishing = False  # an upload's aftermath (rotation, its record) is running
        self._sent: dict[int, tuple[int, int]] = {}  # (bytes sent, bytes referenced) of a step's parts (leader)
        self.index = ObjectIndex()  # objects of kept remote steps, for parts whose bytes did not change
        self._mine: dict[int, list[UploadedFile]] = {}  # this rank's files of the step in flight
        self.audit_interval = audit_interval
        self.keep_remote, self.lease = keep_remote, lease
        self.on_uploaded, self.on_error, self.progress = on_uploaded, on_error, progress
        self.ranks = ranks  # a RankGroup of the uploader's own, or None (a world of one)
        self.leader = ranks is None or ranks.rank == 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pending: set[int] = set()
        self._current: int | None = None
        self.uploaded: set[int] = set()  # upload.json seen on the remote
        self.superseded: set[int] = set()
        self.retired: set[int] = set()  # deleted by remote retention after upload
        self._downloaded: set[int] = set()  # restored from the remote into the run dir: held there
        self._remote_top: int | None = None  # the remote's newest step when we took it (collisions below)
        self._garbage: set[int] = set()  # abandoned half-uploads, deleted once a newer step commits
        self._deletions: set[int] = set()  # remote steps to delete (retried)
        self._done: dict[int, dict] = {}  # parts already sent, per step, across attempts
        self._failures: dict[int, tuple[str, float]] = {}  # permanent failures not raised yet: (error, when)
        self._status: dict[int, dict] = {}
        self._known = False  # the remote's state was read; until then rotation keeps everything
        self._believed: set[int] = set()  # uploaded, says the last status file (until the remote is read)
        self._scanned = False  # every remote step learnt, for retention
        self._confirmed: tuple[int, float] | None = None  # (newest uploaded step, when seen on the remote)
        self._last_error: dict | None = None
        self._failed_rounds = 0
        self._failed_cycle: set[int] = set()  # steps that failed since the last success or pause
        self._kick = False  # drain() asks for a retry now instead of after the backoff
        self._pinned_turn = False
        self.orphan_grace = orphan_grace  # None: objects no step names are left to `tieredckpt gc`
        self._swept = time.monotonic()  # when this process last looked for them: the first look after
        # orphan_grace, so a short run never reads the remote's markers for it
        self._thread = threading.Thread(target=self._run, name="tieredckpt-uploader", daemon=True)

    def start(self) -> Uploader:
        self._recall()
        self._thread.start()
        return self

    def _recall(self) -> None:
        """What the last run's status file says of the local steps: a hint that lets rotation
        go on while the remote cannot be asked (an outage across a restart). Superseded steps
        are evictable; uploaded ones too, but the newest of them stays until the remote is read."""
        try:
            doc = json.loads((Path(self.local.root) / layout.STATUS_FILE).read_bytes())
            steps = doc.get("steps", {}) if isinstance(doc, dict) else {}
            recorded = {int(k): v for k, v in steps.items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError):
            return
        local = set(self.local.steps())
        with self._cond:
            for step, entry in recorded.items():
                if step in local and entry.get("state") in ("superseded", "uploaded"):
                    self._status[step] = {"state": entry["state"], "unix": entry.get("unix", 0)}
                    (self.superseded if entry["state"] == "superseded" else self._believed).add(step)

    # ---- what the store asks --------------------------------------------------------------

    def enqueue(self, step: int) -> None:
        with self._cond:
            if step not in self.uploaded and step != self._current:
                self._pending.add(step)
                self._set(step, "pending")
            self._cond.notify_all()
        if self.ranks is None:  # many ranks supersede in their rounds, in lockstep
            self._supersede_below(step)
        self._write_status()

    def downloaded(self, step: int) -> None:
        """A restore just brought ``step`` from the remote into the run directory: the remote holds
        it (its upload manifest was read this moment), so it is never owed and rotation may evict it."""
        with self._cond:
            self._downloaded.add(step)
            self._pending.discard(step)
            self.uploaded.add(step)
            if step >= max(self.uploaded):
                self._confirmed = (step, time.monotonic())
            self._set(step, "uploaded", None)
        self._write_status()

    def pending(self) -> list[int]:
        with self._cond:
            return sorted(self._pending | ({self._current} if self._current is not None else set()))

    def evictable(self) -> set[int]:
        """Local steps rotation may delete: the remote holds them, or they were superseded.

        The newest uploaded step stays until the remote was seen holding it within the
        last two audit intervals (so a wiped remote never costs the last good copy)."""
        with self._cond:
            owed = self._pending | ({self._current} if self._current is not None else set())
            if not self._known:  # the remote not asked yet: what was superseded, and what the last
                believed = self._believed - {max(self._believed, default=None)}  # run saw uploaded
                return (self.superseded | believed | self._downloaded | self._lagging(owed)) - owed
            ok = (self.uploaded | self.superseded | self.retired) - self._pending - {self._current}
            if self.uploaded:
                newest = max(self.uploaded)
                fresh = self._confirmed and self._confirmed[0] == newest and \
                    time.monotonic() - self._confirmed[1] < 2 * self.audit_interval
                if not fresh:
                    ok.discard(newest)
            return ok

    def _lagging(self, owed: set[int]) -> set[int]:
        """uploads="newest", the remote not reached yet: the local steps older than one still owed
        that no remote policy pins. The first round supersedes them anyway (whether or not the
        remote holds them, it never will from us), so rotation need not wait for the remote:
        without this, each restart during an outage pinned the previous run's unsent steps."""
        if self.mode != "newest" or not owed:
            return set()
        top = max(owed)
        return {s for s in self.local.steps() if s < top and not pins(self.keep_remote, s)}

    def wait_for_room(self) -> None:
        """``mode="all"``: block while more than ``max_pending`` steps await upload. Never raises."""
        if self.mode != "all" or self.max_pending is None:
            return
        with self._cond:
            while (len(self._pending - set(self._failures)) + (self._current is not None) > self.max_pending
                   and not self._stop.is_set() and self._thread.is_alive()):
                self._cond.wait(0.5)

    def drain(self, timeout: float | None) -> bool:
        """Wait until nothing is pending; True if everything was uploaded. Raises UploadError
        when a step failed for good (waiting longer would not help)."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        unknown = bool(self.local.steps())  # until the remote is read, local steps may be owed
        with self._cond:
            self._kick = True  # a retry waiting out its backoff goes now
            self._cond.notify_all()
            while (self._pending or self._current is not None or self._finishing
                   or (unknown and not self._known)) and self._thread.is_alive():
                if any(when >= start for _, when in self._failures.values()):
                    break  # failing for good right now: waiting on would not help
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
        with self._cond:  # what still fails for good now; older failures wait for close()
            unresolved = self._pending | {self._current} | ({-1} if unknown and not self._known else set())
        self.raise_error(only=unresolved)
        with self._cond:
            return not self._pending and self._current is None

    def raise_error(self, only: set | None = None) -> None:
        """Raise every permanent failure not raised yet (of the steps in ``only``), as one
        UploadError naming each step."""
        with self._cond:
            failures = {s: v for s, v in self._failures.items() if only is None or s in only}
            for step in failures:
                del self._failures[step]
        if failures:
            lines = "; ".join(f"step {s}: {e}" for s, (e, _) in sorted(failures.items()))
            raise UploadError(f"{len(failures)} upload(s) failed: {lines}", {s: e for s, (e, _) in failures.items()})

    def close(self, exit_timeout: float = 2.0) -> None:
        """Stop the worker within ``exit_timeout`` seconds, whatever the remote does: every request
        in flight is cancelled (a send in flight is resumed at the next start: the status file and
        the remote say which step it was), and the lease's release gets what is left of the time
        (unreleased, it lapses). Nothing here waits on the network longer."""
        started = time.monotonic()
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self.remote.t.abort(exit_timeout)
        if self._thread.is_alive():
            self._thread.join(timeout=max(0.0, min(1.0, exit_timeout / 2 - (time.monotonic() - started))))
        if self.lease is not None:
            self.lease.release()

    # ---- the worker -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if not self._startup():
                return
            last_idle = time.monotonic()
            while not self._stop.is_set():
                step = self._next_step(timeout=self.audit_interval)
                if step is None:
                    if self.leader and time.monotonic() - last_idle >= self.audit_interval * 0.9:
                        self._idle_work()
                        last_idle = time.monotonic()
                    continue
                self._round(step)
        except BaseException as exc:  # noqa: BLE001 - a bug here must not pass silently
            log.exception("the uploader stopped")
            with self._cond:
                self._failures[-1] = (f"the uploader stopped: {exc}", time.monotonic())
        finally:
            with self._cond:
                self._current = None
                self._cond.notify_all()

    def _startup(self) -> bool:
        """Learn from the remote what is uploaded; queue the rest. Retries until it can."""
        state = None
        while state is None and not self._stop.is_set():
            self._round_started = time.monotonic()
            local = sorted(set().union(*self._gather(self.local.steps())))
            error = None
            if self.leader:
                try:
                    self._ensure_lease()
                    state = self._remote_state(local)
                except (RemoteError, WriterConflictError) as exc:
                    error = exc
            shared = self._gather(state if error is None else {"error": str(error)})[0]
            if "error" in shared:
                state = None
                self._failed(None, error or RemoteError(shared["error"], transient=True))
                if self._sleep():
                    return False
            else:
                state = shared
        if state is None:
            return False
        with self._cond:  # steps enqueued while we asked stay queued unless the remote has them
            self.uploaded = set(state["uploaded"]) | (self._downloaded & set(self.local.steps()))
            self._pending = (set(state["pending"]) | self._pending) & set(self.local.steps()) - self.uploaded
            self.superseded |= set(local) - self.uploaded - self._pending
            if self.uploaded:
                self._confirmed = (max(self.uploaded), time.monotonic())
            for step in self._pending:
                self._set(step, "pending")
            self._failed_rounds = 0
            self._failures.pop(-1, None)  # a failed start is resolved
            self._known = True
            self._cond.notify_all()
        self._write_status()
        if self.on_uploaded:
            self.on_uploaded(-1)  # let rotation catch up on what is already safe
        return True

    def _remote_state(self, local: list[int]) -> dict:
        """Which local steps the remote holds, and which are still owed (rank 0)."""
        newest = self.remote.newest_step()
        uploaded = [s for s in local if s == newest or self.remote.is_committed(s)]
        top = max([newest or -1, *uploaded])
        pending = [s for s in local if s not in uploaded and (s > top or pins(self.keep_remote, s))]
        if newest is None and self._status_says_uploaded():
            log.warning("%s: holds no checkpoint although this run uploaded some (wiped?); "
                        "the local copies are kept and uploaded again", self.remote.display_url)
        half = self.lease.previous_sending() if self.lease is not None else None
        if half is not None and half not in pending and not self.remote.is_committed(half):
            self._garbage.add(half)  # the previous writer died uploading it; ours to clean up
        self._remote_top = newest
        return {"uploaded": uploaded, "pending": pending, "newest": newest}

    def _next_step(self, timeout: float) -> int | None:
        """The step this rank proposes next, or None after ``timeout`` with nothing to do."""
        with self._cond:
            if not self._pending and not self._stop.is_set():
                self._cond.wait(timeout)
            if not self._pending or self._stop.is_set():
                return None
            candidates = self._pending - self._failed_cycle or self._pending
            if self.mode == "all":
                return min(candidates)
            owed = sorted(s for s in candidates if pins(self.keep_remote, s))
            newest = max(candidates)
            self._pinned_turn = not self._pinned_turn and bool(owed) and owed[0] != newest
            return owed[0] if self._pinned_turn else newest

    def _round(self, proposed: int) -> None:
        self._round_started = time.monotonic()
        lost, lease_error = [], None
        if self.leader:
            try:
                if self._failed_rounds:  # after a failure, one cheap request first: no encoding
                    self.remote.latest_pointer()  # and sending of parts while the remote is still down
                self._ensure_lease()
                lost = self._audit()
            except (RemoteError, WriterConflictError) as exc:
                lease_error = exc
        infos = self._gather({"step": proposed, "lost": lost,
                              "error": f"{type(lease_error).__name__}: {lease_error}" if lease_error else None,
                              "transient": getattr(lease_error, "transient", False)})
        self._requeue_lost(infos[0]["lost"])
        step = min(i["step"] for i in infos)
        self._supersede_below(step)
        with self._cond:
            self._pending.discard(step)
            self._current = step
        self._set(step, "uploading" if self._failed_rounds == 0 else "retrying")
        self._write_status()
        error = None
        if infos[0]["error"]:
            error = (infos[0]["error"], infos[0]["transient"])
        elif self.ranks is None and step not in self.local.steps():
            with self._cond:  # removed from the run directory meanwhile: nothing left to send
                self._current = None
                self.superseded.add(step)
                self._set(step, "superseded", "no longer in the run directory")
            return
        else:
            started = time.monotonic()
            error = None
            if self.leader and self.lease is not None:
                error = self._prepare(step)
            error = self._gather(error)[0] or self._attempt(step)
        if error is None:
            self._uploaded(step, time.monotonic() - started)
            return
        with self._cond:
            self._pending.add(step)
            self._current = None
            self._failed_cycle.add(step)
            others = bool(self._pending - self._failed_cycle)  # try those before pausing
            if not others:
                self._failed_cycle.clear()
            self._cond.notify_all()
        self._failed(step, RemoteError(error[0], transient=error[1]))
        if not others:
            self._sleep()

    def _attempt(self, step: int) -> tuple[str, bool] | None:
        """Steps 2-4 of a round: None on success, else (error, transient) -- the same on every rank."""
        error, files = None, []
        try:
            files = self._send(step)
            self._mine[step] = files
        except Exception as exc:  # noqa: BLE001 - exchanged with the other ranks, then handled
            error = exc
        results = self._gather({"ok": error is None, "error": self._describe(error),
                                "transient": _transient(error), "files": [asdict(f) for f in files]})
        bad = [(r, res) for r, res in enumerate(results) if not res["ok"]]
        if bad:
            rank, res = bad[0]
            prefix = f"rank {rank} could not upload its shard: " if self.ranks is not None else ""
            return prefix + res["error"], all(r["transient"] for _, r in bad)
        outcome = None
        if self.leader:
            everyone = [UploadedFile(f["path"], f["size"], [PartEntry(**p) for p in f["parts"]])
                        for res in results for f in res["files"]]
            self._sent[step] = (sum(p.stored_size for f in everyone for p in f.parts if p.sent),
                                sum(p.stored_size for f in everyone for p in f.parts))
            try:
                self._commit(step, everyone)
            except Exception as exc:  # noqa: BLE001
                outcome = {"error": self._describe(exc), "transient": _transient(exc),
                           "missing": [p[:2] for p in exc.parts] if isinstance(exc, PartsMissingError) else []}
        outcome = self._gather(outcome)[0]
        if outcome is None:
            return None
        done = self._done.setdefault(step, {})
        for path, offset in outcome.get("missing", []):  # every rank, the leader too: its next attempt sends its own
            forget_part(done, path, offset)
        return outcome["error"], outcome["transient"]

    def _send(self, step: int) -> list[UploadedFile]:
        manifest = self.local.manifest(step)
        mine = manifest.shards if self.ranks is None else [manifest.shards[self.ranks.rank]]
        if self.leader:
            self.remote.put_side_files(self.local.root)
        done = self._done.setdefault(step, {})
        self._seed_index()
        reuse = Reuse(self.index, self.codec, self._committed_dir)
        return self.remote.send_files(self.local.step_path(step), manifest, mine, self.codec, self.level,
                                      done=done, progress=self.progress, reuse=reuse)

    def _committed_dir(self, step: int) -> Path | None:
        path = self.local.step_path(step)
        return path if (path / layout.MANIFEST).is_file() else None

    def _seed_index(self, newest: int = 2) -> None:
        """Learn the objects of the newest uploaded steps still on local disk (a restart, or a step
        restored from the remote): one upload manifest each, once. A manifest that cannot be read
        only means those bytes are sent again."""
        with self._cond:
            steps = sorted(self.uploaded, reverse=True)
        for step in [s for s in steps if not self.index.has(s) and self._committed_dir(s) is not None][:newest]:
            try:
                upload = self.remote.upload_manifest(step)
            except (TieredCkptError, RemoteError) as exc:
                log.debug("step %d: its objects are not known for reuse (%s)", step, exc)
                continue
            rank = 0 if self.ranks is None else self.ranks.rank
            files = upload.files if self.ranks is None else upload.files[rank:rank + 1]
            self.index.add(step, upload.codec, files)

    def _commit(self, step: int, files: list[UploadedFile]) -> None:
        # Order: sha256 recorded -> fence (a conditional write of our lease record: after a
        # takeover it fails, and we write nothing more) -> upload.json created only if absent
        # (never over a committed marker) -> latest. A crash anywhere leaves either no marker
        # (the parts are garbage for the next owner) or a complete step.
        if self.before_commit is not None:
            self.before_commit(step)
        if self.lease is not None:
            self.lease.fence(commit=True)
        writer = self.lease.identity() if self.lease is not None else None
        self.remote.commit_upload(self.local.manifest(step), self.codec, files, writer=writer)
        self.remote.write_latest(max(self.uploaded | {step}))

    def _clear_foreign(self, step: int) -> None:
        """Before sending ``step``: a committed step of that number that we did not upload (another
        timeline's: a writer we took over from committed it, or a relaunch reuses step numbers)
        is deleted under our fence first, so our parts never land in a committed step."""
        if self.lease is None or self._remote_top is None or step > self._remote_top or step in self.uploaded:
            return  # newer than anything the remote held when we took it: nobody else can have it
        if not self.remote.is_committed(step):
            return
        by = self.remote.committed_by(step)
        self.lease.fence()
        log.warning("%s: step %d there was committed by another writer (%s); replacing it with this run's "
                    "step %d", self.remote.display_url, step, describe_writer(by), step)
        self.index.forget(step)
        self.remote.delete(step, generation=self.lease.generation)

    def _uploaded(self, step: int, seconds: float) -> None:
        with self._cond:  # _current stays set until retention has had its turn: drain() waits for it
            self.uploaded.add(step)
            self._done.pop(step, None)
            sent, referenced = self._sent.pop(step, (None, None))
            self._confirmed = (max(self.uploaded), time.monotonic())
            self._deletions |= {s for s in self._garbage if s < step}
            self._garbage -= self._deletions
            self._failed_rounds = 0
            self._failed_cycle.clear()
            self._failures.pop(step, None)
            self._set(step, "uploaded")
            self._status[step].update(upload_s=round(seconds, 6), bytes_sent=sent,  # the last attempt's
                                      bytes_referenced=referenced)
        self.index.add(step, self.codec, self._mine.pop(step, []))
        if self.leader:
            self._apply_retention()
            self._delete_pending()
            self._sweep_orphans()
        with self._cond:  # evictable from now on; drain() still waits for the callback below
            self._current, self._finishing = None, True
        try:
            self._write_status()
            if self.on_uploaded:
                self.on_uploaded(step)  # rotation and the upload's cost record
        except Exception as exc:  # noqa: BLE001 - the step is uploaded whatever its aftermath
            log.warning("step %d is uploaded, but the work after it failed: %s", step, exc)
        finally:
            with self._cond:
                self._finishing = False
                self._cond.notify_all()

    def _supersede_below(self, step: int) -> None:
        if self.mode != "newest":
            return
        with self._cond:
            older = sorted(s for s in self._pending if s < step and not pins(self.keep_remote, s))
            for s in older:
                self._pending.discard(s)
                self.superseded.add(s)
                if self._done.pop(s, None):
                    self._garbage.add(s)  # some parts were sent: ours to clean up
                self._set(s, "superseded")
        if older:
            log.info("uploads lag: step(s) %s superseded by step %d", older, step)

    # ---- rank 0's housekeeping --------------------------------------------------------------

    def _prepare(self, step: int) -> tuple[str | None, bool] | None:
        """Rank 0, before any part of ``step`` is sent: note it in our lease record (a fenced write:
        a writer that lost the lease stops here) and clear another timeline's step of that number.
        None, or (error, transient) for the round."""
        assert self.lease is not None  # rank 0 holds the lease
        try:
            self.lease.note_sending(step)
            self._clear_foreign(step)
        except WriterConflictError as exc:
            return self._describe(exc), False
        except RemoteError as exc:  # the sends that follow would meet the same trouble
            return self._describe(exc), exc.transient
        return None

    def _ensure_lease(self) -> None:
        """Own the prefix before a round. A lease we lost is taken again only through the normal
        protocol (never a takeover), and never once a later writer was seen (lease.py: once
        replaced, always replaced); a record that vanished with no later marker (a wiped remote)
        is free. Then what the remote holds is read again."""
        if self.lease is None or self.lease.owned:
            return
        lost = self.lease.lost
        try:
            self.lease.acquire()
        except WriterConflictError:
            if lost and not self.lease.replaced:
                raise WriterConflictError(f"{self.remote.display_url}: {lost}") from None
            raise
        if lost:
            log.warning("%s: this store owns the remote again (%s before); re-reading what it holds",
                        self.remote.display_url, lost)
            self._remote_top = self.remote.newest_step()

    def _audit(self) -> list[int]:
        """Re-check that the remote still holds the newest uploaded step; if not, which local ones it lost."""
        with self._cond:
            newest = max(self.uploaded) if self.uploaded else None
            fresh = self._confirmed and self._confirmed[0] == newest and \
                time.monotonic() - self._confirmed[1] < self.audit_interval
        if newest is None or fresh:
            return []
        if self.remote.is_committed(newest):
            with self._cond:
                self._confirmed = (newest, time.monotonic())
            return []
        local = set(self.local.steps())
        lost = sorted(s for s in self.uploaded & local if not self.remote.is_committed(s))
        log.warning("%s: no longer holds uploaded step(s) %s (wiped or damaged?); the local copies are kept "
                    "and uploaded again", self.remote.display_url, lost)
        return lost

    def _requeue_lost(self, lost: list[int]) -> None:
        if not lost:
            return
        with self._cond:
            self.uploaded -= set(lost)
            self._pending |= set(lost) & set(self.local.steps())
            self._confirmed = None
            for s in lost:
                self._set(s, "pending", "the remote lost it; uploading again")

    def _idle_work(self) -> None:
        try:
            self._ensure_lease()
            lost = self._audit()
            if lost and self.ranks is None:
                self._requeue_lost(lost)
                with self._cond:
                    self._cond.notify_all()
            self._delete_pending()
        except (RemoteError, WriterConflictError) as exc:
            log.debug("idle remote check failed: %s", exc)

    def _apply_retention(self) -> None:
        """Decide which remote steps the policy drops. The first time in a process, every
        committed remote step is learnt (one listing, one request per step dir: the only
        place the uploader's cost grows with the remote, and only with ``keep_remote``)."""
        if self.keep_remote is None:
            return
        try:  # re-listed every time: steps we did not write (a late commit, another tool) are judged too
            dirs = set(self.remote.step_dirs())
            known = self.uploaded | self.retired
            found = {s: g for s in dirs if s not in known and (g := self.remote.marker_generation(s)) is not None}
        except RemoteError as exc:
            log.warning("cannot list the remote for its retention policy (%s); retried later", exc)
            return
        late = self._late_commits(found)
        with self._cond:
            self.uploaded = (self.uploaded & dirs) | (set(found) - late)  # deleted behind our back: gone
            self._deletions |= late
            self._scanned = True
        with self._cond:
            doomed = plan_eviction(self.uploaded, self.keep_remote, protected=[max(self.uploaded)])
            self.uploaded -= set(doomed)
            self.retired |= set(doomed)
            self._deletions |= set(doomed)

    def _late_commits(self, found: dict[int, int]) -> set[int]:
        """Steps an earlier generation committed above the remote's newest when we took it: a
        replaced writer's commit that was in flight at the takeover. Never part of our timeline
        (restore prefers ours by generation), so they are deleted, never kept by our policy."""
        mine = None if self.lease is None else self.lease.generation
        if mine is None or self._remote_top is None:
            return set()
        late = {s for s, g in found.items() if g < mine and s > self._remote_top}
        if late:
            log.warning("%s: step(s) %s were committed by a writer this one replaced, after it took over; "
                        "deleting them", self.remote.display_url, sorted(late))
        return late

    def _delete_pending(self) -> None:
        """Delete queued remote steps (retention, abandoned half-uploads); failures stay queued."""
        with self._cond:
            todo = sorted(self._deletions)
        if todo and self.lease is not None:
            try:
                self.lease.fence()  # only the owner deletes, and it proves it first
            except (RemoteError, WriterConflictError) as exc:
                log.warning("remote deletions of step(s) %s wait: %s", todo, exc)
                return
        for step in todo:
            if self._stop.is_set():
                return
            try:
                if self.lease is not None:
                    self.lease.check()
                self.index.forget(step)  # before: a failed delete must not leave it offered for reuse
                self.remote.delete(step, generation=None if self.lease is None else self.lease.generation)
            except (RemoteError, WriterConflictError) as exc:
                if isinstance(exc, WriterConflictError) and self.lease is not None and self.lease.owned:
                    log.warning("remote step %d is kept: %s", step, exc)  # a later generation's: never ours
                    with self._cond:
                        self._deletions.discard(step)
                    continue
                log.warning("deleting remote step %d failed (%s); it is retried later", step, exc)
                return
            with self._cond:
                self._deletions.discard(step)

    def _sweep_orphans(self) -> None:
        """Delete the objects no committed step names once they are ``orphan_grace`` old: parts of an
        upload that a crash or a takeover cut short, or left by a retention delete cut short (its
        marker goes first). After a commit, at most once per ``orphan_grace`` (the first time that long
        after the start), as the fenced owner.

        Why no committed step can lose an object: the names are read fresh from every committed
        marker (an unreadable one keeps everything), and the only objects not yet named are those of
        uploads in flight -- another rank's, or a step retried after an outage. If one of those is
        older than the grace and deleted, its commit confirms every part it names before the marker
        (_confirm_parts) and sends what is missing: a marker never names a deleted object."""
        if self.orphan_grace is None or self.lease is None:
            return
        if time.monotonic() - self._swept < self.orphan_grace:
            return
        self._swept = time.monotonic()
        try:
            orphans, why = self.remote.orphan_objects(self.orphan_grace)
            if why:
                log.warning("%s: objects no committed step names are kept: %s", self.remote.display_url, why)
            if not orphans:  # also when why is given: nothing may be deleted then
                return
            self.lease.fence()
            for rel in orphans:
                if self._stop.is_set():
                    return
                self.lease.check()
                self.remote.delete_objects([rel])
        except (RemoteError, WriterConflictError) as exc:
            log.warning("deleting objects no committed step names failed (%s); tried again in %.0f s",
                        exc, self.orphan_grace)
            return
        log.info("%s: deleted %d object(s) no committed step names, written over %.0f s ago (%s, ...)",
                 self.remote.display_url, len(orphans), self.orphan_grace, orphans[0])

    # ---- failures and waiting -----------------------------------------------------------------

    def _failed(self, step: int | None, exc: Exception) -> None:
        transient = _transient(exc)
        message = self.remote.scrub(str(exc))
        with self._cond:
            self._failed_rounds += 1
            self._last_error = {"unix": time.time(), "message": message, "transient": transient,
                                "step": step}
            if step is not None:
                self._set(step, "retrying" if transient else "failed", message)
            if not transient:
                # stamped with when the failing attempt began: drain() gives up only on an attempt
                # it saw start (one in flight when it was called may have run into an old fault)
                self._failures[-1 if step is None else step] = (message, self._round_started)
        if transient:
            log.warning("upload%s: %s; retrying in %.1f s", f" of step {step}" if step is not None else "",
                        message, self._delay())
        else:
            log.error("upload%s failed: %s; retrying every %.0f s (raised at close)",
                      f" of step {step}" if step is not None else "", message, self.slow_retry)
            if self.on_error is not None:
                try:
                    self.on_error(step, exc)
                except Exception:  # noqa: BLE001 - a user's hook must not stop uploads
                    log.exception("on_upload_error hook failed")
        self._write_status()

    def _delay(self) -> float:
        with self._cond:
            permanent = self._last_error is not None and not self._last_error["transient"]
            n = max(0, self._failed_rounds - 1)
        return self.slow_retry if permanent else min(self.backoff[1], self.backoff[0] * 2 ** min(n, 30))

    def _sleep(self) -> bool:
        """Wait out the backoff (a new step to upload or close() cuts it short); True when stopping."""
        delay = self._delay()
        deadline = time.monotonic() + delay
        with self._cond:
            known = set(self._pending)
            while not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._kick or (self.ranks is None and self._pending - known):
                    break
                self._cond.wait(min(remaining, 0.5))
            self._kick = False
        return self._stop.is_set()

    def _gather(self, value):
        return [value] if self.ranks is None else self.ranks.all_gather_json(value)

    def _describe(self, exc: BaseException | None) -> str | None:
        return None if exc is None else self.remote.scrub(f"{exc}" if isinstance(exc, TieredCkptError)
                                                          else f"{type(exc).__name__}: {exc}")

    # ---- status (for `tieredckpt ls` and store.list) ---------------------------------------------

    def _set(self, step: int, state: str, error: str | None = None) -> None:
        with self._cond:
            entry = {"state": state, "unix": time.time()}
            if error:
                entry["error"] = self.remote.scrub(error)
            self._status[step] = entry

    def status(self) -> dict[int, dict]:
        with self._cond:
            return {s: dict(v) for s, v in self._status.items()}

    def summary(self) -> dict:
        """How far uploads lag, and the last error: what `ls` and ``store.list()`` show."""
        with self._cond:
            return {"remote": self.remote.display_url, "mode": self.mode,
                    "remote_read": self._known,  # False until the uploader has reached the remote once
                    "newest_uploaded": max(self.uploaded) if self.uploaded else None,
                    "pending": sorted(self._pending), "uploading": self._current,
                    "last_error": dict(self._last_error) if self._last_error else None,
                    "failures": {str(s): e for s, (e, _) in self._failures.items()}}

    def _write_status(self) -> None:
        local = set(self.local.steps())
        with self._cond:
            self._status = {s: v for s, v in self._status.items() if s in local or v["state"] != "uploaded"}
            if len(self._status) > 200:  # superseded steps of a long outage: keep the newest
                self._status = dict(sorted(self._status.items())[-200:])
            doc = {**self.summary(), "steps": {str(s): v for s, v in sorted(self._status.items())}}
        try:
            atomic_write_bytes(Path(self.local.root) / layout.STATUS_FILE, json.dumps(doc, indent=1).encode())
        except OSError as exc:  # status is informational; never fail an upload over it
            log.debug("cannot write upload status: %s", exc)

    def _status_says_uploaded(self) -> bool:
        try:
            doc = json.loads((Path(self.local.root) / layout.STATUS_FILE).read_bytes())
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("newest_uploaded") is not None


def _transient(exc: BaseException | None) -> bool:
    if isinstance(exc, RemoteError):
        return exc.transient
    if isinstance(exc, (TieredCkptError, ValueError, TypeError, PermissionError)):
        return False
    return isinstance(exc, OSError)  # local I/O trouble (a step rotated away mid-read...): try again
