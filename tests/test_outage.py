"""The remote never costs the run a step or a checkpoint: outages, other machines, retention, a wrong bucket.

Against moto's S3 server over HTTP with a fault-injecting proxy (tests/faultproxy.py)
between s3fs and moto: 503 SlowDown, 500, 403, connection resets, requests that are
never answered, and an endpoint that refuses connections.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT
from s3server import CREDS

from tieredckpt import CheckpointStore, KeepEvery, KeepLast, RemoteAccessError, RemoteNotFoundError, WriterConflictError
from tieredckpt._format.compare import first_difference


def state(step: int, n: int = 200_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def open_store(run_dir, proxied, **kw):
    kw.setdefault("upload_backoff", (0.1, 1.0, 1.0))
    kw.setdefault("request_timeout", 5.0)
    kw.setdefault("upload_part_size", 256 << 10)
    return CheckpointStore(run_dir, proxied.url, remote_options=proxied.options, **kw)


def wait_until(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("phase_seconds", [6, pytest.param(20, marks=pytest.mark.slow)], ids=["18s", "60s"])
def test_an_outage_of_every_kind_never_blocks_save_nor_reaches_the_loop_and_uploads_catch_up(
        tmp_path, proxied, phase_seconds):
    """503s, then resets, then unanswered requests, each for ``phase_seconds`` (each longer than a
    request timeout, 5 s here): 18 s by default, the full 60 s with ``-m slow``."""
    keep = 2
    s = open_store(tmp_path / "run", proxied, keep_local=keep, every=1)
    blocks = {"before": [], "outage": [], "after": []}
    most_local = 0
    step = 0

    def train(phase: str, seconds: float) -> None:
        nonlocal step, most_local
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step += 1
            start = time.monotonic()
            handle = s.save(step, state(step))  # the loop's whole cost of a checkpoint
            blocks[phase].append(time.monotonic() - start)
            handle.wait()  # the local commit (and the rotation after it) is done
            most_local = max(most_local, len(s.local.steps()))
            time.sleep(0.5)

    train("before", 5)
    assert wait_until(lambda: proxied.remote().newest_step() == step, 60, "the first uploads") >= 0
    for mode in ("503", "reset", "drop"):  # every request fails, then hangs unanswered
        proxied.proxy.set(mode)
        train("outage", phase_seconds)
    newest_before_return = proxied.remote().newest_step()
    proxied.proxy.clear()
    train("after", 3)
    last = step
    caught_up = wait_until(lambda: proxied.remote().newest_step() == last, 60,
                           "the remote's newest step to reach the loop's newest")
    normal = max(blocks["before"])
    print(f"\nsave() blocks: normal max {normal * 1000:.1f} ms, during the outage max "
          f"{max(blocks['outage']) * 1000:.1f} ms over {len(blocks['outage'])} saves; "
          f"remote caught up {caught_up:.1f} s after the last save; most local steps {most_local}")
    assert newest_before_return < last
    # A save that waited for the remote would have blocked for a request timeout (5 s) or longer.
    assert max(blocks["outage"]) < normal + 2.0
    assert most_local <= keep + 2  # keep_local + the one being sent + the newest the remote holds
    assert "failures" not in s.upload_status() or not s.upload_status()["failures"]
    s.close()  # nothing was permanent: nothing is raised
    with CheckpointStore(tmp_path / "fresh", proxied.url, remote_options=proxied.direct, read_only=True) as r:
        assert first_difference(state(last), r.restore()) is None


def test_steps_the_remote_policy_keeps_are_never_superseded_during_an_outage(tmp_path, proxied):
    s = open_store(tmp_path / "run", proxied, keep_local=2, keep_remote=KeepEvery(3))
    proxied.proxy.set("503")
    for step in range(1, 8):
        s.save(step, state(step, 1000)).wait()
    assert s.local.steps() == [3, 6, 7]  # keep_local=2 plus the milestone still owed; 1, 2, 4, 5 superseded
    proxied.proxy.clear()
    assert s.wait(uploads=True, timeout=60)
    s.close()
    assert proxied.remote().steps() == [3, 6, 7]
    with CheckpointStore(tmp_path / "run") as again:
        assert again.local.steps() == [6, 7]



@pytest.mark.parametrize("uploads", ["newest", "all"])
def test_restarts_during_an_outage_never_pin_the_previous_runs_unsent_steps(tmp_path, proxied, uploads):
    """The remote down from the first open, three relaunches: with uploads="newest" rotation keeps
    keep_local steps plus the milestone KeepEvery(4) pins, as in one process; with "all" every
    unsent step stays (each is owed). Then the remote returns and gets what each mode owes it."""
    proxied.proxy.set("dead")
    step = 0
    for _ in range(3):
        s = open_store(tmp_path / "run", proxied, keep_local=2, keep_remote=KeepEvery(4), uploads=uploads,
                       request_timeout=2.0, max_pending_uploads=None)
        for _ in range(3):
            step += 1
            s.save(step, state(step, 1000)).wait()
        held = s.local.steps()
        if uploads == "newest":
            assert held == sorted({4, 8} & set(range(1, step - 1)) | {step - 1, step}), held
        else:
            assert held == list(range(1, step + 1)), held
        s.close(drain_uploads=False)
    proxied.proxy.clear()
    with open_store(tmp_path / "run", proxied, keep_local=2, keep_remote=KeepEvery(4), uploads=uploads) as s:
        assert s.wait(uploads=True, timeout=60)
    assert proxied.remote().steps() == [4, 8, 9]  # KeepEvery(4) and the newest

def test_other_stores_and_the_cli_on_the_same_remote_never_delete_the_writers_uploads(tmp_path, proxied):
    steps, errors = 12, []
    writer = open_store(tmp_path / "run", proxied, keep_local=2, uploads="all", max_pending_uploads=None)

    def train():
        try:
            for step in range(1, steps + 1):
                writer.save(step, state(step)).wait()
                time.sleep(0.3)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    trainer = threading.Thread(target=train)
    trainer.start()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"])
    opened = 0
    while trainer.is_alive() or opened < 4:
        with CheckpointStore(tmp_path / f"eval{opened}", proxied.url, remote_options=proxied.options,
                             read_only=True) as reader:
            got = reader.restore()
            assert got is None or first_difference(state(got["step"]), got) is None
        with pytest.raises(WriterConflictError, match=r"another writer owns this remote \(host .*, pid \d+"):
            CheckpointStore(tmp_path / f"second{opened}", proxied.url, remote_options=proxied.options)
        for args in (["ls", str(tmp_path / "run"), "--remote", proxied.url],
                     ["restore", proxied.url, "--to", str(tmp_path / f"cli{opened}")]):
            out = subprocess.run([sys.executable, "-m", "tieredckpt.cli", *args, "--endpoint-url",
                                  proxied.proxy.endpoint], capture_output=True, text=True, env=env, timeout=120)
            assert "Traceback" not in out.stderr
        opened += 1
    trainer.join()
    assert not errors
    assert writer.wait(uploads=True, timeout=60)
    writer.close()
    remote = proxied.remote()
    assert remote.steps() == list(range(1, steps + 1)) and remote.uncommitted() == []
    with CheckpointStore(tmp_path / "check", proxied.url, remote_options=proxied.direct, read_only=True) as r:
        for step in range(1, steps + 1):
            assert first_difference(state(step), r.restore(step)) is None, step


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from tieredckpt import CheckpointStore
store = CheckpointStore(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None,
                        remote_options={options!r} if len(sys.argv) > 2 else None)
print("open", flush=True)
time.sleep(600)
"""


