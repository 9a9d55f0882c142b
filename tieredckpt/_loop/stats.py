"""What checkpoints cost the training loop: a record per save and per upload, and the
share of wall-clock time the loop spent blocked in ``save()``.

A save's record is made when it commits, an upload's when the remote holds it:

    {"event": "save", "step", "unix", "blocked_s", "staging_s", "deferred_copy_s", "write_s",
     "fsync_s", "commit_s", "bytes", "blocked_share"}
    {"event": "upload", "step", "unix", "upload_s", "lag_s", "bytes_sent"}
    {"event": "save_failed", "step", "unix", "error"}     (a background write that failed)

``blocked_s`` is the whole time ``save()`` held the loop (back-pressure, the copy into
staging buffers); ``write_s`` excludes the fsyncs and the commit (rename and directory
fsyncs), which have their own figures; ``lag_s`` runs from the local commit to the
remote's. ``blocked_share`` is every ``save()`` block since the store opened over the
wall-clock time since then. Records go to RUN_DIR/.events.jsonl (appended, one JSON
object a line, never uploaded; rotated to .events.jsonl.1 past 16 MiB), to the logger
``tieredckpt.stats`` at INFO, and to the ``on_stats`` callback. When the share passes
the budget a warning says so (once; again only after it fell back under), from the
third save on and once ``save()`` has blocked at least a second in all.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import user_stacklevel

log = logging.getLogger("tieredckpt.stats")
MAX_EVENTS_FILE = 16 << 20
MIN_SAVES_FOR_BUDGET = 3  # the first save allocates its buffers; judge a run, not its start
MIN_BLOCKED_S = 1.0  # nor milliseconds: a toy run saving back to back is not a stalled loop


class Stats:
    def __init__(self, path: Path | None, budget: float, callback: Callable[[dict], None] | None) -> None:
        self.path, self.budget, self.callback = path, budget, callback
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # the writer's and the uploader's appends (and rotation)
        self._opened = time.monotonic()
        self._blocked = 0.0
        self._saves: list[dict] = []
        self._uploads: list[dict] = []
        self._failures: list[dict] = []
        self._over = False

    def blocked(self, seconds: float) -> None:
        """One ``save()`` returned after holding the loop ``seconds`` (the loop's thread)."""
        with self._lock:
            self._blocked += seconds
            share, count = self._share(), len(self._saves) + 1
            over = share > self.budget and count >= MIN_SAVES_FOR_BUDGET and self._blocked >= MIN_BLOCKED_S
            warn, self._over = over and not self._over, over
        if warn:
            warnings.warn(f"checkpointing has blocked the training loop {share:.1%} of the time since the store "
                          f"opened ({self._blocked:.2f} s in save()), over the {self.budget:.1%} stall budget: "
                          "save less often, or see store.stats() for where the time goes", RuntimeWarning,
                          stacklevel=user_stacklevel())  # the caller of store.save

    def saved(self, step: int, cost: dict, total_s: float, spent: dict, nbytes: int) -> None:
        """``cost``: blocked_s and staging_s (the loop's thread), deferred_s (overlap's copy)."""
        fsync, commit = spent.get("fsync", 0.0), spent.get("commit", 0.0)
        with self._lock:
            share = self._share()
        self._emit(self._saves, {"event": "save", "step": step, "unix": round(time.time(), 3),
                                 "blocked_s": cost["blocked_s"], "staging_s": cost["staging_s"],
                                 "deferred_copy_s": cost.get("deferred_s", 0.0),
                                 "write_s": max(0.0, total_s - fsync - commit), "fsync_s": fsync,
                                 "commit_s": commit, "bytes": nbytes, "blocked_share": share})

    def uploaded(self, step: int, upload_s: float, lag_s: float, bytes_sent: int) -> None:
        self._emit(self._uploads, {"event": "upload", "step": step, "unix": round(time.time(), 3),
                                   "upload_s": upload_s, "lag_s": lag_s, "bytes_sent": bytes_sent})

    def save_failed(self, step: int, error: str) -> None:
        """A background write of ``step`` failed (nothing was committed for it)."""
        self._emit(self._failures, {"event": "save_failed", "step": step, "unix": round(time.time(), 3),
                                    "error": error})

    def summary(self) -> dict:
        """This process's figures so far: what ``store.stats()`` returns."""
        with self._lock:
            return {"blocked_share": self._share(), "blocked_s": self._blocked,
                    "open_s": time.monotonic() - self._opened, "budget": self.budget,
                    **summarize(list(self._saves), list(self._uploads), list(self._failures))}

    def _share(self) -> float:
        return self._blocked / max(time.monotonic() - self._opened, 1e-9)

    def _emit(self, into: list, record: dict) -> None:
        record = {k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}
        with self._lock:
            into.append(record)
            del into[:-1000]  # recent records for summary(); the file keeps them all
        with self._file_lock:  # not self._lock: save() takes that one, and must never wait on a disk
            self._append(record)
        log.info("%s", json.dumps(record))
        if self.callback is not None:
            try:
                self.callback(dict(record))
            except Exception as exc:  # noqa: BLE001 - a metrics hook never fails a save or an upload
                log.warning("on_stats callback failed: %s", exc)

    def _append(self, record: dict) -> None:
        if self.path is None:
            return
        try:
            if self.path.exists() and self.path.stat().st_size > MAX_EVENTS_FILE:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            # no symlink followed, no FIFO waited on: a planted name only loses the record
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{self.path} is not a regular file")
                os.write(fd, (json.dumps(record) + "\n").encode())  # one write: lines never interleave
            finally:
                os.close(fd)
        except OSError as exc:  # informational: a full disk must not fail the save that just committed
            log.debug("cannot append to %s: %s", self.path, exc)


def summarize(saves: list[dict], uploads: list[dict], failures: Sequence[dict] = ()) -> dict:
    """Medians and maxima of save and upload records (also what ``ls --stats`` prints), and
    how many saves failed (``save_failures``) with the last failure (``last_save_failure``)."""
    def figure(records, key):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if not values:
            return None
        return {"median": statistics.median(values), "max": max(values), "total": sum(values)}
    out = {"saves": len(saves), "uploads": len(uploads), "save_failures": len(failures),
           "last_save_failure": dict(failures[-1]) if failures else None}
    for key in ("blocked_s", "staging_s", "deferred_copy_s", "write_s", "fsync_s", "commit_s", "bytes"):
        out[key.replace("_s", "") if key != "bytes" else "save_bytes"] = figure(saves, key)
    for key in ("upload_s", "lag_s", "bytes_sent"):
        out[key.replace("_s", "") if key != "bytes_sent" else "bytes_sent"] = figure(uploads, key)
    return out


def read_events(path: Path, limit: int = MAX_EVENTS_FILE) -> tuple[list[dict], list[dict], list[dict]]:
    """The save, upload and failed-save records of an events file (its last ``limit`` bytes); lines that
    are not records (a torn last line, damage) are skipped. No file: no records. A file that
    is not a regular one (a FIFO, a symlink) raises UnreadableFileError naming it."""
    from .._format.safefile import open_checked
    from ..errors import MissingShardError
    saves: list[dict] = []
    uploads: list[dict] = []
    failures: list[dict] = []
    try:
        with open_checked(path.parent, path.name, 1 << 50, "events file") as f:
            start = max(0, f.size - limit)
            data = os.pread(f.fd, f.size - start, start)
    except MissingShardError:
        return saves, uploads, failures
    for line in data.splitlines()[1 if start else 0:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            {"save": saves, "upload": uploads, "save_failed": failures}.get(str(record.get("event")), []).append(record)
    return saves, uploads, failures
