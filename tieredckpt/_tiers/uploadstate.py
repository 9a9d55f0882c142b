"""What the uploader knows and says: which steps are pending, in flight, uploaded,
superseded or retired; the status file (``tieredckpt ls``, ``store.list``) and the last run's;
failures, which are reported, retried after a backoff and raised at ``close()``."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .._format import layout
from .._format.atomic import atomic_write_bytes
from .._format.uploadmanifest import UploadedFile
from ..errors import RemoteError, TieredCkptError
from .lease import WriterLease
from .local import LocalTier
from .objects import ObjectIndex
from .remote import RemoteTier
from .retention import Policy

log = logging.getLogger("tieredckpt")
MODES = ("newest", "all")


class UploadState:
    """The uploader's state, shared by its parts (uploadsend.py, uploadkeeping.py, uploader.py)
    under one condition variable, ``_cond``."""

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
        self._damage_checked: tuple[int, float] | None = None  # (step, when its objects last read back whole)
        self._last_error: dict | None = None
        self._failed_rounds = 0
        self._failed_cycle: set[int] = set()  # steps that failed since the last success or pause
        self._kick = False  # drain() asks for a retry now instead of after the backoff
        self._pinned_turn = False
        self._exiting = False  # the process is stopping (SIGTERM): the newest step goes first, alone
        self.orphan_grace = orphan_grace  # None: objects no step names are left to `tieredckpt gc`
        self._swept = time.monotonic()  # when this process last looked for them: the first look after
        # orphan_grace, so a short run never reads the remote's markers for it
        self._thread = threading.Thread(target=self._run, name="tieredckpt-uploader", daemon=True)

    def _run(self) -> None:
        raise NotImplementedError  # the worker thread's loop: Uploader._run

    def _gather(self, value):
        return [value] if self.ranks is None else self.ranks.all_gather_json(value)

    def _describe(self, exc: BaseException | None) -> str | None:
        return None if exc is None else self.remote.scrub(f"{exc}" if isinstance(exc, TieredCkptError)
                                                          else f"{type(exc).__name__}: {exc}")

    # ---- failures and waiting -----------------------------------------------------------------

    def _failed(self, step: int | None, exc: Exception) -> None:
        transient = is_transient(exc)
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
        if transient and self._stop.is_set():  # closing: the exit's own message says what is left
            log.debug("upload%s: %s (closing)", f" of step {step}" if step is not None else "", message)
        elif transient:
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

    # ---- status (for `tieredckpt ls` and store.list) ---------------------------------------------

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


def is_transient(exc: BaseException | None) -> bool:
    if isinstance(exc, RemoteError):
        return exc.transient
    if isinstance(exc, (TieredCkptError, ValueError, TypeError, PermissionError)):
        return False
    return isinstance(exc, OSError)  # local I/O trouble (a step rotated away mid-read...): try again
