"""Every error tieredckpt raises on purpose.

    TieredCkptError (Exception)
     +-- CheckpointNotFoundError (also FileNotFoundError)   no such run / step
     +-- CheckpointExistsError (also FileExistsError)       a committed step is never overwritten
     +-- UnsupportedStateError (also TypeError)             a value we refuse to store
     +-- WorldSizeMismatchError (also ValueError)           saved by N ranks, loading with M
     +-- BackgroundSaveError                                a background write failed
 +-- IncompatibleStateError (also ValueError)           saved state does not fit the live objects
     +-- CorruptCheckpointError (also ValueError)           anything wrong with bytes on disk
          +-- ManifestError                                 manifest missing, unparseable, invalid
          +-- ShardCountMismatchError                       manifest shards != world_size
          +-- MissingShardError (also FileNotFoundError)    a shard the manifest names is gone
          +-- ChecksumMismatchError                         size, crc32c or sha256 differ
          +-- FlatFormatError                               a bad step_NNNNNN.bin

Every message names the file (or value) and the reason. Code that catches a
builtin (``except FileNotFoundError``) keeps working.
"""

from __future__ import annotations


class TieredCkptError(Exception):
    """Root of every error raised on purpose by tieredckpt."""


class CheckpointNotFoundError(TieredCkptError, FileNotFoundError):
    """The run directory or the requested step does not exist."""


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
