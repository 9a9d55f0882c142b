"""What checkpoints cost the loop: store.stats(), the events file, `ls --stats`, the stall budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from tieredckpt import CheckpointStore
from tieredckpt._format import layout
from tieredckpt._tiers.remote import RemoteTier


def state(step: int) -> dict:
    return {"w": torch.full((50_000,), float(step)), "step": step}


def test_every_save_and_upload_gives_one_record_to_the_callback_the_file_and_stats(tmp_path, remote):
    records = []
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options, uploads="all",
                         on_stats=records.append, stall_budget=1.0) as s:
        for step in (1, 2, 3):
            s.save(step, state(step)).wait()
            assert s.wait(uploads=True, timeout=60)
        summary = s.stats()
    lines = [json.loads(x) for x in (tmp_path / "run" / layout.EVENTS_FILE).read_text().splitlines()]
    assert lines == records
    assert [r["step"] for r in records if r["event"] == "save"] == [1, 2, 3]
    assert [r["step"] for r in records if r["event"] == "upload"] == [1, 2, 3]
    saved = {r["step"]: r for r in records if r["event"] == "save"}
    shard_bytes = {st: s.local.manifest(st).total_size for st in (1, 2, 3) if st in s.local.steps()}
    for st, size in shard_bytes.items():
        assert saved[st]["bytes"] == size
    for r in records:
        if r["event"] == "upload":
            assert 0 < r["bytes_sent"] and 0 <= r["upload_s"] <= r["lag_s"]
    assert summary["saves"] == 3 and summary["uploads"] == 3
    assert summary["blocked"]["total"] == pytest.approx(summary["blocked_s"], abs=1e-5)
    assert 0 < summary["blocked_share"] < 1
    r = RemoteTier(remote.url, remote.options)
    found = r.fs.find(r.path())
    assert any("upload.json" in p for p in found) and not [p for p in found if "events" in p]  # local only


def test_fsync_and_commit_seconds_are_measured_where_they_happen(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def slow_fsync(fd):  # every fsync costs at least 20 ms
        time.sleep(0.02)
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    with CheckpointStore(tmp_path / "run", stall_budget=1.0) as s:
        s.save(1, state(1)).wait()
        record = s.stats()
    # one shard fsync (the phase "fsync"); the commit fsyncs the scratch dir and its parent
    assert record["fsync"]["total"] >= 0.02
    assert record["commit"]["total"] >= 0.04
    assert record["write"]["total"] >= 0.02  # the manifest's own fsync is part of writing it


def test_the_stall_budget_warns_once_when_passed_and_never_under_it(tmp_path, monkeypatch):
    monkeypatch.setattr("tieredckpt._loop.stats.MIN_BLOCKED_S", 0.0)  # a second of blocking is slow to test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointStore(tmp_path / "tight", stall_budget=1e-9) as s:
            for step in range(1, 7):
                s.save(step, state(step)).wait()
    budget = [w for w in caught if "stall budget" in str(w.message)]
    assert len(budget) == 1 and "blocked the training loop" in str(budget[0].message)
    assert budget[0].filename == __file__  # points at the caller's save()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointStore(tmp_path / "roomy", stall_budget=1.0) as s:
            for step in range(1, 7):
                s.save(step, state(step)).wait()
    assert not [w for w in caught if "stall budget" in str(w.message)]
    monkeypatch.setattr("tieredckpt._loop.stats.MIN_BLOCKED_S", 1.0)  # the default: milliseconds never warn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointStore(tmp_path / "toy", stall_budget=1e-9) as s:
            for step in range(1, 7):
                s.save(step, state(step)).wait()
    assert not [w for w in caught if "stall budget" in str(w.message)]
    with pytest.raises(ValueError, match="stall_budget"):
        CheckpointStore(tmp_path / "bad", stall_budget=0)


def test_a_failing_callback_or_a_planted_events_file_never_fails_a_save(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / layout.EVENTS_FILE)  # a writer that opened this blocking would hang forever

    def broken(record):
        raise RuntimeError("tracker down")
    with CheckpointStore(run, on_stats=broken, stall_budget=1.0) as s:
        s.save(1, state(1)).wait()
        assert s.stats()["saves"] == 1
    assert s.local.steps() == [1]
    out = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", str(run), "--stats"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "events file is a FIFO" in out.stderr, out


def test_a_planted_symlink_for_the_events_file_is_never_followed(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    victim.write_text("keep me")
    (run / layout.EVENTS_FILE).symlink_to(victim)
    with CheckpointStore(run, stall_budget=1.0) as s:
        s.save(1, state(1)).wait()
        assert s.stats()["saves"] == 1  # the record is kept in memory all the same
    assert victim.read_text() == "keep me" and s.local.steps() == [1]


def ls_stats(run, remote, *extra):
    """`tieredckpt ls RUN --stats` as a user runs it, credentials from the environment."""
    env = dict(os.environ)
    args = []
    if remote.options.get("endpoint_url"):
        env.update(AWS_ACCESS_KEY_ID=remote.options["key"], AWS_SECRET_ACCESS_KEY=remote.options["secret"])
        args = ["--endpoint-url", remote.options["endpoint_url"]]
    return subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", str(run), "--stats", *extra, *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_ls_stats_prints_the_blocked_share_save_phases_and_upload_lag(tmp_path, remote):
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options, stall_budget=1.0) as s:
        for step in (1, 2):
            s.save(step, state(step)).wait()
            assert s.wait(uploads=True, timeout=60)
    out = ls_stats(tmp_path / "run", remote)
    assert out.returncode == 0, out
    assert "stats (2 saves, 2 uploads" in out.stdout
    for label in ("loop blocked by save()", "fsync:", "commit:", "upload lag (commit -> remote):"):
        assert label in out.stdout
    with open(tmp_path / "run" / layout.EVENTS_FILE, "a") as f:
        f.write('{"event": "save", "step": 3, "blocked_s": "x"}\n{torn')  # damage is skipped, not fatal
    out = ls_stats(tmp_path / "run", remote, "--no-verify")
    assert out.returncode == 0 and "stats (3 saves" in out.stdout, out
