"""How long save() blocks the training loop, against the floor and the peers, in one run.

    python benchmarks/bench_stall.py [--params 120000000] [--repeats 3]

Blocking time of: a copy of the same tensors into already-allocated buffers
(the floor), CheckpointStore.save() (steady state: staging buffers reused; the
first save, which allocates them, and the second, which touches the pages of the parts the
first one's writer read straight from the tensors, are shown apart), the same with overlap=True
(the copy of what the optimizer owns runs on the writer thread; a real AdamW
over the same tensors), torch.save + fsync (blocks
for the whole durable write), and torch.distributed.checkpoint.async_save
(single-rank gloo group). Also the total time until each write is durable,
and the peak extra memory (VmHWM above the RSS before the save).

Before every timed run ~2.5x the state's size of fresh memory is touched
(untimed): the warm-memory case (see shared/benchmarking.md).

``--device cuda``: the state lives on the GPU; the floor is a device-to-host copy into
pinned buffers (non-blocking, then one synchronize), the store stages into pinned buffers
the same way, and DCP's ``async_save`` gets its pinned-memory stager (``DefaultStager``
with pinned, non-blocking, asynchronous staging). Written for a machine with a GPU and not
run on this one, which has none.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    fsync_path,
    fsync_tree,
    median,
    model_adamw_state,
    remove,
    state_bytes,
    table,
    tensors_of,
    warm_memory,
)

from tieredckpt import CheckpointStore  # noqa: E402


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(fn, nbytes):
    """(blocking seconds, seconds until durable, peak extra bytes) of one call."""
    warm_memory(int(2.5 * nbytes))
    before = rss_now()
    reset_peak()
    start = time.perf_counter()
    finish = fn()
    blocked = time.perf_counter() - start
    if finish is not None:
        finish()
    total = time.perf_counter() - start
    return blocked, total, max(0, peak() - before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=120_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state lives (see above)")
    p.add_argument("--json", help="write the figures here as JSON (benchmarks/plot.py draws them)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    state = on_device(model_adamw_state(args.params), args.device)
    nbytes = state_bytes(state)
    print(f"state: {args.params / 1e6:.1f}M params -> {nbytes / 1e9:.3f} GB in {len(tensors_of(state))} tensors; "
          f"{args.repeats} interleaved repeats, warm memory, torch {torch.__version__}")
    root = tempfile.mkdtemp(prefix="bench-stall-", dir=args.dir)
    tensors = tensors_of(state)
    cuda = args.device == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    store = CheckpointStore(os.path.join(root, "store"), keep_local=1, every=0)
    dcp_dir = os.path.join(root, "dcp")
    _init_single_rank_group()
    step = [0]

    def floor():
        for b, t in zip(buffers, tensors):
            b.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()

    def ours():
        step[0] += 1
        return store.save(step[0], state).wait

    live = live_objects(state)  # the same tensors, as parameters and a real AdamW's m and v
    overlapped = CheckpointStore(os.path.join(root, "overlap"), keep_local=1, every=0, overlap=True)

    def ours_overlap():
        step[0] += 1
        return overlapped.save(step[0], live).wait

    def torch_save():
        path = os.path.join(root, "torch.pt")
        torch.save(state, path)
        fsync_path(path)
        remove(path)

    def dcp_async():
        import torch.distributed.checkpoint as dcp
        remove(dcp_dir)
        if not cuda:
            future = dcp.async_save(state, checkpoint_id=dcp_dir)
            return lambda: (future.result(), fsync_tree(dcp_dir))
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=True))
        response = dcp.async_save(state, checkpoint_id=dcp_dir, async_stager=stager)
        return lambda: (response.upload_completion.result(), fsync_tree(dcp_dir), stager.close())

    floor()  # the floor's buffers are ours already: touch them once, untimed
    first = measure(ours, nbytes)  # allocates the staging buffers
    second = measure(ours, nbytes)  # touches the pages of what the first one's writer read live
    measure(ours_overlap, nbytes)  # and this store's
    floor_name = "device-to-host copy into pinned buffers (floor)" if cuda else "copy into preallocated buffers (floor)"
    methods = {floor_name: floor, "CheckpointStore.save": ours,
               "CheckpointStore.save(overlap=True)": ours_overlap,
               "torch.save + fsync": torch_save, "dcp.async_save" + (" (pinned stager)" if cuda else ""): dcp_async}
    results = {name: [] for name in methods}
    for rep in range(args.repeats):
        items = list(methods.items())
        for name, fn in items[rep % len(items):] + items[:rep % len(items)]:
            results[name].append(measure(fn, nbytes))
    store.close()
    overlapped.close()
    remove(root)

    floor_s = median([r[0] for r in results[floor_name]])
    rows = [(f"CheckpointStore.save, {which}", f"{one[0]:.3f}", f"{one[0] / floor_s:.2f}x", f"{one[1]:.2f}",
             f"{one[2] / nbytes:.2f}")
            for which, one in (("first (allocates buffers)", first), ("second (touches the rest)", second))]
    for name, rs in results.items():
        blocked = median([r[0] for r in rs])
        rows.append((name, f"{blocked:.3f}", f"{blocked / floor_s:.2f}x", f"{median([r[1] for r in rs]):.2f}",
                     f"{median([r[2] for r in rs]) / nbytes:.2f}"))
    print(table(rows, ("method", "blocks (s)", "vs floor", "durable after (s)", "peak extra / state")))
    ours_s = median([r[0] for r in results["CheckpointStore.save"]])
    ours_mem = median([r[2] for r in results["CheckpointStore.save"]]) / nbytes
    print(f"  steady-state stall is {ours_s / floor_s:.2f}x the preallocated copy (target <= 1.2x); "
          f"peak extra memory {ours_mem:.2f}x the state beyond the staging buffers it keeps "
          f"(the buffers themselves are one copy: {nbytes / 1e9:.2f} GB, target <= 1 extra copy)")
    overlap_s = median([r[0] for r in results["CheckpointStore.save(overlap=True)"]])
    print(f"  with overlap=True the loop waits {overlap_s / floor_s:.3f}x the copy (target <= 0.1x); the copy "
          "runs on the writer thread while the loop computes, and the optimizer's next step() waits for it")
    if args.json:
        import json
        keys = ("blocked", "durable", "peak_extra")
        out = {"bytes": nbytes, "params": args.params, "first_save": dict(zip(keys, first)),
               "second_save": dict(zip(keys, second)),
               "methods": {name: [dict(zip(keys, r)) for r in rs] for name, rs in results.items()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def on_device(state, device: str):
    """The state's tensors moved to ``device`` (its structure kept)."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: on_device(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_device(v, device) for v in state)
    return state


def live_objects(state: dict) -> dict:
    """The state's tensors as parameters and a real AdamW holding its m and v (what
    overlap=True needs: the optimizer object, to hold its next step())."""
    params = [torch.nn.Parameter(t) for t in state["model"].values()]
    opt = torch.optim.AdamW(params, lr=3e-4)
    for i, p in enumerate(params):
        opt.state[p] = dict(state["optim"]["state"][i])
    return {"model": dict(zip(state["model"], params)), "optim": opt}


def _init_single_rank_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


if __name__ == "__main__":
    main()
