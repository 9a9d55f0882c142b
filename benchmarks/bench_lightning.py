"""Lightning checkpoints: how long the training loop is blocked per checkpoint, and the durable
save time, with Lightning's TorchCheckpointIO, AsyncCheckpointIO(TorchCheckpointIO()) and
TieredCheckpointIO, against a copy of the same state into reused buffers (the floor), timed
right before each checkpoint (the machine's memory speed swings 2x between processes).

A LightningModule of about 100M fp32 parameters (a stack of Linear layers) with AdamW
trains on CPU and checkpoints every step through ModelCheckpoint. Blocked: the time
ModelCheckpoint's save takes on the training thread. Durable: from the save's start until
the bytes are on disk (TorchCheckpointIO never fsyncs, so its file is fsynced after, and
counted; AsyncCheckpointIO's background write is waited for and fsynced; ours waits for the
store's commit). Each configuration runs in its own process, in turn, --repeats times.

    python benchmarks/bench_lightning.py [--params 100e6] [--saves 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("torch", "async", "tiered")


def one(kind: str, work: Path, params: float, saves: int) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from tieredckpt.lightning import TieredCheckpointIO, TieredModelCheckpoint

    width = 4096
    layers = max(1, round(params / (width * width)))

    class Big(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

        def training_step(self, batch, i):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    blocked: list[float] = []
    durable: list[float] = []
    plugin = {"torch": TorchCheckpointIO, "async": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
              "tiered": lambda: TieredCheckpointIO(keep_local=2)}[kind]()
    base = TieredModelCheckpoint if kind == "tiered" else ModelCheckpoint

    floors: list[float] = []
    buffers: list = []

    def copy_floor(trainer) -> float:
        """The same state copied into buffers that already exist (what staging does at best),
        timed right before each save so both meet the same machine (its memory speed swings)."""
        state = [p.detach() for p in trainer.lightning_module.parameters()] + \
            [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        if len(buffers) != len(state):
            buffers[:] = [torch.empty_like(t) for t in state]
            for b, t in zip(buffers, state):
                b.copy_(t)
        start = time.perf_counter()
        for b, t in zip(buffers, state):
            b.copy_(t)
        return time.perf_counter() - start

    class Timed(base):
        def _save_checkpoint(self, trainer, filepath):
            floors.append(copy_floor(trainer))
            start = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            blocked.append(time.perf_counter() - start)
            if kind == "tiered":
                plugin.wait()
            elif kind == "async":
                plugin._executor.submit(lambda: None).result()  # its one worker: the write is done
            fd = os.open(filepath, os.O_RDONLY) if kind != "tiered" else None
            if fd is not None:
                os.fsync(fd)
                os.close(fd)
            durable.append(time.perf_counter() - start)

    model = Big()
    data = DataLoader(TensorDataset(torch.randn(saves + 1, 1, width)), batch_size=None)
    trainer = L.Trainer(max_steps=saves + 1, plugins=[plugin], callbacks=[Timed(every_n_train_steps=1, save_top_k=-1)],
                        default_root_dir=str(work), accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, data)
    nbytes = sum(b.numel() * b.element_size() for b in buffers)
    return {"kind": kind, "bytes": nbytes, "blocked": blocked[1:], "durable": durable[1:], "copy": floors[1:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the figures here as JSON")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, Path(args.work), args.params, args.saves)))
        return
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in range(args.repeats):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:  # each repeat starts with another kind
            work = Path(tempfile.mkdtemp(prefix="bench_lightning-"))
            try:
                out = subprocess.run([sys.executable, __file__, "--one", kind, "--work", str(work),
                                      "--params", str(args.params), "--saves", str(args.saves)],
                                     capture_output=True, text=True, check=True).stdout
                results[kind].append(json.loads(out.strip().splitlines()[-1]))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            subprocess.run(["sync"], check=True)
    nbytes = results["tiered"][0]["bytes"]
    print(f"state: {nbytes / 1e9:.2f} GB (weights + AdamW moments, fp32); medians per checkpoint, spread over "
          f"{args.repeats} runs of {args.saves} checkpoints")
    torch_blocked = [statistics.median(r["blocked"]) for r in results["torch"]]
    print(f"{'plugin':<34}{'blocked s':>16}{'durable s':>16}{'blocked vs torch':>18}{'blocked vs copy':>17}")
    for kind, label in zip(KINDS, ("TorchCheckpointIO", "AsyncCheckpointIO(TorchCheckpointIO)", "TieredCheckpointIO")):
        blocked = [statistics.median(r["blocked"]) for r in results[kind]]
        durable = [statistics.median(r["durable"]) for r in results[kind]]
        vs_torch = [b / t for b, t in zip(blocked, torch_blocked)]
        vs_copy = [statistics.median(b / c for b, c in zip(r["blocked"], r["copy"])) for r in results[kind]]
        print(f"{label:<34}{_spread(blocked):>16}{_spread(durable):>16}{_spread(vs_torch, 'x'):>18}"
              f"{_spread(vs_copy, 'x'):>17}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _spread(values: list[float], unit: str = "") -> str:
    return f"{min(values):.2f}-{max(values):.2f}{unit}" if len(values) > 1 else f"{values[0]:.2f}{unit}"


if __name__ == "__main__":
    main()
