"""FSDP2 state at 2 and 4 ranks: DCP's FileSystemWriter vs DCP through our writer vs store.save.

    python benchmarks/bench_dcp.py [--params-m 40] [--repeats 3]
    python benchmarks/bench_dcp.py --experts 3000     # many small DTensor pieces per rank

For each world size a gloo process group is spawned on this machine, a GPT-shaped
model (--params-m million parameters, fp32) is sharded with ``fully_shard`` and
stepped once by AdamW, so its state is parameters + m + v, as DTensors. Timed,
from a barrier to a barrier, the repeats interleaved:

Each rank's time runs from a barrier to its own return; the table shows the slowest
rank's (a collective save is not done before its slowest rank is).

  save (durable, atomic where the writer is):
    dcp-fs     dcp.save with FileSystemWriter (sync_files=True)
    dcp-ours   dcp.save with store.dcp_writer(step)
    store      store.save(step, {"model", "optim"}).wait()
  stall (the loop's wait): dcp.async_save (FileSystemWriter) vs store.save's return
    (and with overlap=True), against the floor: copying every local tensor into
    buffers that already exist
  load (warm page cache, into the live model and optimizer):
    dcp-fs / dcp-ours: dcp.load + set_state_dict;  store: store.restore(into=...)
  resharding 4 -> 2: bytes each rank of a 2-rank restore reads from the 4-rank
    store checkpoint, against the bytes of the shards it holds afterwards.
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


def build(params_m: float, experts: int = 0):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if experts:
        return build_experts(experts)
    dim, vocab = 512, 8192
    layers = max(1, round((params_m * 1e6 - 2 * vocab * dim) / (12 * dim * dim)))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                            nn.LayerNorm(dim), nn.Linear(dim, 4 * dim // 2), nn.GELU(),
                            nn.Linear(4 * dim // 2, dim)) for _ in range(layers)]
    model = nn.Sequential(nn.Embedding(vocab, dim), *blocks, nn.Linear(dim, vocab))
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids).float().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def build_experts(n: int):
    """A mixture-of-experts shape: n experts of two 64x64 matrices and a bias, sharded as one
    FSDP2 unit, stepped once by AdamW: about 4 x 3n DTensor pieces per rank (params, m, v, step)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, bias=False))
                                         for _ in range(n))

        def forward(self, x):
            return sum(e(x).sum() for e in self.experts)

    torch.manual_seed(0)
    model = Experts()
    fully_shard(model, mesh=init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64, generator=torch.Generator().manual_seed(1))).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def local_tensors(value) -> list:
    if isinstance(value, dict):
        return [t for v in value.values() for t in local_tensors(v)]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    import torch
    return [value] if isinstance(value, torch.Tensor) else []


def worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tieredckpt import CheckpointStore
    from tieredckpt._tiers import assemble

    args = json.loads(os.environ["BENCH_ARGS"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = Path(args["dir"])
    out: dict = {"rank": rank}
    counted = [0]
    real = assemble._pread_into

    def counting(fd, view, offset):
        counted[0] += len(view)
        return real(fd, view, offset)
    assemble._pread_into = counting

    if args.get("reshard_from"):  # restore the 4-rank store checkpoint on this (smaller) world
        model, opt = build(args["params_m"], args.get("experts", 0))
        with CheckpointStore(args["reshard_from"], read_only=True) as store:
            store.restore(into={"model": model, "optim": opt})
        out["read"] = counted[0]
        out["need"] = sum(t.numel() * t.element_size() for t in local_tensors(model.state_dict()) +
                          local_tensors(opt.state_dict()["state"]))
        print(json.dumps(out), flush=True)
        dist.destroy_process_group()
        return

    model, opt = build(args["params_m"], args.get("experts", 0))
    local = local_tensors(model.state_dict()) + local_tensors(opt.state_dict()["state"])
    out["bytes"] = sum(t.numel() * t.element_size() for t in local)
    out["pieces"] = len(local)
    buffers = [torch.empty_like(t) for t in local]
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        """From a barrier to this rank's return (the loop's wait), then a barrier untimed;
        the table takes the slowest rank's time."""
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
        dist.barrier()
        return result

    def copy_floor():
        for b, t in zip(buffers, local):
            b.copy_(t)

    store = CheckpointStore(base / "store", every=0, keep_local=5)
    step = 0
    for rep in range(args["repeats"]):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        fs_dir = base / f"fs-{rep}"
        timed("save dcp-fs", lambda: dcp.save(sd, storage_writer=FileSystemWriter(fs_dir, sync_files=True)))
        step += 1
        timed("save dcp-ours", lambda: dcp.save(sd, storage_writer=store.dcp_writer(step)))
        dcp_step = step
        step += 1
        timed("save store", lambda: store.save(step, {"model": model, "optim": opt}).wait())
        store_step = step

        timed("stall copy floor", copy_floor)
        step += 1
        handle = timed("stall store", lambda: store.save(step, {"model": model, "optim": opt}))
        handle.wait()
        step += 1
        handle = timed("stall store overlap", lambda: store.save(step, {"model": model, "optim": opt}, overlap=True))
        handle.wait()
        future = timed("stall dcp async_save",
                       lambda: dcp.async_save(sd, storage_writer=FileSystemWriter(base / f"async-{rep}")))
        future.result()

        def load_fs():
            m, o = get_state_dict(model, opt)
            state = {"model": m, "optim": o}
            dcp.load(state, storage_reader=FileSystemReader(fs_dir))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        def load_ours():
            m, o = get_state_dict(model, opt)
            state = {"model": m, "optim": o}
            dcp.load(state, storage_reader=store.dcp_reader(dcp_step))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        timed("load dcp-fs", load_fs)
        timed("load dcp-ours", load_ours)
        timed("load store", lambda: store.restore(store_step, into={"model": model, "optim": opt}))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(fs_dir, ignore_errors=True)
            shutil.rmtree(base / f"async-{rep}", ignore_errors=True)
    store.close()
    out["times"] = times
    out["last_store_step"] = store_step
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def launch(world: int, args: dict) -> list[dict]:
    from s3server import free_port
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), BENCH_WORKER="1", BENCH_ARGS=json.dumps(args), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a rank failed with exit code {proc.returncode}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--experts", type=int, default=0,
                   help="instead of the GPT shape, N small experts (many pieces per rank; 2 ranks only)")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    args = p.parse_args()
    from common import median, table
    root = Path(tempfile.mkdtemp(prefix="bench_dcp-", dir=args.dir))
    try:
        for world in (2,) if args.experts else (2, 4):
            directory = root / f"w{world}"
            outs = launch(world, {"dir": str(directory), "params_m": args.params_m, "repeats": args.repeats,
                                  "experts": args.experts})
            total = sum(o["bytes"] for o in outs)
            slowest = {name: [max(o["times"][name][i] for o in outs) for i in range(args.repeats)]
                       for name in outs[0]["times"]}  # a collective op takes as long as its slowest rank
            m = {name: median(v) for name, v in slowest.items()}
            pieces = f", {outs[0]['pieces']} tensors per rank" if args.experts else ""
            print(f"\n{world} ranks, state {total / 1e6:.0f} MB (params + AdamW m, v){pieces}, "
                  f"median of {args.repeats} interleaved repeats")
            rows = [(name, f"{m[name] * 1000:.0f} ms", f"{total / m[name] / 1e9:.2f} GB/s") for name in m]
            print(table(rows, ("operation", "time", "throughput")))
            print(f"save: ours/dcp-fs speed {m['save dcp-fs'] / m['save dcp-ours']:.2f}x (dcp writer), "
                  f"{m['save dcp-fs'] / m['save store']:.2f}x (store.save)")
            print(f"load: ours/dcp-fs speed {m['load dcp-fs'] / m['load dcp-ours']:.2f}x (dcp reader), "
                  f"{m['load dcp-fs'] / m['load store']:.2f}x (store.restore)")
            floor = m["stall copy floor"]
            print(f"stall: store.save {m['stall store'] / floor:.2f}x the copy, "
                  f"overlap=True {m['stall store overlap'] / floor:.2f}x, "
                  f"dcp.async_save {m['stall dcp async_save'] / floor:.2f}x the copy")
            if world == 4:
                source = directory / "store"
                shrunk = launch(2, {"dir": str(root / "reshard"), "params_m": args.params_m,
                                    "reshard_from": str(source)})
                for o in shrunk:
                    print(f"reshard 4 -> 2, rank {o['rank']}: read {o['read'] / 1e6:.1f} MB for "
                          f"{o['need'] / 1e6:.1f} MB of shards ({o['read'] / o['need']:.3f}x)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    worker() if os.environ.get("BENCH_WORKER") else main()
