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

import logging
import time

from ..errors import RemoteError, UploadError, WriterConflictError
from .retention import pins
from .uploadkeeping import Housekeeping
from .uploadsend import Sending
from .uploadstate import MODES, UploadState

__all__ = ["MODES", "UploadState", "Uploader"]

log = logging.getLogger("tieredckpt")


class Uploader(Sending, Housekeeping):
    """The queue of committed steps and the worker thread that uploads them (see the module doc);
    its state is UploadState's, its sending Sending's, the remote's upkeep Housekeeping's."""

    def start(self) -> Uploader:
        self._recall()
        self._thread.start()
        return self

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

    def send_newest(self, timeout: float) -> bool:
        """The process is stopping (SIGTERM; the node may never come back): upload this rank's
        newest committed step, first and alone, within ``timeout`` seconds; older steps still
        waiting stay for a next start. True once the remote holds it (or nothing was owed).
        Never raises: a step that fails, or a remote that does not answer in time, returns False."""
        newest = self.local.latest_step()
        if newest is None:
            return True
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._exiting = self._kick = True  # a retry waiting out its backoff goes now
            self._cond.notify_all()
            while newest not in self.uploaded and self._thread.is_alive() and not self._stop.is_set():
                if self._known and newest not in self._pending and self._current != newest:
                    break  # superseded or removed: nobody will send it
                if newest in self._failures:
                    break  # failing for good: waiting on would not help
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(0.25, remaining))
            return newest in self.uploaded

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
            if self._exiting:  # SIGTERM: only the newest step can still reach the remote in time
                return max(self._pending)
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

    def _uploaded(self, step: int, seconds: float) -> None:
        with self._cond:  # _current stays set until retention has had its turn: drain() waits for it
            self.uploaded.add(step)
            self._done.pop(step, None)
            sent, referenced = self._sent.pop(step, (None, None))
            self._confirmed = (max(self.uploaded), time.monotonic())
            # a half-upload we clean up is never a step we committed since: the writer we took over
            # from died sending step N, and this run then saved and committed its own step N
            self._garbage -= self.uploaded
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
