"""Bytes sent per checkpoint with shared remote objects, against moto's S3 server.

    python benchmarks/bench_dedup.py [--params 20000000] [--checkpoints 5]

Two states, each checkpointed ``--checkpoints`` times, 10 AdamW steps apart, through a
CheckpointStore with an s3:// remote (moto in its own process, bodies in memory):

  trainable: a GPT-shaped transformer, every parameter trained (weights, m, v change);
             reported against the same upload with objects cut every 64 MiB only (the
             layout before tensor-aligned cuts): bytes sent and client CPU per checkpoint.
  frozen:    a 10-block transformer (71M params) whose first 9 blocks and embeddings are
             frozen; AdamW trains the last block and the head, so the frozen weights are
             ~75% of the checkpoint's bytes. Reported: bytes sent by checkpoints 2.. as a
             ratio of the first's (target <= 0.3x).
  fork:      (``--fork-params``, default 120M: 1.44 GB with AdamW) one step uploaded, then
             ``store.fork(step, dir, remote=...)`` onto another prefix of the bucket: the
             request bodies the client sends (counted by the test suite's proxy in front of
             moto) against the step's bytes (target <= 1%), and the fork's wall time against
             the step's upload.

Client CPU is this process's user+system time during the upload (moto's CPU is its own).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from faultproxy import FaultProxy  # noqa: E402
from s3server import MotoServer  # noqa: E402

import tieredckpt._tiers.objects as objects  # noqa: E402
from tieredckpt import CheckpointStore  # noqa: E402


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def model_and_optimizer(n_params: int, frozen: bool):
    from train_tiny_lm import TinyLM
    torch.manual_seed(0)
    layers = max(1, round(n_params / (12 * 768 * 768)))
    model = TinyLM(vocab=96, d=768, layers=layers, heads=12, ctx=64, dropout=0.0)
    params = list(model.parameters())
    if frozen:  # the trunk frozen; the last block trained: ~75% of the checkpoint's bytes frozen
        for p in params:
            p.requires_grad_(False)
        trained = [p for name, p in model.named_parameters() if name.startswith(f"blocks.{layers - 1}.")
                   or name.startswith(("head.", "ln."))]
        for p in trained:
            p.requires_grad_(True)
        params = trained
    return model, torch.optim.AdamW(params, lr=3e-4)


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        x = torch.randint(0, 96, (2, 64))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 96), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def run(server: MotoServer, n_params: int, checkpoints: int, frozen: bool, alone: int) -> list[dict]:
    objects.ALONE = alone
    bucket = f"dedup-{int(time.time() * 1000)}"
    server.make_bucket(bucket)
    model, opt = model_and_optimizer(n_params, frozen)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            CheckpointStore(Path(tmp) / "run", f"s3://{bucket}/run", remote_options=server.options(),
                            keep_local=2) as store:
        for i in range(checkpoints):
            train(model, opt, 10)
            step = 10 * (i + 1)
            store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
            cpu, start = cpu_seconds(), time.perf_counter()
            store.wait(uploads=True, timeout=600)
            wall = time.perf_counter() - start
            entry = store.upload_status()["steps"][step]
            rows.append({"step": step, "sent": entry["bytes_sent"], "referenced": entry["bytes_referenced"],
                         "cpu_s": cpu_seconds() - cpu, "wall_s": wall})
    return rows


def fork(server, params: int) -> dict:
    """Upload one step of ``params`` parameters + AdamW, then fork it onto a new prefix."""
    from common import model_adamw_state
    proxy = FaultProxy(server.endpoint).start()
    try:
        server.make_bucket("fork")
        options = {**server.options(), "endpoint_url": proxy.endpoint}
        state = model_adamw_state(params)
        with tempfile.TemporaryDirectory(prefix="bench-fork-") as root, \
                CheckpointStore(os.path.join(root, "run"), "s3://fork/run", remote_options=options) as store:
            start = time.perf_counter()
            store.save(1, state).wait()
            assert store.wait(uploads=True, timeout=3600)
            upload_s = time.perf_counter() - start
            step_bytes = store.remote.upload_manifest(1).stored_size
            before, start = proxy.body_bytes, time.perf_counter()
            store.fork(1, os.path.join(root, "fork"), remote="s3://fork/fork")
            return {"step_bytes": step_bytes, "fork_sent": proxy.body_bytes - before,
                    "fork_s": time.perf_counter() - start, "upload_s": upload_s}
    finally:
        proxy.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=20_000_000)
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--fork-params", type=int, default=120_000_000)
    p.add_argument("--only-fork", action="store_true", help="measure the fork alone")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    server = MotoServer().start()
    try:
        if args.only_fork:
            return print_fork(fork(server, args.fork_params), args.json)
        out = {
            "trainable_aligned": run(server, args.params, 2, False, objects.ALONE),
            "trainable_64mib": run(server, args.params, 2, False, 1 << 62),
            "frozen": run(server, 10 * 12 * 768 * 768, args.checkpoints, True, objects.ALONE),
            "fork": fork(server, args.fork_params),
        }
    finally:
        server.kill()
    a, b = out["trainable_aligned"], out["trainable_64mib"]
    print(f"trainable, {args.params / 1e6:.0f}M params: tensor-aligned objects vs 64 MiB cuts")
    for x, y in zip(a, b):
        print(f"  step {x['step']}: sent {x['sent'] / 1e6:.1f} MB vs {y['sent'] / 1e6:.1f} MB "
              f"({x['sent'] / y['sent']:.4f}x); client CPU {x['cpu_s']:.2f} s vs {y['cpu_s']:.2f} s "
              f"({x['cpu_s'] / y['cpu_s']:.3f}x)")
    first = out["frozen"][0]
    print("frozen trunk (trainable last block and head), bytes sent vs the first checkpoint")
    for row in out["frozen"]:
        print(f"  step {row['step']}: sent {row['sent'] / 1e6:.1f} MB of {row['referenced'] / 1e6:.1f} MB "
              f"referenced ({row['sent'] / first['sent']:.3f}x the first); upload {row['wall_s']:.2f} s, "
              f"client CPU {row['cpu_s']:.2f} s")
    print_fork(out["fork"], None)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def print_fork(f: dict, path: str | None) -> None:
    print(f"fork of a {f['step_bytes'] / 1e9:.2f} GB step onto another prefix of the bucket: the client sent "
          f"{f['fork_sent'] / 1e3:.1f} KB ({f['fork_sent'] / f['step_bytes']:.5%} of the step; target <= 1%) in "
          f"{f['fork_s']:.2f} s, against {f['upload_s']:.2f} s for the step's upload")
    if path:
        Path(path).write_text(json.dumps({"fork": f}, indent=1))


if __name__ == "__main__":
    main()
