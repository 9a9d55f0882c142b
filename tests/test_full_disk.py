"""A disk sized for ``keep_local`` checkpoints keeps a run checkpointing: room is made before a save.

Real small tmpfs mounts where the machine allows them (conftest.tmpfs), ENOSPC injected
where the fault must land at an exact point, a real SIGKILLed subprocess for a crash
during the eviction, and a real remote (file:// and moto through the fault proxy).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from conftest import ROOT
from forkserver import ForkServer

from tieredckpt import BackgroundSaveError, CheckpointStore, DiskFullError
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.local import LocalTier

NUMEL = 250_000  # 1 MB of fp32 a checkpoint (plus its header and manifest)
MB = 1_000_000


def state(step: int) -> dict:
    return {"w": torch.full((NUMEL,), float(step)), "step": step}


def committed(run) -> list[int]:
    return LocalTier(run).steps()


def check_loadable(store: CheckpointStore, run) -> None:
    tier = LocalTier(run)
    latest = tier.latest_pointer()
    assert latest == max(tier.steps())
    for step in tier.steps():
        assert first_difference(state(step), store.restore(step, mark_resume=False)) is None


def test_a_disk_holding_3_5_checkpoints_with_keep_local_3_commits_every_save(tmpfs):
    run = tmpfs(int(3.6 * MB)) / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointStore(run, keep_local=3) as store:
            for step in range(1, 11):
                store.save(step, state(step)).wait()  # raises if a save failed
                held = committed(run)
                assert held[-1] == step and min(step, 2) <= len(held) <= 3, held
                check_loadable(store, run)
            assert store.stats()["save_failures"] == 0
    assert committed(run) == [8, 9, 10]
    room = [w for w in caught if "fewer than keep_local + 1 = 4 checkpoints" in str(w.message)]
    assert len(room) == 1, [str(w.message) for w in caught]  # said once, not at every save


def test_enospc_mid_write_makes_room_and_retries_the_step_once(tmp_path, monkeypatch):
    import tieredckpt._tiers.sharded as sharded
    real, calls = sharded.write_rank, []

    def full_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)
    run = tmp_path / "run"
    with CheckpointStore(run, keep_local=3) as store:
        for step in (1, 2, 3):
            store.save(step, state(step)).wait()
        monkeypatch.setattr(sharded, "write_rank", full_once)
        store.save(4, state(4)).wait()  # the first write fails; room is made; the retry commits
        assert len(calls) == 2
        assert committed(run) == [2, 3, 4]
        assert not [p for p in run.iterdir() if ".tmp-" in p.name]  # the failed scratch is gone
        check_loadable(store, run)


def test_enospc_with_nothing_evictable_fails_clearly_and_loses_nothing(tmp_path, monkeypatch):
    import tieredckpt._tiers.sharded as sharded

    def always_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    run = tmp_path / "run"
    with CheckpointStore(run, keep_local=1) as store:
        store.save(1, state(1)).wait()
        monkeypatch.setattr(sharded, "write_rank", always_full)
        with pytest.raises(BackgroundSaveError, match="No space left on device: step 2 needs about") as failure:
            store.save(2, state(2)).wait()
        assert isinstance(failure.value.__cause__, DiskFullError)
        assert committed(run) == [1]
        monkeypatch.undo()
        check_loadable(store, run)


def test_a_step_rotated_away_while_its_sha256_is_computed_gives_its_blocks_back_at_once(tmpfs, monkeypatch):
    """The sha256 fill of a committed step runs behind the saves (at a lower priority, so on a
    busy machine well behind). Its mapping of a step rotation deletes keeps the blocks allocated:
    the fill must stop within a chunk and the save wait for it, or the disk sized for keep_local
    steps is full. Here each fill takes ~1 s (64 KB chunks, 60 ms each) and saves ~10 ms."""
    import tieredckpt._format.checksum as checksum
    monkeypatch.setattr(checksum, "CHUNK", 64 << 10)
    real_update = checksum.StreamDigest.update

    def slow_update(self, chunk):
        if self._sha is not None:  # the fill's reads; the commit's crc32c-only writes run at speed
            time.sleep(0.06)
        real_update(self, chunk)
    monkeypatch.setattr(checksum.StreamDigest, "update", slow_update)
    run = tmpfs(int(3.6 * MB)) / "run"
    with CheckpointStore(run, keep_local=3) as store:
        for step in range(1, 9):
            store.save(step, state(step)).wait()  # a DiskFullError here without the fix
            assert committed(run)[-1] == step
        assert store.stats()["save_failures"] == 0
    check_loadable(CheckpointStore(run, read_only=True), run)

def test_with_the_remote_down_only_superseded_steps_make_room_and_saving_resumes_when_it_returns(tmpfs, proxied):
    """uploads="all": nothing is superseded, so with the remote down no local step may go; the
    save fails clearly (on_save_error="warn": the loop goes on), and once the remote has the
    steps, the next save makes room by itself."""
    run = tmpfs(int(3.6 * MB)) / "run"
    proxied.proxy.set("dead")
    store = CheckpointStore(run, proxied.url, remote_options=proxied.options, keep_local=3, uploads="all",
                            max_pending_uploads=None, on_save_error="warn", upload_backoff=(0.1, 0.5, 0.5),
                            request_timeout=5.0)
    try:
        for step in (1, 2, 3):
            store.save(step, state(step)).wait()
        handle = store.save(4, state(4))
        with pytest.raises(BackgroundSaveError, match="step 4 needs about"):
            handle.wait()  # the handle says it; the store, in "warn" mode, only logs it
        assert committed(run) == [1, 2, 3]  # nothing the remote lacks was evicted
        store.save(5, state(5))
        store.wait()  # on_save_error="warn": the failed write is logged, not raised
        assert committed(run) == [1, 2, 3] and store.stats()["save_failures"] == 2
        assert store.upload_status()["save_failures"] == 2
        proxied.proxy.clear()
        assert store.wait(uploads=True, timeout=60)
        store.save(6, state(6)).wait()  # the remote holds 1-3 now: room is made, step 6 commits
        assert 6 in committed(run) and len(committed(run)) <= 3
        check_loadable(store, run)
    finally:
        store.close(drain_uploads=False)


def test_with_newest_uploads_and_the_remote_down_the_pending_step_is_never_evicted(tmpfs, proxied):
    run = tmpfs(int(3.6 * MB)) / "run"
    proxied.proxy.set("dead")
    with CheckpointStore(run, proxied.url, remote_options=proxied.options, keep_local=3,
                         upload_backoff=(0.1, 0.5, 0.5), request_timeout=5.0) as store:
        for step in range(1, 8):
            store.save(step, state(step)).wait()  # every save commits: superseded steps make room
            assert step in committed(run) and len(committed(run)) <= 3
            assert store.uploader.pending() == [step]  # the one owed to the remote stays
        proxied.proxy.clear()
        assert store.wait(uploads=True, timeout=60)
    assert proxied.remote().steps() == [7]


CHILD = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, sys.argv[2])
    import tieredckpt._tiers.local as local
    from tieredckpt import CheckpointStore
    real = local.remove_dir
    def slow_remove(path):  # the eviction made visible: a kill lands inside it
        print("EVICT", path.name, flush=True)
        time.sleep(0.3)
        real(path)
    local.remove_dir = slow_remove
    start = int(sys.argv[3])
    with CheckpointStore(sys.argv[1], keep_local=3) as store:
        for step in range(start, start + 1000):
            store.save(step, {"w": torch.full((250_000,), float(step)), "step": step}).wait()
""")


