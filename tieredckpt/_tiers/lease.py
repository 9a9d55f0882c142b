"""Who owns a remote prefix: one writer, recorded on the remote, fenced on every write that matters.

    ROOT/writer.json  {"host", "pid", "pid_start", "since", "heartbeat", "seq", "lease_seconds",
                       "sending", "token", "generation", "free", "base", "committed"}

Only the owner uploads, commits and deletes under the prefix; everyone else
(an eval job, a notebook, the CLI, a restore on another machine) reads and
never asks for permission.

Where the backend enforces conditions (S3's If-None-Match/If-Match, a disk's
O_EXCL link and flock: Transport.conditional) the record is a compare-and-swap
register: every write of it -- taking it, each heartbeat, each "sending" note,
the release -- names the version it replaces, so a writer whose record was
replaced (a takeover, or a taker that has left since) finds out at its very
next write and never writes again. ``fence()`` is that write: the uploader
calls it before every commit marker and every batch of deletes, so after a
takeover no old writer's upload.json, latest or delete reaches the remote
(up to the one request between its last good fence and the write it fenced).
Elsewhere the same calls read, compare and write (read-back after ``settle``
closes the race for writers that start more than a round trip apart).

Taking the lease, in order:
  1. read writer.json with its version and its age by the remote's clock; a
     record that is another live writer's stops us with a WriterConflictError
     naming it and saying how to take over. A record is dead when the remote's
     own clock says it was not rewritten for its ``lease_seconds`` (never the
     other host's timestamp against ours), or when it names a process on this
     host that no longer exists, or when ``takeover`` is asked for. A record
     whose age the backend cannot tell counts as alive;
  2. write ours with a fresh random token, conditional on the version read (or
     on nothing being there): a writer that wrote in between wins, and we raise.
A heartbeat that finds the record gone or changed means someone else owned the
prefix meanwhile: we stop, say so, and touch nothing more there.

Ownership only moves forward. Every taking writes a ``generation`` one above
every generation the remote has seen (the record's, and the newest commit
marker's where the record is missing); a release marks the record ``free`` and
keeps its generation, so it is never forgotten. The record also names the
generation of the timeline its writer continued (``base``) and whether it has
committed yet (set at the fence of its first commit): until it has, readers take
the ``latest`` pointer of that earlier timeline as newest (RemoteTier.newest_step).
A lease that has seen another
writer's record after its own (a takeover, or a taker that has released since)
is *replaced* for good: it never takes the remote again, whatever the record
looks like later (once replaced, always replaced; a new store takes a new
generation). A writer whose own record is still there after an outage longer
than its lease goes on: nobody came in between. Each commit marker records its
writer's generation (``identity()``), and nothing deletes what a higher
generation committed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from .._format import layout
from .._format.uploadmanifest import generation_of
from ..errors import RemoteError, WriterConflictError
from . import condprobe
from .transport import Transport

log = logging.getLogger("tieredckpt")
_LIVE: set[str] = set()  # tokens of the leases this process holds now (a closed store's is gone)
LEASE_SECONDS = 120.0
HEARTBEAT_SECONDS = 20.0
_MAX_RECORD = 64 << 10


class WriterLease:
    def __init__(self, transport: Transport, *, lease_seconds: float = LEASE_SECONDS,
                 heartbeat: float = HEARTBEAT_SECONDS, settle: float | None = None,
                 floor: Callable[[], int] | None = None, allow_unfenced: bool = False) -> None:
        self.t = transport
        self.allow_unfenced = allow_unfenced  # go on where the server ignores write conditions
        self._probed = False  # condprobe.py asked, once, before the first taking
        # the highest generation the remote's commit markers record (RemoteTier.newest_generation):
        # asked only when there is no record to read it from (a new or wiped remote)
        self.floor = floor
        if settle is None:  # a round trip or two to an object store; a local directory needs little
            settle = 0.05 if transport.protocol in ("file", "local", "memory") else 0.3
        self.lease_seconds, self.heartbeat, self.settle = lease_seconds, heartbeat, settle
        self.token = secrets.token_hex(8)
        self.since = time.time()
        self.owned = False
        self.lost: str | None = None  # why we are no longer the owner
        self.previous: dict | None = None  # the record we replaced: its "sending" may be a half-upload
        self.sending: int | None = None  # the step being uploaded, so a successor can clean up after us
        self.version: str | None = None  # of our record on the remote, for the next conditional write
        self.seq = 0
        self.generation: int | None = None  # the generation we hold, or held last
        self.base = 0  # the generation of the timeline we continued (the newest commit's when we took it)
        self.committed = False  # set (and recorded) at the fence of our first commit
        self.held = False  # once we owned the remote, any other record seen later replaced us
        self.replaced: str | None = None  # set once a later writer was seen: never the owner again
        self.fences = 0  # conditional writes of the record made to fence a commit or a delete
        self._lock = threading.Lock()  # the heartbeat and the uploader write the record in turn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- taking and keeping it ------------------------------------------------------------

    def acquire(self, takeover: bool = False) -> None:
        """Become the owner, or raise WriterConflictError (or a transient RemoteError). With
        ``takeover`` a record that changes under us (a live zombie's heartbeat) is read and
        replaced again, a few times: the old writer's writes never keep a relaunch out. A lease
        that was replaced raises at once, takeover or not: it never owns the remote again."""
        if self.replaced:
            raise WriterConflictError(self._replaced_message())
        for attempt in range(_TAKEOVER_TRIES if takeover else 1):
            try:
                return self._acquire_once(takeover)
            except _Raced:
                if attempt + 1 == (_TAKEOVER_TRIES if takeover else 1):
                    raise WriterConflictError(f"{self.t.display_url}: another writer took this remote at the "
                                              f"same moment ({describe(self.read() or {})})") from None
                # a live zombie fencing each of its commits can land between our read and our write
                # every time, in step with us: a random pause takes us out of its rhythm (five tries
                # without one lost all five against a writer committing every ~0.2 s on SeaweedFS)
                time.sleep(random.uniform(0.0, min(0.5, 0.05 * (attempt + 1))))

    def _acquire_once(self, takeover: bool) -> None:
        # Order: read the record (and the newest commit's generation) -> refuse if we were replaced
        # -> refuse a live other writer unless taking over -> write ours, one generation up, over
        # the version read (a writer that wrote in between wins: _Raced) -> heartbeat.
        # The markers are read first: the record's read and our write over it stay one round trip
        # apart, or a zombie writing its record twice a step wins every race against a takeover.
        self._check_fencing()
        marked = self.floor() if self.floor else 0
        found = self.t.read_versioned(layout.WRITER_LEASE, _MAX_RECORD)
        current, version, age = (None, None, None) if found is None else (_parse(found[0], self.t), *found[1:])
        other = current if current is not None and current.get("token") != self.token else None
        seen = max(generation_of(current) if current is not None else 0, marked)
        self._refuse_if_replaced(other, current is None and seen > (self.generation or 0), seen)
        if other is not None and not takeover and not other.get("free"):
            alive, why = holder_alive(other, age, mine=_LIVE)
            if alive:
                raise WriterConflictError(
                    f"{self.t.display_url}: another writer owns this remote ({describe(other)}; {why}). "
                    "Open with read_only=True to read; if that writer is gone or must stop (a relaunch of "
                    "its job), pass takeover=True: it stops writing there at its next write")
        with self._lock:
            seq = current.get("seq") if isinstance(current, dict) else None
            self.seq = (seq if type(seq) is int and seq >= 0 else 0) + 1
            # one above everything seen; our own record (kept through an outage) keeps its own.
            # Set before the write (the record carries it) and put back if the write loses a race:
            # a taking that never happened must not count as a lease we held.
            before = self.generation, self.base
            self.generation = max(seen, self.generation or 0) + (0 if current is not None and other is None else 1)
            self.base = self.base if self.held else marked
            try:
                self._write_taken(version)
            except BaseException:
                self.generation, self.base = before
                raise
        if other is not None and not other.get("free"):
            log.warning("%s: took over the remote from %s", self.t.display_url, describe(other))
        self.owned, self.held, self.lost = True, True, None
        _LIVE.add(self.token)
        self.previous = other
        self._start_heartbeat()

    def _check_fencing(self) -> None:
        """Before the first taking: does the remote enforce the conditions every fence is? A
        server that ignores or refuses them stops a writer here, with the way forward, unless
        ``allow_unfenced`` (then the lease reads, compares and writes, and says so every open)."""
        if self._probed:
            return
        what = condprobe.ignored_conditions(self.t)
        self._probed = True
        if what is None:
            if not self.t.conditional and self.t.protocol != "memory":
                log.warning("%s: this backend has no conditional writes: two writers are told apart by reading "
                            "the writer record back, and a replaced writer learns it only at its next heartbeat "
                            "(an S3 server or a disk fences every commit)", self.t.display_url)
            return
        if not self.allow_unfenced:
            raise RemoteError(
                f"{self.t.display_url}: this server does not enforce conditional writes ({what}). Every guard "
                "against a second writer rests on them: through this server two writers could both own the "
                "remote, and a writer replaced by a relaunch would go on committing and pruning steps. Use a "
                "server that honours If-None-Match and If-Match (AWS S3, MinIO, SeaweedFS, moto), or, when "
                "no two writers can ever run at once, open with allow_unfenced=True (--allow-unfenced), "
                "accepting that a zombie writer can then commit", transient=False)
        self.t.conditions_ignored = True
        log.warning("%s: this server does not enforce conditional writes (%s); opened with allow_unfenced: "
                    "writers are NOT fenced here, so a second writer or a zombie of this one can commit and "
                    "delete steps. Make sure only one writer ever runs", self.t.display_url, what)

    def _refuse_if_replaced(self, other: dict | None, wiped_after_us: bool, seen: int) -> None:
        """A lease we held and lost never comes back: any record but ours, or (where the record
        was wiped) a commit marker above our generation, is a writer that came after us."""
        if not self.held or (other is None and not wiped_after_us):
            return
        if other is not None:
            self._replace(other)
        else:
            self.lost = f"its writer record was removed, and a later writer (generation {seen}) committed there"
            self.replaced = self.lost
        raise WriterConflictError(self._replaced_message())

    def _write_taken(self, version: str | None) -> None:
        """Write our record over ``version`` (None: over nothing); _Raced or WriterConflictError
        when another writer wrote in between."""
        if self.t.conditional:
            body = self._record()
            # Live before the record exists: another store of this process that reads it right
            # after our write must not take it for a closed store's leftover (holder_alive).
            _LIVE.add(self.token)
            try:
                self.version = (self.t.put_if_absent(layout.WRITER_LEASE, body) if version is None
                                else self.t.put_if_match(layout.WRITER_LEASE, body, version))
            except BaseException:
                _LIVE.discard(self.token)
                raise
            if self.version is None:
                _LIVE.discard(self.token)
                raise _Raced()
        else:
            self._write_blind()
            time.sleep(self.settle)
            back = self.read()
            if back is None or back.get("token") != self.token:
                raise WriterConflictError(f"{self.t.display_url}: another writer took this remote at the "
                                          f"same moment ({describe(back or {})})")

    def renew(self) -> bool:
        """One heartbeat: rewrite our record, on the condition that it is still ours. False (and
        we are no longer the owner) when it was replaced or removed meanwhile."""
        if not self.owned:
            return False
        with self._lock:
            if not self.owned:
                return False
            self.seq += 1
            if self.t.conditional and self.version is not None:
                version = self.t.put_if_match(layout.WRITER_LEASE, self._record(), self.version)
                if version is None:  # changed: by us (a write whose answer an outage lost), or not
                    current, version = self._ours_again()
                if version is not None:
                    self.version = version
                    return True
            else:
                current = self.read()
                if current is not None and current.get("token") == self.token:
                    self._write_blind()
                    return True
            self._lose(current)
            return False

    def _ours_again(self) -> tuple[dict | None, str | None]:
        """After a conditional write that failed: (the record, our new version). A record that
        still carries our token was last written by us -- a write that landed although its answer
        was lost to a timeout -- so it is rewritten over the version now there (a taker writing
        in between still wins). Any other record (or none) is returned with no version."""
        found = self.t.read_versioned(layout.WRITER_LEASE, _MAX_RECORD)
        current = None if found is None else _parse(found[0], self.t)
        if current is None or current.get("token") != self.token or found is None:
            return current, None
        return current, self.t.put_if_match(layout.WRITER_LEASE, self._record(), found[1])

    def fence(self, commit: bool = False) -> None:
        """Prove, by a conditional write of our record, that we own the prefix at this moment;
        raise WriterConflictError if not. Called right before each commit marker (``commit``:
        the record then says this generation has committed, so readers stop preferring the
        timeline it continued) and each batch of deletes."""
        self.check()
        self.fences += 1
        self.committed = self.committed or commit
        if not self.renew():
            self.check()

    def _lose(self, current: dict | None) -> None:
        self.owned = False
        _LIVE.discard(self.token)
        if current is None:  # wiped: the next acquire() asks the markers whether anyone came after us
            self.lost = ("the writer record was removed: another writer may have owned this remote meanwhile "
                         "(a takeover while this one could not reach it)")
        else:
            self._replace(current)
        log.error("%s: %s; this store stops uploading and deleting there (its local checkpoints go on; "
                  "open a new store to write there again)", self.t.display_url, self.lost)

    def _replace(self, current: dict) -> None:
        """Another writer's record came after ours: we are done with this remote for good."""
        self.owned = False
        _LIVE.discard(self.token)
        gen = generation_of(current)
        if current.get("free"):
            self.lost = (f"a later writer (generation {gen}: {describe(current)}) took this remote over "
                         "and has released it since")
        else:
            self.lost = f"another writer took this remote over ({describe(current)}, generation {gen})"
        self.replaced = self.lost

    def _replaced_message(self) -> str:
        return (f"{self.t.display_url}: {self.replaced}; a writer that was replaced never writes there again "
                f"(this store held generation {self.generation}). Open a new store to write there: it takes "
                "a new generation")

    def note_sending(self, step: int) -> None:
        """Record the step about to be uploaded (before its first part is sent): if we die
        mid-upload, the next owner knows where a half-upload may lie. A conditional write, so
        it fences the sending too: a writer that lost the lease learns it here."""
        if self.owned and self.sending != step:
            self.sending = step
            if not self.renew():
                self.check()

    def previous_sending(self) -> int | None:
        step = (self.previous or {}).get("sending")
        return step if type(step) is int and step >= 0 else None

    def check(self) -> None:
        """Raise unless we own the prefix as far as we know (no request)."""
        if not self.owned:
            raise WriterConflictError(f"{self.t.display_url}: this store does not own the remote"
                                      + (f": {self.lost}" if self.lost else ""))

    def release(self) -> None:
        """Mark the record free, keeping its generation (a conditional write on our version): the
        next writer needs no takeover, and a writer older than us still finds out it was replaced."""
        self._stop.set()
        _LIVE.discard(self.token)
        if self.owned:
            self.owned = False
            try:
                with self._lock:
                    if self.t.conditional and self.version is not None:
                        self.t.put_if_match(layout.WRITER_LEASE, self._record(free=True), self.version)
                    else:
                        current = self.read()
                        if current is not None and current.get("token") == self.token:
                            self.t.put(layout.WRITER_LEASE, self._record(free=True))
            except RemoteError as exc:
                log.info("%s: could not release the writer lease (%s); it lapses in %.0f s",
                         self.t.display_url, exc, self.lease_seconds)

    # ---- the record -----------------------------------------------------------------------

    def read(self) -> dict | None:
        data = self.t.get_optional(layout.WRITER_LEASE, _MAX_RECORD)
        return None if data is None else _parse(data, self.t)

    def identity(self) -> dict:
        """Who we are, as recorded in each upload manifest we commit (``tieredckpt ls`` shows it)."""
        return {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "generation": self.generation or 0}

    def _record(self, free: bool = False) -> bytes:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                  "since": self.since, "heartbeat": time.time(), "seq": self.seq,
                  "lease_seconds": self.lease_seconds, "sending": self.sending,
                  "token": self.token, "generation": self.generation or 0, "free": free,
                  "base": self.base, "committed": self.committed}
        return json.dumps(record).encode()

    def _write_blind(self) -> None:
        """Backends without conditional writes: the write itself (callers read first)."""
        self.t.put(layout.WRITER_LEASE, self._record())

    def _start_heartbeat(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="tieredckpt-lease", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                if not self.renew():
                    return
            except RemoteError as exc:  # an outage: the next beat tries again
                log.debug("writer heartbeat failed: %s", exc)


class _Raced(Exception):
    """The record changed between our read and our conditional write."""


_TAKEOVER_TRIES = 10


def _parse(data: bytes, t: Transport) -> dict:
    try:
        record = json.loads(data)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        log.warning("%s: unreadable writer record; treating it as lapsed", t.where(layout.WRITER_LEASE))
        return {"token": None, "heartbeat": 0, "unreadable": True}
    return record


def holder_alive(record: dict, age: float | None, mine: AbstractSet[str] = frozenset()) -> tuple[bool, str]:
    """(alive?, why) for a lease record another writer left, ``age`` seconds old by the remote's
    own clock (None: the backend cannot tell). ``mine``: the tokens this process holds now; a
    record of this very process with another token is a store of ours that was closed without
    deleting it (the remote did not answer then). Another host's ``heartbeat`` timestamp is
    never compared with our clock: a host whose clock runs ahead would look alive for ever,
    one whose clock runs behind would look dead at once."""
    lease = float(record.get("lease_seconds") or LEASE_SECONDS)
    if record.get("free"):
        return False, "it released the remote"
    if record.get("unreadable"):
        return False, "its record is unreadable"
    if record.get("host") == socket.gethostname() and record.get("pid") == os.getpid() \
            and record.get("pid_start") == process_start(os.getpid()) and record.get("token") not in mine:
        return False, "a closed store of this process"
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        start = process_start(record["pid"])
        if start is None or (record.get("pid_start") is not None and start != record.get("pid_start")):
            return False, "that process is gone"
        return True, "that process is running on this host"
    if age is None:
        return True, "this remote cannot say how old its record is, so it is taken as alive"
    if age > lease:
        return False, f"the remote last saw its heartbeat {age:.0f} s ago"
    return True, f"the remote saw its last heartbeat {age:.0f} s ago; its lease lapses in {lease - age:.0f} s"


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
