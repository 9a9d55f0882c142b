"""Local tier throughput against the disk's limit and the peers, in one run, interleaved.

    python benchmarks/bench_local.py [--params 120000000] [--repeats 3] [--dir DIR] [--dtype bfloat16]

Save (durable, fsync included): tieredckpt save_sharded (sha256 while writing, and as the
store saves: committed with crc32c, sha256 recorded after) vs a raw sequential
write + fsync of the same bytes through the page cache (the usual way to write a file),
the same raw write with O_DIRECT from aligned buffers (the device's own limit: no page
cache), torch.save + fsync, torch.distributed.checkpoint.save, safetensors save_file + fsync.
Load into preallocated tensors (warm page cache: every file read once, untimed, first):
tieredckpt vs torch.load, torch.load(mmap=True), safetensors load_file; the verified load's
own bound: it reads the bytes twice (its crc32c pass, then the copy), so it is measured
against one crc32c pass then one load with sizes checked only, timed as one in each repeat; and cold
(the files evicted from the page cache first, as after a reboot or on another node):
tieredckpt verified vs safetensors. Verify: crc32c vs sha256.

Before every timed run ~2.5x the state's size of fresh memory is touched
(untimed), so the figures are the warm-memory case (see shared/benchmarking.md).
Medians of --repeats interleaved runs (warm loads: six times as many, cold loads three times,
rounded up to whole cycles),
in a balanced order: each method runs first, and right after each other method, equally
often (see ``ordered``).

``--json PATH`` writes every timing (benchmarks/plot.py draws them).

``--fresh``: the saves again, each method and repeat in a new process that builds the state
and saves once with no warm-up (what a long-lived training process meets, whose freed
buffers went back to the kernel), beside the store's own ``save().wait()``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

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
    timer,
    warm_memory,
)

from tieredckpt._format.checksum import CHUNK, file_digest  # noqa: E402
from tieredckpt._format.memview import byte_view  # noqa: E402
from tieredckpt._tiers.sharded import load_sharded, save_sharded, verify_checkpoint  # noqa: E402


def raw_write(state, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors_of(state):
            view = byte_view(t.reshape(-1))
            for i in range(0, len(view), CHUNK):
                os.write(fd, view[i:i + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_direct_write(state, path):
    """The same bytes with O_DIRECT, from two aligned 16 MiB buffers on huge pages (the
    store's own kind: 4 MiB requests, see directwrite._Buffer), each block copied and then
    written on this one thread (no checksums, no overlap): the device without the page cache,
    less the overlap of copy and write the store's writer has, so the store can beat it."""
    from tieredckpt._format.directwrite import _Buffer
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    buffers = [_Buffer().view for _ in range(2)]
    try:
        filled, which, total = 0, 0, 0
        for t in tensors_of(state):
            view = byte_view(t.reshape(-1))
            while len(view):
                n = min(len(view), CHUNK - filled)
                buffers[which][filled:filled + n] = view[:n]
                filled, view, total = filled + n, view[n:], total + n
                if filled == CHUNK:
                    os.write(fd, buffers[which])
                    filled, which = 0, 1 - which
        if filled:
            os.write(fd, buffers[which][:-(-filled // 4096) * 4096])
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        os.close(fd)


def flat_names(state):
    out = {}
    for k, v in state["model"].items():
        out[f"model.{k}"] = v
    for i, s in state["optim"]["state"].items():
        for k, v in s.items():
            out[f"optim.{i}.{k}"] = v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=120_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and AdamW moments' dtype")
    p.add_argument("--fresh", action="store_true", help="saves in fresh processes, no warm-up (see above)")
    p.add_argument("--one-save", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write every timing here as JSON (benchmarks/plot.py draws them)")
    args = p.parse_args()
    if args.one_save:
        return one_fresh_save(args)
    if args.fresh:
        return fresh_saves(args)

    state = model_adamw_state(args.params, dtype=getattr(torch, args.dtype))
    nbytes = state_bytes(state)
    n_tensors = len(tensors_of(state))
    print(f"state: {args.params / 1e6:.1f}M params -> {nbytes / 1e9:.3f} GB in {n_tensors} tensors; "
          f"{args.dtype}, {args.repeats} interleaved repeats, warm memory, torch {torch.__version__}, {torch.get_num_threads()} threads")
    root = tempfile.mkdtemp(prefix="bench-local-", dir=args.dir)
    try:
        savers = make_savers(state, root)
        save_times = {name: [] for name in savers}
        for rep in range(args.repeats):
            for name, (save, target) in ordered(savers, rep):
                remove(target)
                warm_memory(int(2.5 * nbytes))
                with timer(save_times[name]):
                    save()
        report_save(save_times, nbytes)

        targets = {k: torch.zeros_like(v) for k, v in flat_names(state).items()}  # touched: no load pays for it
        loaders = make_loaders(root, targets)
        load_times = {name: [] for name in loaders}
        crc_pass: list[float] = []
        shard = os.path.join(root, "tieredckpt", "rank0.bin")
        for where in ("tieredckpt", "torch.save", "safetensors"):
            read_through(os.path.join(root, where))  # warm: the store's write went past the page cache
        timed = {**loaders, "crc32c pass alone": None}
        # Loads are quick, and the verified load and its bound do the same work, so their ratio sits near
        # 1.0 with a run's noise (+-8% at 28 repeats): 6x the repeats, rounded up to whole cycles.
        for rep in range(whole_cycles(6 * args.repeats, len(timed))):
            for name, load in ordered(timed, rep):
                warm_memory(int(2.5 * nbytes))
                with timer(load_times[name] if load is not None else crc_pass):
                    load() if load is not None else file_digest(shard, sha256=False)
        report_load(load_times, crc_pass, nbytes)
        cold = cold_loads(root, loaders, whole_cycles(3 * args.repeats, 2), nbytes)  # each swings with the disk
        if args.json:
            dump(args.json, {"mode": "warm", "bytes": nbytes, "params": args.params, "dtype": args.dtype,
                             "save": save_times, "load": load_times, "crc_pass": crc_pass, "cold": cold})

        ckpt = os.path.join(root, "tieredckpt")
        shard = os.path.join(ckpt, "rank0.bin")
        verify_times = {"crc32c (fast verify)": [], "sha256 (full verify)": []}
        for _ in range(args.repeats):
            with timer(verify_times["crc32c (fast verify)"]):
                verify_checkpoint(ckpt, full=False)
            with timer(verify_times["sha256 (full verify)"]):
                file_digest(shard, sha256=True)
        crc, sha = median(verify_times["crc32c (fast verify)"]), median(verify_times["sha256 (full verify)"])
        print(table([(k, f"{median(v):.3f}", f"{nbytes / median(v) / 1e9:.2f}") for k, v in verify_times.items()],
                    ("verify (warm cache)", "seconds", "GB/s")))
        print(f"  crc32c verify is {sha / crc:.1f}x faster than sha256 (target >= 4x)")
    finally:
        remove(root)


FRESH = ("raw write + fsync (disk limit)", "raw O_DIRECT write + fsync (device limit)", "tieredckpt save_sharded",
         "tieredckpt, sha256 after the commit", "safetensors save_file + fsync", "CheckpointStore.save().wait()")


def one_fresh_save(args) -> None:
    """In a new process: build the state, save it once by ``args.one_save``, print the seconds."""
    import json
    import time

    from tieredckpt import CheckpointStore
    state = model_adamw_state(args.params, dtype=getattr(torch, args.dtype))
    root = tempfile.mkdtemp(prefix="bench-fresh-", dir=args.dir)
    try:
        savers = make_savers(state, root)
        if args.one_save == FRESH[-1]:
            store = CheckpointStore(os.path.join(root, "store"), every=0, keep_local=1)
            start = time.perf_counter()
            store.save(1, state).wait()
            took = time.perf_counter() - start
            store.close()
        else:
            save, _ = savers[args.one_save]
            start = time.perf_counter()
            save()
            took = time.perf_counter() - start
        print(json.dumps({"method": args.one_save, "seconds": took}))
    finally:
        remove(root)


def fresh_saves(args) -> None:
    import json
    import subprocess
    import time
    nbytes = state_bytes(model_adamw_state(args.params, dtype=getattr(torch, args.dtype)))
    print(f"fresh processes: {nbytes / 1e9:.3f} GB of {args.dtype} state, {args.repeats} interleaved repeats, "
          "each save in a new process with no warm-up")
    times = {name: [] for name in FRESH}
    for rep in range(args.repeats):
        for name, _ in ordered(dict.fromkeys(FRESH), rep):
            cmd = [sys.executable, __file__, "--one-save", name, "--params", str(args.params), "--dtype", args.dtype]
            out = subprocess.run(cmd + (["--dir", args.dir] if args.dir else []), capture_output=True, text=True,
                                 check=True).stdout
            times[name].append(json.loads(out.strip().splitlines()[-1])["seconds"])
            subprocess.run(["sync"], check=True)
            time.sleep(0.5)
    report(times, nbytes, "raw write + fsync (disk limit)", "durable save, fresh process", "tieredckpt save_sharded",
           ">= 0.8x")
    store = median(times[FRESH[-1]])
    print(f"  the store's save().wait() is {median(times[FRESH[0]]) / store:.2f}x the raw write (target >= 0.9x) and "
          f"{median(times['safetensors save_file + fsync']) / store:.2f}x safetensors + fsync (target >= 1.0x); "
          f"{median(times[FRESH[1]]) / store:.2f}x the O_DIRECT write (the device's limit)\n")
    if args.json:
        dump(args.json, {"mode": "fresh", "bytes": nbytes, "params": args.params, "dtype": args.dtype, "save": times})


def cycle(n: int) -> int:
    """How many repeats make one whole balanced cycle of ``n`` methods (see ``ordered``)."""
    return n if n % 2 == 0 else 2 * n


def whole_cycles(repeats: int, n: int) -> int:
    """``repeats`` rounded up to whole cycles, so that every method follows every other equally often."""
    return -(-repeats // cycle(n)) * cycle(n)


def ordered(methods: dict, rep: int) -> list:
    """The methods in repeat ``rep``'s order, from a Williams design: over one cycle (n repeats
    for an even n, 2n for an odd one) every method runs once in each position and right after
    every other method equally often, so what one method leaves behind (freed memory, a page
    cache another mapping just walked) falls on each of the others alike.

    A random order per repeat did not: over 15 repeats of 7 methods the verified load's bound
    ran right after safetensors' load_file 7 times. A fixed cyclic order before that made the
    verified load always follow the crc32c pass alone, which slowed it from 0.179 to 0.202 s."""
    items = list(methods.items())
    n = len(items)
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each step between neighbours differs
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = [(i + rep) % n for i in first]
    return [items[i] for i in (row if (rep // n) % 2 == 0 or n % 2 == 0 else row[::-1])]


def make_savers(state, root):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    names = flat_names(state)
    paths = {k: os.path.join(root, k) for k in ("raw", "direct", "tieredckpt", "deferred", "torch.save", "dcp", "safetensors")}

    def torch_save():
        torch.save(state, paths["torch.save"])
        fsync_path(paths["torch.save"])

    def dcp_save():
        dcp.save(state, checkpoint_id=paths["dcp"], no_dist=True)
        fsync_tree(paths["dcp"])

    def st_save():
        save_file(names, paths["safetensors"])
        fsync_path(paths["safetensors"])

    return {
        "raw write + fsync (disk limit)": (lambda: raw_write(state, paths["raw"]), paths["raw"]),
        "raw O_DIRECT write + fsync (device limit)": (lambda: raw_direct_write(state, paths["direct"]), paths["direct"]),
        "tieredckpt save_sharded": (lambda: save_sharded([state], paths["tieredckpt"], 1000), paths["tieredckpt"]),
        "tieredckpt, sha256 after the commit": (lambda: save_sharded([state], paths["deferred"], 1000, sha256=False),
                                                paths["deferred"]),
        "torch.save + fsync": (torch_save, paths["torch.save"]),
        "dcp.save": (dcp_save, paths["dcp"]),
        "safetensors save_file + fsync": (st_save, paths["safetensors"]),
    }


def make_loaders(root, targets):
    from safetensors.torch import load_file

    def copy_into(flat):
        for k, t in targets.items():
            t.copy_(flat[k])

    def ours(verify):
        (loaded,) = load_sharded(os.path.join(root, "tieredckpt"), 1, verify=verify)
        copy_into(flat_names(loaded))

    def tload(mmap):
        loaded = torch.load(os.path.join(root, "torch.save"), weights_only=True, mmap=mmap)
        copy_into(flat_names(loaded))

    def two_reads():
        file_digest(os.path.join(root, "tieredckpt", "rank0.bin"), sha256=False)
        ours("none")

    return {
        "tieredckpt load (crc32c verified)": lambda: ours("crc"),
        BOUND: two_reads,
        "tieredckpt load (sizes only)": lambda: ours("none"),
        "torch.load": lambda: tload(False),
        "torch.load(mmap=True)": lambda: tload(True),
        "safetensors load_file": lambda: copy_into(load_file(os.path.join(root, "safetensors"))),
    }


def evict(path: str) -> None:
    """Drop a file's (or a directory's files') pages from the page cache: the next read is cold."""
    for name in ([os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(path: str) -> None:
    """Read a file (or a directory's files) once, so that the page cache holds it."""
    for name in ([os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]):
        with open(name, "rb") as f:
            while f.read(CHUNK):
                pass


def dump(path: str, figures: dict) -> None:
    import json
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)


def cold_loads(root, loaders, repeats, nbytes) -> dict:
    """Cold loads: the files evicted from the page cache first, as after a reboot.

    One cold read's time follows the virtual disk's speed at that moment (0.55-0.86 s for the
    same load within one run), so the median is taken over as many repeats as the warm loads."""
    cold = {"tieredckpt load (crc32c verified)": "tieredckpt", "safetensors load_file": "safetensors"}
    times = {name: [] for name in cold}
    for rep in range(repeats):
        for name, where in ordered(cold, rep):
            warm_memory(int(2.5 * nbytes))
            evict(os.path.join(root, where))
            with timer(times[name]):
                loaders[name]()
    report(times, nbytes, "safetensors load_file", "load into preallocated (cold cache)",
           "tieredckpt load (crc32c verified)", ">= 1.5x")
    return times


def report(times, nbytes, peer, title, summary, target):
    base = median(times[peer])
    rows = [(k, f"{median(v):.3f}", f"{nbytes / median(v) / 1e9:.2f}", f"{base / median(v):.2f}x")
            for k, v in times.items()]
    print(table(rows, (title, "seconds", "GB/s", f"vs {peer.split(' (')[0]}")))
    ours = next(k for k in times if k.startswith("tieredckpt"))
    print(f"  {summary} is {base / median(times[ours]):.2f}x {peer.split(' (')[0]} (target {target})\n")


def report_save(times, nbytes):
    report(times, nbytes, "raw write + fsync (disk limit)", "durable save", "tieredckpt save", ">= 0.9x")
    late = median(times["tieredckpt, sha256 after the commit"])
    print(f"  the store's save (committed with crc32c, sha256 recorded after) is "
          f"{median(times['raw write + fsync (disk limit)']) / late:.2f}x the raw write (target >= 0.9x) and "
          f"{median(times['safetensors save_file + fsync']) / late:.2f}x safetensors + fsync (target >= 1.0x)\n")


# The verified load's bound, timed as one operation in each repeat: a sum of two medians is not the
# median of a sum when a repeat's times swing (here 0.08 or 0.15 s for the same sizes-only load).
BOUND = "two reads: a crc32c pass, then a sizes-only load"


def report_load(times, crc_pass, nbytes):
    report(times, nbytes, "safetensors load_file", "load into preallocated (warm cache)",
           "tieredckpt load (crc32c verified)", "its two-read bound, below")
    bound = median(times[BOUND])
    verified = median(times["tieredckpt load (crc32c verified)"])
    st = median(times["safetensors load_file"])
    print(f"  a load that verifies every byte before any reaches the model reads them twice: its bound is one "
          f"crc32c pass ({median(crc_pass):.3f} s alone) then one load with sizes checked only, timed together: "
          f"{bound:.3f} s, {st / bound:.2f}x safetensors; the verified load takes {verified:.3f} s, "
          f"{bound / verified:.2f}x of its bound (target >= 0.9x)\n")


if __name__ == "__main__":
    main()
