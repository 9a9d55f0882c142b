"""The local tier: listing, the latest pointer, rotation and stale-scratch cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tieredckpt import CheckpointNotFoundError, KeepEvery, KeepLast
from tieredckpt._format import layout
from tieredckpt._tiers.local import LocalTier
from tieredckpt._tiers.retention import AnyOf, plan_eviction


def state(step):
    return [{"step": step}]


def test_steps_latest_and_rotation_keep_last_k(run_dir):
    tier = LocalTier(run_dir)
    for step in (100, 200, 300, 400, 500):
        tier.save(step, state(step))
        tier.rotate(3)
    assert tier.steps() == [300, 400, 500]
    assert tier.latest_pointer() == 500
    assert (run_dir / "latest").read_text().strip() == "step_000500"
    assert tier.load()[0] == {"step": 500}
    assert tier.load(300)[0] == {"step": 300}
    assert not [p for p in run_dir.iterdir() if ".del-" in p.name]


def test_rotation_never_deletes_the_latest_pointer_target_or_protected_steps(run_dir):
    tier = LocalTier(run_dir)
    for step in (1, 2, 3, 4):
        tier.save(step, state(step))
    # Simulate a crash after a newer step's commit but before latest moved on:
    (run_dir / "latest").write_text("step_000001\n")
    assert tier.rotate(1, protected=[2]) == [3]
    assert tier.steps() == [1, 2, 4]


def test_missing_steps_raise_not_found(run_dir):
    tier = LocalTier(run_dir)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        tier.load()
    tier.save(7, state(7))
    with pytest.raises(CheckpointNotFoundError, match=r"step 8 \(have: \[7\]\)"):
        tier.load(8)
    with pytest.raises(CheckpointNotFoundError, match="no such run directory"):
        LocalTier(run_dir / "absent", create=False)


def test_scratch_is_never_listed_and_dead_writers_scratch_is_cleaned(run_dir):
    tier = LocalTier(run_dir)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = run_dir / f"step_000009.tmp-{dead_pid}-abcd1234"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")  # even a scratch dir with a manifest is not a checkpoint
    deleting = run_dir / f"step_000002.del-{dead_pid}-abcd1234"
    deleting.mkdir()
    live = run_dir / f"step_000010.tmp-{os.getppid()}-abcd1234"  # a live writer (our parent process)
    live.mkdir()
    assert tier.steps() == []
    tier.save(1, state(1))
    assert tier.steps() == [1]
    assert not stale.exists() and not deleting.exists()
    assert live.exists()


def test_policies_are_pure_and_composable():
    steps = [10_000, 15_000, 20_000, 25_000, 30_000, 35_000]
    assert KeepLast(2).keep(steps) == {30_000, 35_000}
    assert KeepEvery(10_000).keep(steps) == {10_000, 20_000, 30_000}
    both = AnyOf(KeepLast(2), KeepEvery(10_000))
    assert plan_eviction(steps, both) == [15_000, 25_000]
    assert plan_eviction(steps, KeepLast(1), protected=[15_000]) == [10_000, 20_000, 25_000, 30_000]
    with pytest.raises(ValueError):
        KeepLast(0)


def test_step_names():
    assert layout.step_dir_name(100) == "step_000100"
    assert layout.step_dir_name(12_345_678) == "step_12345678"
    assert layout.parse_step_dir("step_000100") == 100
    assert layout.parse_step_dir("step_000100.tmp-1-ab") is None
    assert layout.scratch_owner_pid("step_000100.tmp-42-abcd") == 42
    with pytest.raises(ValueError):
        layout.step_dir_name(-1)
