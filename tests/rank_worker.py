"""One rank of a gloo process group, for tests/test_ranks.py (launched like torchrun: RANK, WORLD_SIZE...).

    python tests/rank_worker.py SCENARIO RUN_DIR [--remote URL]

RUN_DIR may contain {rank} for node-local directories. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tieredckpt import CheckpointStore  # noqa: E402
from tieredckpt._format.compare import first_difference  # noqa: E402


def rank_state(step: int, rank: int, numel: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    n = numel + rank  # uneven shards
    return {"flat": {"params": torch.randn(n, generator=g).half(), "exp_avg": torch.randn(n, generator=g),
                     "exp_avg_sq": torch.rand(n, generator=g)},
            "step": step, "owner": rank, "ids": {rank: [step, (1, 2)]}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("run_dir")
    p.add_argument("--remote")
    p.add_argument("--step", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = args.run_dir.format(rank=rank)
    result = {"rank": rank}
    store = CheckpointStore(run_dir, args.remote, every=1, max_pending_uploads=None, upload_backoff=(0.05, 0.2))
    try:
        if args.scenario == "save":
            for step in range(1, args.step + 1):
                store.save(step, rank_state(step, rank)).wait()
            store.wait(uploads=True)
            result["steps"] = store.local.steps()
        elif args.scenario == "upload_fails_on_last_rank":
            if rank == world - 1:  # this rank's writes are refused by the remote
                fs = store.remote.fs
                real_pipe = fs.pipe_file

                def refuse(path, *a, **kw):
                    if "/objects/" in path:
                        raise PermissionError("Access Denied")
                    return real_pipe(path, *a, **kw)
                fs.pipe_file = refuse
            store.save(1, rank_state(1, rank)).wait()
            try:
                store.wait(uploads=True)
                result["error"] = None
            except Exception as exc:  # noqa: BLE001
                result["error"] = f"{type(exc).__name__}: {exc}"[:300]
            result["remote_steps"] = store.remote.steps()
            result["local_steps"] = store.local.steps()
        elif args.scenario == "part_lost_before_commit":
            if rank == 0:  # the leader: one of rank 1's parts vanishes between its send and the commit
                from lostpart import losing_commit

                from tieredckpt._tiers.remote import RemoteTier
                lost: list[str] = []
                RemoteTier.commit_upload = losing_commit(1, lost)
            store.save(1, rank_state(1, rank)).wait()
            result["error"] = None if store.wait(uploads=True, timeout=60) else "not uploaded in 60 s"
            result["remote_steps"] = store.remote.steps()
        elif args.scenario == "restore":
            out = store.restore()
            result["step"] = out["step"]
            result["diff"] = first_difference(rank_state(out["step"], rank), out)
        elif args.scenario == "kill":
            store.save(1, rank_state(1, rank)).wait()
            big = rank_state(2, rank, numel=12_000_000)  # several 16 MiB chunks per shard
            if rank == world - 1:  # a 48 MB shard goes out through directwrite's I/O thread
                import tieredckpt._format.directwrite as directwrite
                real, calls = directwrite.write_block, []

                def die_midway(fd, data):
                    calls.append(1)
                    if len(calls) == 3:
                        os.kill(os.getpid(), signal.SIGKILL)  # dies with its shard half written
                    return real(fd, data)
                directwrite.write_block = die_midway
            try:
                store.save(2, big).wait()
                result["error"] = None
            except Exception as exc:  # noqa: BLE001 - the survivors' view of the death
                result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(result), flush=True)
    finally:
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)  # after a peer's death, gloo teardown may block


if __name__ == "__main__":
    main()
