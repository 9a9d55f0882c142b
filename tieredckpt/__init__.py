"""tieredckpt: crash-safe, pickle-free, tiered checkpoints for PyTorch training runs."""

from .errors import (BackgroundSaveError, IncompatibleStateError, CheckpointExistsError, CheckpointNotFoundError,
                     ChecksumMismatchError, CorruptCheckpointError, FlatFormatError, ManifestError,
                     MissingShardError, ShardCountMismatchError, TieredCkptError,
                     UnsupportedStateError, WorldSizeMismatchError)
from .config import StoreConfig
from .flat import FlatCheckpoint, flat_to_model, model_to_flat, read_flat, write_flat
from .local import LocalTier
from .manifest import ShardEntry, ShardManifest
from .retention import AnyOf, KeepEvery, KeepLast
from .rng import capture_rng, restore_rng
from .runlog import LossHistory, RunLog
from .sharded import load_sharded, save_sharded, verify_checkpoint
from .errors import (DiskFullError, DistributedCommitError, NotARunDirectoryError, RemoteAccessError, RemoteError,
                     RemoteNotFoundError, UnreadableFileError, UploadError, WriterConflictError)
from .store import CheckpointInfo, CheckpointStore, SaveHandle

__version__ = "0.1.0"

__all__ = [
    "AnyOf", "BackgroundSaveError", "CheckpointInfo", "CheckpointStore", "IncompatibleStateError",
    "LossHistory", "RunLog", "SaveHandle", "capture_rng", "restore_rng", "CheckpointExistsError", "CheckpointNotFoundError",
    "ChecksumMismatchError", "CorruptCheckpointError", "FlatCheckpoint", "FlatFormatError",
    "KeepEvery", "KeepLast", "LocalTier", "ManifestError", "MissingShardError",
    "ShardCountMismatchError", "StoreConfig", "UploadError", "RemoteError", "RemoteAccessError",
    "RemoteNotFoundError", "WriterConflictError", "DistributedCommitError", "NotARunDirectoryError",
    "DiskFullError", "UnreadableFileError", "ShardEntry", "ShardManifest", "TieredCkptError",
    "UnsupportedStateError", "WorldSizeMismatchError", "__version__", "flat_to_model",
    "load_sharded", "model_to_flat", "read_flat", "save_sharded", "verify_checkpoint", "write_flat",
]
