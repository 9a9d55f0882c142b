"""Many ranks: checkpoint collectives and the coordinated commit of one step.

Checkpoint collectives run on a group of their own (gloo, created once per
store), so they never interleave with the training's collectives on the default
group, even when issued from the store's background writer thread. Metadata is
exchanged as JSON inside uint8 tensors: nothing is pickled.

A node is the set of ranks whose local tier is the same directory on the same
host (so one machine with one NVMe, or every rank with a directory of its own,
both work). Its leader is its lowest rank. Commit of step S, in order:

  1. every rank writes its shard into a scratch dir of its own, fsynced;
  2. all ranks exchange (ok?, size, checksums, node); if any rank failed,
     every rank deletes its scratch and raises: nothing is committed anywhere;
  3. every non-leader renames its shard into its leader's scratch dir (same
     directory, so an atomic rename), and all ranks meet at a barrier;
  4. each leader writes the global manifest (every rank's shard) last, fsyncs
     and renames its scratch dir to ``step_S`` -- rank 0's leader only after
     every shard in the world is durable (step 2 came after every fsync);
  5. all ranks exchange the leaders' outcome, so a failed commit raises everywhere.

A rank that dies before step 2 makes the others' collective fail: no commit.
A crash between 3 and 4 leaves only scratch, removed by the next save's cleanup.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .._format import layout
from .._format.atomic import commit_dir, fsync_dir, make_scratch_dir
from .._format.checksum import Digest
from .._format.manifest import ShardManifest
from ..errors import CheckpointExistsError, DistributedCommitError
from .sharded import make_manifest, state_numel, write_manifest, write_rank


class RankGroup:
    """This process's place in the world, and collectives on a checkpoint-only gloo group."""

    def __init__(self, timeout_seconds: float = 600.0) -> None:
        import torch.distributed as dist
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Every rank creates it in the same order (the store's constructor).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))

    @staticmethod
    def active() -> bool:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def all_gather_json(self, value: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        chunks = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._dist.all_gather(chunks, padded, group=self.group)
        return [json.loads(bytes(c[:int(s.item())].tolist())) for c, s in zip(chunks, sizes)]

    def any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over all ranks (one tiny all-reduce)."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


def node_key(root: Path) -> str:
    return f"{socket.gethostname()}:{os.path.realpath(root)}"


def commit_rank(root: Path, step: int, state: Any, ranks: RankGroup, *,
                param_span: tuple[int, int] | None = None, wall_clock_seconds: float = 0.0,
                user: dict | None = None) -> ShardManifest:
    """Write this rank's shard and commit step ``step`` on every node together (see module doc)."""
    final = root / layout.step_dir_name(step)
    scratch, error, info = None, None, {}
    try:  # 1. own shard, durable
        if final.exists():
            raise CheckpointExistsError(f"{final}: step {step} is already committed")
        root.mkdir(parents=True, exist_ok=True)
        scratch = make_scratch_dir(final)
        name = layout.shard_name(ranks.rank)
        digest = write_rank(scratch / name, state)
        fsync_dir(scratch)
        numel = state_numel(state)
        info = {"size": digest.size, "crc32c": digest.crc32c, "sha256": digest.sha256, "numel": numel,
                "header_crc32c": digest.header_crc32c,
                "span": list(param_span) if param_span else None, "scratch": str(scratch)}
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = exc
    infos = ranks.all_gather_json({"ok": error is None, "node": node_key(root),
                                   "error": f"{type(error).__name__}: {error}" if error else None, **info})
    failed = [r for r, i in enumerate(infos) if not i["ok"]]  # 2. all or nothing
    if failed:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if error is not None:
            raise error
        raise DistributedCommitError(f"step {step}: rank {failed[0]} could not write its shard "
                                     f"({infos[failed[0]]['error']}); nothing was committed")
    manifest = _manifest(step, infos, wall_clock_seconds, user)
    leader = min(r for r, i in enumerate(infos) if i["node"] == infos[ranks.rank]["node"])
    leader_scratch = Path(infos[leader]["scratch"])
    outcome = None
    try:
        if ranks.rank != leader:  # 3. gather this node's shards in the leader's scratch
            assert scratch is not None  # every rank wrote its shard (2.)
            os.rename(scratch / layout.shard_name(ranks.rank), leader_scratch / layout.shard_name(ranks.rank))
            os.rmdir(scratch)
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    ranks.barrier()
    if ranks.rank == leader and outcome is None:
        try:  # 4. manifest last, then the atomic rename
            fsync_dir(leader_scratch)
            here = [layout.shard_name(r) for r, i in enumerate(infos) if i["node"] == infos[leader]["node"]]
            if sorted(os.listdir(leader_scratch)) != sorted(here):
                raise DistributedCommitError(f"{leader_scratch}: holds {sorted(os.listdir(leader_scratch))}, "
                                             f"expected {sorted(here)}")
            write_manifest(leader_scratch, manifest)
            commit_dir(leader_scratch, final)
        except Exception as exc:  # noqa: BLE001
            outcome = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(leader_scratch, ignore_errors=True)
    results = ranks.all_gather_json(outcome)  # 5. everyone learns how every node fared
    bad = [(r, o) for r, o in enumerate(results) if o]
    if bad:
        raise DistributedCommitError(f"step {step}: rank {bad[0][0]} failed to commit ({bad[0][1]})")
    return manifest


def _manifest(step: int, infos: list[dict], wall: float, user: dict | None) -> ShardManifest:
    """What every rank reported, as the manifest (sharded.make_manifest; default spans end to end)."""
    spans, offset = [], 0
    for i in infos:
        span = tuple(i["span"]) if i["span"] else (offset, i["numel"])
        spans.append(span)
        offset = span[0] + span[1]
    digests = [Digest(i["size"], i["crc32c"], i["sha256"], i["header_crc32c"]) for i in infos]
    return make_manifest(step, digests, spans, wall, user)

