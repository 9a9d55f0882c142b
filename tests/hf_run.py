"""A tiny Hugging Face Trainer run (a GPT-2 built from a config, CPU, no hub download).

In-process: ``run(output_dir, max_steps, callbacks, resume)``. As a script (the SIGTERM test):
``python hf_run.py OUTPUT_DIR REMOTE_URL MAX_STEPS`` with AWS_ENDPOINT_URL set for s3 (and
HF_RUN_JIT=1: with the Trainer's ``enable_jit_checkpoint``).
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


def dataset(n: int = 64, length: int = 16):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 64, (length,), generator=g)), "labels": ids} for _ in range(n)]


class Losses(TrainerCallback):
    """Every step's loss as the Trainer computed it (the logged value is rounded)."""

    def __init__(self) -> None:
        self.by_step: dict[int, str] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.by_step[state.global_step] = logs["loss"]


class Progress(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"step {state.global_step}", flush=True)


def run(output_dir, max_steps: int, callbacks=(), resume: bool = False, save_steps: int = 5,
        save_total_limit: int | None = 2, **extra):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    args = TrainingArguments(str(output_dir), max_steps=max_steps, save_steps=save_steps,
                             save_total_limit=save_total_limit, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], logging_steps=1, seed=0, disable_tqdm=True, learning_rate=1e-3, **extra)
    losses = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[*callbacks, losses])
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer, losses.by_step


if __name__ == "__main__":
    from tieredckpt.hf import TieredCheckpointCallback
    out, url, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if url.startswith("s3://") else {}
    cb = TieredCheckpointCallback(remote=url, remote_options=options)
    extra = {"enable_jit_checkpoint": True} if os.environ.get("HF_RUN_JIT") else {}  # the Trainer's own SIGTERM save
    trainer, _ = run(out, steps, [cb, Progress()], save_steps=10_000, save_total_limit=None, **extra)
    print(f"stopped at {trainer.state.global_step}", flush=True)
