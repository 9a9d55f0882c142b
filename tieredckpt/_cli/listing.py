"""``tieredckpt ls``: every step, local and remote, newest first, with what is wrong with it."""

from __future__ import annotations

import sys
import time

from .._format import layout
from .._tiers.local import LocalTier
from .._tiers.sharded import verify_present
from ..errors import TieredCkptError
from .remoteargs import run_remote
from .units import fmt_age, fmt_ranks, fmt_size


def cmd_ls(args) -> int:
    """Newest first, a row printed as soon as it is known: the remote is listed once (its step
    directories, with a delimiter) and each shown step's upload manifest read as it is printed."""
    tier = LocalTier(args.run_dir, create=False)
    remote, recorded = _remote_or_none(tier, args)
    local_steps = set(tier.steps())
    remote_dirs, problems = _remote_dirs(remote)
    steps = sorted(local_steps | set(remote_dirs), reverse=True)
    if not steps:
        print(f"{tier.root}: no committed checkpoints" + (f" (nor in {remote.display_url})" if remote else ""))
        return problems and 1
    shown = steps[:args.limit] if args.limit > 0 else steps
    pointer = tier.latest_pointer()
    print(f"{'STEP':>10}  {'AGE':>9}  {'SIZE':>10}  {'FILES':>5}  {'WHERE':<12}  STATUS", flush=True)
    for step in shown:
        row, bad = _ls_row(tier, remote, step, step in local_steps, step in remote_dirs, recorded, args)
        problems += bad
        print(row + (" <- latest" if step == pointer else ""), flush=True)
    if len(shown) < len(steps):
        print(f"... and {len(steps) - len(shown)} older step(s) (--limit 0 lists all)")
    if remote is not None:
        problems += _ls_lag(remote, local_steps, recorded)
    if args.stats:
        _ls_stats(tier.root / layout.EVENTS_FILE)
    else:
        problems += _ls_failing(tier.root / layout.EVENTS_FILE)
    stale = [e.name for e in tier.root.iterdir() if layout.scratch_owner_pid(e.name) is not None]
    if stale:
        print(f"({len(stale)} leftover temp entries from an interrupted save; removed at the next save)")
    return 1 if problems else 0


def _remote_or_none(tier: LocalTier, args):
    """The run's remote, or None with --local-only or when it cannot be reached (missing
    credentials, a dead endpoint): the local steps are still listed, and a warning says why
    the remote is not. An explicit problem of the local run is still an error."""
    from .remoteargs import read_status
    if getattr(args, "local_only", False):
        return None, read_status(tier)
    try:
        return run_remote(tier, args)
    except (TieredCkptError, OSError) as exc:
        print(f"warning: the remote is unreachable now, so only the local steps are listed ({exc}); "
              "--local-only skips it", file=sys.stderr)
        return None, read_status(tier)


def _remote_dirs(remote) -> tuple[list[int], int]:
    if remote is None:
        return [], 0
    try:
        return remote.step_dirs(), 0
    except TieredCkptError as exc:
        print(f"remote {remote.display_url}: cannot list it: {exc}", file=sys.stderr)
        return [], 1


def _ls_row(tier, remote, step, local: bool, on_remote: bool, recorded: dict, args) -> tuple[str, int]:
    """One row of `ls` and whether it shows a problem."""
    from ..errors import CheckpointNotFoundError
    bad, committed, manifest, status, writer = 0, False, None, "", None
    if on_remote:
        try:
            upload = remote.upload_manifest(step)
            manifest, writer = upload.shard_manifest, upload.writer
            committed = True
        except CheckpointNotFoundError:
            status = "half-uploaded (no upload.json: invisible to readers)"
        except TieredCkptError as exc:
            bad, status = 1, f"BAD on the remote: {exc}"
    try:
        if local:
            status = "unchecked" if args.no_verify else "ok (crc32c)"
            manifest, here = (tier.manifest(step), None) if args.no_verify else verify_present(tier.step_path(step))
            if here is not None and len(here) < manifest.world_size:
                status += f"; ranks {fmt_ranks(here)} of {manifest.world_size} on this node"
        elif committed:
            status = "remote only"
    except TieredCkptError as exc:
        bad, status, manifest = 1, f"BAD: {exc}", None
    if remote is not None and local and not committed:
        entry = recorded.get("steps", {}).get(str(step))
        entry = entry if isinstance(entry, dict) else {"state": "pending"}
        state = entry.get("state", "pending")
        status += f"; upload {state}" + (f": {entry['error']}" if entry.get("error") else "")
        bad += state == "failed"
    if committed and upload.schema_version >= 2:
        status += f"; sent {fmt_size(upload.sent_size)} of {fmt_size(upload.stored_size)} referenced"
    if writer:
        status += f"; committed by {writer.get('host')} pid {writer.get('pid')} ({writer.get('token', '')[:8]})"
    where = "+".join(name for name, has in (("local", local), ("remote", committed)) if has) or "remote"
    age, size, files = ((fmt_age(manifest.created_unix), fmt_size(manifest.total_size), len(manifest.shards))
                        if manifest is not None else ("?", "?", "?"))
    return f"{step:>10}  {age:>9}  {size:>10}  {files:>5}  {where:<12}  {status}", bad


