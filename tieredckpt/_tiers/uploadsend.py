"""One upload's sending and commit (steps 2-3 of a round, uploader.py): each rank sends its own
shard's parts, reusing objects of earlier steps whose bytes did not change; rank 0 confirms every
part and writes the commit marker under its fence, then latest."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

from .._format import layout
from .._format.uploadmanifest import PartEntry, UploadedFile
from ..errors import CommitRefusedError, RemoteError, TieredCkptError
from .objects import Reuse
from .remote import PartsMissingError, forget_part
from .uploadstate import UploadState, is_transient

log = logging.getLogger("tieredckpt")


class Sending(UploadState):
    """The uploader's sending of one step and its commit on the remote."""

    def _attempt(self, step: int) -> tuple[str, bool] | None:
        """Steps 2-4 of a round: None on success, else (error, transient) -- the same on every rank."""
        error, files = None, []
        try:
            files = self._send(step)
            self._mine[step] = files
        except Exception as exc:  # noqa: BLE001 - exchanged with the other ranks, then handled
            error = exc
        results = self._gather({"ok": error is None, "error": self._describe(error),
                                "transient": is_transient(error), "files": [asdict(f) for f in files]})
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
                outcome = {"error": self._describe(exc), "transient": is_transient(exc),
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
        try:
            self.remote.commit_upload(self.local.manifest(step), self.codec, files, writer=writer)
        except CommitRefusedError:
            if not self._clear_late_commit(step):
                raise  # our own timeline's, or a later writer's: never replaced
            raise RemoteError(f"{self.remote.display_url}: step {step} there was committed late by a writer this "
                              "one replaced; deleted, this run's step is committed next", transient=True) from None
        self.remote.write_latest(max(self.uploaded | {step}))

    def _clear_late_commit(self, step: int) -> bool:
        """Our marker was refused: ``step`` is committed already. When an earlier generation than
        ours committed it -- a writer we replaced, whose commit was in flight at the takeover and
        landed after it, above the step we resumed from -- it is not our timeline: it is deleted
        under our fence and the round commits ours again (its commit confirms every part first and
        sends what the delete took). True when it was deleted."""
        mine = None if self.lease is None else self.lease.generation
        if self.lease is None or mine is None:
            return False
        theirs = self.remote.marker_generation(step, unknown=mine)
        if theirs is None or theirs >= mine:
            return False
        self.lease.fence()
        log.warning("%s: step %d was committed by a writer this one replaced (generation %d, this one holds "
                    "%d), after the takeover; replacing it with this run's step %d", self.remote.display_url,
                    step, theirs, mine, step)
        self.index.forget(step)
        self.remote.delete(step, generation=mine)
        return True
