"""Train a tiny character-level transformer LM with tieredckpt checkpoints.

    python examples/train_tiny_lm.py --run-dir runs/tiny --steps 1200 --every 100
    python examples/train_tiny_lm.py --remote s3://checkpoints/tiny --endpoint-url http://127.0.0.1:9000

Run it again with the same --run-dir and it resumes from the newest
checkpoint. Send SIGTERM (kill PID) to save the current step and exit 0, or
SIGUSR1 (kill -USR1 PID) to save the current step and keep training. A resumed
run is bit-for-bit the run that never stopped: model, AdamW m and v, RNG
states (dropout) and the data order are all in the checkpoint.

Every step's loss goes to RUN_DIR/.loss.json; a generated sample is written
to RUN_DIR/.samples.json at every checkpoint cadence. With --remote, every
checkpoint (and the side files) is also uploaded in the background; delete the
run directory and run again to watch it come back from the remote.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path

# torch warns on import when NumPy is absent; nothing here needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tieredckpt import CheckpointStore, TieredCkptError, capture_rng, restore_rng  # noqa: E402
from tieredckpt._loop.progress import Progress  # noqa: E402

CORPUS = Path(__file__).with_name("data") / "corpus.txt"


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 96, layers: int = 3, heads: int = 4, ctx: int = 64,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.ctx = ctx
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.ln(x))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/tiny-lm")
    p.add_argument("--steps", type=int, default=1200, help="train until this step (default 1200, about a minute on one CPU core)")
    p.add_argument("--every", type=int, default=100, help="checkpoint cadence in steps")
    p.add_argument("--keep", type=int, default=3, help="local checkpoints to keep")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=1, help="torch threads (fixed, so runs are bit-reproducible)")
    p.add_argument("--remote", help="also upload checkpoints here: s3://bucket/prefix, file:///dir, ...")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint, e.g. MinIO's http://127.0.0.1:9000 "
                                          "(credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    p.add_argument("--upload-on-exit", type=float, default=20.0,
                   help="after SIGTERM, seconds to spend sending the step just saved to the remote (default 20)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    text = CORPUS.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    seed_everything(args.seed)  # every generator capture_rng() saves starts from a known state
    model = TinyLM(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data_order = torch.Generator().manual_seed(args.seed)  # which windows each batch draws

    def state(step: int) -> dict:
        return {"model": model, "optim": opt, "step": step, "rng": capture_rng(),
                "data_order": data_order.get_state(), "vocab": "".join(chars)}

    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    with CheckpointStore(args.run_dir, args.remote, remote_options=options, every=args.every,
                         keep_local=args.keep, upload_on_exit=args.upload_on_exit) as store, store.handle_signals():
        had_local = bool(store.local.steps())
        saved = store.restore(into={"model": model, "optim": opt})
        step = 0
        if saved is not None:
            step = saved["step"]
            restore_rng(saved["rng"])
            data_order.set_state(saved["data_order"])
            where = store.local.step_path(step) if had_local else f"{store.remote.display_url} (downloaded)"
            print(f"resumed from {where} (step {step})", flush=True)
        print(f"training {sum(p.numel() for p in model.parameters()):,} params to step {args.steps}; "
              f"checkpoint every {args.every} steps; pid {os.getpid()} "
              f"(kill -TERM to save and exit, kill -USR1 to save and go on)", flush=True)
        bar = Progress(args.steps, "step", start=step)
        loss = math.nan
        while step < args.steps:
            step += 1
            loss = train_step(model, opt, data, data_order, args.batch)
            store.log_loss(step, loss)
            if step % args.every == 0:
                write_sample(store, model, chars, step)
            if store.requests.save_requested():  # a signal asked: say which step answers it
                cadence = " (a cadence step too)" if step % args.every == 0 else ""
                print(f"\n{store.requests.received[-1]}: saving step {step}{cadence}", flush=True)
            if step == args.steps:
                store.requests.request_save()  # always end on a checkpoint
            stop = store.step_end(step, lambda: state(step))
            bar.update(step, f"loss {loss:.3f}")
            if stop:
                bar.close()
                print(f"SIGTERM: checkpoint for step {step} committed; exiting", flush=True)
                break
        else:
            bar.close()
        store.wait()
        print(f"done at step {step}, loss {loss:.4f}. checkpoints in {store.local.root.resolve()}: "
              f"{store.local.steps()} (latest -> {store.local.latest_step()})", flush=True)
        cost = store.stats()
        if cost["saves"]:
            print(f"checkpointing blocked the loop {cost['blocked_share']:.2%} of the time "
                  f"({cost['saves']} saves, {cost['blocked_s']:.3f} s in save(); tieredckpt ls --stats for more)",
                  flush=True)
        if store.remote is not None and not stop:
            print(f"uploading to {store.remote.display_url} ...", flush=True)
            store.wait(uploads=True)
            print(f"remote holds steps {store.remote.steps()}", flush=True)
        elif store.remote is not None:  # close() sends the stopped step first: this node may not come back
            print(f"sending step {step} to {store.remote.display_url} before exiting "
                  f"(up to {store.upload_on_exit:.0f} s) ...", flush=True)
    if stop and store.remote is not None:
        if store.upload_status()["newest_uploaded"] == step:
            print(f"step {step} is on {store.remote.display_url}: a fresh machine resumes from it", flush=True)
        else:
            print(f"step {step} did not reach the remote in time; it is committed locally and the next "
                  f"start here uploads it (pending: {store.upload_status()['pending']})", flush=True)
    return 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:
        pass


def train_step(model, opt, data, data_order, batch: int) -> float:
    starts = torch.randint(0, len(data) - model.ctx - 1, (batch,), generator=data_order)
    x = torch.stack([data[s:s + model.ctx] for s in starts])
    y = torch.stack([data[s + 1:s + model.ctx + 1] for s in starts])
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def write_sample(store, model, chars, step: int, length: int = 80) -> None:
    """Sample with a generator of its own (and dropout off) so training's RNG stream is untouched."""
    model.eval()
    g = torch.Generator().manual_seed(step)
    idx = torch.tensor([[chars.index("T")]])
    for _ in range(length):
        probs = torch.softmax(model(idx[:, -model.ctx:])[0, -1], dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
    model.train()
    samples = store.run.read_samples([])[-19:]
    samples.append({"step": step, "text": "".join(chars[i] for i in idx[0].tolist()), "unix": time.time()})
    store.run.write_samples(samples)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TieredCkptError as exc:  # a second demo on the same run, a full disk...: one line, no traceback
        print(f"train_tiny_lm: error: {exc}", file=sys.stderr)
        sys.exit(1)
