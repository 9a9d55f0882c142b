"""The local commit protocol: temp name, fsync, rename, fsync the parent.

POSIX ``rename`` within one filesystem is atomic, and a directory entry is only
durable once its parent directory is fsynced. Every helper here keeps the rule
"the final name appears only after everything under it is durable", so a crash
at any instant leaves either the old state or the complete new one.

Scratch entries (``*.tmp-<pid>-<hex>``, ``*.del-<pid>-<hex>``) carry their
writer's pid; :func:`clean_stale` removes only those whose writer is dead, so a
cleaner never pulls the floor out from under a live writer on the same node.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .._format import layout
from ..errors import DiskFullError
from .phases import phase


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data) -> None:
    """``os.write`` until every byte of ``data`` is written (writes may be partial)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: write a sibling temp, fsync, rename, fsync dir."""
    atomic_write_chunks(path, [data], durable)


def atomic_write_chunks(path: str | os.PathLike, chunks, durable: bool = True) -> None:
    """Replace ``path`` with the concatenation of ``chunks`` (buffers), durably and atomically.

    Order: a sibling temp file (same directory, so the rename is atomic) -> every chunk
    written -> fsync -> rename over ``path`` -> fsync the directory. Readers see the old
    file or the complete new one; a crash leaves at most a temp file with a dead pid.
    ``durable=False`` skips both fsyncs (still atomic; a power loss may lose the new file):
    for a caller that makes it durable later, off its hot path (fsync_file + fsync_dir).
    """
    path = Path(path)
    tmp = path.with_name(layout.scratch_name(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            write_all(fd, chunk)
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)  # atomic: readers see the old or the new file
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if durable:
        fsync_dir(path.parent)  # make the rename itself durable


@contextmanager
def building(final: str | os.PathLike) -> Iterator[Path]:
    """The one way a directory (a checkpoint, an archive) comes into existence.

        with building(run / "step_000100") as tmp:
            write files into tmp (each fsynced), the manifest last
        # here step_000100/ exists, complete and durable

    Order: a scratch sibling ``<final>.tmp-<pid>-<hex>`` (same filesystem) is
    made and yielded -> the caller writes everything into it -> on a clean exit
    it is fsynced, renamed to ``final`` (refused if ``final`` exists) and the
    parent fsynced. On any exception the scratch is deleted and ``final`` never
    appears. A crash at any instant leaves ``final`` absent or complete; the
    scratch a crash leaves behind carries a dead pid and goes in clean_stale.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_scratch_dir(final)
    try:
        yield tmp
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def scratch_dir(near: str | os.PathLike | None) -> Iterator[Path]:
    """A private scratch directory, deleted on exit whatever happens: beside ``near``
    (same filesystem, named so a crash's leftover is cleaned), or in the system's
    temp directory when ``near`` is None (a reader that must not write the run)."""
    import tempfile
    tmp = make_scratch_dir(Path(near)) if near is not None else Path(tempfile.mkdtemp(prefix="tieredckpt-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_scratch_dir(final: Path) -> Path:
    """A fresh sibling directory of ``final`` (same filesystem) to build it in."""
    tmp = final.with_name(layout.scratch_name(final.name))
    tmp.mkdir()
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Publish a fully written, fsynced scratch directory under its final name.

    Order: fsync(tmp) so its entries are durable -> rename(tmp, final), which
    fails rather than replace an existing ``final`` -> fsync(parent) so the new
    name survives a power cut. Before the rename the checkpoint does not exist;
    after it, it is complete.
    """
    with phase("commit"):
        fsync_dir(tmp)
        if final.exists():
            raise FileExistsError(errno.EEXIST, "already exists", str(final))
        os.rename(tmp, final)
        fsync_dir(final.parent)


@contextmanager
def naming_a_full_disk(directory: Path, what: str, need: Callable[[], int]) -> Iterator[None]:
    """A full disk (or quota) inside the block is raised as DiskFullError naming ``directory``,
    ``what`` was being written, about how many bytes it needs (``need()``, asked only then) and
    how many are free. The block's own cleanup (``building``'s scratch) has run by then."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or isinstance(exc, DiskFullError):
            raise
        free = shutil.disk_usage(directory).free
        raise DiskFullError(f"{directory}: {exc.strerror}: {what} needs about {need()} bytes, {free} "
                            "are free (its scratch copy was removed; nothing committed was touched)") from exc


def remove_dir(path: Path) -> None:
    """Delete a directory so that no half-deleted copy is ever visible under its name.

    Rename it to a scratch name first (atomic; it vanishes from listings at once,
    fsynced), then delete the contents. A crash mid-delete leaves only scratch.
    """
    doomed = path.with_name(layout.scratch_name(path.name, kind="del"))
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_stale(parent: Path) -> list[str]:
    """Remove scratch entries in ``parent`` left by writers that are no longer alive."""
    removed = []
    for entry in os.scandir(parent):
        pid = layout.scratch_owner_pid(entry.name)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            _unlink_quietly(Path(entry.path))
        removed.append(entry.name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
