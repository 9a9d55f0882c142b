"""Hostile files in a run directory: every read path gives a clear error naming the file.

For each case the newest of three steps is damaged in one way; then every read
path of the library and of the CLI runs in a process of its own, under a time
limit and an address-space limit (tests/hostile_reader.py), and must: raise a
TieredCkptError naming the file and the reason (the CLI: exit 1, one line, no
traceback), never hang, never grow, and change nothing. A read-only restore of
the newest step falls back to the previous good one with a warning; a writing
store also moves the damaged step aside, repairs ``latest`` and saves that step
number again.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rewrite_manifest

from tieredckpt import CheckpointStore
from tieredckpt._format.checksum import crc32c_update, crc_hex
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.local import LocalTier

READER = Path(__file__).with_name("hostile_reader.py")
STEPS = (100, 200, 300)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(2000, generator=g), "b": torch.arange(10).bfloat16() * step, "step": step}


def set_shard(step_dir: Path, data: bytes) -> None:
    """Replace rank0.bin by ``data`` and make the manifest agree with it (size and checksums)."""
    (step_dir / "rank0.bin").write_bytes(data)
    rewrite_manifest(step_dir, lambda raw: raw["shards"][0].update(
        size=len(data), crc32c=crc_hex(crc32c_update(data)), sha256=hashlib.sha256(data).hexdigest()))


def shard_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def nested(depth: int) -> dict:
    node: dict = {"leaf": 1}
    for _ in range(depth):
        node = {"n": node}
    return node


def replace(path: Path, make) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    make(path)


def pickled(path: Path) -> None:
    path.unlink()
    torch.save({"w": torch.ones(3)}, path)  # a pickle named like a shard


# name -> (damage(step_dir, outside_dir) -> paths to deny, why: regex of the reason,
#          whether a crc32c-only check passes because the file's checksums were made to match)
CASES = {
    "manifest_fifo": (lambda d, o: replace(d / "manifest.json", os.mkfifo), "FIFO", False),
    "manifest_symlink_to_dev_zero": (lambda d, o: replace(d / "manifest.json", lambda p: os.symlink("/dev/zero", p)),
                                     "symlink", False),
    "manifest_directory": (lambda d, o: replace(d / "manifest.json", os.mkdir), "directory", False),
    "manifest_unreadable": (lambda d, o: [d / "manifest.json"], "Permission denied", False),
    "manifest_too_large": (lambda d, o: (d / "manifest.json").write_bytes(b" " * (65 << 20) + b"{}"),
                           "larger than", False),
    "manifest_user_nested_deep": (lambda d, o: rewrite_manifest(d, lambda raw: raw.update(user=nested(100))),
                                  "nests deeper than 32", False),
    "manifest_json_nested_deeper_than_python": (
        lambda d, o: (d / "manifest.json").write_bytes(b"[" * 200_000), "not valid JSON", False),
    "manifest_of_another_step": (lambda d, o: (shutil.rmtree(d), shutil.copytree(d.with_name("step_000100"), d)),
                                 "records step 100, but its directory is step 300", False),
    "manifest_bit_flip": (lambda d, o: _flip_in(d / "manifest.json", b'"sha256": "'), "manifest_sha256", False),
    "shard_fifo": (lambda d, o: replace(d / "rank0.bin", os.mkfifo), "FIFO", False),
    "shard_symlink_out_of_the_step": (lambda d, o: (shutil.move(d / "rank0.bin", o / "rank0.bin"),
                                                    os.symlink(o / "rank0.bin", d / "rank0.bin")), "symlink", False),
    "shard_unreadable": (lambda d, o: [d / "rank0.bin"], "Permission denied", False),
    "shard_shape_overflowing_strides": (
        lambda d, o: set_shard(d, shard_bytes({"x": {"dtype": "F32", "shape": [0, 2**61, 2**61],
                                                     "data_offsets": [0, 0]}})), "too large for any tensor", True),
    "shard_huge_declared_size": (lambda d, o: rewrite_manifest(d, lambda raw: raw["shards"][0].update(size=2**60)),
                                 "manifest records 1152921504606846976", False),
    "shard_is_a_pickle": (lambda d, o: (pickled(d / "rank0.bin"),
                                        set_shard(d, (d / "rank0.bin").read_bytes())), "header length", True),
    "step_dir_unreadable": (lambda d, o: [d], "Permission denied", False),
}


def _flip_in(path: Path, after: bytes) -> None:
    data = bytearray(path.read_bytes())
    i = data.index(after) + len(after) + 3
    data[i] ^= 0x01  # one bit of a shard's sha256
    path.write_bytes(bytes(data))


def snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # torch alone maps ~3.2 GB


@pytest.fixture
def run(tmp_path) -> Path:
    run_dir = tmp_path / "run"
    tier = LocalTier(run_dir)
    for step in STEPS:
        tier.save(step, [state(step)], wall_clock_seconds=step)
    return run_dir


@pytest.mark.parametrize("case", list(CASES))
def test_every_read_path_refuses_a_hostile_step_clearly_and_changes_nothing(tmp_path, run, case):
    damage, why, checksums_match = CASES[case]
    step_dir = run / "step_000300"
    outside = tmp_path / "outside"
    outside.mkdir()
    denied = damage(step_dir, outside)
    denied = [str(p) for p in denied] if isinstance(denied, list) else []
    before = snapshot(run)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, str(READER), str(run), "300", str(out_dir), "--deny", *denied],
                          capture_output=True, text=True, timeout=180, preexec_fn=limit_memory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["peak_rss_mb"] < 1500, report["peak_rss_mb"]
    assert snapshot(run) == before  # readers never write, move or delete anything

    named = ["load_sharded", "verify_full", "restore_named"] + ([] if checksums_match else ["verify"])
    for path in named:
        got = report[path]
        assert not got["ok"] and got["ours"], (path, got)
        assert str(step_dir) in got["message"] or "step 300" in got["message"], (path, got)
        assert _matches(why, got["message"]), (path, why, got)
    newest = report["restore_newest"]
    assert newest["ok"] and newest["value"] == 200, newest
    assert any("step 300 refused" in w and _matches(why, w) for w in newest["warnings"]), newest

    failing = ["cli_verify_full", "cli_inspect", "cli_reshard", "cli_convert"]
    failing += [] if checksums_match else ["cli_ls", "cli_verify"]
    failing += ["cli_inspect_json"] if not case.startswith("shard") else []  # it prints only the manifest
    for command in failing:
        got = report[command]
        text = got["stdout"] + got["stderr"]
        assert got["rc"] == 1, (command, got)
        assert "Traceback" not in text, (command, got)
        assert "step_000300" in text or "step 300" in text, (command, got)
        assert _matches(why, text), (command, why, got)
    for command in set(report) - set(failing) - {"peak_rss_mb"}:
        if command.startswith("cli_"):
            assert report[command]["rc"] == 0 and "Traceback" not in report[command]["stderr"], (command, report)

    if denied:
        return  # a process that may read everything (root) cannot see the damage; the reader above did
    with pytest.warns(RuntimeWarning, match="step 300 refused"):
        with CheckpointStore(run) as store:
            assert store.restore()["step"] == 200
            assert store.local.latest_pointer() == 200  # latest repaired
            store.save(300, state(300)).wait()  # the step number is free again
    quarantined = [p.name for p in (run / "quarantine").iterdir()]
    assert len(quarantined) == 1 and quarantined[0].startswith("step_000300.")
    tier = LocalTier(run)
    assert tier.steps() == [100, 200, 300] and tier.latest_pointer() == 300
    for step in STEPS:  # nothing committed was lost or changed
        assert first_difference(state(step), tier.load(step)[0]) is None


def _matches(why: str, text: str) -> bool:
    import re
    return re.search(why, text) is not None


def test_the_cli_binary_prints_one_line_and_the_traceback_only_when_asked(run):
    os.unlink(run / "step_000300" / "manifest.json")
    os.mkfifo(run / "step_000300" / "manifest.json")
    base = [sys.executable, "-m", "tieredckpt.cli"]
    plain = subprocess.run([*base, "inspect", str(run), "--step", "300"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and plain.stdout == ""
    assert plain.stderr.count("\n") == 1 and "FIFO" in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run([*base, "--debug", "inspect", str(run), "--step", "300"], capture_output=True,
                           text=True, timeout=60)
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    env = dict(os.environ, TIEREDCKPT_DEBUG="1")
    assert "Traceback" in subprocess.run([*base, "inspect", str(run), "--step", "300"], capture_output=True,
                                         text=True, timeout=60, env=env).stderr
    usage = subprocess.run([*base, "inspect"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2  # bad usage


def test_a_regular_file_as_run_dir_and_a_user_dict_too_deep_are_clear_errors(tmp_path):
    from tieredckpt import NotARunDirectoryError, UnsupportedStateError
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotARunDirectoryError, match="file: is a file, not a run directory"):
        CheckpointStore(tmp_path / "file")
    with CheckpointStore(tmp_path / "run") as store:
        with pytest.raises(UnsupportedStateError, match="nested deeper than 32"):
            store.save(1, state(1), user=nested(40))
        with pytest.raises(UnsupportedStateError, match="not plain JSON"):
            store.save(1, state(1), user={"f": object()})
        store.save(1, state(1), user={"ok": nested(10)}).wait()


def test_a_failed_write_is_raised_once(tmp_path, monkeypatch):
    import errno

    import tieredckpt._format.shardfile as shardfile
    from tieredckpt import BackgroundSaveError, DiskFullError
    store = CheckpointStore(tmp_path / "run")
    store.save(1, state(1)).wait()

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(shardfile, "write_all", full)
    handle = store.save(2, state(2))
    with pytest.raises(BackgroundSaveError) as failure:
        handle.wait()
    assert isinstance(failure.value.__cause__, DiskFullError)
    assert str(tmp_path / "run") in str(failure.value) and "needs about" in str(failure.value)
    store.close()  # the failure was raised once already: not again
    assert LocalTier(tmp_path / "run").steps() == [1]


def test_a_step_dir_without_manifest_does_not_block_its_step_number(tmp_path):
    run = tmp_path / "run"
    with CheckpointStore(run) as store:
        store.save(1, state(1)).wait()
    (run / "step_000002").mkdir()
    (run / "step_000002" / "rank0.bin").write_bytes(b"half a copy")
    with CheckpointStore(run) as store:
        assert store.restore()["step"] == 1
        store.save(2, state(2)).wait()
    assert LocalTier(run).steps() == [1, 2]
    (moved,) = (run / "quarantine").iterdir()
    assert (moved / "rank0.bin").read_bytes() == b"half a copy"  # kept aside, not deleted


def test_wall_clock_seconds_is_the_runs_training_time_across_resumes(tmp_path, monkeypatch):
    import types
    clock = [1000.0]  # the store's monotonic clock, under the test's control
    import time as real
    monkeypatch.setattr("tieredckpt._loop.store.time", types.SimpleNamespace(
        monotonic=lambda: clock[0], perf_counter=real.perf_counter, time=real.time))
    with CheckpointStore(tmp_path / "run") as store:
        clock[0] += 7.0  # seven seconds of training
        store.save(1, state(1)).wait()
    clock[0] += 100.0  # the run is stopped: this does not count
    with CheckpointStore(tmp_path / "run") as store:
        store.restore()
        clock[0] += 5.0
        store.save(2, state(2)).wait()
    tier = LocalTier(tmp_path / "run")
    assert tier.manifest(1).wall_clock_seconds == 7.0
    assert tier.manifest(2).wall_clock_seconds == 12.0


def big(step: int) -> dict:
    return {"w": torch.full((1_000_000,), float(step)), "step": step}


def test_a_reader_racing_rotation_always_gets_a_whole_checkpoint(tmp_path):
    import threading
    run = tmp_path / "run"
    run.mkdir()
    done, errors = threading.Event(), []

    def write():
        try:
            with CheckpointStore(run, keep_local=1) as writer:
                for step in range(1, 250):
                    writer.save(step, big(step)).wait()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()
    thread = threading.Thread(target=write)
    thread.start()
    restores = 0
    with CheckpointStore(run, read_only=True) as reader:
        while not done.is_set() or restores < 60:
            got = reader.restore()
            if got is not None:
                assert first_difference(big(got["step"]), got) is None
                restores += 1
    thread.join()
    assert not errors and restores >= 60


def test_work_after_the_commit_only_warns(tmp_path, monkeypatch, caplog):
    import logging
    caplog.set_level(logging.WARNING, logger="tieredckpt")
    with CheckpointStore(tmp_path / "run", keep_local=1) as store:
        store.save(1, state(1)).wait()

        def broken(*args, **kwargs):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(LocalTier, "rotate", broken)
        store.save(2, state(2)).wait()  # committed: the save succeeded and says so
    assert "step 2 is committed, but the work after it failed" in caplog.text
    assert LocalTier(tmp_path / "run").steps() == [1, 2]


@pytest.fixture
def tiny_disk(tmpfs):
    """A 3 MB tmpfs (needs mount privileges; without them the ENOSPC path is covered by
    test_a_failed_write_is_raised_once's injected error)."""
    return tmpfs(3 << 20)


def test_a_full_disk_fails_the_save_clearly_and_keeps_every_committed_step(tiny_disk):
    """keep_local=1 on a disk that cannot hold two checkpoints: the one committed step is the
    newest and never evicted to make room, so the next save fails -- clearly, nothing lost."""
    from tieredckpt import BackgroundSaveError, DiskFullError

    def big(step):
        return {"w": torch.full((420_000,), float(step)), "step": step}  # 1.68 MB of a 3 MB disk
    run = tiny_disk / "run"
    store = CheckpointStore(run, keep_local=1)
    store.save(1, big(1)).wait()
    with pytest.raises(BackgroundSaveError) as failure:
        store.save(2, big(2)).wait()
    assert isinstance(failure.value.__cause__, DiskFullError)
    assert f"{run}: No space left on device: step 2 needs about" in str(failure.value)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == [
        "step_000001"]  # no scratch left behind, nothing lost
    assert first_difference(big(1), store.restore(1)) is None
    assert store.stats()["save_failures"] == 1
    store.close()


def test_a_run_dir_on_a_read_only_mount_restores_and_skips_the_resume_mark(tiny_disk):
    run = tiny_disk / "run"
    with CheckpointStore(run) as store:
        store.log_loss(1, 0.5)
        store.save(1, state(1)).wait()
    remounted = subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], capture_output=True)
    assert remounted.returncode == 0, remounted.stderr
    before = snapshot(run)
    with pytest.warns(RuntimeWarning) as caught:
        with CheckpointStore(run) as store:  # opened as a reader by itself
            assert first_difference(state(1), store.restore()) is None
            assert store.read_only
    messages = [str(w.message) for w in caught]
    assert any("cannot write here (Read-only file system)" in m and "opened as a reader" in m for m in messages)
    assert any("the resume is not recorded" in m for m in messages)
    assert snapshot(run) == before


