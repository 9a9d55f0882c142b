"""Waiting and closing: the pending write finished, uploads drained or left to the next start,
the threads stopped, the lease and the run directory let go -- within ``exit_timeout`` on the
network however the remote behaves."""

from __future__ import annotations

import logging

from .parts import StoreParts
from .saving import finish_pending

log = logging.getLogger("tieredckpt")


def wait(s: StoreParts, uploads: bool, timeout: float | None) -> bool:
    """CheckpointStore.wait."""
    finish_pending(s)
    s._sha256.flush()  # every committed step's sha256 recorded
    if uploads and s.uploader is not None:
        return s.uploader.drain(timeout)
    return True


def close(s: StoreParts, drain_uploads: bool | None) -> None:
    """CheckpointStore.close: finish the pending write, drain (or not), release; raise what failed."""
    if s._closed:
        return
    if drain_uploads is None:
        drain_uploads = not s.should_stop()
    try:
        finish_pending(s)
        if s.uploader is not None:
            if drain_uploads and not s.uploader.drain(s.close_timeout):
                log.warning("closing with uploads still pending (%s); the next start resumes them",
                            s.uploader.pending())
            s.uploader.raise_error()
    finally:
        s._closed = True
        release(s)


def release(s: StoreParts) -> None:
    """Stop the threads and let go of the run directory and the remote (never raises)."""
    try:
        if s.uploader is not None:
            s.uploader.close(s.exit_timeout)  # nothing waits on the network past it
        s._writer.shutdown(wait=True)
        s._sha256.shutdown()
        s._hold.release_all()
        s.run.close()
        if s.remote is not None:
            s.remote.close()
    finally:
        s._lock.release()


def close_on_error(s: StoreParts) -> None:
    """Leaving the ``with`` block on an exception: commit what was staged, leave uploads to the
    next start, never mask the error."""
    try:
        close(s, drain_uploads=False)
    except Exception:  # noqa: BLE001
        log.exception("while closing after an error")
