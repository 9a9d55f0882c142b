"""Restoring: which step, from which tier, for which rank -- and loading it verified.

    Restorer.restore(step) -> (step, state): the named step, or the newest that loads,
                              older ones tried in turn when a newer one is refused
    Restorer.candidates()  -> which steps to try, asking the remote as little as possible
    Restorer.load(step)    -> this rank's state:
        one rank:   the local copy if it verifies, else the remote copy, downloaded
                    into the local tier with the commit protocol (a corrupt local
                    copy is replaced, with a warning);
        many ranks: this rank's shard, locally or fetched alone from the remote;
                    every rank learns if any rank failed (no rank goes on alone);
        reshard:    every source shard, re-split for this world (_tiers/reshard.py).
    load_into(state, into) -> live objects loaded only after every key and shape checks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from .._format import layout
from .._format.atomic import building, fsync_dir, naming_a_full_disk, scratch_dir
from .._format.manifest import ShardManifest
from .._format.shardfile import read_shard
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCommitError,
    IncompatibleStateError,
    RemoteError,
    warn_user,
)
from . import folder
from .assemble import PieceFile, assemble
from .local import LocalTier
from .placement import Targets
from .ranks import RankGroup
from .remote import RemoteTier
from .reshard import reshard as reshard_states
from .sharded import load_rank, load_sharded_files, open_shard, shard_path, write_manifest

log = logging.getLogger("tieredckpt")


class Restorer:
    def __init__(self, local: LocalTier, remote: RemoteTier | None, ranks: RankGroup | None,
                 verify: str, node_leader: bool = True, read_only: bool = False) -> None:
        self.local, self.remote, self.ranks = local, remote, ranks
        self.verify, self.node_leader, self.read_only = verify, node_leader, read_only
        self.rank = ranks.rank if ranks else 0
        self.targets = Targets()
        self._uploads: dict[int, Any] = {}

    @property
    def _tier(self) -> RemoteTier:
        """The remote, on paths that run only when there is one."""
        if self.remote is None:
            raise CheckpointNotFoundError(f"{self.local.root}: no remote is configured")
        return self.remote

    @property
    def _group(self) -> RankGroup:
        """The rank group, on paths that run only with many ranks."""
        assert self.ranks is not None, "a many-rank path ran in one process"
        return self.ranks

    def _upload(self, step: int):
        """The remote's upload manifest of ``step``, asked once per restore."""
        if step not in self._uploads:
            self._uploads[step] = self._tier.upload_manifest(step)
        return self._uploads[step]

    def restore(self, step: int | None, reshard: bool = False, targets: Targets | None = None
                ) -> tuple[int | None, Any]:
        """(step, state) of the named step, or of the newest step that loads and verifies.

        With no step named, each refused newer step (corrupt, malformed, unreadable,
        on either tier) is named in a warning, its local copy is moved to
        ``quarantine/`` (so the run can save that step number again), and the next
        older one is tried. (None, None) when no tier holds any checkpoint.
        ``targets``: what the objects loaded into want (their sharding; placement.py)."""
        self.targets = targets or Targets()
        return self._first_that_loads(step, lambda c, local, remote: self.load(c, local, remote, reshard))

    def restore_files(self, step: int | None, to: Path) -> int | None:
        """A folder step's files into a new directory ``to``: the named step or the newest that
        verifies, older ones tried in turn as ``restore`` does; None when no tier holds any step."""
        return self._first_that_loads(step, lambda c, local, remote: self._load_folder(c, local, remote, to))[0]

    def _first_that_loads(self, step: int | None, load) -> tuple[int | None, Any]:
        """(step, load(step, local steps, remote steps)) of the first candidate that loads."""
        self._uploads = {}
        for attempt in (1, 2):  # a second look when the writer rotated away what we were reading
            local_steps, remote_steps = self.local.steps(), RemoteSteps(self.remote)
            refused, vanished = [], False
            for candidate in self.candidates(step, local_steps, remote_steps):
                try:
                    return candidate, load(candidate, local_steps, remote_steps)
                except Exception as exc:  # noqa: BLE001 - refusals are handled, anything else re-raised
                    gone = self.ranks is None and candidate in local_steps and \
                        not self.local.step_path(candidate).exists()
                    if gone and attempt == 1:
                        vanished = True  # rotation removed it while we read: list again
                        break
                    if step is not None or not _refusal(exc):
                        raise
                    refused.append(f"step {candidate}: {exc}")
                    _warn(f"step {candidate} refused ({exc}); trying an older step")
                    self._set_aside(candidate, exc)
            if not vanished:
                break
        if refused:
            raise CorruptCheckpointError(f"{self.local.root}: no checkpoint restores: " + "; ".join(refused))
        return None, None

    def _set_aside(self, step: int, exc: Exception) -> None:
        """Move a refused local copy to quarantine/ (one process that may write, and only a real copy)."""
        if self.ranks is not None or self.read_only or isinstance(exc, (CheckpointNotFoundError, DistributedCommitError)):
            return
        if self.local.step_path(step).is_dir():
            try:
                self.local.quarantine(step, f"refused on restore: {exc}")
            except OSError as err:
                log.warning("could not move %s aside: %s", self.local.step_path(step), err)

    def candidates(self, step: int | None, local_steps: list[int], remote_steps: RemoteSteps):
        """The steps to try, newest first: just ``step`` when one is named.

        One process: the newer of the local newest and the remote's newest (two requests
        when its ``latest`` pointer is right), and only if that one is refused, every
        other step of either tier (one delimiter listing of the remote's step dirs).
        Many ranks: the steps every rank has, agreed by all of them.
        A remote that cannot be asked (an outage) leaves the local steps; with none of
        those either, that is an error, never "no checkpoint yet"."""
        if step is not None:
            yield step
            return
        newest = None
        try:
            if self.ranks is not None:
                yield from self._agreed(local_steps, remote_steps)
                return
            newest = max([*local_steps[-1:], *filter(None, [remote_steps.newest()])], default=None)
            if newest is None:
                return
            yield newest
            rest = sorted((set(local_steps) | set(remote_steps.dirs())) - {newest}, reverse=True)
        except RemoteError as exc:
            if not local_steps:
                raise RemoteError(f"{exc}; cannot tell which checkpoints the remote holds, so nothing "
                                  "is restored (starting from scratch could lose a run)", exc.transient) from None
            _warn(f"{exc}; restoring from the local checkpoints only")
            remote_steps.unreachable = True
            rest = sorted(local_steps, reverse=True)
        yield from (s for s in rest if s < (newest if newest is not None else float("inf")))

    def _agreed(self, local_steps: list[int], remote_steps: RemoteSteps) -> list[int]:
        """Many ranks: only a step that every rank can restore, newest first."""
        candidates = sorted(set(local_steps) | set(remote_steps.dirs()))
        every = self._group.all_gather_json(candidates)
        agreed = sorted(set.intersection(*map(set, every)), reverse=True)
        if not agreed and any(every):
            raise CheckpointNotFoundError(f"no step is available to every rank (per rank: "
                                          f"{[c[-3:] for c in every]}); restore a named step or repair")
        return agreed

    def load(self, step: int, local_steps: list[int], remote_steps: list[int], reshard: bool = False) -> Any:
        world = self.ranks.world_size if self.ranks else 1
        if self.ranks is not None:  # decided on each rank inside _agree: no rank waits on a failed one
            return self._agree(lambda: self._load_any(step, local_steps, remote_steps, reshard, world),
                               f"restoring step {step}")
        return self._load_any(step, local_steps, remote_steps, reshard, world)

    def _load_any(self, step: int, local_steps: list[int], remote_steps, reshard: bool, world: int) -> Any:
        if step in local_steps:
            _not_a_folder(self.local, step)
        if self._assembles(step, local_steps, remote_steps):
            return self._load_assembled(step, local_steps, remote_steps)
        if reshard and self._saved_manifest(step, local_steps).world_size != world:
            return self._load_resharded(step, local_steps)
        if self.ranks is None:
            return self._load_single(step, local_steps, remote_steps)
        return self._load_rank(step, local_steps, remote_steps)

    def _assembles(self, step: int, local_steps: list[int], remote_steps) -> bool:
        """Whether the step is read piece by piece: the targets are sharded (DTensors), or the
        checkpoint holds DTensor pieces (its manifest's layout). A single process learns the
        layout of a remote-only step after downloading it (no extra request)."""
        if self.targets.sharded:
            return True
        if step in local_steps:
            try:
                return self.local.manifest(step).layout == "dtensor"
            except (CorruptCheckpointError, OSError):
                return False  # the usual path refuses or replaces it
        if self.ranks is not None and step in remote_steps:
            return self._upload(step).shard_manifest.layout == "dtensor"
        return False

    def _load_assembled(self, step: int, local_steps: list[int], remote_steps) -> Any:
        """This rank's state from the pieces it needs (assemble.py)."""
        for manifest, here, upload in self._sources(step, local_steps, remote_steps):
            try:
                with self._files(step, manifest, here, upload) as (manifest, open_file, where):
                    return assemble(open_file, manifest, self.rank, self.targets, where)
            except CorruptCheckpointError as exc:
                self._fall_back(step, here, remote_steps, exc)

    @contextmanager
    def opened_pieces(self, step: int):
        """(every rank's shard of ``step`` opened as a PieceFile, where), open while the caller
        reads (the DCP reader): the local shards if every one opens clean, else the remote's."""
        local_steps, remote_steps = self.local.steps(), RemoteSteps(self.remote)
        self._uploads = {}
        for manifest, here, upload in self._sources(step, local_steps, remote_steps):
            with ExitStack() as stack:
                try:
                    manifest, open_file, where = stack.enter_context(self._files(step, manifest, here, upload))
                    files = [open_file(r) for r in range(manifest.world_size)]
                except CorruptCheckpointError as exc:
                    self._fall_back(step, here, remote_steps, exc)
                    continue
                yield files, where
                return

    def _sources(self, step: int, local_steps: list[int], remote_steps):
        """Where to read ``step`` piece by piece, preferred first: (manifest, local dir, None) when
        the local tier holds it, then (manifest, None, upload manifest) when the remote does."""
        if step in local_steps:
            yield self.local.manifest(step), self.local.step_path(step), None
        elif step not in remote_steps:
            raise CheckpointNotFoundError(f"step {step}: not in {self.local.root} nor on the remote")
        upload = self._upload(step)
        yield upload.shard_manifest, None, upload

    def _fall_back(self, step: int, here: Path | None, remote_steps, exc: Exception) -> None:
        """A refused local copy: go on to the remote's (with a warning), or re-raise."""
        if here is None or step not in remote_steps:
            raise exc
        _warn(f"{exc}; reading step {step} from the remote copy instead")

    def _saved_manifest(self, step: int, local_steps: list[int]) -> ShardManifest:
        if step in local_steps:
            return self.local.manifest(step)
        if self.remote is None:
            raise CheckpointNotFoundError(f"step {step}: not in {self.local.root}")
        return self._upload(step).shard_manifest

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
                upload = self._upload(step)
                with self._scratch(step) as tmp:  # the mapping outlives the scratch file
                    self._fetch_shard(upload, entry, tmp)
                    states.append(read_shard(tmp / entry.path, size=entry.size, crc32c=entry.crc32c,
                                             verify=self.verify))
        spans = [(e.param_shard_offset, e.param_shard_numel) for e in manifest.shards]
        world = self.ranks.world_size if self.ranks else 1
        log.info("resharding step %d from %d to %d ranks", step, manifest.world_size, world)
        return reshard_states(states, spans, world)[0][self.rank]

    @contextmanager
    def _files(self, step: int, manifest: ShardManifest, here: Path | None, upload):
        opened: list[PieceFile] = []
        with self._scratch(step) as tmp:
            def open_file(rank: int) -> PieceFile:
                entry = manifest.shards[rank]
                if here is not None and (here / entry.path).exists():
                    opened.append(PieceFile(here / entry.path, entry, self.verify))
                    return opened[-1]
                if self.remote is None:
                    raise CheckpointNotFoundError(f"{here}: holds no shard of rank {rank} and there is no remote "
                                                  "to fetch it from (node-local directories need a remote)")
                fetcher = SparseFetch(self.remote, upload or self._upload(step), rank, tmp / entry.path)
                opened.append(PieceFile(tmp / entry.path, entry, self.verify, ensure=fetcher.ensure))
                return opened[-1]
            where = here if here is not None else self._tier.where(layout.step_dir_name(step))
            try:
                yield manifest, open_file, str(where)
            finally:
                for f in opened:
                    f.close()

    def _agree(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on every rank; if it fails anywhere, raise everywhere (no rank goes on alone).

        When every failure is a refusal (a corrupt or missing copy), the other ranks'
        error says so (``refused``), so that all ranks move on to an older step together."""
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
        outcomes = self._group.all_gather_json(
            {"error": f"{type(error).__name__}: {error}", "refused": _refusal(error)} if error else None)
        failed = [(r, o) for r, o in enumerate(outcomes) if o]
        every_refused = all(o["refused"] for _, o in failed)
        if error is not None:
            if _refusal(error) and not every_refused:  # another rank failed for good: so do we
                raise DistributedCommitError(f"{what}: {error}; and another rank failed for good") from error
            raise error
        if failed:
            refusal = DistributedCommitError(f"{what}: rank {failed[0][0]} failed ({failed[0][1]['error']})")
            refusal.refused = every_refused  # type: ignore[attr-defined]
            raise refusal
        return result

    def _load_rank(self, step: int, local_steps: list[int], remote_steps: list[int]) -> Any:
        """This rank's shard: local if present and it verifies, else fetched alone from the remote."""
        path = self.local.step_path(step)
        if step in local_steps:
            try:
                return load_rank(path, self.rank, self._group.world_size, self.verify)
            except CorruptCheckpointError as exc:
                if step not in remote_steps:
                    raise
                _warn(f"{exc}; fetching rank {self.rank}'s shard of step {step} from the remote")
        elif step not in remote_steps:
            raise CheckpointNotFoundError(f"step {step}: not in {self.local.root} nor on the remote")
        upload = self._upload(step)
        manifest = upload.shard_manifest
        entry = manifest.shards[self.rank]
        if self.read_only:
            with self._scratch(step) as tmp:
                self._fetch_shard(upload, entry, tmp)
                return read_shard(tmp / entry.path, size=entry.size, crc32c=entry.crc32c, sha256=entry.sha256,
                                  verify=self.verify)
        if not path.exists():  # this node had nothing for the step yet: commit it with our shard
            try:
                with building(path) as tmp:
                    self._fetch_shard(upload, entry, tmp)
                    write_manifest(tmp, manifest)
            except FileExistsError:
                pass  # another rank of this node committed it meanwhile
        if not (path / entry.path).exists() or _bad(path, entry):
            with self._scratch(step) as tmp:  # replace the missing/corrupt file, atomically
                self._fetch_shard(upload, entry, tmp)
                os.replace(tmp / entry.path, path / entry.path)
                fsync_dir(path)
        if self.node_leader:
            self.local.update_latest()
        return load_rank(path, self.rank, self._group.world_size, self.verify)

    def _load_single(self, step: int, local_steps: list[int], remote_steps: list[int]) -> Any:
        """The local copy if present and it verifies; else the remote copy, downloaded first."""
        done, state = self._from_local(step, local_steps, remote_steps,
                                       lambda: self.local.load(step, world_size=1, verify=self.verify)[0])
        if done:
            return state
        if self.read_only:  # a reader writes nothing: fetch into a private temp dir, load, drop it
            upload = self._upload(step)
            if upload.shard_manifest.layout == "dtensor":
                return self._load_assembled(step, [], remote_steps)
            with scratch_dir(None) as tmp:
                self._tier.fetch_files(upload, upload.files, tmp)
                return load_sharded_files(tmp, upload.shard_manifest, self.verify)[0]
        self.local.download(step, self._tier, verify=self.verify)
        _not_a_folder(self.local, step)
        if self.local.manifest(step).layout == "dtensor":
            return self._load_assembled(step, [step], remote_steps)
        # download() verified every file in this same mode before committing it
        return self.local.load(step, world_size=1, verify="none")[0]

    def _from_local(self, step: int, local_steps: list[int], remote_steps, read: Callable[[], Any]
                    ) -> tuple[bool, Any]:
        """(True, ``read()``) when the local copy serves; (False, None) when the remote's must: the
        local copy is missing, or was refused (moved to quarantine/ with a warning). Raises when
        neither tier can give the step."""
        if step in local_steps:
            try:
                return True, read()
            except CorruptCheckpointError as exc:
                if step not in remote_steps:
                    raise
                _warn(f"{exc}; restoring step {step} from the remote copy instead")
                if not self.read_only:
                    self.local.quarantine(step, f"refused on restore: {exc}")
        elif step not in remote_steps:
            where = f" or {self.remote.display_url}" if self.remote is not None else ""
            raise CheckpointNotFoundError(f"step {step}: no committed checkpoint in {self.local.root}{where} "
                                          f"(local: {local_steps[-5:] or 'none'})")
        return False, None

    def _load_folder(self, step: int, local_steps: list[int], remote_steps, to: Path) -> None:
        """A folder step into ``to``: from the local copy when every file passes its crc32c as it
        is copied out, else the remote copy (downloaded into the local tier first, verified)."""
        if self.ranks is not None:
            raise ValueError("restore_files runs in one process (a store opened with distributed=False)")

        def from_local() -> None:
            manifest = self.local.manifest(step)
            folder.require_folder(manifest, str(self.local.step_path(step)))
            folder.materialize(self.local.step_path(step), manifest, to)
        if self._from_local(step, local_steps, remote_steps, from_local)[0]:
            return
        upload = self._upload(step)
        folder.require_folder(upload.shard_manifest, self._tier.where(layout.step_dir_name(step)))
        if self.read_only:  # a reader writes nothing into the run: a private temp dir, dropped after
            with scratch_dir(None) as tmp:
                self._tier.fetch_files(upload, upload.files, tmp)
                return folder.materialize(tmp, upload.shard_manifest, to)
        self.local.download(step, self._tier, verify=self.verify)
        return folder.materialize(self.local.step_path(step), self.local.manifest(step), to)

    def _scratch(self, step: int):
        return scratch_dir(None if self.read_only else self.local.step_path(step))

    def _fetch_shard(self, upload, entry, dest: Path) -> None:
        """One rank's shard from the remote into ``dest``, its crc32c checked."""
        self._tier.fetch_files(upload, [upload.files[entry.rank]], dest)
        if _bad(dest, entry):
            raise CorruptCheckpointError(f"{self._tier.where(layout.step_dir_name(upload.step), entry.path)}: "
                                         f"crc32c differs from the manifest's {entry.crc32c}")


class SparseFetch:
    """A remote shard as a sparse local file whose parts are fetched (and verified) the first time
    a read needs a byte of them: a rank reading some pieces downloads only the parts they lie in."""

    def __init__(self, remote: RemoteTier, upload, rank: int, path: Path) -> None:
        self.remote, self.upload, self.path = remote, upload, path
        self.file = upload.files[rank]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # in our own scratch dir
        try:
            os.ftruncate(fd, self.file.size)
        finally:
            os.close(fd)
        self.fetched: set[int] = set()

    def ensure(self, start: int, end: int) -> None:
        wanted = [(i, part) for i, part in enumerate(self.file.parts)
                  if i not in self.fetched and part.offset < end and start < part.offset + part.raw_size]
        if not wanted:
            return
        fd = os.open(self.path, os.O_RDWR)
        need = lambda: sum(part.raw_size for _, part in wanted)  # noqa: E731
        try:
            with naming_a_full_disk(self.path.parent.parent, f"the download of step {self.upload.step}", need):
                for i, part in wanted:
                    self.remote.fetch_part(self.upload, fd, part)
                    self.fetched.add(i)
        finally:
            os.close(fd)


class RemoteSteps:
    """Which steps the remote holds, asked lazily and remembered: the newest in two requests
    (the ``latest`` pointer, confirmed), any one step in one, all step dirs in one listing.
    With no remote it holds nothing."""

    def __init__(self, remote: RemoteTier | None) -> None:
        self.remote = remote
        self.unreachable = False
        self._known: dict[int, bool] = {}
        self._dirs: list[int] | None = None

    def newest(self) -> int | None:
        if self.remote is None or self.unreachable:
            return None
        step = self.remote.newest_step()
        if step is not None:
            self._known[step] = True
        return step

    def dirs(self) -> list[int]:
        if self.remote is None or self.unreachable:
            return []
        if self._dirs is None:
            self._dirs = self.remote.step_dirs()
        return self._dirs

    def __contains__(self, step: int) -> bool:
        if self.remote is None or self.unreachable:
            return False
        if step not in self._known:
            self._known[step] = self.remote.is_committed(step)
        return self._known[step]


def _not_a_folder(local: LocalTier, step: int) -> None:
    try:
        manifest = local.manifest(step)
    except (CorruptCheckpointError, OSError):
        return  # the usual path refuses or replaces it
    if folder.is_folder(manifest):
        raise IncompatibleStateError(f"{local.step_path(step)}: step {step} is a folder of files saved with "
                                     "save_files(); restore it with restore_files(to=...)")


def _refusal(exc: BaseException | None) -> bool:
    """An error that refuses one step (a bad or vanished copy): an older step may still restore."""
    return isinstance(exc, (CorruptCheckpointError, CheckpointNotFoundError)) or \
        (isinstance(exc, DistributedCommitError) and getattr(exc, "refused", False))


def _bad(directory: Path, entry) -> bool:
    """True when ``directory``'s copy of the shard is missing, short or fails its crc32c."""
    try:
        with open_shard(directory, entry) as f:
            return f.digest(sha256=False).crc32c != entry.crc32c
    except (CorruptCheckpointError, FileNotFoundError):
        return True


def _warn(message: str) -> None:
    warn_user(message)


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
