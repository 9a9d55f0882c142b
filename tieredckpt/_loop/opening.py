"""Opening a store, in order: its options checked (a bad one is named before anything is
touched) -> the run directory's lock (one writer per run; runlock.py) -> one probe of the remote
(a missing bucket or refused credentials fail here, before any training; an unreachable remote
only warns) -> the remote writer lease (one writer per prefix; lease.py). With many ranks, a
step that fails on one rank fails on every rank (``agree``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from .._format.codec import MAX_LEVEL
from .._format.layout import CODECS
from .._format.shardfile import VERIFY_MODES
from .._tiers.lease import WriterLease
from .._tiers.local import LocalTier
from .._tiers.ranks import RankGroup
from .._tiers.remote import RemoteTier
from .._tiers.runlock import RunLock
from .._tiers.uploader import MODES as UPLOAD_MODES
from ..errors import DistributedCommitError, RemoteError, WriterConflictError, warn_user

SAVE_ERROR_MODES = ("raise", "warn")

log = logging.getLogger("tieredckpt")


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def check_local(local: object, remote: object) -> None:
    """A URL where the local run directory belongs is refused (it would be made into a local
    directory named ``s3:/bucket/...`` and no remote opened), saying where the URL goes."""
    if isinstance(local, str) and _URL.match(local):
        hint = f"CheckpointStore('runs/x', remote={local!r})" if not remote else "a path on this machine"
        raise ValueError(f"local={local!r} is a URL, but the first argument is the local run directory, a path on "
                         f"this machine; a remote URL goes in remote= (for example {hint})")


def alias(name: str, value: object, old: str, old_value: object):
    """One option under its fsspec name (``storage_options=``, ``fs=``) or ours (``remote_options=``,
    ``remote_fs=``); both at once is refused, since one would be silently dropped."""
    if value is not None and old_value is not None:
        raise ValueError(f"{name}= and {old}= are the same option under two names; give one")
    return value if value is not None else old_value


def check_options(compression: str | None, compression_level: int, keep_local: int, every: int, verify: str,
                  uploads: str, exit_timeout: float, upload_on_exit: float, on_save_error: str, orphan_grace: float | None,
                  stall_budget: float) -> None:
    """Raise ValueError naming the first option that is out of range."""
    if (compression or "raw") not in CODECS:
        raise ValueError(f"compression must be one of {CODECS[1:]} or None, got {compression!r}")
    if type(compression_level) is not int or not 1 <= compression_level <= MAX_LEVEL:
        raise ValueError(f"compression_level must be an int in [1, {MAX_LEVEL}], got {compression_level!r}")
    if type(keep_local) is not int or keep_local < 1:
        raise ValueError(f"keep_local must be an int >= 1, got {keep_local!r}")
    if type(every) is not int or every < 0:
        raise ValueError(f"every must be an int >= 0 (0: only on request), got {every!r}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if uploads not in UPLOAD_MODES:
        raise ValueError(f"uploads must be one of {UPLOAD_MODES}, got {uploads!r}")
    if not _seconds(exit_timeout):
        raise ValueError(f"exit_timeout must be a number of seconds >= 0, got {exit_timeout!r}")
    if not _seconds(upload_on_exit):
        raise ValueError(f"upload_on_exit must be a number of seconds >= 0 (0: none), got {upload_on_exit!r}")
    if on_save_error not in SAVE_ERROR_MODES:
        raise ValueError(f"on_save_error must be one of {SAVE_ERROR_MODES}, got {on_save_error!r}")
    if orphan_grace is not None and not _seconds(orphan_grace):
        raise ValueError(f"orphan_grace must be a number of seconds >= 0 or None, got {orphan_grace!r}")
    if not isinstance(stall_budget, (int, float)) or not 0 < stall_budget <= 1:
        raise ValueError(f"stall_budget must be a share of time in (0, 1], got {stall_budget!r}")


def take_lock(lock: RunLock, local: LocalTier) -> bool:
    """Lock the run directory for this writer; False when it cannot be written at all (a
    read-only directory: the store goes on as a reader, and says so)."""
    try:
        lock.acquire()
    except WriterConflictError as exc:
        if not exc.read_only_dir:
            raise
        warn_user(f"{exc}; opened as a reader (restores work, saves do not)")
        return False
    local.clean_stale_once()  # what a killed save or restore left behind
    return True


def probe(remote: RemoteTier, read_only: bool) -> bool:
    """Fail fast on what no retry fixes (no bucket, access denied); False when the remote does
    not answer now, which only delays uploads (the uploader keeps trying)."""
    try:
        remote.t.probe(create=not read_only)
    except RemoteError as exc:
        if not exc.transient:
            raise
        log.warning("%s: unreachable now (%s); local saves and restores go on, uploads start "
                    "when it answers", remote.display_url, exc)
        return False
    return True


def take_lease(remote: RemoteTier, takeover: bool, answered: bool, allow_unfenced: bool = False) -> WriterLease:
    """The writer lease on the remote (another live writer fails here); when the remote does not
    answer it is left to the uploader to record, in the background."""
    lease = WriterLease(remote.t, floor=remote.newest_generation, allow_unfenced=allow_unfenced)
    if answered:
        try:
            lease.acquire(takeover=takeover)
        except RemoteError as exc:
            if not exc.transient:
                raise
            log.warning("%s: cannot record this writer yet (%s); retried in the background",
                        remote.display_url, exc)
    return lease


def agree(ranks: RankGroup | None, fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on this rank; with many ranks, if it failed anywhere, raise everywhere."""
    if ranks is None:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        error = exc
    outcomes = ranks.all_gather_json(f"{type(error).__name__}: {error}" if error else None)
    if error is not None:
        raise error
    failed = [(r, o) for r, o in enumerate(outcomes) if o]
    if failed:
        raise DistributedCommitError(f"{what}: rank {failed[0][0]} failed ({failed[0][1]})")
    return result