def _ls_stats(path) -> None:
    """The summary of the events file: what saves blocked and took, what uploads lagged."""
    from .._loop.stats import read_events, summarize
    saves, uploads, failures = read_events(path)
    if not saves and not uploads and not failures:
        print(f"stats: {path} holds no records yet (written by a store that saves)")
        return
    s = summarize(saves, uploads, failures)
    share = saves[-1].get("blocked_share") if saves else None

    def secs(key):
        f = s.get(key)
        return "-" if not f else f"median {f['median']:.3f} s, max {f['max']:.3f} s"
    print(f"stats ({len(saves)} saves, {len(uploads)} uploads, from {path.name}):")
    if isinstance(share, (int, float)):
        print(f"  loop blocked by save(): {share:.2%} of wall-clock time in the latest process")
    for key, label in (("blocked", "blocked per save"), ("staging", "staging copy"),
                       ("deferred_copy", "background copy (overlap)"), ("write", "write"),
                       ("fsync", "fsync"), ("commit", "commit"), ("upload", "upload"),
                       ("lag", "upload lag (commit -> remote)")):
        if key != "deferred_copy" or (s.get(key) and s[key]["max"] > 0):
            print(f"  {label + ':':<31} {secs(key)}")
    if s.get("save_bytes") and s.get("bytes_sent") and s["save_bytes"]["median"]:
        print(f"  sent per save: median {s['bytes_sent']['median'] / s['save_bytes']['median']:.3f}x its size")
    if failures:
        print(f"  failed saves: {len(failures)}; the last: {_failure(failures[-1])}")


def _ls_failing(path) -> int:
    """A line when the newest saves failed (none committed since): 1 then, else 0."""
    from .._loop.stats import read_events
    try:
        saves, _, failures = read_events(path, limit=1 << 20)
    except TieredCkptError:
        return 0
    last_ok = max((r.get("unix") or 0 for r in saves), default=0)
    failing = [r for r in failures if (r.get("unix") or 0) > last_ok]
    if failing:
        print(f"SAVES FAILING: {len(failing)} save(s) failed since the last one that committed; "
              f"the last: {_failure(failing[-1])}")
    return int(bool(failing))


def _failure(record: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("unix") or 0))
    return f"step {record.get('step')} at {when}: {record.get('error')}"


def _remote_damage(remote, step: int | None) -> str | None:
    """What the remote's newest step lacks (remote.damage: sizes, a sample of crc32c), or None."""
    if step is None:
        return None
    try:
        bad = remote.damage(step)
    except TieredCkptError as exc:
        return str(exc)
    return "; ".join(sorted(bad.values())[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "") if bad else None


def _ls_lag(remote, local_steps: set[int], recorded: dict) -> int:
    """The summary line: how far the remote lags, and the uploader's last error."""
    try:
        newest_remote = remote.newest_step()
    except TieredCkptError as exc:
        print(f"remote {remote.display_url}: cannot read its newest step: {exc}")
        return 1
    behind = [s for s in local_steps if s > (newest_remote if newest_remote is not None else -1)]
    damage = _remote_damage(remote, newest_remote)
    if damage:
        print(f"remote {remote.display_url}: its newest step {newest_remote} is DAMAGED and does not restore: "
              f"{damage}; a running store sends it again from its local copy")
        return 1
    lag = (f"{len(behind)} checkpoint(s) not uploaded yet; the remote's newest is step {newest_remote}, "
           f"{max(local_steps) - (newest_remote or 0)} steps behind") if behind else "the remote is up to date"
    print(f"remote {remote.display_url}: {lag}")
    error = recorded.get("last_error")
    if isinstance(error, dict) and error.get("message") and behind:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(error.get("unix", 0)))
        kind = "retrying" if error.get("transient") else "FAILING (retried slowly; fix it)"
        print(f"last upload error at {when} ({kind}): {error['message']}")
    return 0
