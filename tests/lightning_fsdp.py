"""An FSDP2 Lightning run on CPU (gloo) through TieredModelParallelStrategy, for tests/test_lightning.py.

    python lightning_fsdp.py ROOT REMOTE_URL EPOCHS DEVICES OUT

EPOCHS 0: train until a signal stops it, printing ``rank R pid P`` per rank and ``step N``.

Lightning's own launcher starts the other ranks (it re-runs this script). Resumes with
``ckpt_path="last"``. Rank 0 writes OUT/start.pt and OUT/end.pt: the gathered full model and
AdamW state (tensors only) when training starts (after any restore) and when it ends, and
prints ``global_step START END``.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tieredckpt.lightning import TieredCheckpointIO, TieredModelCheckpoint, TieredModelParallelStrategy  # noqa: E402


def say(line: str) -> None:
    """One write per line: both ranks share the test's stdout pipe, and print() writes the text
    and its newline apart, so two ranks' lines could interleave ("rank 1 pid 8746rank 0 ...")."""
    os.write(1, (line + "\n").encode())


class Sharded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


class Gathered(L.Callback):
    """The full state (every rank takes part; rank 0 writes it) at train start and end."""

    def __init__(self, out: str) -> None:
        self.out = out

    def _dump(self, trainer, pl_module, name: str) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(pl_module, options=options)
        optim = get_optimizer_state_dict(pl_module, trainer.optimizers[0], options=options)
        flat = {f"model/{k}": v for k, v in model.items()}
        for fqn, state in optim.get("state", {}).items():  # full state: rank 0 only
            flat.update({f"optim/{fqn}/{k}": torch.as_tensor(v) for k, v in state.items()})
        if trainer.global_rank == 0:
            torch.save(flat, os.path.join(self.out, f"{name}.pt"))
            torch.save({"global_step": torch.tensor(trainer.global_step),
                        "lr": torch.tensor(trainer.optimizers[0].param_groups[0]["lr"])},
                       os.path.join(self.out, f"{name}-loop.pt"))

    def on_train_start(self, trainer, pl_module):
        self._dump(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module):
        self._dump(trainer, pl_module, "end")


class Progress(L.Callback):
    def on_train_start(self, trainer, pl_module):
        say(f"rank {trainer.global_rank} pid {os.getpid()}")

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == 0:
            say(f"step {trainer.global_step}")


def main(root: str, url: str, epochs: int, devices: int, out: str) -> None:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if url.startswith("s3://") else {}
    trainer = L.Trainer(
        max_epochs=epochs or 100_000, accelerator="cpu", devices=devices, default_root_dir=root, logger=False,
        strategy=TieredModelParallelStrategy(), plugins=[TieredCheckpointIO(remote=url, remote_options=options)],
        callbacks=[TieredModelCheckpoint(save_last=True), Gathered(out)] + ([] if epochs else [Progress()]),
        enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(Sharded(), data, ckpt_path="last")
    if trainer.global_rank == 0:
        say(f"global_step {trainer.global_step}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