def _holder(tmp_path, *args, options=None):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER.format(root=str(ROOT), options=options or {}))
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_two_writers_on_one_run_dir_the_second_is_told_who_and_a_killed_holder_frees_it(tmp_path):
    proc = _holder(tmp_path, tmp_path / "run")
    try:
        with pytest.raises(WriterConflictError, match=rf"another writer holds this run directory .*pid {proc.pid}"):
            CheckpointStore(tmp_path / "run")
        with CheckpointStore(tmp_path / "run", read_only=True) as reader:  # a reader needs no permission
            assert reader.restore() is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with CheckpointStore(tmp_path / "run") as s:  # the kernel released the dead holder's lock
        s.save(1, state(1, 10)).wait()


def test_two_writers_on_one_remote_prefix_and_takeover_after_the_holder_dies(tmp_path, proxied, caplog):
    proc = _holder(tmp_path, tmp_path / "a", proxied.url, options=proxied.options)
    try:
        with pytest.raises(WriterConflictError, match=rf"another writer owns this remote .*pid {proc.pid}"):
            open_store(tmp_path / "b", proxied)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    caplog.set_level(logging.WARNING, logger="tieredckpt")
    s = open_store(tmp_path / "b", proxied)  # a dead process on this host: its lease is void
    assert "took over the remote from host" in caplog.text and f"pid {proc.pid}" in caplog.text
    s.save(1, state(1, 10)).wait()
    assert s.wait(uploads=True, timeout=60)
    s.close()
    assert proxied.remote().steps() == [1]


