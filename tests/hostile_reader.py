"""Every read path over a run directory holding one hostile step, in a process of its own.

    python tests/hostile_reader.py RUN_DIR STEP OUT_DIR [--deny PATH ...]

Runs the library's read paths (load_sharded, verify, verify full, a read-only
store's named and newest restore) and the CLI's (ls, verify, verify --full,
inspect, inspect --json, reshard, convert) through ``tieredckpt.cli.main``,
and prints one JSON document: for each path, what it returned or raised, and
the process's peak RSS. ``--deny`` makes opening (and listing) PATH fail with
EACCES, as a file without read permission does for anyone but root (the suite
may run as root, whom permissions do not stop).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import resource
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def deny(paths: list[str]) -> None:
    """Fail with EACCES as mode 000 does for anyone but root: opening a denied file; opening,
    listing or looking up anything inside (or listing) a denied directory."""
    files = [os.path.abspath(p) for p in paths if not os.path.isdir(p)]
    dirs = [os.path.abspath(p) for p in paths if os.path.isdir(p)]

    def blocked(path, op: str) -> bool:
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return False
        inside = any(p.startswith(d + os.sep) for d in dirs)
        listing = op in ("scandir", "listdir", "open") and p in dirs
        return inside or listing or (op == "open" and p in files)

    def wrap(fn, op):
        def guarded(path=".", *args, **kwargs):
            if blocked(path, op):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return fn(path, *args, **kwargs)
        return guarded
    for name in ("open", "lstat", "stat", "scandir", "listdir"):
        setattr(os, name, wrap(getattr(os, name), name))


def attempt(fn) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
            result = {"ok": True, "value": value}
        except BaseException as exc:  # noqa: BLE001 - this is what we report
            from tieredckpt.errors import TieredCkptError
            result = {"ok": False, "type": type(exc).__name__, "ours": isinstance(exc, TieredCkptError),
                      "message": str(exc)[:2000]}
    result["warnings"] = [str(w.message)[:500] for w in caught]
    return result


def cli(*args) -> dict:
    from tieredckpt.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as exc:
            rc = exc.code
    return {"rc": rc, "stdout": out.getvalue()[-4000:], "stderr": err.getvalue()[-4000:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("step", type=int)
    p.add_argument("out_dir")
    p.add_argument("--deny", nargs="*", default=[])
    args = p.parse_args()
    deny(args.deny)
    from tieredckpt import CheckpointStore, load_sharded
    from tieredckpt._tiers.local import LocalTier
    run, step, out = args.run_dir, args.step, args.out_dir
    step_dir = LocalTier(run, create=False).step_path(step)

    def restore(named):
        with CheckpointStore(run, read_only=True) as store:
            got = store.restore(step if named else None)
            return got["step"] if got is not None else None

    report = {
        "load_sharded": attempt(lambda: len(load_sharded(step_dir, 1))),
        "verify": attempt(lambda: LocalTier(run, create=False).verify(step).step),
        "verify_full": attempt(lambda: LocalTier(run, create=False).verify(step, full=True).step),
        "restore_named": attempt(lambda: restore(True)),
        "restore_newest": attempt(lambda: restore(False)),
        "cli_ls": cli("ls", run),
        "cli_verify": cli("verify", run),
        "cli_verify_full": cli("verify", run, "--full"),
        "cli_inspect": cli("inspect", run, "--step", step),
        "cli_inspect_json": cli("inspect", run, "--step", step, "--json"),
        "cli_reshard": cli("reshard", run, "--step", step, "--world-size", 2, "--to", os.path.join(out, "resharded")),
        "cli_convert": cli("convert", run, os.path.join(out, "flat.bin"), "--step", step),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
