"""A folder of ordinary files as one checkpoint step: snapshot it, commit it, bring it back.

    RUN_DIR/step_000500/
      manifest.json                  layout "files": shards[i] is file i (sorted by name),
                                     path "files/<name>", its size, crc32c and sha256
      files/model.safetensors ...    copies of the source's files (reflinks where the filesystem
                                     has them); hard links with ``link=True``

What a framework writes (a Hugging Face ``checkpoint-500/``, accelerate's
``checkpoint_3/``, DeepSpeed's per-rank files) becomes a step like any other: the
same commit protocol, ``latest``, rotation, upload, prefer-local restore and
fallback. The files are never opened as anything but bytes: we move them, the
framework reads them.

Order of a snapshot, and why a crash anywhere is safe:
  1. ``collect``: the source tree is walked without following anything; a
     symlink, FIFO, device or socket, a name that is not plain UTF-8 or that could
     leave the step, too many files: refused by name, before anything is made;
  2. ``stage``: each file is copied (``_clone``: a reflink, else an in-kernel copy, else
     reads and writes; the source opened without following) into ``files/`` of a scratch
     sibling ``step_000500.tmp-<pid>-<hex>/``; with ``link=True``, hard-linked instead.
     From here on the source may be changed in place, deleted or replaced: the step holds
     its own copy (with links: its own names of the same inodes, see below);
  3. ``commit`` (the store's writer thread, off the training loop): each staged
     file is opened refusing symlinks and non-regular files, fsynced (a hard link
     shares the framework's unflushed pages), its size and crc32c recorded; the
     manifest is written and fsynced last; the scratch is fsynced and renamed.
A crash before the rename leaves only scratch with a dead pid (cleaned at the
next start); after it the step is complete. sha256 is recorded after the commit,
off the save's path, as for any step (sharded.fill_sha256).

Why a copy by default: a hard link shares the source's inode, and frameworks that save
into a fixed folder (accelerate's ``save_state("ckpt")``, ``torch.save`` or
``safetensors.save_file`` over an existing file, DeepSpeed's ``latest``) truncate and
rewrite that inode, writing through into the committed step, which is then lost where
no other tier holds it. A copy is a snapshot nothing can change later. On a filesystem
with reflinks (XFS, btrfs) it costs no data copy at all; on ext4 it is an in-kernel copy
(``copy_file_range``) on the caller's thread: the snapshot is taken when ``stage``
returns, whatever the caller does next. ``link=True`` is for writers known to write each
checkpoint into a new folder and only ever delete old ones (the Hugging Face Trainer, which
the callback links; it also removes a committed folder before the Trainer saves over it):
no data copy, and a later rewrite in place is still caught (``written_through``, the
crc32c of every restore and of every upload) but can cost that step. No read of a
folder step's files ever maps them (a truncation under a mapping is SIGBUS).

Restoring (``materialize``) copies each file out of a verified step into a
scratch sibling of the target, checking its crc32c on the way (one read serves
both), fsyncs, and renames the scratch to the target: a restore killed midway
leaves nothing half-written under the target's name. Copies, not links: what the
framework later does with the restored files never reaches a committed step.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .._format import layout
from .._format.atomic import commit_dir, fsync_dir, make_scratch_dir, naming_a_full_disk, write_all
from .._format.checksum import CHUNK, crc32c_update, crc_hex
from .._format.manifest import ShardEntry, ShardManifest, check_relative_path
from .._format.phases import phase
from .._format.safefile import kind_of, open_checked
from ..errors import ChecksumMismatchError, IncompatibleStateError, ManifestError, TieredCkptError, UnreadableFileError
from .sharded import write_manifest

FILES_DIR = layout.FOLDER_FILES_DIR
LAYOUT = "files"
MAX_FILES = 10_000  # an upload manifest of this many one-part files stays under its 8 MiB bound
_ANY_SIZE = 1 << 62
log = logging.getLogger("tieredckpt")
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass
class Staged:
    """A snapshot waiting for its commit: the scratch directory and what it holds."""
    scratch: Path
    final: Path
    names: list[str]  # relative to the source (and to scratch/files), sorted
    copied_bytes: int  # bytes that had to be copied (no hard link possible)
    nbytes: int


def collect(source: Path) -> list[tuple[str, int]]:
    """(name relative to ``source``, size) of every file below it, sorted; refused by name: a
    symlink, anything not a regular file or directory, a name that is not plain, or too many."""
    if not source.is_dir() or source.is_symlink():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory (a folder of files is saved)", str(source))
    found: list[tuple[str, int]] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(source / rel_dir) as entries:
            for entry in entries:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(rel)
                    continue
                _check_name(source, rel)
                if not stat.S_ISREG(st.st_mode):
                    raise UnreadableFileError(f"{source / rel}: is {kind_of(st.st_mode)}; only regular files are "
                                              "saved (a symlink could point anywhere), so nothing was saved")
                found.append((rel, st.st_size))
                if len(found) > MAX_FILES:
                    raise ValueError(f"{source}: holds more than {MAX_FILES} files; a step holds at most that many")
    if not found:
        raise ValueError(f"{source}: holds no files; nothing to save")
    return sorted(found)


def _check_name(source: Path, rel: str) -> None:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise UnreadableFileError(f"{source}: a file name is not valid UTF-8 ({rel!r}); refused") from None
    try:
        check_relative_path(rel, str(source))
    except ManifestError as exc:
        raise UnreadableFileError(str(exc)) from None
    if any(c in rel for c in "\n\r"):
        raise UnreadableFileError(f"{source}: a file name holds a line break ({rel!r}); refused")


def stage(source: str | os.PathLike, final: Path, link: bool = False, previous: Path | None = None) -> Staged:
    """Steps 1 and 2 of the module docstring: the snapshot, in the caller's thread.
    ``previous``: the newest committed step's directory, checked for files the source shares
    with it by inode (see ``written_through``)."""
    source = Path(source)
    files = collect(source)
    if previous is not None:
        for name in written_through(source, files, previous):
            log.warning("%s: was rewritten in place after it was saved as %s (they are one file, hard-linked),"
                        " so that step's local copy no longer matches its checksums; a restore falls back to "
                        "its remote copy or an older step. Save folders whose files are rewritten in place "
                        "without link=True", source / name, previous / FILES_DIR / name)
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = make_scratch_dir(final)
    copied = 0
    try:
        with naming_a_full_disk(final.parent, f"the snapshot of {source}", lambda: sum(s for _, s in files)):
            for rel, size in files:
                target = scratch / FILES_DIR / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                if not (link and _link(source / rel, target)):
                    _clone(source / rel, target)
                    copied += size
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Staged(scratch, final, [rel for rel, _ in files], copied, sum(s for _, s in files))


def written_through(source: Path, files: list[tuple[str, int]], previous: Path) -> list[str]:
    """Names whose source file is the very inode the previous step holds and whose bytes no
    longer match that step's manifest: a framework rewrote it in place (open for writing on the
    same name), through the hard link. Only files sharing an inode are read."""
    from .sharded import read_manifest
    shared = []
    for rel, _ in files:
        try:
            a, b = os.lstat(source / rel), os.lstat(previous / FILES_DIR / rel)
        except OSError:
            continue
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            shared.append(rel)
    if not shared:
        return []
    try:
        entries = {e.path: e for e in read_manifest(previous).shards}
    except (TieredCkptError, OSError):
        return []
    damaged = []
    for rel in shared:
        entry = entries.get(f"{FILES_DIR}/{rel}")
        if entry is None:
            continue
        with open_checked(previous, entry.path, _ANY_SIZE, "file") as f:
            if f.size != entry.size or f.digest(sha256=False).crc32c != entry.crc32c:
                damaged.append(rel)
    return damaged


def _link(src: Path, dst: Path) -> bool:
    """A hard link of ``src`` itself (never what a symlink swapped in meanwhile points at)."""
    try:
        os.link(src, dst, follow_symlinks=False)
        return True
    except OSError as exc:
        if exc.errno in _NO_LINK:
            return False  # another filesystem, or links not allowed: copy
        raise


_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def _clone(src: Path, dst: Path) -> None:
    """A new file ``dst`` holding ``src``'s bytes (not yet fsynced: the commit does that): a
    reflink (FICLONE) where the filesystem shares extents copy-on-write, else the kernel's
    copy_file_range, else reads and writes. The source is opened refusing symlinks and
    anything but a regular file; a file that changes size while copied is the caller's doing,
    and what was read is what the step holds (its crc32c is taken from the copy)."""
    with open_checked(src.parent, src.name, _ANY_SIZE, "file") as f:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if not _reflink(f.fd, out):
                _copy_range(f.fd, out, f.size)
        finally:
            os.close(out)


def _reflink(src_fd: int, dst_fd: int) -> bool:
    import fcntl
    try:
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        return True
    except OSError:  # ext4, tmpfs, another filesystem: no reflinks here
        return False


def _copy_range(src_fd: int, dst_fd: int, size: int) -> None:
    """copy_file_range until the source ends (the kernel copies; no bytes pass through us)."""
    offset = 0
    copy_range = getattr(os, "copy_file_range", None)
    while copy_range is not None:
        try:
            n = copy_range(src_fd, dst_fd, max(size - offset, CHUNK), offset, offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP) or offset:
                raise
            break  # not offered between these two files: read and write
        if n == 0:
            return
        offset += n
    while chunk := os.pread(src_fd, CHUNK, offset):
        write_all(dst_fd, chunk)
        offset += len(chunk)


def _copy_out(f, dst: Path) -> tuple[int, str]:
    """Copy an opened file into a new file ``dst``, fsynced; (bytes, crc32c) of what was copied."""
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        crc, offset = 0, 0
        while chunk := os.pread(f.fd, CHUNK, offset):
            crc = crc32c_update(chunk, crc)
            write_all(out, chunk)
            offset += len(chunk)
        os.fsync(out)
    finally:
        os.close(out)
    return offset, crc_hex(crc)


def commit(staged: Staged, step: int, wall_clock_seconds: float, user: dict) -> ShardManifest:
    """Step 3: record, fsync and publish the staged snapshot as ``step`` (the writer thread).
    On any failure the scratch is removed and nothing is committed."""
    try:
        entries = [_entry(staged.scratch, i, rel) for i, rel in enumerate(staged.names)]
        manifest = ShardManifest(world_size=len(entries), step=step, wall_clock_seconds=float(wall_clock_seconds),
                                 shards=entries, created_unix=time.time(), user=dict(user), layout=LAYOUT)
        for sub in {Path(FILES_DIR, rel).parent for rel in staged.names}:
            fsync_dir(staged.scratch / sub)
        write_manifest(staged.scratch, manifest)  # last: names only durable files
        commit_dir(staged.scratch, staged.final)
    except BaseException:
        shutil.rmtree(staged.scratch, ignore_errors=True)
        raise
    return manifest


def _entry(scratch: Path, index: int, rel: str) -> ShardEntry:
    path = f"{FILES_DIR}/{rel}"
    with open_checked(scratch, path, _ANY_SIZE, "file") as f:
        with phase("fsync"):
            os.fsync(f.fd)  # a hard link shares the framework's unflushed pages: flushed here
        got = f.digest(sha256=False)
    return ShardEntry(rank=index, path=path, sha256="", param_shard_offset=0, param_shard_numel=0,
                      size=got.size, crc32c=got.crc32c)


def discard(staged: Staged) -> None:
    shutil.rmtree(staged.scratch, ignore_errors=True)


def is_folder(manifest: ShardManifest) -> bool:
    return manifest.layout == LAYOUT


def require_folder(manifest: ShardManifest, where: str) -> None:
    if not is_folder(manifest):
        raise IncompatibleStateError(f"{where}: step {manifest.step} holds a state saved with save(), not a "
                                     "folder of files; restore it with restore()")


def file_names(manifest: ShardManifest) -> list[str]:
    """The files of a folder step, as named in the source folder."""
    return [e.path[len(FILES_DIR) + 1:] for e in manifest.shards]


def materialize(step_dir: Path, manifest: ShardManifest, to: Path) -> None:
    """Copy a folder step's files out of ``step_dir`` into a new directory ``to``, each checked
    against its crc32c as it is copied; ``to`` appears whole (rename) or not at all. A file that
    fails its check is a ChecksumMismatchError naming it: nothing is left under ``to``."""
    to = Path(to)
    _check_target(to)
    scratch = make_scratch_dir(to)
    try:
        with naming_a_full_disk(to.parent, f"the restore of step {manifest.step}", lambda: manifest.total_size):
            for entry in manifest.shards:
                target = scratch / entry.path[len(FILES_DIR) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                _copy_checked(step_dir, entry, target)
            for sub in {p.parent for p in scratch.rglob("*")}:
                fsync_dir(sub)
        if to.is_dir():
            to.rmdir()  # an empty directory is the target's place; a non-empty one was refused
        commit_dir(scratch, to)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def _check_target(to: Path) -> None:
    if to.is_symlink() or (to.exists() and not to.is_dir()):
        raise FileExistsError(errno.EEXIST, "exists and is not a directory; a restore never replaces it", str(to))
    if to.is_dir() and any(to.iterdir()):
        raise FileExistsError(errno.EEXIST, "is not empty; a restore writes only into a new or empty "
                              "directory (nothing there is ever overwritten)", str(to))
    to.parent.mkdir(parents=True, exist_ok=True)


def _copy_checked(step_dir: Path, entry: ShardEntry, target: Path) -> None:
    with open_checked(step_dir, entry.path, _ANY_SIZE, "file") as f:
        f.sequential()
        size, crc = _copy_out(f, target)
        if size != entry.size or crc != entry.crc32c:
            raise ChecksumMismatchError(f"{f.path}: {size} bytes with crc32c {crc}, the manifest records "
                                        f"{entry.size} bytes with {entry.crc32c} (corrupt, or rewritten in "
                                        "place after it was saved)")
