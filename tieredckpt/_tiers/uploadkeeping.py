"""Rank 0's housekeeping of the remote between and after uploads: the lease's use (owning the
prefix before a round, noting the step in flight, clearing another timeline's step), audits (a
wiped or damaged remote is noticed), retention, the queued deletions and the sweep of orphans.
Only the lease owner deletes anything, and it proves it first (a fenced write)."""

from __future__ import annotations

import logging
import time

from ..errors import RemoteError, WriterConflictError
from .remote import describe_writer
from .retention import plan_eviction
from .uploadstate import UploadState

log = logging.getLogger("tieredckpt")

# Audits between two damage checks of one step (an hour at the default audit_interval). The
# check lists objects/ and reads back up to 16 MB: at every audit that would be 23 GB of GETs a
# day from a run that is only waiting. A step is checked at its first audit, then this rarely;
# its marker is still looked at every audit.
DAMAGE_EVERY = 60


class Housekeeping(UploadState):
    """The uploader's upkeep of the remote (rank 0 only; the other ranks never call these)."""

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

    def _audit(self) -> list[int]:
        """Re-check that the remote still holds the newest uploaded step; if not, which local ones it lost."""
        with self._cond:
            newest = max(self.uploaded) if self.uploaded else None
            fresh = self._confirmed and self._confirmed[0] == newest and \
                time.monotonic() - self._confirmed[1] < self.audit_interval
        if newest is None or fresh:
            return []
        if self.remote.is_committed(newest):
            if self._damage_due(newest) and self._replace_if_damaged(newest):
                return [newest]
            with self._cond:
                self._confirmed = (newest, time.monotonic())
            return []
        local = set(self.local.steps())
        lost = sorted(s for s in self.uploaded & local if not self.remote.is_committed(s))
        log.warning("%s: no longer holds uploaded step(s) %s (wiped or damaged?); the local copies are kept "
                    "and uploaded again", self.remote.display_url, lost)
        return lost

    def _damage_due(self, step: int) -> bool:
        last = self._damage_checked
        return last is None or last[0] != step or time.monotonic() - last[1] >= DAMAGE_EVERY * self.audit_interval

    def _replace_if_damaged(self, step: int) -> bool:
        """The newest uploaded step is there but does not read back as committed (a part missing,
        cut short or changed: a flipped byte, another tool's write): it is deleted under our fence
        and, its damaged objects forgotten so that nothing names them again, sent afresh from the
        local copy. True when that is to happen. Where the local copy is gone too, it is said."""
        bad = self.remote.damage(step)
        if not bad:
            self._damage_checked = (step, time.monotonic())
            return False
        if step not in self.local.steps() or self.lease is None or self.ranks is not None:
            log.error("%s: step %d is damaged there (%s) and cannot be sent again from here; restore an "
                      "earlier step", self.remote.display_url, step, "; ".join(sorted(bad.values())[:3]))
            return False
        log.warning("%s: step %d is damaged there (%s); sending it again from the local copy",
                    self.remote.display_url, step, "; ".join(sorted(bad.values())[:3]))
        self.lease.fence()
        self.index.forget_objects(set(bad))
        self.index.forget(step)
        self.remote.delete(step, generation=self.lease.generation)
        return True

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
