"""One checkpoint directory: shards of every rank plus the manifest, committed atomically.

    save_sharded(state_dict_per_rank, dir, step) -> ShardManifest
    load_sharded(dir, expected_world_size, verify="crc") -> [state of rank 0, 1, ...]
    verify_checkpoint(dir, full=False) -> ShardManifest

Crash safety of a save, in order:
  1. everything is written inside ``<dir>.tmp-<pid>-<hex>/``, a sibling on the
     same filesystem; the final name does not exist yet;
  2. each shard is written and fsynced (write_shard);
  3. the manifest, which names every shard with its size and checksums, is
     written and fsynced last;
  4. the temp directory is fsynced, renamed to ``dir`` and the parent fsynced.
A crash before 4 leaves only scratch (removed by atomic.clean_stale); after 4
the checkpoint is complete. No manifest ever points at a partial shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._format import layout
from .._format.atomic import atomic_write_bytes, building, fsync_file, naming_a_full_disk, write_all
from .._format.checksum import DigestStopped
from .._format.manifest import MAX_MANIFEST_BYTES, MAX_USER_DEPTH, ShardEntry, ShardManifest, json_depth
from .._format.safefile import Checked, open_checked, read_small
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ManifestError,
    UnsupportedStateError,
    WorldSizeMismatchError,
)

# torch is imported by the functions that move tensors (tree, shardfile, staging), not
# here: reading manifests and checksumming files -- `tieredckpt ls`, `verify` -- need none.
_ANY_SIZE = 1 << 62


def save_sharded(state_dict_per_rank: Sequence[Any], dir: str | os.PathLike, step: int, *,
                 wall_clock_seconds: float = 0.0,
                 param_shards: Sequence[tuple[int, int]] | None = None,
                 user: dict | None = None, sha256: bool = True) -> ShardManifest:
    """Write one shard file per rank, then the manifest, and commit ``dir`` atomically.

    ``param_shards`` gives each rank's ``(param_shard_offset, param_shard_numel)``
    in the flat parameter space; by default each rank owns as many elements as
    its tensors hold, laid end to end in rank order. ``sha256=False`` commits with
    crc32c alone and leaves each shard's sha256 to :func:`fill_sha256` (the store
    does that right after the commit, off the save's path).
    """
    final = Path(dir)
    if final.exists():
        raise CheckpointExistsError(f"{final}: a checkpoint is already committed here; it is never overwritten")
    if not state_dict_per_rank:
        raise ValueError("state_dict_per_rank is empty: nothing to save")
    spans = list(param_shards) if param_shards is not None else _default_spans(state_dict_per_rank)
    if len(spans) != len(state_dict_per_rank):
        raise ValueError(f"param_shards has {len(spans)} entries for {len(state_dict_per_rank)} ranks")
    user = check_user_value(user)
    with naming_a_full_disk(final.parent, f"step {step}", lambda: sum(map(state_nbytes, state_dict_per_rank))):
        return _save(state_dict_per_rank, final, step, spans, wall_clock_seconds, user, sha256)


def _save(state_dict_per_rank, final: Path, step: int, spans, wall_clock_seconds, user, sha256) -> ShardManifest:
    with building(final) as tmp:  # shards, then the manifest, then the atomic rename
        digests = [write_rank(tmp / layout.shard_name(rank), state, sha256)  # fsynced inside
                   for rank, state in enumerate(state_dict_per_rank)]
        manifest = make_manifest(step, digests, spans, wall_clock_seconds, user)
        write_manifest(tmp, manifest)  # last: names only durable shards
    return manifest


def make_manifest(step: int, digests, spans, wall_clock_seconds: float, user: dict | None) -> ShardManifest:
    """The one place a checkpoint manifest is made: rank r's shard ``rank{r}.bin`` with its
    digest (size, crc32c, sha256; a header crc32c when it holds DTensor pieces, which makes
    the layout "dtensor") and its (offset, numel) span of the flat parameter space."""
    entries = [ShardEntry(rank=rank, path=layout.shard_name(rank), sha256=d.sha256 or "", size=d.size, crc32c=d.crc32c,
                          param_shard_offset=span[0], param_shard_numel=span[1], header_crc32c=d.header_crc32c)
               for rank, (d, span) in enumerate(zip(digests, spans))]
    return ShardManifest(world_size=len(entries), step=step, wall_clock_seconds=float(wall_clock_seconds),
                         shards=entries, created_unix=time.time(), user=dict(user or {}),
                         layout="dtensor" if any(d.header_crc32c for d in digests) else "plain")


def check_user_value(user: dict | None) -> dict:
    """``user`` as the manifest will hold it: plain JSON, nested at most MAX_USER_DEPTH levels."""
    user = dict(user or {})
    try:
        json.dumps(user)
    except (TypeError, ValueError) as exc:
        raise UnsupportedStateError(f"user={user!r:.200}: not plain JSON ({exc})") from None
    if json_depth(user, MAX_USER_DEPTH) > MAX_USER_DEPTH:
        raise UnsupportedStateError(f"user: nested deeper than {MAX_USER_DEPTH} levels")
    return user


def write_manifest(directory: Path, manifest: ShardManifest) -> None:
    """Write ``manifest.json`` into a scratch directory and fsync it."""
    fd = os.open(directory / layout.MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, manifest.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank(path: Path, state: Any, sha256: bool = True):
    """Write one rank's shard from plain state or a store's Staged snapshot."""
    from .._format.shardfile import write_flattened, write_shard
    from .._format.tree import Staged
    if isinstance(state, Staged):  # already snapshotted by the store
        return write_flattened(path, state.skeleton, state.tensors, state.names, sha256=sha256,
                               handoff=state.handoff, pieces=state.pieces, structure=state.structure)
    return write_shard(path, state, sha256=sha256)


def fill_sha256(dir: str | os.PathLike) -> ShardManifest | None:
    """Record the sha256 of every shard whose manifest entry has none yet; None if none lacked it.

    Each such shard is read once, computing crc32c and sha256 together; a shard whose
    crc32c no longer matches is refused (its corruption is never blessed with a sha256).
    The manifest is then replaced atomically (sibling temp, fsync, rename, fsync dir):
    a crash leaves the old manifest -- valid, with crc32c, its sha256 still to fill.

    A step rotated away meanwhile (its directory renamed to scratch) stops the read within
    one chunk, raising CheckpointNotFoundError: an open mapping of a deleted shard would
    keep its blocks allocated, and a disk sized for ``keep_local`` steps needs them back."""
    manifest = read_manifest(dir)
    if all(e.sha256 for e in manifest.shards):
        return None
    gone = Path(dir) / layout.MANIFEST

    def removed() -> bool:
        return not gone.exists()
    entries = []
    for entry in manifest.shards:
        if not entry.sha256:
            try:
                with open_shard(dir, entry) as f:
                    got = f.digest(sha256=True, stop=removed)
            except DigestStopped:
                raise CheckpointNotFoundError(f"{dir}: rotated away while its sha256 was computed") from None
            if got.crc32c != entry.crc32c:
                raise ChecksumMismatchError(f"{f.path}: crc32c {got.crc32c} does not match the manifest's "
                                            f"{entry.crc32c} (corrupt); its sha256 is not recorded")
            entry = dataclasses.replace(entry, sha256=got.sha256)
        entries.append(entry)
    filled = dataclasses.replace(manifest, shards=entries)
    atomic_write_bytes(Path(dir) / layout.MANIFEST, filled.to_json().encode())
    return filled


def state_nbytes(state: Any) -> int:
    from .._format import tree
    from .._format.tree import Staged
    tensors = state.tensors if isinstance(state, Staged) else tree.flatten(state)[1]
    return sum(t.numel() * t.element_size() for t in tensors)


def state_numel(state: Any) -> int:
    """How many tensor elements a rank's state (or Staged snapshot) holds."""
    from .._format import tree
    from .._format.tree import Staged
    tensors = state.tensors if isinstance(state, Staged) else tree.flatten(state)[1]
    return sum(t.numel() for t in tensors)