def test_a_kill_during_the_eviction_before_a_write_leaves_every_committed_step_loadable(tmpfs):
    run = tmpfs(int(3.6 * MB)) / "run"
    kills, start, err = 0, 1, run.parent.parent / "stderr"
    server = ForkServer()  # torch imported once, each child forked from it
    for round_ in range(6):
        pid = server.spawn(CHILD, run, ROOT, start, stderr=err)
        for _ in range(1 + round_ % 3):  # kill at the first, second or third eviction
            line = server.readline()
            assert line.startswith("EVICT"), (line, err.read_text())
        time.sleep(0.05 * (round_ % 4))  # before, inside or after the rename
        server.kill(pid, signal.SIGKILL)
        assert server.reap(pid) == -signal.SIGKILL, err.read_text()
        kills += 1
        held = committed(run)
        assert held and len(held) >= 2, held
        with CheckpointStore(run, keep_local=3) as store:  # a restart cleans the scratch and checks
            check_loadable(store, run)
            start = max(held) + 1
    server.close()
    assert kills == 6
    assert not [p for p in run.iterdir() if ".del-" in p.name or ".tmp-" in p.name]


def test_a_fresh_machine_resume_then_keep_local_saves_leaves_keep_local_steps(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    with CheckpointStore(tmp_path / "first", remote, keep_local=3) as store:
        for step in (1, 2, 3):
            store.save(step, state(step)).wait()
        assert store.wait(uploads=True, timeout=60)
    fresh = tmp_path / "fresh"  # a new machine: nothing local
    with CheckpointStore(fresh, remote, keep_local=3) as store:
        assert first_difference(state(3), store.restore()) is None
        assert committed(fresh) == [3]
        for step in (4, 5, 6):
            store.save(step, state(step)).wait()
            assert store.wait(uploads=True, timeout=60)
        assert committed(fresh) == [4, 5, 6]  # the downloaded step 3 counted as held by the remote


def test_on_save_error_warn_keeps_the_loop_going_through_a_full_disk(tmpfs, tmp_path):
    run = tmpfs(int(1.5 * MB)) / "run"  # one checkpoint fits; keep_local=1 may never evict the newest
    with CheckpointStore(run, keep_local=1, every=1, on_save_error="warn") as store:
        for step in range(1, 21):
            store.step_end(step, lambda: state(step))  # never raises
        store.wait()
        stats = store.stats()
    assert stats["saves"] == 1 and stats["save_failures"] == 19
    assert stats["last_save_failure"]["step"] == 20
    assert committed(run) == [1]
    ls = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", str(run)], capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "SAVES FAILING: 19 save(s) failed" in ls.stdout and "step 20" in ls.stdout, ls.stdout + ls.stderr
    assert ls.returncode == 1
    stats_out = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", "--stats", str(run)],
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "failed saves: 19" in stats_out.stdout, stats_out.stdout


def test_on_save_error_is_checked():
    with pytest.raises(ValueError, match="on_save_error"):
        CheckpointStore("unused", on_save_error="ignore")
