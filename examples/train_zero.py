"""ZeRO-style training across ranks, checkpointed by tieredckpt: one shard per rank.

    torchrun --nproc_per_node 2 examples/train_zero.py --run-dir runs/zero --steps 300

Every rank holds the whole model for forward/backward, but the flat parameter
space is split across ranks: rank r owns elements [offset_r, offset_r + numel_r)
of the flattened parameters and their AdamW m and v, updates only that slice,
and the slices are all-gathered back into the model after each step. Each rank
saves exactly what it owns (the manifest records the spans), so a checkpoint
can be resharded to another world size (`tieredckpt reshard`, or restore with
--reshard). SIGTERM or SIGUSR1 sent to any one rank: every rank saves at the
same step boundary (SIGTERM: then all exit 0). Run again to resume.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tieredckpt import CheckpointStore  # noqa: E402
from tieredckpt._tiers.reshard import even_spans  # noqa: E402

BETAS, EPS, LR, WD = (0.9, 0.999), 1e-8, 1e-2, 0.01


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/zero")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--remote", help="also upload checkpoints here (every rank uploads its own shard)")
    p.add_argument("--node-local", action="store_true",
                   help="give every rank a local directory of its own (RUN_DIR/rankN), as on separate nodes")
    p.add_argument("--reshard", action="store_true", help="resume from a checkpoint of another world size")
    p.add_argument("--upload-on-exit", type=float, default=20.0,
                   help="after SIGTERM, seconds to spend sending the step just saved to the remote (default 20)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1))
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    offset, numel = even_spans(total, world)[rank]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    mine = {"params": flat[offset:offset + numel].clone(), "exp_avg": torch.zeros(numel),
            "exp_avg_sq": torch.zeros(numel)}
    data = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    run_dir = Path(args.run_dir) / f"rank{rank}" if args.node_local else Path(args.run_dir)

    with CheckpointStore(run_dir, args.remote, every=args.every, upload_on_exit=args.upload_on_exit) as store, \
            store.handle_signals():
        saved = store.restore(reshard=args.reshard)
        step = 0
        if saved is not None:
            step = saved["step"]
            mine = saved["flat"]
            data.set_state(saved["data_order"])
            if rank == 0:
                print(f"resumed at step {step}", flush=True)
        gather_into_model(params, mine["params"], total, world)
        if rank == 0:
            print(f"{world} ranks, {total:,} params, rank 0 owns [{offset}, +{numel}); pid of each rank: "
                  f"{store.ranks.all_gather_json(os.getpid()) if store.ranks else os.getpid()}", flush=True)
        elif store.ranks:
            store.ranks.all_gather_json(os.getpid())
        while step < args.steps:
            step += 1
            loss = train_step(model, params, mine, offset, numel, total, data, step, rank, world)
            store.log_loss(step, loss)
            if step == args.steps:
                store.requests.request_save()  # always end on a checkpoint
            state = lambda: {"flat": mine, "step": step, "data_order": data.get_state(),  # noqa: E731
                             "hparams": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}}
            if store.step_end(step, state, param_span=(offset, numel)):
                if rank == 0:
                    print(f"SIGTERM: step {step} committed on every rank; exiting", flush=True)
                break
        store.wait()
        if rank == 0:
            print(f"done at step {step}, loss {loss:.5f}; checkpoints {store.local.steps()}", flush=True)
    dist.destroy_process_group()
    return 0


def train_step(model, params, mine, offset, numel, total, data, step, rank, world) -> float:
    x = torch.randn(64, 32, generator=data)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    xs, ys = x[rank::world], y[rank::world]  # this rank's part of the global batch
    loss = torch.nn.functional.mse_loss(model(xs), ys)
    model.zero_grad(set_to_none=False)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(grad)
    grad = grad[offset:offset + numel] / world
    adamw_(mine, grad, step)
    gather_into_model(params, mine["params"], total, world)
    mean = torch.tensor([loss.item()])
    dist.all_reduce(mean)
    return mean.item() / world


def adamw_(mine, grad, step) -> None:
    """AdamW on this rank's slice only (decoupled weight decay, bias correction)."""
    p, m, v = mine["params"], mine["exp_avg"], mine["exp_avg_sq"]
    p.mul_(1 - LR * WD)
    m.mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
    denom = (v / (1 - BETAS[1] ** step)).sqrt_().add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


def gather_into_model(params, my_slice, total, world) -> None:
    spans = even_spans(total, world)
    longest = max(n for _, n in spans)  # gloo gathers equal sizes: pad, then trim
    padded = torch.zeros(longest)
    padded[:my_slice.numel()] = my_slice
    pieces = [torch.empty(longest) for _ in spans]
    dist.all_gather(pieces, padded)
    flat = torch.cat([piece[:n] for piece, (_, n) in zip(pieces, spans)])
    with torch.no_grad():
        i = 0
        for p in params:
            p.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()


if __name__ == "__main__":
    sys.exit(main())
