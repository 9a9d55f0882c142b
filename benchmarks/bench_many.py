"""States of tens of thousands of tensors: what save() blocks and the durable save, against a bare
copy and torch.save + fsync, in one run.

    python benchmarks/bench_many.py [--repeats 3]

Two states, fp32, one process (the shapes of issue 47): 30,000 tensors of 4,096 floats
(480 MB: mixture-of-experts weights and their AdamW moments) and 100,000 tensors of 64
floats (per-layer adapters). Per state, after two warm-up saves (the first allocates the
staging buffers, the second keeps the state's structure for the saves after it: treecache.py),
``repeats`` interleaved rounds of:

  bare copy          ``clone()`` of every tensor (what any snapshot must at least do)
  save() blocks      CheckpointStore.save until it returns
  durable save       ... until its handle's wait() returns (fsynced, committed)
  torch.save + fsync the whole state pickled into one file, fsynced

Targets (issue 47): save() blocks <= 1.2x the bare copy; the durable save at least as fast
as torch.save + fsync.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from common import median, remove, table  # noqa: E402

from tieredckpt import CheckpointStore  # noqa: E402

STATES = {"30,000 x 4,096 floats": (30_000, 4096), "100,000 x 64 floats": (100_000, 64)}


def state_of(n: int, size: int) -> dict:
    return {f"layer{i // 192}.expert{i % 64}.{('w', 'exp_avg', 'exp_avg_sq')[i % 3]}": torch.randn(size)
            for i in range(n)}


def torch_save_fsync(state: dict, path: str) -> float:
    start = time.perf_counter()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    took = time.perf_counter() - start
    os.unlink(path)
    return took


def measure(n: int, size: int, repeats: int, work: str) -> dict[str, list[float]]:
    state = state_of(n, size)
    times: dict[str, list[float]] = {"bare copy": [], "save() blocks": [], "durable save": [],
                                     "torch.save + fsync": []}
    with CheckpointStore(os.path.join(work, "run"), every=0, keep_local=2) as store:
        for step in (1, 2):  # the first allocates the buffers; the second keeps the structure (treecache.py)
            store.save(step, state).wait()
        for r in range(repeats):
            start = time.perf_counter()
            copies = [t.clone() for t in state.values()]
            times["bare copy"].append(time.perf_counter() - start)
            del copies
            start = time.perf_counter()
            handle = store.save(3 + r, state)
            times["save() blocks"].append(time.perf_counter() - start)
            handle.wait()
            times["durable save"].append(time.perf_counter() - start)
            times["torch.save + fsync"].append(torch_save_fsync(state, os.path.join(work, "t.pt")))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the stall-budget warning: this loop only saves
    for label, (n, size) in STATES.items():
        work = tempfile.mkdtemp(prefix="bench_many-", dir=args.dir)
        try:
            times = measure(n, size, args.repeats, work)
        finally:
            remove(work)
        copy, blocks = median(times["bare copy"]), median(times["save() blocks"])
        durable, peer = median(times["durable save"]), median(times["torch.save + fsync"])
        rows = [(name, f"{median(v):.3f}", f"{min(v):.3f}-{max(v):.3f}") for name, v in times.items()]
        print(f"{label} ({n * size * 4 / 1e6:.0f} MB, fp32)")
        print(table(rows, ("method", "median s", "range s")))
        print(f"  save() blocks {blocks / copy:.2f}x the bare copy (target <= 1.2x); the durable save is "
              f"{peer / durable:.2f}x as fast as torch.save + fsync (target >= 1.0x)\n")


if __name__ == "__main__":
    main()
