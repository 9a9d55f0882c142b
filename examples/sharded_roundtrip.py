"""Four ranks' state written as four shard files plus a manifest, reloaded, compared byte for byte.

    python examples/sharded_roundtrip.py [--dir DIR]

Each rank holds a ZeRO-style slice of a flat fp16 parameter vector with its
AdamW m and v (fp32), plus replicated plain values.
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tieredckpt import load_sharded, save_sharded, verify_checkpoint
from tieredckpt._format.compare import first_difference


def rank_states(world_size: int, numel: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    per_rank = -(-numel // world_size)
    states = []
    for rank in range(world_size):
        n = min(per_rank, numel - rank * per_rank)
        states.append({
            "params_fp16": torch.randn(n, generator=gen).half(),
            "optim": {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen),
                      "step": torch.tensor(1234.0)},
            "hparams": {"lr": 3e-4, "betas": (0.9, 0.999), "rank": rank},
        })
    return states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write (default: a temporary directory, removed afterwards)")
    parser.add_argument("--numel", type=int, default=4 * 65536)
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tieredckpt-demo-"))
    ckpt = root / "step_001234"
    try:
        states = rank_states(4, args.numel)
        start = time.perf_counter()
        spans, offset = [], 0
        for state in states:  # each rank owns a contiguous slice of the flat parameter space
            spans.append((offset, state["params_fp16"].numel()))
            offset += spans[-1][1]
        manifest = save_sharded(states, ckpt, step=1234, wall_clock_seconds=4521, param_shards=spans)
        saved = time.perf_counter() - start
        for shard in manifest.shards:
            print(f"  {shard.path}: {shard.size:>9} bytes  params [{shard.param_shard_offset}, "
                  f"+{shard.param_shard_numel})  sha256 {shard.sha256[:16]}...")
        print(f"  manifest.json: world_size {manifest.world_size}, step {manifest.step}")
        verify_checkpoint(ckpt, full=True)
        loaded = load_sharded(ckpt, expected_world_size=4, verify="sha256")
        diff = first_difference(states, loaded)
        print(f"wrote 4 shards + manifest to {ckpt} in {saved * 1000:.0f} ms; "
              f"reloaded with sha256 verification: {'byte-equal' if diff is None else 'MISMATCH at ' + diff}")
        if diff is not None:
            raise SystemExit(1)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