@pytest.mark.parametrize("policy", [KeepLast(1), KeepEvery(3)], ids=["KeepLast(1)", "KeepEvery(3)"])
def test_remote_retention_never_pins_local_disk_and_a_restart_uploads_nothing_again(tmp_path, proxied, policy):
    with open_store(tmp_path / "run", proxied, keep_local=2, keep_remote=policy) as s:
        for step in range(1, 8):
            s.save(step, state(step, 1000)).wait()
            assert s.wait(uploads=True, timeout=60)
            assert len(s.local.steps()) <= 2
    expected = [7] if isinstance(policy, KeepLast) else [3, 6, 7]
    assert proxied.remote().steps() == expected
    proxied.proxy.reset_counts()
    with open_store(tmp_path / "run", proxied, keep_local=2, keep_remote=policy) as s:
        assert s.wait(uploads=True, timeout=60)
        assert s.local.steps() == [6, 7]
    assert proxied.proxy.requests("PUT", ".p0") == []  # no part was sent again
    assert proxied.remote().steps() == expected


def test_a_failed_retention_delete_is_retried_and_fails_nothing(tmp_path, proxied):
    with open_store(tmp_path / "run", proxied, keep_local=1, keep_remote=KeepLast(1), audit_interval=0.5) as s:
        s.save(1, state(1, 1000)).wait()
        assert s.wait(uploads=True, timeout=60)
        proxied.proxy.set("503", methods={"DELETE", "POST"})  # deletes fail (S3 batch deletes are POSTs)
        s.save(2, state(2, 1000)).wait()
        assert s.wait(uploads=True, timeout=60)  # the upload itself succeeded
        time.sleep(1.0)
        assert proxied.remote().steps() == [1, 2]  # the delete has not gone through yet
        assert all(v["state"] != "failed" for v in s.uploader.status().values())
        proxied.proxy.clear()
        wait_until(lambda: proxied.remote().steps() == [2], 30, "the retried delete")
    # close() raised nothing: a failed delete is not a failed upload


