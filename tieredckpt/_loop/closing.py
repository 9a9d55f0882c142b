"""Waiting and closing: the pending write finished; uploads drained, or after SIGTERM the newest
step sent within ``upload_on_exit`` (a preempted node rarely comes back); the threads stopped,
the lease and the run directory let go -- within ``exit_timeout`` more on the network however
the remote behaves."""

from __future__ import annotations

import logging
import time

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


def close(s: StoreParts, drain_uploads: bool | None, preempted: bool | None = None) -> None:
    """CheckpointStore.close: finish the pending write; drain the uploads, or -- stopping on
    SIGTERM -- send the newest step within ``upload_on_exit``; release; raise what failed."""
    if s._closed:
        return
    preempted = s.should_stop() if preempted is None else preempted
    if drain_uploads is None:
        drain_uploads = not preempted
    try:
        finish_pending(s)
        if s.uploader is not None:
            if drain_uploads:
                if not s.uploader.drain(s.close_timeout):
                    log.warning("closing with uploads still pending (%s); the next start resumes them",
                                s.uploader.pending())
            elif preempted and s.upload_on_exit > 0:
                _send_newest(s)
            s.uploader.raise_error()
    finally:
        s._closed = True
        release(s)


def _send_newest(s: StoreParts) -> None:
    """Stopping on SIGTERM: the node may never come back, so the step just saved goes to the
    remote first, within ``upload_on_exit`` seconds (then ``exit_timeout`` cancels what is left)."""
    assert s.uploader is not None
    newest, started = s.local.latest_step(), time.monotonic()
    if s.uploader.send_newest(s.upload_on_exit):
        if newest is not None:
            log.info("step %d is on %s (%.1f s after the stop)", newest, s.uploader.remote.display_url,
                     time.monotonic() - started)
        return
    log.warning("stopping: step %s did not reach %s within upload_on_exit=%.0f s; it is committed locally, "
                "and the next start on this machine uploads it (pending: %s)", newest,
                s.uploader.remote.display_url, s.upload_on_exit, s.uploader.pending())


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
