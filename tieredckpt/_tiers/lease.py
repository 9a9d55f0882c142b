"""Who owns a remote prefix: one writer, recorded on the remote, with a heartbeat.

    ROOT/writer.json  {"host", "pid", "pid_start", "since", "heartbeat", "lease_seconds", "token"}

Only the owner uploads, commits and deletes under the prefix; everyone else
(an eval job, a notebook, the CLI, a restore on another machine) reads and
never asks for permission. The record is written when a writer starts and
rewritten every ``heartbeat`` seconds by a thread of its own.

Taking the lease, in order:
  1. read writer.json; a record that is another live writer's stops us with a
     WriterConflictError naming it. A record is dead when its heartbeat is older
     than its ``lease_seconds``, or when it names a process on this host that no
     longer exists (pid and start time), or when ``takeover`` is asked for;
  2. write our record with a fresh random token;
  3. wait ``settle`` seconds and read it back: another writer that raced us and
     wrote last owns it, and we raise. (Object stores have no compare-and-swap
     that every fsspec backend offers; read-back after a pause closes the race
     for writers that start more than a round trip apart.)
Every heartbeat reads the record first: a foreign token means our lease lapsed
(an outage longer than ``lease_seconds``) and another writer took over; from
then on we are not the owner and touch nothing.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time

from .._format import layout
from ..errors import RemoteError, WriterConflictError
from .transport import Transport

log = logging.getLogger("tieredckpt")
_LIVE: set[str] = set()  # tokens of the leases this process holds now (a closed store's is gone)
LEASE_SECONDS = 120.0
HEARTBEAT_SECONDS = 20.0
_MAX_RECORD = 64 << 10


class WriterLease:
    def __init__(self, transport: Transport, *, lease_seconds: float = LEASE_SECONDS,
                 heartbeat: float = HEARTBEAT_SECONDS, settle: float | None = None) -> None:
        self.t = transport
        if settle is None:  # a round trip or two to an object store; a local directory needs little
            settle = 0.05 if transport.protocol in ("file", "local", "memory") else 0.3
        self.lease_seconds, self.heartbeat, self.settle = lease_seconds, heartbeat, settle
        self.token = secrets.token_hex(8)
        self.since = time.time()
        self.owned = False
        self.lost: str | None = None  # why we are no longer the owner
        self.previous: dict | None = None  # the record we replaced: its "sending" may be a half-upload
        self.sending: int | None = None  # the step being uploaded, so a successor can clean up after us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- taking and keeping it ------------------------------------------------------------

    def acquire(self, takeover: bool = False) -> None:
        """Become the owner, or raise WriterConflictError (or a transient RemoteError)."""
        current = self.read()
        if current is not None and current.get("token") != self.token and not takeover:
            alive, why = holder_alive(current, mine=_LIVE)
            if alive:
                raise WriterConflictError(
                    f"{self.t.display_url}: another writer owns this remote ({describe(current)}; {why}). "
                    "Open with read_only=True to read; if that writer is gone, wait for its lease to lapse "
                    "or pass takeover=True")
        self._write()
        time.sleep(self.settle)
        back = self.read()
        if back is None or back.get("token") != self.token:
            raise WriterConflictError(f"{self.t.display_url}: another writer took this remote at the same moment "
                                      f"({describe(back or {})})")
        if current is not None and current.get("token") != self.token:
            log.warning("%s: took over the remote from %s", self.t.display_url, describe(current))
        self.owned, self.lost = True, None
        _LIVE.add(self.token)
        self.previous = current if current is not None and current.get("token") != self.token else None
        self._start_heartbeat()

    def renew(self) -> bool:
        """One heartbeat: True while we own the prefix. A foreign token means we lost it."""
        if not self.owned:
            return False
        current = self.read()
        if current is not None and current.get("token") != self.token:
            self.owned = False
            _LIVE.discard(self.token)
            self.lost = f"another writer took this remote over ({describe(current)})"
            log.error("%s: %s; this store stops uploading and deleting there", self.t.display_url, self.lost)
            return False
        self._write()
        return True

    def note_sending(self, step: int) -> None:
        """Record the step about to be uploaded (before its first part is sent): if we die
        mid-upload, the next owner knows where a half-upload may lie."""
        if self.owned and self.sending != step:
            self.sending = step
            self._write()

    def previous_sending(self) -> int | None:
        step = (self.previous or {}).get("sending")
        return step if type(step) is int and step >= 0 else None

    def check(self) -> None:
        """Raise unless we own the prefix right now (called before anything is deleted)."""
        if not self.owned:
            raise WriterConflictError(f"{self.t.display_url}: this store does not own the remote"
                                      + (f": {self.lost}" if self.lost else ""))

    def release(self) -> None:
        self._stop.set()
        _LIVE.discard(self.token)
        if self.owned:
            self.owned = False
            try:
                current = self.read()
                if current is not None and current.get("token") == self.token:
                    self.t.rm(layout.WRITER_LEASE)
            except RemoteError as exc:
                log.info("%s: could not release the writer lease (%s); it lapses in %.0f s",
                         self.t.display_url, exc, self.lease_seconds)

    # ---- the record -----------------------------------------------------------------------

    def read(self) -> dict | None:
        data = self.t.get_optional(layout.WRITER_LEASE, _MAX_RECORD)
        if data is None:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            log.warning("%s: unreadable writer record; treating it as lapsed", self.t.where(layout.WRITER_LEASE))
            return {"token": None, "heartbeat": 0}
        return record

    def _write(self) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                  "since": self.since, "heartbeat": time.time(), "lease_seconds": self.lease_seconds,
                  "sending": self.sending, "token": self.token}
        self.t.put(layout.WRITER_LEASE, json.dumps(record).encode())

    def _start_heartbeat(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="tieredckpt-lease", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                if not self.renew():
                    return
            except RemoteError as exc:  # an outage: the next beat tries again
                log.debug("writer heartbeat failed: %s", exc)


def holder_alive(record: dict, mine: set[str] = frozenset()) -> tuple[bool, str]:
    """(alive?, why) for a lease record another writer left. ``mine``: the tokens this
    process holds now; a record of this very process with another token is a store of
    ours that was closed without deleting it (the remote did not answer then)."""
    age = time.time() - float(record.get("heartbeat") or 0)
    lease = float(record.get("lease_seconds") or LEASE_SECONDS)
    if record.get("host") == socket.gethostname() and record.get("pid") == os.getpid() \
            and record.get("pid_start") == process_start(os.getpid()) and record.get("token") not in mine:
        return False, "a closed store of this process"
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        start = process_start(record["pid"])
        if start is None or (record.get("pid_start") is not None and start != record.get("pid_start")):
            return False, "that process is gone"
        return True, "that process is running on this host"
    if age > lease:
        return False, f"its last heartbeat was {age:.0f} s ago"
    return True, f"last heartbeat {age:.0f} s ago; its lease lapses in {lease - age:.0f} s"


def describe(record: dict) -> str:
    since = record.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, since {when}"


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), or None if it is not running.

    With the pid it identifies a process even after the pid is reused. Without /proc,
    0 for any running process."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None