def _default_spans(states: Sequence[Any]) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for state in states:
        numel = state_numel(state)
        spans.append((offset, numel))
        offset += numel
    return spans


def read_manifest(dir: str | os.PathLike) -> ShardManifest:
    """The validated manifest of a committed checkpoint directory (read through safefile)."""
    directory = Path(dir)
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory")
    path = directory / layout.MANIFEST
    text = read_small(directory, layout.MANIFEST, MAX_MANIFEST_BYTES, "manifest", missing=ManifestError)
    manifest = ShardManifest.from_json(text, source=str(path))
    named = layout.parse_step_dir(directory.name)
    if named is not None and named != manifest.step:
        raise ManifestError(f"{path}: records step {manifest.step}, but its directory is step {named} "
                            "(copied or renamed?)")
    return manifest


def shard_paths(dir: str | os.PathLike, manifest: ShardManifest) -> list[Path]:
    """Each shard's path, checked to exist, to match its recorded size, and to stay inside ``dir``."""
    return [shard_path(dir, entry) for entry in manifest.shards]


def shard_path(dir: str | os.PathLike, entry: ShardEntry) -> Path:
    """One shard's path, checked (a regular file inside ``dir``, its recorded size)."""
    with open_shard(dir, entry):
        pass
    return Path(dir) / entry.path


def open_shard(dir: str | os.PathLike, entry: ShardEntry) -> Checked:
    """One shard opened through safefile, its size checked against the manifest."""
    f = open_checked(dir, entry.path, _ANY_SIZE, f"shard of rank {entry.rank}")
    if f.size != entry.size:
        f.close()
        raise ChecksumMismatchError(
            f"{f.path}: {f.size} bytes on disk but the manifest records {entry.size} "
            f"({'truncated or partial write' if f.size < entry.size else 'file grew'})")
    return f


