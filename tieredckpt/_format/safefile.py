"""Opening a file read from a checkpoint: once, checked, then read through that descriptor.

Every read path (load, restore, ls, verify, inspect, convert, reshard) opens
checkpoint files through :func:`open_checked`, which refuses, with an error
naming the file and the reason, before anything is read or allocated:

- a path that is not a plain relative name inside its directory, or a symlink
  (``O_NOFOLLOW``; a parent that resolves outside the directory is refused too);
- anything but a regular file: a FIFO (opened non-blocking, so it cannot hang
  us), a device such as ``/dev/zero``, a directory;
- a file larger than the bound that applies to it (a manifest: 64 MiB);
- a file we may not read.

The caller then reads through the descriptor (:meth:`Checked.read_all`) or maps
it (:meth:`Checked.map`, via ``/proc/self/fd`` where there is one, so the same
inode is mapped that was checked).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import CorruptCheckpointError, MissingShardError, UnreadableFileError


class Checked:
    """An open, checked, regular file: its descriptor, size and path (for messages)."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        self.fd, self.size, self.path = fd, size, path

    def read_all(self) -> bytes:
        chunks, left = [], self.size
        while left > 0:
            chunk = os.pread(self.fd, min(left, 16 << 20), self.size - left)
            if not chunk:
                raise CorruptCheckpointError(f"{self.path}: shrank while being read")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def map(self):
        """A private (copy-on-write) mapping of the file as a uint8 tensor, read whole (see
        :meth:`sequential`)."""
        import torch
        if self.size == 0:
            return torch.empty(0, dtype=torch.uint8)
        self.sequential()
        where = f"/proc/self/fd/{self.fd}" if os.path.isdir("/proc/self/fd") else str(self.path)
        try:
            return torch.from_file(where, shared=False, size=self.size, dtype=torch.uint8)
        except RuntimeError as exc:
            raise UnreadableFileError(f"{self.path}: cannot be mapped ({exc})") from None

    def digest(self, sha256: bool, stop=None):
        """size, crc32c (and sha256) of the file, read with bounded preads (never a mapping, so
        a file truncated meanwhile is an error naming it, not a SIGBUS); ``stop``: see
        checksum.digest_view."""
        from .checksum import FileShrank, digest_fd
        self.sequential()
        try:
            return digest_fd(self.fd, self.size, sha256, stop)
        except FileShrank as exc:
            raise CorruptCheckpointError(f"{self.path}: shrank while being read (it held {self.size} bytes when "
                                         f"opened, {exc.offset} now): truncated or rewritten in place by "
                                         "another process") from None

    def sequential(self) -> None:
        """Tell the kernel the whole file is read front to back: a larger readahead window.
        A cold verified load (the crc32c pass is what reads the file in) went from 1.75 to
        2.25 GB/s here; a warm one does not change. Only a hint: never an error."""
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Checked:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checked(directory: str | os.PathLike, rel: str, max_size: int, what: str = "file",
                 missing=MissingShardError) -> Checked:
    """Open ``directory/rel`` for reading after the checks in the module docstring.

    ``missing``: the error class for a file that does not exist (with ``what`` in its message)."""
    directory = Path(directory)
    path = directory / rel
    if rel.startswith("/") or ".." in rel.split("/") or "\x00" in rel:
        raise UnreadableFileError(f"{path}: {what} path {rel!r} leaves its directory; refused")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise missing(f"{path}: {what} is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnreadableFileError(f"{path}: {what} is a symlink; refused (it could point anywhere)") from None
        raise UnreadableFileError(f"{path}: cannot open the {what} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFileError(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file; refused")
        if st.st_size > max_size:
            raise UnreadableFileError(f"{path}: {what} of {st.st_size} bytes is larger than the "
                                      f"{max_size} bytes allowed for it; refused")
        if "/" in rel and not os.path.realpath(path.parent).startswith(os.path.realpath(directory) + os.sep):
            raise UnreadableFileError(f"{path}: resolves outside {directory}; refused")
    except BaseException:
        os.close(fd)
        raise
    return Checked(fd, st.st_size, path)


def read_small(directory: str | os.PathLike, rel: str, max_size: int, what: str, missing=MissingShardError) -> bytes:
    with open_checked(directory, rel, max_size, what, missing) as f:
        return f.read_all()


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, for an error message."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"

