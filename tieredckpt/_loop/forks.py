"""Forks: a committed step copied into a new run directory with its provenance, and -- with a
new remote -- committed there by the storage's own copies, without sending its bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

from .._tiers.lease import WriterLease
from .._tiers.remote import RemoteTier
from ..errors import CheckpointExistsError, CheckpointNotFoundError, RemoteError, warn_user
from .parts import StoreParts
from .runlog import fork_run
from .saving import finish_pending


def fork(s: StoreParts, step: int, new_run_dir: Path, remote: str | None, remote_options: dict | None) -> Path:
    """CheckpointStore.fork."""
    finish_pending(s)
    if remote is None:
        return fork_run(s.local.root, step, new_run_dir)
    if s.remote is None or not s.remote.is_committed(step):
        raise CheckpointNotFoundError(
            f"fork(remote=...): step {step} is not on this store's remote "
            f"({s.remote.display_url if s.remote else 'none configured'}); "
            "wait(uploads=True) for it first")
    return _fork_remote(s.remote, s.local.root, step, new_run_dir, remote, remote_options)


def _fork_remote(source: RemoteTier, run_dir: Path, step: int, new_run_dir: Path, url: str,
                 options: dict | None) -> Path:
    """Order: the new remote's lease taken and the remote found empty (nothing is written
    anywhere before) -> the local fork -> the step's objects copied by the storage -> its
    marker committed under that lease -> latest and the side files -> the lease let go.

    All or nothing up to the marker: if the copy or the commit fails, the local fork this call
    made is removed again, so the same call can be retried; the remote keeps only objects no
    step names (``tieredckpt gc``), never a partial step. After the marker the fork exists in
    both places: a failure of latest or the side files is warned of, not raised (the new run's
    store writes both with its next upload)."""
    child = RemoteTier(url, source.t.options if options is None else options,
                       request_timeout=source.t.request_timeout)
    try:
        _require_empty(child)  # before taking its lease: a live run's remote is refused for what it is
        # a source opened with allow_unfenced on such a server: its forks there go on the same way
        lease = WriterLease(child.t, floor=child.newest_generation, allow_unfenced=source.t.conditions_ignored)
        lease.acquire()
        try:
            _require_empty(child)  # and under it: nobody committed there meanwhile
            root = fork_run(run_dir, step, new_run_dir)
            try:
                child.copy_step_from(source, step, writer=lease.identity(), fence=lambda: lease.fence(commit=True))
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)  # ours, made above: nothing of the user's is in it
                raise
            _finish_fork(child, step, root)
        finally:
            lease.release()
    finally:
        child.close()
    return root


def _finish_fork(child: RemoteTier, step: int, root: Path) -> None:
    try:
        child.write_latest(step)
        child.put_side_files(root)
    except RemoteError as exc:
        warn_user(f"fork: step {step} is committed on {child.display_url} and in {root}, but its latest pointer "
                  f"or side files were not written ({exc}); a store opened on the new run writes them with its "
                  "next upload")


def _require_empty(remote: RemoteTier) -> None:
    if remote.step_dirs():
        raise CheckpointExistsError(f"{remote.display_url}: already holds checkpoints; a fork's remote must be "
                                    "a new prefix")