def _uploaded_big(tmp_path, codec):
    """Step 1 (8 MB of floats) uploaded to a file:// remote with ``codec``; its state and URL."""
    big = {"w": torch.randn(2_000_000) * 0.02, "step": 1}
    url = f"file://{tmp_path / f'remote-{codec}'}"
    with CheckpointStore(tmp_path / f"origin-{codec}", url, compression=codec, upload_part_size=1 << 20) as s:
        s.save(1, big).wait()
        assert s.wait(uploads=True, timeout=60)
    return big, url


@pytest.mark.parametrize("codec", [None, "zstd-dtype"], ids=["raw", "zstd-dtype"])
def test_a_restore_onto_a_full_disk_names_the_directory_and_the_size_and_leaves_nothing(tmp_path, tiny_disk, codec):
    from tieredckpt import DiskFullError
    big, url = _uploaded_big(tmp_path, codec)
    run = tiny_disk / "run"
    with CheckpointStore(run, url) as store:
        with pytest.raises(DiskFullError) as failure:
            store.restore()
    assert f"{run}: No space left on device: the download of step 1 needs about 8" in str(failure.value)
    assert not [p.name for p in run.iterdir() if p.name.startswith("step_")]  # no half-download, no scratch
    shutil.rmtree(run)
    with CheckpointStore(tmp_path / "roomy", url) as store:  # nothing on the remote was touched
        assert first_difference(big, store.restore()) is None


@pytest.mark.parametrize("codec", [None, "zstd-dtype"], ids=["raw", "zstd-dtype"])
def test_a_full_disk_during_a_download_is_a_disk_full_error_on_every_download_path(tmp_path, monkeypatch, codec):
    """The same without mount privileges: the disk fills (ENOSPC) at the first write of a part, for
    a writer's restore (into the run directory) and a reader's (into a private temp directory)."""
    import errno

    from tieredckpt import DiskFullError
    from tieredckpt._tiers import download as download_module
    big, url = _uploaded_big(tmp_path, codec)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(download_module, "pwrite_all", full)
    for read_only in (False, True):
        where = tmp_path / f"fresh-{read_only}"
        with CheckpointStore(where, url, read_only=read_only) as store:
            with pytest.raises(DiskFullError, match="the download of step 1 needs about 8"):
                store.restore()
        assert not where.exists() or not [p.name for p in where.iterdir() if p.name.startswith("step_")]
