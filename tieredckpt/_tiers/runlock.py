"""One writer per run directory: an advisory lock the kernel drops when its holder dies.

``RUN_DIR/.lock`` is locked with ``flock(LOCK_EX | LOCK_NB)`` by a store that
writes (saves, rotates, downloads into the run directory). The holder writes its
host, pid and start time into the file so that a second writer's error can name
it. Nothing has to be cleaned up after a crash: the kernel releases the lock of
a process killed with SIGKILL, and the next writer overwrites the description.
Readers (``read_only=True``, the CLI's read commands) never take it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .._format import layout
from ..errors import WriterConflictError


def describe_holder(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {since}"


class RunLock:
    def __init__(self, root: str | os.PathLike) -> None:
        self.path = Path(root) / layout.LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise WriterConflictError naming the holder."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                error = WriterConflictError(f"{self.path.parent}: cannot write here ({exc.strerror}); "
                                            "open it with read_only=True to restore from it")
                error.read_only_dir = True
                raise error from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_info(fd)
            os.close(fd)
            raise WriterConflictError(
                f"{self.path.parent}: another writer holds this run directory ({describe_holder(holder)}); "
                "one writer per run -- open it with read_only=True to read or restore") from None
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_info(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}
