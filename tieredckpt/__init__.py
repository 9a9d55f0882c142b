"""tieredckpt: crash-safe, pickle-free, tiered checkpoints for PyTorch training runs.

Names are imported on first use (PEP 562), so that ``import tieredckpt`` -- and
the command line's read-only commands -- do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_WHERE = {
    # the store a training loop holds
    "CheckpointStore": "_loop.store", "SaveHandle": "_loop.handle", "CheckpointInfo": "_loop.handle", "StoreConfig": "_loop.config",
    "KeepLast": "_tiers.retention", "KeepEvery": "_tiers.retention", "AnyOf": "_tiers.retention",
    "capture_rng": "_loop.rng", "restore_rng": "_loop.rng", "LossHistory": "_loop.runlog", "RunLog": "_loop.runlog",
    # the low-level format the seed names, and the flat single-run format
    "ShardManifest": "_format.manifest", "ShardEntry": "_format.manifest",
    "save_sharded": "_tiers.sharded", "load_sharded": "_tiers.sharded", "verify_checkpoint": "_tiers.sharded",
    **{name: "_format.flat" for name in (
        "FlatCheckpoint", "read_flat", "write_flat", "model_to_flat", "flat_to_model", "flat_state")},
    # errors
    **{name: "errors" for name in (
        "TieredCkptError", "CheckpointNotFoundError", "NotARunDirectoryError", "CheckpointExistsError",
        "UnsupportedStateError", "WorldSizeMismatchError", "BackgroundSaveError", "IncompatibleStateError",
        "WriterConflictError", "CommitRefusedError", "DistributedCommitError", "UploadError", "RemoteError",
        "RemoteNotFoundError",
        "RemoteAccessError", "CorruptCheckpointError", "ManifestError", "ShardCountMismatchError",
        "MissingShardError", "ChecksumMismatchError", "FlatFormatError", "UnreadableFileError", "DiskFullError")},
}

__all__ = sorted(_WHERE) + ["__version__"]

if TYPE_CHECKING:  # what the names above resolve to, for type checkers and the API reference
    from ._format.flat import FlatCheckpoint, flat_state, flat_to_model, model_to_flat, read_flat, write_flat
    from ._format.manifest import ShardEntry, ShardManifest
    from ._loop.config import StoreConfig
    from ._loop.handle import CheckpointInfo, SaveHandle
    from ._loop.rng import capture_rng, restore_rng
    from ._loop.runlog import LossHistory, RunLog
    from ._loop.store import CheckpointStore
    from ._tiers.retention import AnyOf, KeepEvery, KeepLast
    from ._tiers.sharded import load_sharded, save_sharded, verify_checkpoint
    from .errors import (
        BackgroundSaveError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        ChecksumMismatchError,
        CommitRefusedError,
        CorruptCheckpointError,
        DiskFullError,
        DistributedCommitError,
        FlatFormatError,
        IncompatibleStateError,
        ManifestError,
        MissingShardError,
        NotARunDirectoryError,
        RemoteAccessError,
        RemoteError,
        RemoteNotFoundError,
        ShardCountMismatchError,
        TieredCkptError,
        UnreadableFileError,
        UnsupportedStateError,
        UploadError,
        WorldSizeMismatchError,
        WriterConflictError,
    )


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tieredckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
