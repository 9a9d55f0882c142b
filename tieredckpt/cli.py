"""The ``tieredckpt`` command line, built on the same modules as the library.

    tieredckpt ls RUN_DIR [--no-verify]
    tieredckpt verify RUN_DIR [--step N] [--full]
    tieredckpt inspect RUN_DIR [--step N] [--json]
    tieredckpt convert SRC DST [--step N]     flat .bin <-> checkpoint
    tieredckpt plot RUN_DIR [-o PNG]          loss history with checkpoints and pivots

User errors print one line naming the file and the reason (exit 1); no tracebacks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import layout
from .errors import TieredCkptError
from .local import LocalTier
from .shardfile import read_header


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (TieredCkptError, OSError, ValueError) as exc:
        print(f"tieredckpt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredckpt", description="Inspect and manage tieredckpt runs.")
    sub = p.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("ls", help="list a run's checkpoints")
    ls.add_argument("run_dir")
    ls.add_argument("--no-verify", action="store_true", help="skip the crc32c check of every shard")
    ls.set_defaults(func=cmd_ls)

    verify = sub.add_parser("verify", help="check checkpoints' sizes and checksums (exit 1 on any problem)")
    verify.add_argument("run_dir")
    verify.add_argument("--step", type=int, help="only this step (default: every checkpoint)")
    verify.add_argument("--full", action="store_true", help="also check sha256 (slower than crc32c)")
    verify.set_defaults(func=cmd_verify)

    inspect = sub.add_parser("inspect", help="show a checkpoint's manifest and tensor index")
    inspect.add_argument("run_dir")
    inspect.add_argument("--step", type=int, help="default: the newest")
    inspect.add_argument("--json", action="store_true", help="print the raw manifest")
    inspect.set_defaults(func=cmd_inspect)

    convert = sub.add_parser("convert", help="flat step_NNNNNN.bin -> checkpoint in RUN_DIR, or back")
    convert.add_argument("src", help="a step_NNNNNN.bin file, or a run directory")
    convert.add_argument("dst", help="a run directory, or the .bin file to write")
    convert.add_argument("--step", type=int, help="with a run directory as SRC: which step (default newest)")
    convert.set_defaults(func=cmd_convert)

    plot = sub.add_parser("plot", help="write a PNG of the loss history with checkpoints and pivots marked")
    plot.add_argument("run_dir")
    plot.add_argument("-o", "--out", help="output file (default RUN_DIR/loss.png)")
    plot.set_defaults(func=cmd_plot)
    return p


def cmd_ls(args) -> int:
    tier = LocalTier(args.run_dir, create=False)
    steps = tier.steps()
    if not steps:
        print(f"{tier.root}: no committed checkpoints")
        return 0
    pointer = tier.latest_pointer()
    print(f"{'STEP':>10}  {'AGE':>9}  {'SIZE':>10}  {'FILES':>5}  STATUS")
    problems = 0
    for step in steps:
        try:
            manifest = tier.verify(step) if not args.no_verify else tier.manifest(step)
            status = "unchecked" if args.no_verify else "ok (crc32c)"
            age, size, files = _age(manifest.created_unix), _size(manifest.total_size), len(manifest.shards)
        except TieredCkptError as exc:
            problems += 1
            status, age, size, files = f"BAD: {exc}", "?", "?", "?"
        mark = " <- latest" if step == pointer else ""
        print(f"{step:>10}  {age:>9}  {size:>10}  {files:>5}  {status}{mark}")
    stale = [e.name for e in tier.root.iterdir() if layout.scratch_owner_pid(e.name) is not None]
    if stale:
        print(f"({len(stale)} leftover temp entries from an interrupted save; removed at the next save)")
    return 1 if problems else 0


def cmd_verify(args) -> int:
    tier = LocalTier(args.run_dir, create=False)
    steps = [args.step] if args.step is not None else tier.steps()
    if not steps:
        print(f"{tier.root}: no committed checkpoints to verify", file=sys.stderr)
        return 1
    kind = "sha256+crc32c" if args.full else "crc32c"
    failed = 0
    for step in steps:
        try:
            manifest = tier.verify(step, full=args.full)
            print(f"step {step}: ok ({len(manifest.shards)} shards, {_size(manifest.total_size)}, {kind})")
        except TieredCkptError as exc:
            failed += 1
            print(f"step {step}: FAILED: {exc}")
    return 1 if failed else 0


def cmd_inspect(args) -> int:
    tier = LocalTier(args.run_dir, create=False)
    step = args.step if args.step is not None else tier.latest_step()
    path = tier.step_path(step) if step is not None else tier.root
    manifest = tier.manifest(step)
    if args.json:
        print(manifest.to_json())
        return 0
    print(f"checkpoint {path}")
    print(f"  step {manifest.step}, world_size {manifest.world_size}, "
          f"schema_version {manifest.schema_version}, wall_clock_seconds {manifest.wall_clock_seconds:g}")
    print(f"  written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created_unix))}, "
          f"{_size(manifest.total_size)} in {len(manifest.shards)} shards")
    for key, value in manifest.user.items():
        print(f"  {key}: {value}")
    for entry in manifest.shards:
        header = read_header(path / entry.path)
        header.pop("__metadata__", None)
        print(f"  rank {entry.rank}: {entry.path}  {_size(entry.size)}  crc32c {entry.crc32c}  "
              f"params [{entry.param_shard_offset}, +{entry.param_shard_numel})  {len(header)} tensors")
        for name, info in list(header.items())[:20]:
            print(f"      {name:<48} {info['dtype']:<5} {info['shape']}")
        if len(header) > 20:
            print(f"      ... and {len(header) - 20} more")
    return 0


def cmd_convert(args) -> int:
    from .flat import checkpoint_to_flat, flat_to_checkpoint
    src = Path(args.src)
    if src.is_file():
        step = flat_to_checkpoint(src, args.dst)
        print(f"converted {src} -> {LocalTier(args.dst).step_path(step)}")
    elif src.is_dir():
        step = checkpoint_to_flat(src, args.dst, args.step)
        print(f"converted {src} step {step} -> {args.dst}")
    else:
        print(f"tieredckpt: error: {src}: no such file or run directory", file=sys.stderr)
        return 1
    return 0


def cmd_plot(args) -> int:
    from .plot import plot_run
    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _age(created: float) -> str:
    seconds = max(0.0, time.time() - created)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


if __name__ == "__main__":
    sys.exit(main())
