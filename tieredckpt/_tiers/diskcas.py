"""Conditional writes on a local or mounted disk remote: create by an O_EXCL link of a fully
written temporary file, replace or delete under an exclusive flock of ``path.lock`` -- the disk's
compare-and-swap, as S3's If-None-Match/If-Match are the object store's. Records are read only
from regular files of a bounded size (never through a symlink, never from a FIFO)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat

from .._format.safefile import kind_of
from ..errors import RemoteError

MAX_COMPARED = 8 << 20  # a record a compare-and-replace reads (ours are ~300 bytes)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_versioned(path: str, max_size: int, where: str) -> tuple[bytes, str, float]:
    """(bytes, version, age) of the record at ``path``: its sha256 is the version, and its age is
    told by the disk's own clock (the mtime of a probe file written now), never ours."""
    data, written = read_regular(path, max_size, where)
    probe = f"{path}.clock-{secrets.token_hex(4)}"  # "now" by the clock that stamped the record
    try:
        with open(probe, "wb"):
            pass
        now = os.stat(probe).st_mtime
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return data, digest(data), max(0.0, now - written)


def conditional_write(path: str, data: bytes | None, version: str | None) -> str | None:
    """``version`` None: create ``path`` with ``data`` unless it exists (a fully written temp file
    linked in: O_EXCL's atomicity, never a half-written record). Otherwise, under an exclusive
    flock of ``path.lock``: if ``path`` still holds ``version``, replace it with ``data`` (or
    delete it when ``data`` is None). Returns the new version (sha256; "" for a delete), or None
    when the condition failed. Every writer of ``path`` goes through here, so the lock orders them."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    if version is None:
        if data is None:
            raise ValueError(f"{path}: nothing to create (a delete needs the version it deletes)")
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        _write_synced(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        _fsync_dir(directory)
        return digest(data)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = read_regular(path, MAX_COMPARED, path)[0]
        except FileNotFoundError:
            return None
        if digest(current) != version:
            return None
        if data is None:
            os.unlink(path)
            _fsync_dir(directory)
            return ""
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        _write_synced(tmp, data)
        os.replace(tmp, path)
        _fsync_dir(directory)
        return digest(data)
    finally:
        os.close(fd)


def read_regular(path: str, max_size: int, where: str) -> tuple[bytes, float]:
    """(bytes, mtime) of a regular file of at most ``max_size`` bytes on a disk remote. A symlink
    (it could point anywhere), a FIFO (it would block the reader), a device or a directory is a
    permanent RemoteError naming it, as is a larger file; nothing is read from those."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RemoteError(f"{where}: is a symlink, not a file tieredckpt wrote; refused", transient=False) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RemoteError(f"{where}: is {kind_of(st.st_mode)}, not a file tieredckpt wrote; refused",
                              transient=False)
        if st.st_size > max_size:
            raise RemoteError(f"{where}: larger than the {max_size} bytes allowed for it (not written by "
                              "tieredckpt?)", transient=False)
        chunks, left = [], max_size + 1
        while left > 0 and (chunk := os.read(fd, min(left, 16 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_size:
            raise RemoteError(f"{where}: larger than the {max_size} bytes allowed for it", transient=False)
        return data, st.st_mtime
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
