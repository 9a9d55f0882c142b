"""One rank of an FSDP2 / tensor-parallel run on a CPU gloo mesh, for tests/test_dtensor.py.

    python tests/fsdp_worker.py SCENARIO RUN_DIR REF --mesh dp[xtp] [--remote URL] [--kill-rank R]

Launched like torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); with WORLD_SIZE
unset it runs alone with a plain (unsharded) model. Prints one JSON line per rank.

  save:    train 3 AdamW steps, save step 3, write the gathered full state to REF,
           train 2 more steps and report their losses;
  restore: restore the newest step into a freshly sharded model and optimizer, compare
           the gathered full state with REF bit for bit, train 2 steps, report losses;
  killed:  save step 1, then rank --kill-rank dies by SIGKILL while writing step 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tieredckpt import CheckpointStore, capture_rng, restore_rng  # noqa: E402
from tieredckpt._format.compare import first_difference  # noqa: E402
from tieredckpt._format.shardfile import read_shard, write_shard  # noqa: E402

DIM, HEADS, VOCAB, LAYERS = 32, 4, 64, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(mesh_shape: tuple[int, ...] | None):
    torch.manual_seed(0)
    model = TinyLM()
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        names = ("dp", "tp")[:len(mesh_shape)]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        if "tp" in names:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                    "up": ColwiseParallel(), "down": RowwiseParallel()}
            for block in model.blocks:
                parallelize_module(block, mesh["tp"], plan)
        dp = mesh["dp"]
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)  # the same batch on every rank
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full(value):
    """A gathered copy: DTensors become their full tensor, containers are walked."""
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [full(v) for v in value]
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def full_state(model, opt) -> dict:
    return {"model": full(model.state_dict()), "optim": full(opt.state_dict()["state"])}


def main() -> None:
    global DIM
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("run_dir")
    p.add_argument("ref")
    p.add_argument("--mesh", default="")
    p.add_argument("--remote")
    p.add_argument("--remote-options", default="{}")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--overlap", action="store_true", help="save with overlap=True")
    p.add_argument("--part-size", type=int, default=64 << 20, help="upload part size")
    p.add_argument("--width", type=int, default=32, help="the model's width")
    p.add_argument("--dcp", choices=["save", "async_save"], help="save and load with torch.distributed.checkpoint")
    args = p.parse_args()
    DIM = args.width
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    mesh = tuple(int(x) for x in args.mesh.split("x")) if distributed else None
    model, opt = build(mesh)
    out = {"rank": rank}
    reads = [0]
    from tieredckpt._tiers import assemble
    real = assemble._pread_into

    def counting(fd, view, offset):  # every byte a restore reads from a shard passes here
        reads[0] += len(view)
        return real(fd, view, offset)
    assemble._pread_into = counting
    from tieredckpt._tiers.remote import RemoteTier
    fetched, real_fetch = [0], RemoteTier.fetch_part

    def counting_fetch(self, upload, fd, part):  # every part a restore downloads passes here
        fetched[0] += part.raw_size
        return real_fetch(self, upload, fd, part)
    RemoteTier.fetch_part = counting_fetch
    with CheckpointStore(args.run_dir.format(rank=rank), args.remote, every=1, upload_part_size=args.part_size,
                         remote_options=json.loads(args.remote_options)) as store:
        torch.manual_seed(1000 + rank)  # each rank's own generator state, saved with its shard
        state = lambda step: {"model": model, "optim": opt, "step": step, "rng": capture_rng()}  # noqa: E731
        if args.scenario == "save":
            train(model, opt, range(1, 4))
            if args.dcp:
                dcp_save(store, model, opt, 3, args.dcp)
            else:
                handle = store.save(3, state(3), overlap=args.overlap)
                out["next_random"] = torch.rand(3).tolist()
                if not args.overlap:
                    handle.wait()
            ref = full_state(model, opt)
            if rank == 0:
                write_shard(args.ref, ref)
            out["losses"] = train(model, opt, range(4, 6))
            store.wait(uploads=True)
        elif args.scenario == "restore":
            restored = {}
            if args.dcp:
                out["step"] = dcp_load(store, model, opt)
            else:
                restored = store.restore(into={"model": model, "optim": opt})
                out["step"] = restored["step"]
                restore_rng(restored["rng"])
                out["next_random"] = torch.rand(3).tolist()
            out["read"], out["fetched"] = reads[0], fetched[0]
            out["need"] = sum(t.numel() * t.element_size() for t in _locals(model.state_dict()) +
                              _locals(opt.state_dict()["state"]) + _locals(restored.get("rng", {})))
            got = full_state(model, opt)
            if rank == 0 and os.path.exists(args.ref):
                diff = first_difference(read_shard(args.ref), got)
                out["diff"] = None if diff is None else str(diff)
            out["losses"] = train(model, opt, range(4, 6))
        elif args.scenario == "killed":
            train(model, opt, range(1, 2))
            store.save(1, state(1)).wait()
            train(model, opt, range(2, 3))
            if rank == args.kill_rank:
                from tieredckpt._tiers import ranks
                ranks.write_rank = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            try:
                store.save(2, state(2)).wait()
                out["saved"] = True
            except Exception as exc:  # noqa: BLE001 - the test reads what happened
                out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    if distributed:
        dist.destroy_process_group()


def dcp_save(store, model, opt, step: int, how: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": step}
    if how == "async_save":
        dcp.async_save(state, storage_writer=store.dcp_writer(step)).result()
    else:
        dcp.save(state, storage_writer=store.dcp_writer(step))


def dcp_load(store, model, opt) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": -1}
    dcp.load(state, storage_reader=store.dcp_reader())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["step"]


def _locals(value) -> list:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _locals(v)]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []


if __name__ == "__main__":
    main()