def load_rank(dir: str | os.PathLike, rank: int, expected_world_size: int, verify: str = "crc") -> Any:
    """One rank's state (on a node that holds only its own ranks' shards), verified."""
    from .._format.shardfile import read_shard
    manifest = read_manifest(dir)
    if manifest.world_size != expected_world_size:
        raise WorldSizeMismatchError(
            f"{Path(dir) / layout.MANIFEST}: written by world_size {manifest.world_size}, "
            f"loading with {expected_world_size} (pass reshard=True to restore to reshard it)")
    entry = manifest.shards[rank]
    return read_shard(Path(dir) / entry.path, size=entry.size, crc32c=entry.crc32c, sha256=entry.sha256,
                      verify=verify)


def load_sharded(dir: str | os.PathLike, expected_world_size: int, verify: str = "crc") -> list[Any]:
    """Every rank's state, verified; raises before returning anything if any part is bad.

    ``verify``: "crc" (fast, crc32c), "sha256" (full), or "none" (sizes only).
    """
    manifest = read_manifest(dir)
    if manifest.world_size != expected_world_size:
        raise WorldSizeMismatchError(
            f"{Path(dir) / layout.MANIFEST}: written by world_size {manifest.world_size}, "
            f"loading with {expected_world_size} (reshard it to change the world size)")
    return load_sharded_files(dir, manifest, verify)


def load_sharded_files(dir: str | os.PathLike, manifest: ShardManifest, verify: str = "crc") -> list[Any]:
    """Every rank's state from the shard files in ``dir``, checked against ``manifest``."""
    from .._format.shardfile import read_shard
    paths = shard_paths(dir, manifest)  # cheap checks on every shard before reading any
    return [read_shard(path, size=e.size, crc32c=e.crc32c, sha256=e.sha256, verify=verify)
            for path, e in zip(paths, manifest.shards)]


def verify_checkpoint(dir: str | os.PathLike, full: bool = False) -> ShardManifest:
    """Check every shard's size and crc32c; with ``full``, also sha256 and decode every
    shard as a load would (a file whose checksums match but which no load accepts fails)."""
    manifest = read_manifest(dir)
    verify_checkpoint_files(dir, manifest, full)
    return manifest


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> ShardManifest:
    """Copy a committed checkpoint to ``dst`` with the same protocol as a save.

    Shards are copied into a scratch sibling of ``dst`` and fsynced, the copy
    is verified against the manifest (crc32c), the manifest goes in last, then
    the directory is committed by rename. A crash leaves only scratch.
    """
    manifest = read_manifest(src)
    final = Path(dst)
    if final.exists():
        raise CheckpointExistsError(f"{final}: a checkpoint is already committed here; it is never overwritten")
    with building(final) as tmp:
        for path, entry in zip(shard_paths(src, manifest), manifest.shards):
            target = tmp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            fsync_file(target)
        verify_checkpoint_files(tmp, manifest)
        write_manifest(tmp, manifest)
    return manifest


def verify_present(dir: str | os.PathLike, full: bool = False) -> tuple[ShardManifest, list[int]]:
    """Verify the shards this directory holds; return the manifest and their ranks.

    On node-local disks a node's step directory holds only its own ranks' shards
    (plus the global manifest): absent shards are reported, present ones checked.
    """
    manifest = read_manifest(dir)
    here = [e for e in manifest.shards if (Path(dir) / e.path).exists()]
    verify_checkpoint_files(dir, ShardManifest(manifest.world_size, manifest.step, manifest.wall_clock_seconds,
                                               here, manifest.schema_version, manifest.created_unix,
                                               manifest.user), full, entries=here)
    return manifest, [e.rank for e in here]


def verify_checkpoint_files(dir: str | os.PathLike, manifest: ShardManifest, full: bool = False,
                            entries=None) -> None:
    """Check the shards in ``dir`` against ``manifest`` (sizes, crc32c; with ``full`` sha256 and a decode)."""
    entries = manifest.shards if entries is None else entries
    for entry in entries:
        with open_shard(dir, entry) as f:
            got = f.digest(sha256=full)
            if got.crc32c != entry.crc32c:
                raise ChecksumMismatchError(f"{f.path}: crc32c {got.crc32c} does not match the manifest's "
                                            f"{entry.crc32c} (corrupt)")
            if full and entry.sha256 and got.sha256 != entry.sha256:  # "": not recorded yet
                raise ChecksumMismatchError(f"{f.path}: sha256 {got.sha256} does not match the manifest's "
                                            f"{entry.sha256} (corrupt)")
            if full and manifest.layout != "files":  # a folder's files are bytes to us: never parsed
                from .._format.shardfile import decode
                decode(f.map(), str(f.path))  # parses the header and every tensor entry, as a load does
