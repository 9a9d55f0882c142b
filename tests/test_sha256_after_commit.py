"""A save commits with crc32c; each shard's sha256 is recorded right after, off the save's path.

The manifest is replaced atomically once the sha256 is known; until then it is a valid
manifest whose shards are verified by crc32c. Corrupt bytes are never blessed with a sha256.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from tieredckpt import CheckpointStore, ChecksumMismatchError, load_sharded, save_sharded
from tieredckpt._format.uploadmanifest import UploadManifest
from tieredckpt._tiers.sharded import fill_sha256, read_manifest, verify_checkpoint


def state(step: int) -> dict:
    return {"w": torch.arange(50_000, dtype=torch.float32) * step, "step": step}


def sha256_of(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_commit_without_sha256_loads_verifies_and_is_filled_atomically(tmp_path):
    step_dir = tmp_path / "step_000001"
    save_sharded([state(1), state(2)], step_dir, 1, sha256=False)
    assert [e.sha256 for e in read_manifest(step_dir).shards] == ["", ""]  # committed, sha256 to come
    assert load_sharded(step_dir, 2, verify="sha256")[1]["step"] == 2  # crc32c stands meanwhile
    verify_checkpoint(step_dir, full=True)
    told = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "verify", str(tmp_path), "--full"],
                          capture_output=True, text=True)
    assert told.returncode == 0 and "sha256 not recorded yet" in told.stdout  # never claims a sha256 check
    filled = fill_sha256(step_dir)
    assert [e.sha256 for e in filled.shards] == [sha256_of(step_dir / e.path) for e in filled.shards]
    assert read_manifest(step_dir) == filled and fill_sha256(step_dir) is None
    assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json", "rank0.bin", "rank1.bin"]


def test_corrupt_bytes_are_never_blessed_with_a_sha256(tmp_path):
    step_dir = tmp_path / "step_000001"
    save_sharded([state(1)], step_dir, 1, sha256=False)
    before = (step_dir / "manifest.json").read_bytes()
    shard = step_dir / "rank0.bin"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="rank0.bin: crc32c .* its sha256 is not recorded"):
        fill_sha256(step_dir)
    assert (step_dir / "manifest.json").read_bytes() == before


def test_the_store_records_sha256_after_each_commit_and_before_uploading(tmp_path):
    remote = tmp_path / "remote"
    with CheckpointStore(tmp_path / "run", f"file://{remote}", every=1) as store:
        for step in (1, 2):  # each uploaded before the next commit (a newer one supersedes a pending upload)
            store.save(step, state(step)).wait()
            store.wait(uploads=True)
        for step in (1, 2):
            entry = store.local.manifest(step).shards[0]
            assert entry.sha256 == sha256_of(store.local.step_path(step) / entry.path)
    for step in (1, 2):  # the remote's commit marker embeds the completed manifest
        upload = UploadManifest.from_json((remote / f"step_{step:06d}" / "upload.json").read_text(), "upload.json")
        assert upload.shard_manifest.shards[0].sha256 == sha256_of(tmp_path / "run" / f"step_{step:06d}" / "rank0.bin")


def test_a_crash_between_commit_and_sha256_is_completed_by_the_next_open(tmp_path):
    run = tmp_path / "run"
    with CheckpointStore(run) as store:
        store.save(1, state(1)).wait()
    save_sharded([state(2)], run / "step_000002", 2, sha256=False)  # as if killed right after this commit
    assert json.loads((run / "step_000002" / "manifest.json").read_text())["shards"][0]["sha256"] == ""
    with CheckpointStore(run) as store:
        store.wait()
        assert store.restore()["step"] == 2
    assert read_manifest(run / "step_000002").shards[0].sha256 == sha256_of(run / "step_000002" / "rank0.bin")


def test_the_sha256_after_the_commit_runs_below_the_training_loops_priority(tmp_path):
    """It shares the cores with the next save's copy on the loop: 10 nice levels below it."""
    import os
    import threading

    import torch

    from tieredckpt import CheckpointStore
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, {"w": torch.ones(10)}).wait()
        store._sha256.flush()  # its thread exists
        threads = [t for t in threading.enumerate() if t.name.startswith("tieredckpt-sha256")]
        loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the loop's own is untouched
        assert threads and all(os.getpriority(os.PRIO_PROCESS, t.native_id) == min(19, loop + 10) for t in threads)
