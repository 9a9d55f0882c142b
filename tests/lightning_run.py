"""A small Lightning run on CPU: ``run(root, epochs, plugins, callbacks, ckpt_path)`` in-process;
as a script (the SIGTERM test): ``python lightning_run.py ROOT REMOTE_URL`` trains until stopped."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self, width: int = 16, note: object = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        middle = [torch.nn.Linear(width, width), torch.nn.Tanh()] if width >= 1024 else []  # a big state to kill saving
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), *middle, torch.nn.Linear(width, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.losses[self.global_step] = loss.item()
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)}


def data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)), batch_size=8)


def run(root, epochs: int, plugins=(), callbacks=(), ckpt_path=None, model=None, max_steps: int = -1):
    L.seed_everything(0, verbose=False)
    model = model or Model()
    trainer = L.Trainer(max_epochs=epochs, max_steps=max_steps, plugins=list(plugins), callbacks=list(callbacks),
                        default_root_dir=str(root), accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer, model


class Progress(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        print(f"step {trainer.global_step}", flush=True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if wait is not None:
            wait()  # the previous save committed: a kill from here on lands in this one
        print(f"saving {trainer.global_step}", flush=True)


if __name__ == "__main__":  # ROOT URL [WIDTH EVERY]: URL "-" for no remote
    from tieredckpt.lightning import TieredCheckpointIO, TieredModelCheckpoint
    root, url = sys.argv[1], sys.argv[2]
    width, every = (int(a) for a in sys.argv[3:5]) if len(sys.argv) > 4 else (16, 10_000)
    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if url.startswith("s3://") else {}
    trainer, _ = run(root, 100_000, [TieredCheckpointIO(remote=None if url == "-" else url, remote_options=options)],
                     [TieredModelCheckpoint(every_n_train_steps=every, save_last=True), Progress()],
                     ckpt_path="last", model=Model(width=width))
    print(f"stopped at {trainer.global_step}", flush=True)
