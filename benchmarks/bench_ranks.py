"""Aggregate save throughput with 1, 2 and 4 ranks: own shards vs gather-to-rank-0, one run.

    python benchmarks/bench_ranks.py [--total-mb 1440] [--repeats 2]

For each world size a gloo process group is spawned on this machine; the same
total state (model + AdamW-shaped fp32 tensors, --total-mb MB) is split evenly
over the ranks. Timed, from a barrier to the commit, interleaved:

  sharded:  every rank writes its own shard; one coordinated commit (tieredckpt)
  gather:   every rank sends its part to rank 0 (torch.distributed.gather),
            rank 0 writes one file + manifest (the seed's "vanilla" checkpoint)

Both are durable (fsync) and atomic. Before each timed run every rank touches
2.5x its share of fresh memory (untimed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def worker() -> None:
    import torch
    import torch.distributed as dist
    from common import warm_memory

    from tieredckpt._tiers.ranks import RankGroup, commit_rank
    from tieredckpt._tiers.sharded import save_sharded

    args = json.loads(os.environ["BENCH_ARGS"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    share = args["total_bytes"] // 4 // 3 // world  # fp32 elements per tensor per rank (3 tensors)
    g = torch.Generator().manual_seed(rank)
    mine = {"flat": {"params": torch.randn(share, generator=g), "exp_avg": torch.randn(share, generator=g),
                     "exp_avg_sq": torch.rand(share, generator=g)}}
    numel = 3 * share
    group = RankGroup() if world > 1 else None
    times = {"sharded": [], "gather": []}
    root = Path(args["dir"])
    step = 0
    for rep in range(args["repeats"]):
        for mode in (("sharded", "gather") if rep % 2 == 0 else ("gather", "sharded")):
            step += 1
            warm_memory(int(2.5 * numel * 4))
            dist.barrier()
            start = time.perf_counter()
            if mode == "sharded":
                if group is None:
                    save_sharded([mine], root / f"sharded-{step}", step)
                else:
                    commit_rank(root / "sharded", step, mine, group)
            else:
                flat = torch.cat([mine["flat"][k] for k in ("params", "exp_avg", "exp_avg_sq")])
                parts = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
                if world > 1:
                    dist.gather(flat, parts, dst=0)
                else:
                    parts = [flat]
                if rank == 0:
                    save_sharded([{"flat": torch.cat(parts)}], root / f"gather-{step}", step)
            dist.barrier()
            times[mode].append(time.perf_counter() - start)
            if rank == 0:
                for d in root.glob("*"):
                    shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def launch(world: int, args, directory: str) -> dict:
    from s3server import free_port
    port = free_port()
    payload = json.dumps({"total_bytes": args.total_mb * 1_000_000, "repeats": args.repeats, "dir": directory})
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), BENCH_ARGS=payload, BENCH_WORKER="1", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"world size {world}: a rank failed")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mb", type=int, default=1440, help="total state over all ranks (MB)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    from common import median, table
    print(f"total state {args.total_mb} MB split over the ranks; {os.cpu_count()} cores; "
          f"{args.repeats} interleaved repeats")
    rows = []
    for world in (1, 2, 4):
        directory = tempfile.mkdtemp(prefix=f"bench-ranks-{world}-", dir=args.dir)
        try:
            times = launch(world, args, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        sharded, gather = median(times["sharded"]), median(times["gather"])
        rows.append((world, f"{sharded:.2f}", f"{args.total_mb / 1000 / sharded:.2f}", f"{gather:.2f}",
                     f"{args.total_mb / 1000 / gather:.2f}", f"{gather / sharded:.2f}x"))
    print(table(rows, ("ranks", "own shards (s)", "GB/s", "gather to rank 0 (s)", "GB/s", "speed-up")))


if __name__ == "__main__":
    worker() if os.environ.get("BENCH_WORKER") else main()