def test_a_missing_bucket_or_refused_credentials_fail_at_open_before_any_save(tmp_path, proxied):
    with pytest.raises(RemoteNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        CheckpointStore(tmp_path / "a", "s3://no-such-bucket/run", remote_options=proxied.options)
    proxied.proxy.set("403")
    with pytest.raises(RemoteAccessError, match=rf"access to bucket '{proxied.bucket}' was refused"):
        open_store(tmp_path / "b", proxied)
    with pytest.raises(RemoteAccessError):
        CheckpointStore(tmp_path / "c", proxied.url, remote_options=proxied.options, read_only=True)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").glob("step_*"))


def test_a_remote_down_at_open_does_not_stop_a_local_resume(tmp_path, proxied, caplog):
    with open_store(tmp_path / "run", proxied) as s:
        s.save(1, state(1)).wait()
        assert s.wait(uploads=True, timeout=60)
        s.save(2, state(2)).wait()
    proxied.proxy.set("dead")
    caplog.set_level(logging.WARNING, logger="tieredckpt")
    s = open_store(tmp_path / "run", proxied, request_timeout=2.0)
    assert "unreachable" in caplog.text
    with pytest.warns(RuntimeWarning, match="restoring from the local checkpoints only"):
        assert first_difference(state(2), s.restore()) is None
    s.save(3, state(3)).wait()  # and saving goes on
    proxied.proxy.clear()
    assert s.wait(uploads=True, timeout=60)  # uploads start when the remote answers
    s.close()
    assert proxied.remote().newest_step() == 3


def test_with_no_local_copy_an_unreachable_remote_is_an_error_never_an_empty_run(tmp_path, proxied):
    with open_store(tmp_path / "run", proxied) as s:
        s.save(1, state(1)).wait()
        assert s.wait(uploads=True, timeout=60)
    proxied.proxy.set("dead")
    with open_store(tmp_path / "fresh", proxied, request_timeout=2.0) as s:
        with pytest.raises(Exception, match="cannot tell which checkpoints the remote holds"):
            s.restore()


def test_a_wiped_remote_is_noticed_and_the_newest_step_uploaded_again(tmp_path, proxied, caplog):
    caplog.set_level(logging.WARNING, logger="tieredckpt")
    with open_store(tmp_path / "run", proxied, keep_local=2, audit_interval=0.5) as s:
        for step in (1, 2, 3):
            s.save(step, state(step, 1000)).wait()
        assert s.wait(uploads=True, timeout=60)
        remote = proxied.remote()
        remote.fs.rm(remote.path(), recursive=True)  # someone wipes the prefix
        assert remote.newest_step() is None
        wait_until(lambda: proxied.remote().newest_step() == 3, 30, "the re-upload")
        assert s.local.steps() == [2, 3]  # the local copies were kept
    assert "no longer holds uploaded step(s)" in caplog.text


def test_a_dead_endpoint_prints_no_tracebacks_from_inside_aiohttp_and_other_loop_reports_still_pass(
        tmp_path, proxied, caplog):
    """A reset before a request's headers leaves aiohttp's body-writing task failed and unawaited;
    asyncio would log "Task exception was never retrieved" with aiohttp's traceback, many per
    outage. The upload's own error says what happened; those reports go to debug logging."""
    import asyncio
    import gc

    from tieredckpt._tiers.remote import RemoteTier
    from tieredckpt._tiers.sharded import save_sharded
    from tieredckpt.errors import RemoteError
    local = tmp_path / "local" / "step_000001"
    manifest = save_sharded([{"w": torch.randn(2_000_000)}], local, 1)
    r = RemoteTier(proxied.url, proxied.options, part_size=256 << 10)
    proxied.proxy.set("dead")
    with caplog.at_level(logging.DEBUG):
        deadline = time.monotonic() + 20  # reports of tasks freed on the loop's thread (slow under load)
        while time.monotonic() < deadline and not any("abandoned request body" in rec.getMessage()
                                                      for rec in caplog.records):
            # each attempt fails at its first refused request: the header's tiny part often goes
            # first, and only a body large enough to be written apart leaves such a task behind
            with pytest.raises(RemoteError, match="failed"):
                r.upload(local, manifest)
            gc.collect()
            time.sleep(0.1)
    proxied.proxy.clear()
    loud = [rec for rec in caplog.records if rec.name == "asyncio" and rec.levelno >= logging.WARNING]
    assert not loud, loud[0].getMessage()
    assert any("abandoned request body" in rec.getMessage() for rec in caplog.records)  # it did happen
    caplog.clear()  # any other report on that loop still reaches asyncio's logger

    async def fails():
        raise ValueError("not aiohttp's")
    loop = r.fs.loop
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result()
        loop.call_soon_threadsafe(lambda: loop.create_task(fails()))
        time.sleep(0.3)
        gc.collect()
        time.sleep(0.3)
    assert any("never retrieved" in rec.getMessage() for rec in caplog.records)


def test_ls_with_the_remote_down_lists_the_local_steps_warns_and_exits_0(tmp_path, proxied):
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options) as store:
        store.save(1, state(1)).wait()
        assert store.wait(uploads=True, timeout=60)
    proxied.proxy.set("dead")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"])
    base = [sys.executable, "-m", "tieredckpt.cli", "ls", str(tmp_path / "run"), "--endpoint-url",
            proxied.proxy.endpoint, "--remote-option", "connect_timeout=2"]
    down = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "the remote is unreachable now, so only the local steps are listed" in down.stderr
    assert "Traceback" not in down.stderr
    assert any(line.split()[:1] == ["1"] and "local" in line for line in down.stdout.splitlines()), down.stdout
    skipped = subprocess.run(base + ["--local-only"], capture_output=True, text=True, env=env, timeout=60)
    assert skipped.returncode == 0 and "unreachable" not in skipped.stderr, skipped.stderr
    assert "remote s3://" not in skipped.stdout and "1 " in skipped.stdout  # the remote not even named
