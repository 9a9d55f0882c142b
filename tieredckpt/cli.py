"""The ``tieredckpt`` command line, built on the same modules as the library.

    tieredckpt ls RUN_DIR [--no-verify] [--remote URL]
    tieredckpt restore REMOTE_URL --to LOCAL_DIR [--step N]
    tieredckpt push RUN_DIR [--remote URL] [--compression C]
    tieredckpt verify RUN_DIR [--step N] [--full]
    tieredckpt inspect RUN_DIR [--step N] [--json]
    tieredckpt convert SRC DST [--step N]     flat .bin <-> checkpoint
    tieredckpt reshard RUN_DIR --world-size M [--step N] [--to NEW_RUN]
    tieredckpt plot RUN_DIR [-o PNG]          loss history with checkpoints and pivots
    tieredckpt gc REMOTE_URL [--grace S] [--force]   delete abandoned half-uploads and objects no step names

Exit codes: 0 fine; 1 a problem found (a damaged checkpoint, failing saves, a remote
step that does not restore); 2 bad usage; 3 the command could not run (no such run
or step, the remote refused or cannot be reached, the disk is full); 130 interrupted; 141 the
output pipe closed. Errors print one line, ``tieredckpt: error (ErrorClass): ...``,
naming the file or object and the reason (docs/troubleshooting.md has an entry per
class); ``--debug`` (or TIEREDCKPT_DEBUG=1) adds the traceback.
Remote credentials come from the environment (AWS_ACCESS_KEY_ID, ...) or
``--remote-option key=value``; they are never printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from . import __version__
from ._cli.listing import cmd_ls
from ._cli.remoteargs import open_remote, recorded_remote, remote_options, run_remote
from ._cli.units import fmt_ranks, fmt_size
from ._format.shardheader import read_header
from ._tiers.local import LocalTier
from ._tiers.runlock import RunLock
from ._tiers.sharded import open_shard, verify_present
from .errors import CorruptCheckpointError, TieredCkptError

OK, PROBLEM, USAGE, FAILED, INTERRUPTED, PIPE_CLOSED = 0, 1, 2, 3, 130, 141


def fail(message: str, kind: str = "CheckpointNotFoundError") -> int:
    """One error line, as the handler in ``main`` prints it; the exit code of a command that could not run."""
    print(f"tieredckpt: error ({kind}): {message}", file=sys.stderr)
    return FAILED


def main(argv: list[str] | None = None) -> int:
    # torch, imported by the commands that parse tensors, warns at import when NumPy is absent
    # (it is optional: nothing here uses it); a user of the CLI has nothing to act on.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("TIEREDCKPT_DEBUG") == "1"
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="tieredckpt: %(message)s")
    try:
        return args.func(args) or OK
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:  # `tieredckpt ls RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return PIPE_CLOSED
    except Exception as exc:  # noqa: BLE001 - the one place a user could meet a traceback
        if debug:
            traceback.print_exc()
        code = fail(str(exc), type(exc).__name__)
        return PROBLEM if isinstance(exc, CorruptCheckpointError) else code  # what it found is the damage


def _global_flags_after_the_command(sub) -> None:
    """``tieredckpt ls RUN --debug`` as well as ``tieredckpt --debug ls RUN``: every command's
    parser also takes the global flags (SUPPRESS: given before the command, they stay)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    add_parser = sub.add_parser

    def with_common(name, **kwargs):
        return add_parser(name, parents=[common, *kwargs.pop("parents", [])], **kwargs)
    sub.add_parser = with_common


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tieredckpt", description="Inspect and manage tieredckpt runs.",
                                epilog="exit codes: 0 fine, 1 a problem found (a damaged checkpoint), 2 bad usage, "
                                       "3 could not run, 130 interrupted, 141 output pipe closed")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument("--version", action="version", version=f"tieredckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _global_flags_after_the_command(sub)

    ls = sub.add_parser("ls", help="list a run's checkpoints, where each lives, and how far uploads lag")
    ls.add_argument("run_dir")
    ls.add_argument("--no-verify", action="store_true", help="skip the crc32c check of every shard")
    ls.add_argument("--limit", type=int, default=50, help="show the newest N steps (default 50; 0: all)")
    ls.add_argument("--stats", action="store_true",
                    help="also what checkpoints cost the loop: blocked share, save phases, upload lag")
    _remote_args(ls, "the run's remote (default: the one its store last used)")
    ls.add_argument("--local-only", action="store_true", help="list the local steps only; the remote is not asked")
    ls.set_defaults(func=cmd_ls)

    restore = sub.add_parser("restore", help="bring a run back from its remote onto this machine")
    restore.add_argument("remote_url")
    restore.add_argument("--to", required=True, dest="to", help="local run directory")
    restore.add_argument("--step", type=int, help="default: the newest uploaded step")
    _remote_args(restore, None)
    restore.set_defaults(func=cmd_restore)

    push = sub.add_parser("push", help="upload every local checkpoint the remote does not hold yet")
    push.add_argument("run_dir")
    push.add_argument("--compression", default="zstd-dtype", choices=["zstd-dtype", "zstd-planes", "zstd", "raw"])
    _remote_args(push, "the remote (default: the one the run's store last used)")
    _unfenced_arg(push)
    push.set_defaults(func=cmd_push)

    push_dir = sub.add_parser("push-dir", help="commit a folder of files (a framework's checkpoint) as a step, and upload it")
    push_dir.add_argument("run_dir")
    push_dir.add_argument("step", type=int)
    push_dir.add_argument("dir", help="the folder: ordinary files in any tree (no symlinks, FIFOs, devices)")
    push_dir.add_argument("--link", action="store_true",
                          help="hard-link the files instead of copying them: only for a folder whose files are "
                               "never rewritten in place afterwards")
    push_dir.add_argument("--copy", action="store_true", help=argparse.SUPPRESS)  # the default now; still accepted
    _remote_args(push_dir, "the remote (default: the one the run's store last used; none: local only)")
    _unfenced_arg(push_dir)
    push_dir.set_defaults(func=cmd_push_dir)

    restore_dir = sub.add_parser("restore-dir", help="bring a folder step's files back into a new directory")
    restore_dir.add_argument("source", help="a run directory, or the remote URL of one")
    restore_dir.add_argument("--to", required=True, dest="to", help="a new or empty directory")
    restore_dir.add_argument("--step", type=int, help="default: the newest")
    _remote_args(restore_dir, "with a run directory: its remote (default: the one its store last used)")
    restore_dir.set_defaults(func=cmd_restore_dir)

    verify = sub.add_parser("verify", help="check checkpoints' sizes and checksums (exit 1 on any problem)")
    verify.add_argument("run_dir")
    verify.add_argument("--step", type=int, help="only this step (default: every checkpoint)")
    verify.add_argument("--full", action="store_true", help="also check sha256 (slower than crc32c)")
    verify.add_argument("--node-local", action="store_true",
                        help="a node-local directory: other nodes' shards are expected to be absent")
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

    reshard = sub.add_parser("reshard", help="re-split a ZeRO-style checkpoint for another world size")
    reshard.add_argument("run_dir")
    reshard.add_argument("--step", type=int, help="default: the newest")
    reshard.add_argument("--world-size", type=int, required=True)
    reshard.add_argument("--to", help="the new run directory (default: RUN_DIR-wsM)")
    reshard.set_defaults(func=cmd_reshard)

    plot = sub.add_parser("plot", help="write a PNG of the loss history with checkpoints and pivots marked")
    plot.add_argument("run_dir")
    plot.add_argument("-o", "--out", help="output file (default RUN_DIR/loss.png)")
    plot.set_defaults(func=cmd_plot)

    gc = sub.add_parser("gc", help="delete half-uploaded steps (no upload.json) nobody is finishing, and objects no committed step names")
    gc.add_argument("remote_url")
    gc.add_argument("--grace", type=float, default=3600.0,
                    help="only what was written longer ago than this many seconds (default 3600)")
    gc.add_argument("--force", action="store_true", help="take the remote over from a live writer first (it stops writing there)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    _remote_args(gc, None)
    _unfenced_arg(gc)
    gc.set_defaults(func=cmd_gc)
    return p


def _remote_args(parser, url_help: str | None) -> None:
    if url_help:
        parser.add_argument("--remote", help=url_help)
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, moto, ...)")
    parser.add_argument("--remote-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an fsspec/s3fs option; repeatable; VALUE is JSON where it parses (true, 8, {...})")


def _unfenced_arg(parser) -> None:
    parser.add_argument("--allow-unfenced", action="store_true",
                        help="write even where the server ignores conditional writes (no second writer is "
                             "fenced off there: only when one writer ever runs)")


def cmd_restore(args) -> int:
    remote = open_remote(args.remote_url, args)
    step = args.step if args.step is not None else remote.newest_step()
    if step is None:
        return fail(f"{remote.display_url}: no uploaded checkpoints")
    if not remote.is_committed(step):
        return fail(f"{remote.display_url}: no uploaded checkpoint for step {step} (the newest is {remote.newest_step()})")
    tier = LocalTier(args.to)
    lock = RunLock(tier.root)
    lock.acquire()  # we write into this run directory: nobody else may
    try:
        if step in tier.steps():
            print(f"{tier.step_path(step)} is already here; verifying it")
            tier.verify(step)
        else:
            upload = remote.upload_manifest(step)
            bar = _TransferBar(upload.shard_manifest.total_size, f"download step {step}")
            tier.download(step, remote, progress=bar.add)
            bar.close()
        fetched = remote.get_side_files(tier.root, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    finally:
        lock.release()
    print(f"restored step {step} from {remote.display_url} into {tier.step_path(step)}"
          + (f"; side files: {', '.join(fetched)}" if fetched else ""))
    return 0


def cmd_push(args) -> int:
    from ._tiers.lease import WriterLease
    from ._tiers.sharded import fill_sha256
    from ._tiers.uploader import Uploader
    tier = LocalTier(args.run_dir, create=False)
    lock = RunLock(tier.root)
    lock.acquire()  # a training run writing here holds it: its own uploader does this job
    try:
        remote, _ = run_remote(tier, args, create=True)
        if remote is None:
            raise ValueError(f"{tier.root}: no remote recorded for this run; pass --remote URL")
        pending = [s for s in tier.steps() if not remote.is_committed(s)]
        if not pending:
            print(f"{remote.display_url}: already holds every local checkpoint")
            return 0
        lease = WriterLease(remote.t, floor=remote.newest_generation, allow_unfenced=args.allow_unfenced)
        lease.acquire()  # only the remote's one writer uploads
        total = sum(tier.manifest(s).total_size for s in pending)
        bar = _TransferBar(total, f"upload {len(pending)} checkpoint(s)")
        uploader = Uploader(tier, remote, codec=args.compression, mode="all", max_pending=None, progress=bar.add,
                            lease=lease, before_commit=lambda step: fill_sha256(tier.step_path(step))).start()
        try:
            for step in pending:
                uploader.enqueue(step)
            uploader.drain(None)
            bar.close()
        finally:
            uploader.close()
    finally:
        lock.release()
    print(f"uploaded steps {pending} to {remote.display_url}")
    return 0


def cmd_push_dir(args) -> int:
    """Commit DIR as STEP of RUN_DIR through a store (its lock and the remote's lease), then
    wait for the upload."""
    from ._loop.store import CheckpointStore
    url = recorded_remote(args.run_dir, args)
    with CheckpointStore(args.run_dir, url, remote_options=remote_options(args, url), every=0,
                         allow_unfenced=args.allow_unfenced) as store:
        manifest = store.save_files(args.step, args.dir, link=args.link and not args.copy).wait()
        print(f"committed step {args.step} ({len(manifest.shards)} files, {fmt_size(manifest.total_size)}) "
              f"in {store.local.step_path(args.step)}")
        if store.remote is not None:
            if not store.wait(uploads=True):
                raise RuntimeError("the upload did not finish; the next start resumes it")
            print(f"uploaded step {args.step} to {store.remote.display_url}")
    return 0


def cmd_restore_dir(args) -> int:
    """A folder step into a new directory, from a run directory (and its remote) or a remote URL."""
    import tempfile

    from ._loop.store import CheckpointStore
    if "://" in args.source:
        local, url = Path(tempfile.gettempdir()) / f"tieredckpt-reader-{os.getpid()}", args.source
    else:
        local, url = Path(args.source), recorded_remote(args.source, args)
    with CheckpointStore(local, url, remote_options=remote_options(args, url), read_only=True) as store:
        step = store.restore_files(args.step, to=args.to)
    if step is None:
        return fail(f"{args.source}: holds no checkpoint")
    print(f"restored step {step} from {args.source} into {args.to}")
    return 0


def cmd_gc(args) -> int:
    """Delete remote step directories without an upload manifest, once nobody can be finishing them."""
    from ._tiers.lease import WriterLease
    from .errors import WriterConflictError
    remote = open_remote(args.remote_url, args)
    lease = WriterLease(remote.t, floor=remote.newest_generation, allow_unfenced=args.allow_unfenced)
    if not args.dry_run:  # gc deletes as the remote's one writer, fenced like any: a live one refuses it
        try:
            lease.acquire(takeover=args.force)
        except WriterConflictError as exc:
            raise ValueError(f"{exc} -- a live writer cleans up after itself; --force takes the remote over "
                             "from it (it stops writing there)") from None
    try:
        return _gc(remote, lease, args)
    finally:
        lease.release()


def _gc(remote, lease, args) -> int:
    now = time.time()
    doomed = []
    for step in remote.uncommitted():
        newest = remote.newest_object_time(step)
        if newest is not None and now - newest < args.grace:
            print(f"step {step}: half-uploaded, but written {now - newest:.0f} s ago (< --grace); kept")
            continue
        doomed.append(step)
    for step in doomed:
        print(f"step {step}: half-uploaded (no upload.json); " + ("would delete" if args.dry_run else "deleting"))
        if not args.dry_run:
            lease.fence()
            remote.delete(step, generation=lease.generation)
    orphans, why = remote.orphan_objects(args.grace, now)
    if why:
        print(f"{remote.display_url}: objects kept: {why}")
    if orphans:
        print(f"{len(orphans)} object(s) no committed step names, written over --grace ago: "
              + ("would delete" if args.dry_run else "deleting") + f" (first: {orphans[0]})")
        if not args.dry_run:
            lease.fence()  # only the owner deletes; a step committed meanwhile would have fenced us out
            remote.delete_objects(orphans)
    if not doomed and not orphans:
        print(f"{remote.display_url}: nothing to clean up")
    return 0


class _TransferBar:
    """A thread-safe byte counter driving a Progress line."""

    def __init__(self, total: int, label: str) -> None:
        from ._loop.progress import Progress
        self._bar = Progress(total, label, unit="B")
        self._done = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            self._bar.update(self._done)

    def close(self) -> None:
        self._bar.close()


def cmd_verify(args) -> int:
    tier = LocalTier(args.run_dir, create=False)
    steps = [args.step] if args.step is not None else tier.steps()
    if not steps:
        return fail(f"{tier.root}: no committed checkpoints to verify")
    kind = "sha256+crc32c" if args.full else "crc32c"
    failed = 0
    for step in steps:
        try:
            if args.node_local:
                manifest, here = verify_present(tier.require(step), full=args.full)
                print(f"step {step}: ok (ranks {fmt_ranks(here)} of {manifest.world_size} here, {kind})")
                continue
            manifest = tier.verify(step, full=args.full)
            checked = kind if all(e.sha256 for e in manifest.shards) or not args.full else \
                "crc32c; sha256 not recorded yet, a store opened on the run records it"
            print(f"step {step}: ok ({len(manifest.shards)} {_unit(manifest)}, {fmt_size(manifest.total_size)}, {checked})")
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
    folder = manifest.layout == "files"
    print(f"{'folder step' if folder else 'checkpoint'} {path}")
    print(f"  step {manifest.step}, {'files' if folder else 'world_size'} {manifest.world_size}, "
          f"schema_version {manifest.schema_version}, wall_clock_seconds {manifest.wall_clock_seconds:g}")
    print(f"  written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created_unix))}, "
          f"{fmt_size(manifest.total_size)} in {len(manifest.shards)} {_unit(manifest)}")
    for key, value in manifest.user.items():
        print(f"  {key}: {value}")
    if folder:
        return _inspect_folder(path, manifest)
    problems = 0
    for entry in manifest.shards:
        try:
            open_shard(path, entry).close()  # a regular file of the recorded size
            header = read_header(path / entry.path)
        except TieredCkptError as exc:
            problems += 1
            print(f"  rank {entry.rank}: {entry.path}  BAD: {exc}")
            continue
        header.pop("__metadata__", None)
        print(f"  rank {entry.rank}: {entry.path}  {fmt_size(entry.size)}  crc32c {entry.crc32c}  "
              f"params [{entry.param_shard_offset}, +{entry.param_shard_numel})  {len(header)} tensors")
        for name, info in list(header.items())[:20]:
            print(f"      {name:<48} {info['dtype']:<5} {info['shape']}")
        if len(header) > 20:
            print(f"      ... and {len(header) - 20} more")
    return 1 if problems else 0


def _unit(manifest) -> str:
    return "files" if manifest.layout == "files" else "shards"


def _inspect_folder(path: Path, manifest) -> int:
    """A folder step's files: bytes to us, so only their sizes and checksums, never their content."""
    problems = 0
    for entry in manifest.shards:
        try:
            open_shard(path, entry).close()  # a regular file of the recorded size
            state = f"{fmt_size(entry.size):>10}  crc32c {entry.crc32c}"
        except TieredCkptError as exc:
            problems += 1
            state = f"BAD: {exc}"
        print(f"  {entry.path.split('/', 1)[1]:<40} {state}")
    return 1 if problems else 0


def cmd_convert(args) -> int:
    from ._tiers.convert import checkpoint_to_flat, flat_to_checkpoint
    src = Path(args.src)
    if src.is_file():
        step = flat_to_checkpoint(src, args.dst)
        print(f"converted {src} -> {LocalTier(args.dst).step_path(step)}")
    elif src.is_dir():
        step = checkpoint_to_flat(src, args.dst, args.step)
        print(f"converted {src} step {step} -> {args.dst}")
    else:
        return fail(f"{src}: no such file or run directory")
    return 0


def cmd_reshard(args) -> int:
    from ._tiers.reshard import reshard
    from ._tiers.sharded import load_sharded, save_sharded
    tier = LocalTier(args.run_dir, create=False)
    path = tier.require(args.step)
    manifest = tier.manifest(args.step)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    states = load_sharded(path, manifest.world_size, verify="sha256")
    spans = [(s.param_shard_offset, s.param_shard_numel) for s in manifest.shards]
    out, new_spans = reshard(states, spans, args.world_size)
    dest = LocalTier(args.to or f"{str(tier.root).rstrip('/')}-ws{args.world_size}")
    save_sharded(out, dest.step_path(manifest.step), manifest.step, wall_clock_seconds=manifest.wall_clock_seconds,
                 param_shards=new_spans, user={**manifest.user, "resharded_from": {
                     "run": str(tier.root.resolve()), "world_size": manifest.world_size}})
    dest.update_latest()
    print(f"resharded step {manifest.step}: {manifest.world_size} -> {args.world_size} ranks, "
          f"{sum(n for _, n in new_spans):,} flat elements, written to {dest.step_path(manifest.step)}")
    return 0


def cmd_plot(args) -> int:
    from ._loop.plot import plot_run
    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
