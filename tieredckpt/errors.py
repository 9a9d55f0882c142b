"""Every error tieredckpt raises on purpose.

    TieredCkptError (Exception)
     +-- CheckpointNotFoundError (also FileNotFoundError)   no such run / step
     +-- NotARunDirectoryError (also NotADirectoryError)    the run directory's path is a file
     +-- CheckpointExistsError (also FileExistsError)       a committed step is never overwritten
     +-- UnsupportedStateError (also TypeError)             a value we refuse to store
     +-- WorldSizeMismatchError (also ValueError)           saved by N ranks, loading with M
     +-- BackgroundSaveError                                a background write failed
     +-- IncompatibleStateError (also ValueError)           saved state does not fit the live objects
     +-- WriterConflictError                                another live writer owns the run dir / remote
     |    +-- CommitRefusedError (also FileExistsError)     a committed remote step is never overwritten
     +-- DistributedCommitError                             another rank failed; nothing was committed
     +-- UploadError                                        uploads failed for good (raised at close)
     +-- RemoteError (also OSError)                         a remote request failed; .transient
     |    +-- RemoteNotFoundError (also FileNotFoundError)  no such bucket / prefix / object
     |    +-- RemoteAccessError (also PermissionError)      access denied, bad or expired credentials
     +-- CorruptCheckpointError (also ValueError)           anything wrong with bytes on disk
          +-- ManifestError                                 manifest missing, unparseable, invalid
          +-- ShardCountMismatchError                       manifest shards != world_size
          +-- MissingShardError (also FileNotFoundError)    a shard the manifest names is gone
          +-- ChecksumMismatchError                         size, crc32c or sha256 differ
          +-- FlatFormatError                               a bad step_NNNNNN.bin
          +-- UnreadableFileError                           a symlink, FIFO, device, too large, no permission
     +-- DiskFullError (also OSError)                       no space for a checkpoint (names dir and size)

Every message names the file (or value) and the reason. Code that catches a
builtin (``except FileNotFoundError``) keeps working.
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called by the caller of this function that names
    the user's line: the first frame outside this package (however deep the call inside it)."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn_user(message: str) -> None:
    """What the user must see but need not stop for: logged, and warned of as a RuntimeWarning
    that names the user's line that led to it."""
    logging.getLogger("tieredckpt").warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


class TieredCkptError(Exception):
    """Root of every error raised on purpose by tieredckpt."""


class CheckpointNotFoundError(TieredCkptError, FileNotFoundError):
    """The run directory or the requested step does not exist."""


class NotARunDirectoryError(TieredCkptError, NotADirectoryError):
    """The path given as a run directory exists and is not a directory."""


class CheckpointExistsError(TieredCkptError, FileExistsError):
    """A checkpoint for this step is already committed; it is never overwritten."""


class UnsupportedStateError(TieredCkptError, TypeError):
    """The state holds a value that cannot be stored without pickle."""


class WorldSizeMismatchError(TieredCkptError, ValueError):
    """The checkpoint was written by a different number of ranks."""


class BackgroundSaveError(TieredCkptError):
    """A background write failed; raised at the next call into the store."""


class IncompatibleStateError(TieredCkptError, ValueError):
    """The saved state does not match the model or optimizer it is loaded into."""


class CorruptCheckpointError(TieredCkptError, ValueError):
    """The bytes on disk are not a valid, complete checkpoint."""


class ManifestError(CorruptCheckpointError):
    """The manifest is missing, unparseable or fails validation."""


class ShardCountMismatchError(CorruptCheckpointError):
    """The manifest lists a different number of shards than its world size."""


class MissingShardError(CorruptCheckpointError, FileNotFoundError):
    """A shard named by the manifest is not on disk."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A file's size, crc32c or sha256 differs from what the manifest recorded."""


class FlatFormatError(CorruptCheckpointError):
    """A flat step_NNNNNN.bin file is malformed."""


class UnreadableFileError(CorruptCheckpointError):
    """A checkpoint file that cannot be read as one: a symlink, a FIFO or device, too large, no permission."""


class DiskFullError(TieredCkptError, OSError):
    """The disk has no room for the checkpoint (the message names the directory and the size)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class WriterConflictError(TieredCkptError):
    """Another live writer holds the run directory or the remote prefix (named in the message)."""

    read_only_dir = False  # True: nobody holds it, but this directory cannot be written at all


class CommitRefusedError(WriterConflictError, FileExistsError):
    """The remote already holds a commit marker for this step, written by another writer (named):
    a committed step is never overwritten."""


class DistributedCommitError(TieredCkptError):
    """Another rank failed to write or commit its part; nothing was committed."""


class UploadError(TieredCkptError):
    """Uploads failed in a way no retry fixed; ``failures`` maps each step to its error."""

    def __init__(self, message: str, failures: dict | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class RemoteError(TieredCkptError, OSError):
    """A remote request failed. ``transient``: a retry may succeed. ``code`` and ``status``: the
    server's error code and HTTP status, where it answered (S3), else None."""

    code: str | None = None
    status: int | None = None

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient

    def __str__(self) -> str:  # OSError would format its args
        return self.args[0] if self.args else ""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The remote object, prefix or bucket does not exist."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)


class RemoteAccessError(RemoteError, PermissionError):
    """The remote refused us: access denied, bad or expired credentials."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)
