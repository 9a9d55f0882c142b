"""Crash harness: fork children that save checkpoints in a loop, SIGKILL them at random moments.

    python tests/crash_writer.py RUN_DIR --trials N --seed S [--store]

After every kill the parent (which never writes) checks the run directory the
way a restarting user would: every listed step must verify (sha256) and load
with exactly the content its step number implies, and nothing partial may be
listed. Prints one JSON line of results. The child is a real forked process
killed with a real SIGKILL, mid-write more often than not.

With ``--store`` the child saves through CheckpointStore (one rank), which commits
with crc32c and records sha256 by replacing the manifest just after: kills land
before, inside and after that replace too. A step whose sha256 is not recorded yet
must still verify (crc32c) and load; once the parent has opened the run as a store
and waited, every step's sha256 must be recorded and right.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tieredckpt._format import layout  # noqa: E402
from tieredckpt._format.compare import first_difference  # noqa: E402
from tieredckpt._tiers.local import LocalTier  # noqa: E402

NUMEL = 1 << 20  # 4 MiB per tensor, 3 tensors per rank, 2 ranks: ~24 MB a checkpoint


def expected_states(step: int) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    return [{"w": torch.randn(NUMEL, generator=g), "m": torch.randn(NUMEL, generator=g),
             "v": torch.rand(NUMEL, generator=g), "step": step, "rank": r} for r in range(2)]


def child(run_dir: str, first_step: int, store: bool = False) -> None:
    if store:
        from tieredckpt import CheckpointStore
        with CheckpointStore(run_dir, keep_local=3, every=1) as s:
            step = first_step
            while True:
                s.save(step, expected_states(step)[0]).wait()
                step += 1
    tier = LocalTier(run_dir)
    step = first_step
    while True:
        tier.save(step, expected_states(step))
        tier.rotate(3)
        step += 1


def check(run_dir: str, store: bool = False) -> tuple[list[int], str | None]:
    tier = LocalTier(run_dir)
    steps = tier.steps()
    ranks = 1 if store else 2
    for step in steps:
        try:
            tier.verify(step, full=True)
            diff = first_difference(expected_states(step)[:ranks], tier.load(step, world_size=ranks, verify="sha256"))
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            return steps, f"step {step}: {type(exc).__name__}: {exc}"
        if diff:
            return steps, f"step {step}: content differs at {diff}"
    pointer = tier.latest_pointer()
    if pointer is not None and pointer not in steps:
        return steps, f"latest names step {pointer}, which is not committed"
    return steps, None


def main() -> None:
    global NUMEL
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", action="store_true", help="save through CheckpointStore (see above)")
    parser.add_argument("--numel", type=int, default=1 << 20,
                        help="elements per tensor (3 << 20: 36 MiB shards, written with O_DIRECT, see directwrite.py)")
    parser.add_argument("--mid-write", type=int, default=0,
                        help="after --trials, go on (up to 3x as many) until this many kills landed mid-save: "
                             "where they land depends on the machine's speed, the count must not")
    args = parser.parse_args()
    NUMEL = args.numel  # the forked children and the checks see the same
    torch.set_num_threads(1)  # no intra-op thread pool in the parent: a forked child could not use it
    if args.store:
        import tieredckpt._loop.store  # noqa: F401 - imported before forking: the children save at once
    rng = random.Random(args.seed)
    failures, scratch_seen, newest, unfilled = [], 0, -1, 0
    trial = 0
    while trial < args.trials or (scratch_seen < args.mid_write and trial < 3 * args.trials):
        trial += 1
        pid = os.fork()
        if pid == 0:
            try:
                child(args.run_dir, newest + 1, args.store)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        scratch_seen += any(layout.scratch_owner_pid(n) == pid for n in os.listdir(args.run_dir))
        steps, problem = check(args.run_dir, args.store)
        if problem:
            failures.append(f"trial {trial}: {problem}")
        if args.store and not problem:
            pending = sum(not e.sha256 for st in steps for e in LocalTier(args.run_dir).manifest(st).shards)
            problem = completed_by_a_store(args.run_dir)
            unfilled += pending
            if problem:
                failures.append(f"trial {trial}: {problem}")
        if steps:
            if steps[-1] < newest:
                failures.append(f"trial {trial}: newest step went back from {newest} to {steps[-1]}")
            newest = steps[-1]
    print(json.dumps({"trials": trial, "failures": failures, "killed_mid_write": scratch_seen,
                      "newest_step": newest, "sha256_left_to_fill": unfilled}))


def completed_by_a_store(run_dir: str) -> str | None:
    """Open the run as a store and wait: every step's sha256 recorded, and right."""
    import hashlib

    from tieredckpt import CheckpointStore
    with CheckpointStore(run_dir, keep_local=3) as store:
        store.wait()
    tier = LocalTier(run_dir)
    for step in tier.steps():
        for entry in tier.manifest(step).shards:
            got = hashlib.sha256((tier.step_path(step) / entry.path).read_bytes()).hexdigest()
            if entry.sha256 != got:
                return f"step {step}: sha256 {entry.sha256!r} recorded, the file's is {got}"
    return None


if __name__ == "__main__":
    main()
