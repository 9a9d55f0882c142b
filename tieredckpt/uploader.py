"""The background uploader: a queue of committed local steps, one worker thread.

For each step, in order: side files -> parts -> upload.json -> remote latest ->
remote retention -> ``on_uploaded`` (the store then lets local rotation evict
it). With many ranks, every rank sends its own shard in parallel; they then
exchange what each sent (on a process group of the uploader's own), and rank 0
writes upload.json only if every rank succeeded. What is uploaded is read from the remote (upload manifests) at start, so a
restart re-queues every local step without one; half-uploaded remote steps that
no local step will finish are deleted.

Transient errors (connection trouble, timeouts, 5xx, throttling) are retried
with exponential backoff, resuming at the first part not yet sent, until
``retry_timeout`` seconds have passed; other errors fail at once. A failure is
stored and raised, once, by :meth:`raise_error` (the store calls it at the next
save, wait or close); the step stays local and is retried at the next start.

Back-pressure: :meth:`wait_for_room` blocks while more than ``max_pending``
steps await upload, so a slow or absent remote slows saves down instead of
filling the local disk with checkpoints that rotation may not delete.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from .atomic import atomic_write_bytes
from .errors import TieredCkptError
from .local import LocalTier
from .remote import RemoteError, RemoteTier
from .uploadmanifest import PartEntry, UploadedFile
from .retention import Policy, plan_eviction

log = logging.getLogger("tieredckpt")
STATUS_FILE = ".uploads.json"


class UploadError(TieredCkptError):
    """Uploading a checkpoint to the remote tier failed."""


class Uploader:
    def __init__(self, local: LocalTier, remote: RemoteTier, *, codec: str = "zstd-planes", level: int = 1,
                 max_pending: int | None = 2, retry_timeout: float | None = 900.0,
                 backoff: tuple[float, float] = (0.5, 30.0), keep_remote: Policy | None = None,
                 on_uploaded: Callable[[int], None] | None = None,
                 progress: Callable[[int], None] | None = None, ranks=None) -> None:
        self.local, self.remote = local, remote
        self.codec, self.level = codec, level
        self.max_pending, self.retry_timeout, self.backoff = max_pending, retry_timeout, backoff
        self.keep_remote = keep_remote
        self.on_uploaded = on_uploaded
        self.progress = progress
        self.ranks = ranks  # a RankGroup of its own: uploads exchange results on it
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._current: int | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._status: dict[int, dict] = {}
        self.uploaded: set[int] = set(remote.steps())
        self._resume_pending()
        self._thread = threading.Thread(target=self._run, name="tieredckpt-uploader", daemon=True)
        self._thread.start()

    # ---- queue ------------------------------------------------------------------------

    def _resume_pending(self) -> None:
        local_steps = self.local.steps()
        for step in (self.remote.uncommitted() if self.ranks is None or self.ranks.rank == 0 else []):
            if step not in local_steps:  # nobody will finish it: garbage
                log.info("removing half-uploaded %s", self.remote.where(f"step {step}"))
                self.remote.delete(step)
        for step in local_steps:
            if step not in self.uploaded:
                self._queue.append(step)
                self._status[step] = {"state": "pending"}
        self._write_status()

    def enqueue(self, step: int) -> None:
        with self._cond:
            if step not in self.uploaded and step not in self._queue and step != self._current:
                self._queue.append(step)
                self._set(step, "pending")
            self._cond.notify_all()

    def pending(self) -> list[int]:
        with self._cond:
            return sorted([*self._queue] + ([self._current] if self._current is not None else []))

    def wait_for_room(self) -> None:
        """Back-pressure: block while more than ``max_pending`` steps await upload."""
        with self._cond:
            while (self.max_pending is not None and len(self._queue) + (self._current is not None) > self.max_pending
                   and self._error is None and self._thread.is_alive()):
                self._cond.wait(0.5)
        self.raise_error()

    def drain(self, timeout: float | None) -> bool:
        """Wait until nothing is pending (or a failure); True if everything was uploaded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._current is not None) and self._error is None and self._thread.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
            return not self._queue and self._current is None

    def raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise UploadError(str(error)) from error

    def close(self, drain_timeout: float | None = 0.0) -> None:
        """Stop the worker; first wait up to ``drain_timeout`` s for pending uploads (0: don't)."""
        if drain_timeout != 0:
            self.drain(drain_timeout)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=1.0)  # a send in flight is resumed at the next start

    # ---- worker -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                step = self._current = self._queue.popleft()
            try:
                self._process(step)
            except BaseException as exc:  # noqa: BLE001 - stored, raised at the next call
                if self._stop.is_set():
                    self._set(step, "pending")  # interrupted by close: resumed at the next start
                    return
                log.error("upload of step %d failed: %s", step, exc)
                self._set(step, "failed", str(exc))
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _process(self, step: int) -> None:
        """One step: send (with retries), then commit. With many ranks every rank sends its own shard,
        they exchange what they sent, and rank 0 writes upload.json only if all succeeded."""
        error, files = None, None
        try:
            files = self._retrying(step, lambda done: self._send(step, done))
        except BaseException as exc:  # noqa: BLE001 - with ranks, still join the exchange
            if self.ranks is None:
                raise
            error = exc
        if self.ranks is not None:
            files = self._exchange(step, files, error)
        if files is None:
            return  # nothing local to send
        outcome = None
        if self.ranks is None or self.ranks.rank == 0:
            try:
                self._retrying(step, lambda done: self._commit(step, files))
            except Exception as exc:  # noqa: BLE001
                if self.ranks is None:
                    raise
                outcome = str(exc)
        if self.ranks is not None:
            failed = [o for o in self.ranks.all_gather_json(outcome) if o]
            if failed:
                raise RemoteError(f"step {step}: committing the upload failed on rank 0: {failed[0]}", transient=False)
        with self._cond:
            self.uploaded.add(step)
        if self.ranks is None or self.ranks.rank == 0:
            self._apply_remote_retention()
        self._set(step, "uploaded")
        if self.on_uploaded:
            self.on_uploaded(step)

    def _exchange(self, step: int, files, error):
        results = self.ranks.all_gather_json(
            {"ok": error is None, "error": str(error) if error else None,
             "files": [asdict(f) for f in files] if files else []})
        if error is not None:
            raise error
        failed = [(r, res["error"]) for r, res in enumerate(results) if not res["ok"]]
        if failed:
            raise RemoteError(f"step {step}: rank {failed[0][0]} could not upload its shard ({failed[0][1]})",
                              transient=False)
        return [UploadedFile(f["path"], f["size"], [PartEntry(**p) for p in f["parts"]])
                for res in results for f in res["files"]]

    def _commit(self, step: int, files) -> None:
        self.remote.commit_upload(self.local.manifest(step), self.codec, files)  # the commit marker
        self.remote.write_latest(max(self.uploaded | {step}))

    def _retrying(self, step: int, attempt_fn):
        """``attempt_fn(done)`` until it succeeds, retrying transient RemoteErrors with backoff."""
        deadline = None if self.retry_timeout is None else time.monotonic() + self.retry_timeout
        done: dict = {}  # parts already sent: a retry resumes after them
        attempt = 0
        while True:
            self._set(step, "uploading" if attempt == 0 else "retrying")
            try:
                return attempt_fn(done)
            except RemoteError as exc:
                late = deadline is not None and time.monotonic() >= deadline
                if not exc.transient or late or self._stop.is_set():
                    raise
                delay = min(self.backoff[1], self.backoff[0] * 2 ** attempt)
                log.warning("upload of step %d: %s; retrying in %.1f s", step, exc, delay)
                self._set(step, "retrying", str(exc))
                attempt += 1
                if self._stop.wait(delay):
                    raise

    def _send(self, step: int, done: dict):
        if step not in self.local.steps():
            return None  # deleted locally meanwhile (nothing to send)
        manifest = self.local.manifest(step)
        mine = manifest.shards if self.ranks is None else [manifest.shards[self.ranks.rank]]
        if self.ranks is None or self.ranks.rank == 0:
            self.remote.put_side_files(self.local.root)
        return self.remote.send_files(self.local.step_path(step), manifest, mine, self.codec, self.level,
                                      done=done, progress=self.progress)

    def _apply_remote_retention(self) -> None:
        if self.keep_remote is None:
            return
        newest = max(self.uploaded)
        for step in plan_eviction(self.uploaded, self.keep_remote, protected=[newest]):
            self.remote.delete(step)
            with self._cond:
                self.uploaded.discard(step)

    # ---- status (for `tieredckpt ls`) ------------------------------------------------------

    def _set(self, step: int, state: str, error: str | None = None) -> None:
        with self._cond:
            entry = {"state": state, "unix": time.time()}
            if error:
                entry["error"] = self.remote.scrub(error)
            self._status[step] = entry
            if state == "uploaded":
                self._status = {s: v for s, v in self._status.items() if v["state"] != "uploaded" or s == step}
        self._write_status()

    def _write_status(self) -> None:
        with self._cond:
            doc = {"remote": self.remote.display_url,
                   "steps": {str(s): v for s, v in sorted(self._status.items())}}
        try:
            atomic_write_bytes(Path(self.local.root) / STATUS_FILE, json.dumps(doc, indent=1).encode())
        except OSError as exc:  # status is informational; never fail an upload over it
            log.debug("cannot write upload status: %s", exc)

    def status(self) -> dict[int, dict]:
        with self._cond:
            return dict(self._status)
