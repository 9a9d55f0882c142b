"""Restoring: which step, from which tier, for which rank -- and loading it verified.

    Restorer.choose(step)  -> the newest step every rank can restore (or the named one)
    Restorer.load(step)    -> this rank's state:
        one rank:   the local copy if it verifies, else the remote copy, downloaded
                    into the local tier with the commit protocol (a corrupt local
                    copy is replaced, with a warning);
        many ranks: this rank's shard, locally or fetched alone from the remote;
                    every rank learns if any rank failed (no rank goes on alone);
        reshard:    every source shard, re-split for this world (tieredckpt.reshard).
    load_into(state, into) -> live objects loaded only after every key and shape checks.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .atomic import commit_dir, fsync_dir, remove_dir
from .errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleStateError
from .local import LocalTier
from .manifest import ShardManifest
from .ranks import DistributedCommitError, RankGroup
from .remote import RemoteTier
from .reshard import reshard as reshard_states
from .shardfile import read_shard
from .sharded import load_rank, shard_path, write_manifest

log = logging.getLogger("tieredckpt")


class Restorer:
    def __init__(self, local: LocalTier, remote: RemoteTier | None, ranks: RankGroup | None,
                 verify: str, node_leader: bool = True) -> None:
        self.local, self.remote, self.ranks = local, remote, ranks
        self.verify, self.node_leader = verify, node_leader
        self.rank = ranks.rank if ranks else 0

    def choose(self, step: int | None) -> tuple[int | None, list[int], list[int]]:
        """(step to restore or None, local steps, remote steps)."""
        local_steps = self.local.steps()
        remote_steps = self.remote.steps() if self.remote is not None else []
        candidates = sorted(set(local_steps) | set(remote_steps))
        if self.ranks is not None:  # only a step that every rank can restore
            every = self.ranks.all_gather_json(candidates)
            candidates = sorted(set.intersection(*map(set, every)))
            if step is None and not candidates and any(every):
                raise CheckpointNotFoundError(f"no step is available to every rank (per rank: "
                                              f"{[c[-3:] for c in every]}); restore a named step or repair")
        if step is None and candidates:
            step = candidates[-1]
        return step, local_steps, remote_steps

    def load(self, step: int, local_steps: list[int], remote_steps: list[int], reshard: bool = False) -> Any:
        world = self.ranks.world_size if self.ranks else 1
        if reshard and self._saved_manifest(step, local_steps).world_size != world:
            if self.ranks is None:
                return self._load_resharded(step, local_steps)
            return self._agree(lambda: self._load_resharded(step, local_steps), f"resharding step {step}")
        if self.ranks is None:
            return self._load_single(step, local_steps, remote_steps)
        return self._agree(lambda: self._load_rank(step, local_steps, remote_steps), f"restoring step {step}")

    def _saved_manifest(self, step: int, local_steps: list[int]) -> ShardManifest:
        if step in local_steps:
            return self.local.manifest(step)
        if self.remote is None:
            raise CheckpointNotFoundError(f"step {step}: not in {self.local.root}")
        return self.remote.upload_manifest(step).shard_manifest

    def _load_resharded(self, step: int, local_steps: list[int]) -> Any:
        """Every source shard (local, or fetched from the remote), re-split; this rank's part."""
        manifest = self._saved_manifest(step, local_steps)
        path = self.local.step_path(step)
        states = []
        for entry in manifest.shards:
            try:
                states.append(read_shard(shard_path(path, entry), size=entry.size, crc32c=entry.crc32c,
                                         sha256=entry.sha256, verify=self.verify))
            except (CorruptCheckpointError, FileNotFoundError):
                if self.remote is None:
                    raise
                scratch, _ = self.remote.download_shard(step, entry.rank, self.local.root)
                try:  # the mapping outlives the scratch file
                    states.append(read_shard(scratch / entry.path, size=entry.size, crc32c=entry.crc32c,
                                             verify=self.verify))
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
        spans = [(e.param_shard_offset, e.param_shard_numel) for e in manifest.shards]
        world = self.ranks.world_size if self.ranks else 1
        log.info("resharding step %d from %d to %d ranks", step, manifest.world_size, world)
        return reshard_states(states, spans, world)[0][self.rank]

    def _agree(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on every rank; if it fails anywhere, raise everywhere (no rank goes on alone)."""
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        outcomes = self.ranks.all_gather_json(f"{type(error).__name__}: {error}" if error else None)
        if error is not None:
            raise error
        failed = [(r, o) for r, o in enumerate(outcomes) if o]
        if failed:
            raise DistributedCommitError(f"{what}: rank {failed[0][0]} failed ({failed[0][1]})")
        return result

    def _load_rank(self, step: int, local_steps: list[int], remote_steps: list[int]) -> Any:
        """This rank's shard: local if present and it verifies, else fetched alone from the remote."""
        path = self.local.step_path(step)
        if step in local_steps:
            try:
                return load_rank(path, self.rank, self.ranks.world_size, self.verify)
            except CorruptCheckpointError as exc:
                if step not in remote_steps:
                    raise
                _warn(f"{exc}; fetching rank {self.rank}'s shard of step {step} from the remote")
        elif step not in remote_steps:
            raise CheckpointNotFoundError(f"step {step}: not in {self.local.root} nor on the remote")
        scratch, manifest = self.remote.download_shard(step, self.rank, self.local.root)
        name = manifest.shards[self.rank].path
        try:
            if not path.exists():
                write_manifest(scratch, manifest)
                try:
                    commit_dir(scratch, path)  # this node had nothing for the step yet
                    scratch = None
                except FileExistsError:
                    pass  # another rank of this node committed it meanwhile
            if scratch is not None:  # replace the missing/corrupt file, atomically
                os.replace(scratch / name, path / name)
                fsync_dir(path)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if self.node_leader:
            self.local.update_latest()
        # download_shard checked the crc32c; only a sha256 mode asks for more
        return load_rank(path, self.rank, self.ranks.world_size, "sha256" if self.verify == "sha256" else "none")

    def _load_single(self, step: int, local_steps: list[int], remote_steps: list[int]) -> Any:
        """The local copy if present and it verifies; else the remote copy, downloaded first."""
        if step in local_steps:
            try:
                return self.local.load(step, world_size=1, verify=self.verify)[0]
            except CorruptCheckpointError as exc:
                if step not in remote_steps:
                    raise
                _warn(f"{exc}; restoring step {step} from the remote copy instead")
                remove_dir(self.local.step_path(step))
        elif step not in remote_steps:
            where = f" or {self.remote.display_url}" if self.remote is not None else ""
            raise CheckpointNotFoundError(f"step {step}: no committed checkpoint in {self.local.root}{where} "
                                          f"(have: {sorted(set(local_steps) | set(remote_steps))[-5:]})")
        self.remote.download(step, self.local.step_path(step), verify=self.verify)
        self.local.update_latest()
        # download() verified every file in this same mode before committing it
        return self.local.load(step, world_size=1, verify="none")[0]


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def load_into(state: Any, into: dict, where: Path) -> None:
    """Load saved entries into live objects, after checking all of them (no half-loaded state)."""
    if not isinstance(state, dict):
        raise IncompatibleStateError(f"{where}: the saved state is not a dict; cannot load into {list(into)}")
    missing = [key for key in into if key not in state]
    if missing:
        raise IncompatibleStateError(f"{where}: the checkpoint has no entries {missing} (it has {list(state)})")
    for key, target in into.items():
        if isinstance(target, torch.nn.Module):
            _check_module_state(target, state[key], f"{where} [{key!r}]")
    for key, target in into.items():
        target.load_state_dict(state[key])


def _check_module_state(module: torch.nn.Module, saved: Any, where: str) -> None:
    expected = module.state_dict()
    if not isinstance(saved, dict):
        raise IncompatibleStateError(f"{where}: saved entry is a {type(saved).__name__}, not a state dict")
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise IncompatibleStateError(f"{where}: keys differ from the model's: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in expected.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise IncompatibleStateError(f"{where}: {name!r} is {got} in the checkpoint, {tuple(tensor.shape)} in the model")
