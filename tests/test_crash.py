"""Crash consistency: writers SIGKILLed at random moments never leave a partial checkpoint listed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tieredckpt._tiers.local import LocalTier

HARNESS = Path(__file__).with_name("crash_writer.py")


def run_harness(run_dir: Path, trials: int, seed: int, *extra: str) -> dict:
    # at least trials // 5 kills must land mid-save; the harness goes on (up to 3x the trials) until they have
    out = subprocess.run([sys.executable, str(HARNESS), str(run_dir), "--trials", str(trials), "--seed", str(seed),
                          "--mid-write", str(trials // 5), *extra], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_consistent(result: dict, run_dir: Path, trials: int) -> None:
    assert trials <= result["trials"] <= 3 * trials
    assert result["failures"] == []
    # The kills really landed mid-save (scratch left behind), not only between saves.
    assert result["killed_mid_write"] >= trials // 5
    assert result["newest_step"] >= 0
    tier = LocalTier(run_dir)
    tier.save(result["newest_step"] + 1, [{"x": 1}, {"x": 2}])  # the next run cleans the dead writers' scratch
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name or ".del-" in p.name]


def test_sigkill_of_a_store_between_commit_and_sha256_is_completed_on_the_next_open(tmp_path):
    # the store commits with crc32c and records sha256 just after: kills land before, inside and
    # after that manifest replace; every listed step verifies and loads, and a store opened on the
    # run records every missing sha256 correctly (the harness checks each against the file)
    result = run_harness(tmp_path / "run", 30, 4, "--store")
    assert result["failures"] == []
    assert result["killed_mid_write"] >= 30 // 5 and result["sha256_left_to_fill"] > 0


def test_sigkill_during_direct_writes_never_leaves_a_partial_checkpoint(tmp_path):
    # 36 MiB shards go past the page cache (O_DIRECT from aligned buffers, the tail padded and
    # truncated): a kill mid-file leaves scratch only, and what is listed verifies by sha256
    result = run_harness(tmp_path / "run", 15, 5, "--numel", str(3 << 20))
    _assert_consistent(result, tmp_path / "run", 15)


def test_sigkill_at_random_moments_never_leaves_a_partial_checkpoint(tmp_path):
    result = run_harness(tmp_path / "run", trials=30, seed=1)  # 500 in the slow soak below
    _assert_consistent(result, tmp_path / "run", 30)


@pytest.mark.slow
def test_sigkill_soak(tmp_path):
    result = run_harness(tmp_path / "run", trials=500, seed=2)
    _assert_consistent(result, tmp_path / "run", 500)
