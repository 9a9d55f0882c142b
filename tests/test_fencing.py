"""Two writers can never both commit: the lease is a compare-and-swap, every commit and delete is fenced.

Against moto's S3 server over HTTP (If-None-Match / If-Match on PUT) and a file://
remote (O_EXCL link, flock'd compare-and-replace): a zombie writer after a
takeover, a writer whose host clock runs ahead, a taker that leaves again, two
writers racing for a free lease, and re-commits of a committed step.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

from tieredckpt import CheckpointStore, CommitRefusedError, KeepLast, UploadError, WriterConflictError
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers import lease as lease_module
from tieredckpt._tiers.lease import WriterLease
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.transport import Transport


def state(step: int, timeline: str = "a") -> dict:
    g = torch.Generator().manual_seed(step * 7 + (timeline == "b"))
    return {"w": torch.randn(50_000, generator=g), "step": step, "timeline": timeline}


def open_store(run_dir, remote, **kw):
    kw.setdefault("upload_backoff", (0.05, 0.5, 0.5))
    return CheckpointStore(run_dir, remote.url, remote_options=remote.options, **kw)


def remote_tier(remote) -> RemoteTier:
    return RemoteTier(remote.url, remote.options)


def writers_by_step(remote) -> dict[int, str]:
    tier = remote_tier(remote)
    return {s: (tier.committed_by(s) or {}).get("token") for s in tier.steps()}


def test_a_zombie_writer_after_a_takeover_never_commits_and_the_new_owner_keeps_exactly_its_policy(
        tmp_path, remote, caplog):
    a = open_store(tmp_path / "a", remote, keep_remote=KeepLast(4))
    for step in (10, 20, 30, 40):
        a.save(step, state(step)).wait()
        assert a.wait(uploads=True, timeout=60)
    b = open_store(tmp_path / "b", remote, keep_remote=KeepLast(4), takeover=True)  # the relaunch
    assert first_difference(state(40), b.restore()) is None
    caplog.set_level(logging.ERROR, logger="tieredckpt")
    for step in (50, 60, 70):  # the zombie goes on along its own timeline
        a.save(step, state(step)).wait()
    with pytest.raises(UploadError, match="took this remote over"):
        a.wait(uploads=True, timeout=30)  # its uploads are refused, not made, and it says so
    assert a.uploader.lease.lost and "took this remote over" in a.uploader.lease.lost
    assert 70 in a.upload_status()["pending"]
    for step in (50, 60, 70, 80):  # the owner's timeline, reusing the zombie's step numbers
        b.save(step, state(step, "b")).wait()
        assert b.wait(uploads=True, timeout=60)
    mine = b.uploader.lease.token
    held = writers_by_step(remote)
    assert sorted(held) == [50, 60, 70, 80]  # KeepLast(4) holds exactly
    assert set(held.values()) == {mine}  # every committed step is the owner's
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as r:
        for step in (50, 60, 70, 80):
            assert first_difference(state(step, "b"), r.restore(step)) is None
    close_quietly(a)
    b.close()
    assert writers_by_step(remote) == held  # the zombie's close wrote nothing either


def test_a_zombie_uploading_continuously_never_blocks_the_takeover(tmp_path, remote):
    a = open_store(tmp_path / "a", remote)
    stop, step = threading.Event(), [0]

    def zombie() -> None:
        while not stop.is_set():
            step[0] += 1
            a.save(step[0], state(step[0])).wait()
            time.sleep(0.02)
    thread = threading.Thread(target=zombie)
    thread.start()
    try:
        time.sleep(1.0)
        b = open_store(tmp_path / "b", remote, takeover=True)  # never "another writer took ... same moment"
    finally:
        stop.set()
        thread.join()
    b.save(1000, state(1000, "b")).wait()
    assert b.wait(uploads=True, timeout=60)
    before = writers_by_step(remote)
    for s in range(step[0] + 1, step[0] + 4):  # A's next writes (idle, it had nothing to write)
        a.save(s, state(s)).wait()
    deadline = time.monotonic() + 10
    while a.uploader.lease.owned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not a.uploader.lease.owned  # it noticed at its next write
    time.sleep(0.5)
    assert writers_by_step(remote) == before
    assert max(before) == 1000 and before[1000] == b.uploader.lease.token
    close_quietly(a)
    b.close()


def test_a_zombie_process_after_a_relaunch_takes_over_commits_nothing_more(tmp_path, remote):
    """Writer A is a real process that goes on saving and uploading every 0.2 s after B's takeover."""
    import os
    import signal
    from pathlib import Path

    import forkserver
    from s3server import CREDS
    here = Path(__file__).parent
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
               AWS_ENDPOINT_URL=remote.options.get("endpoint_url", ""))
    a = forkserver.shared().popen([str(here / "zombie_writer.py"), str(tmp_path / "a"), remote.url], env=env)
    try:
        for line in a.stdout:  # until A has uploaded a few steps
            if line.startswith("step ") and line.split()[-1] != "None" and int(line.split()[-1]) >= 3:
                break
        b = open_store(tmp_path / "b", remote, takeover=True)
        resumed = b.restore()
        start = resumed["step"]
        for step in range(start + 1, start + 4):
            b.save(step, state(step, "b")).wait()
            assert b.wait(uploads=True, timeout=60)
        time.sleep(2.0)  # A saves ~10 more steps and tries to upload them
        a.send_signal(signal.SIGTERM)
        _, err = a.communicate(timeout=60)
    finally:
        a.kill()
    assert "took this remote over" in err, err[-2000:]
    mine, held = b.uploader.lease.token, writers_by_step(remote)
    assert max(held) == start + 3
    assert all(held[s] == mine for s in held if s > start), held  # nothing of A's after the resume point
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as r:
        for step in held:
            assert first_difference(state(step, "b" if step > start else "a"), r.restore(step)) is None
    b.close()


def test_an_outage_longer_than_the_lease_then_another_writer_the_first_never_commits_again(
        tmp_path, proxied, monkeypatch):
    monkeypatch.setattr(WriterLease.__init__, "__kwdefaults__",
                        {**WriterLease.__init__.__kwdefaults__, "lease_seconds": 2.0, "heartbeat": 0.5})
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "host-a")  # A runs on another host
    a = CheckpointStore(tmp_path / "a", proxied.url, remote_options=proxied.options,
                        upload_backoff=(0.05, 0.3, 0.3), request_timeout=2.0)
    a.save(1, state(1)).wait()
    assert a.wait(uploads=True, timeout=60)
    proxied.proxy.set("dead")  # A's remote is gone for longer than its lease
    for step in (2, 3):
        a.save(step, state(step)).wait()
    time.sleep(3.5)
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "host-b")
    b = CheckpointStore(tmp_path / "b", proxied.url, remote_options=proxied.direct)  # no takeover needed
    assert b.restore()["step"] == 1
    for step in (2, 3):
        b.save(step, state(step, "b")).wait()
    assert b.wait(uploads=True, timeout=60)
    proxied.proxy.clear()  # the remote returns to A
    with pytest.raises(UploadError, match="took this remote over"):
        a.wait(uploads=True, timeout=30)
    assert not a.uploader.lease.owned
    time.sleep(1.0)
    held = {s: (proxied.remote().committed_by(s) or {}).get("token") for s in proxied.remote().steps()}
    assert held[2] == held[3] == b.uploader.lease.token
    with CheckpointStore(tmp_path / "fresh", proxied.url, remote_options=proxied.direct, read_only=True) as r:
        assert first_difference(state(3, "b"), r.restore(3)) is None
    close_quietly(a)
    b.close()


def test_a_writer_whose_clock_runs_10_minutes_ahead_is_refused_and_with_takeover_wins(tmp_path, remote, monkeypatch):
    a = open_store(tmp_path / "a", remote)
    a.save(1, state(1)).wait()
    assert a.wait(uploads=True, timeout=60)
    real_time = time.time
    monkeypatch.setattr(lease_module.time, "time", lambda: real_time() + 600)  # B's clock runs ahead
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "skewed-host")  # on another host
    with pytest.raises(WriterConflictError, match=r"another writer owns this remote .*the remote saw its last "
                                                   r"heartbeat \d+ s ago.*takeover=True"):
        open_store(tmp_path / "b", remote)
    b = open_store(tmp_path / "b", remote, takeover=True)
    monkeypatch.undo()
    a.save(2, state(2)).wait()  # A's next write finds its record replaced: it stops and says so
    with pytest.raises(UploadError, match="took this remote over"):
        a.wait(uploads=True, timeout=30)
    assert not a.uploader.lease.owned
    assert remote_tier(remote).steps() == [1]
    b.close()
    close_quietly(a)


def test_a_writer_whose_taker_has_left_notices_and_does_not_write_again(tmp_path, remote):
    a = open_store(tmp_path / "a", remote)
    a.save(1, state(1)).wait()
    assert a.wait(uploads=True, timeout=60)
    b = open_store(tmp_path / "b", remote, takeover=True)  # takes over while A cannot tell...
    b.close()  # ...and leaves: writer.json is marked free, with B's generation kept
    assert not a.uploader.lease.renew()  # A's next heartbeat: a later generation's record, free or not
    assert "released it since" in a.uploader.lease.lost and a.uploader.lease.replaced
    record = json.loads(remote_tier(remote).t.get_optional("writer.json", 1 << 16))
    assert record["free"] and record["generation"] == 2 and record["token"] == b.uploader.lease.token
    with pytest.raises(WriterConflictError, match="never writes there again"):
        a.uploader.lease.acquire()  # the record is free, but A was replaced: it never takes it back
    close_quietly(a)


def test_a_lease_lapses_by_the_remotes_own_clock(tmp_path, remote, monkeypatch):
    t = Transport(remote.url, remote.options)
    t.probe(create=True)
    old = WriterLease(t, lease_seconds=1.0, heartbeat=3600)
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "gone-host")
    old.acquire()
    monkeypatch.undo()
    time.sleep(2.5)  # the remote's clock: its record has not changed for longer than its lease
    new = WriterLease(Transport(remote.url, remote.options))
    new.acquire()  # no takeover needed
    assert new.owned and not old.renew()
    new.release()


@pytest.mark.parametrize("rounds", [50])
def test_two_writers_racing_for_a_free_lease_exactly_one_wins_every_round(remote, rounds):
    transports = [Transport(remote.url, remote.options) for _ in range(2)]
    transports[0].probe(create=True)
    for _ in range(rounds):
        leases = [WriterLease(t, heartbeat=3600) for t in transports]
        barrier, outcomes = threading.Barrier(2), [None, None]

        def take(i: int) -> None:
            barrier.wait()
            try:
                leases[i].acquire()
                outcomes[i] = "owner"
            except WriterConflictError as exc:
                outcomes[i] = str(exc)
        threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert outcomes.count("owner") == 1, outcomes
        winner = leases[outcomes.index("owner")]
        assert winner.read()["token"] == winner.token
        winner.release()


def test_a_committed_upload_manifest_is_never_overwritten_by_another_writer(tmp_path, remote):
    with open_store(tmp_path / "a", remote) as a:
        a.save(5, state(5)).wait()
        assert a.wait(uploads=True, timeout=60)
        manifest = a.local.manifest(5)
    tier = remote_tier(remote)
    upload = tier.upload_manifest(5)
    with pytest.raises(CommitRefusedError, match=r"step 5 is already committed on the remote \(by host"):
        tier.commit_upload(manifest, upload.codec, upload.files, writer={"token": "f" * 16, "host": "x", "pid": 1})
    assert tier.upload_manifest(5).writer == upload.writer


def test_cli_gc_is_fenced_a_live_writer_refuses_it_and_force_takes_over(tmp_path, remote):
    from test_remote_cli import cli  # the CLI as a real subprocess
    a = open_store(tmp_path / "a", remote)
    a.save(1, state(1)).wait()
    assert a.wait(uploads=True, timeout=60)
    endpoint = remote.options.get("endpoint_url")
    refused = cli("gc", remote.url, endpoint=endpoint)
    assert refused.returncode != 0 and "another writer owns this remote" in refused.stderr, refused.stderr
    forced = cli("gc", remote.url, "--force", endpoint=endpoint)
    assert forced.returncode == 0, forced.stderr
    assert not a.uploader.lease.renew()  # the writer it took over from stops at its next write
    close_quietly(a)


def test_cli_push_and_push_dir_are_fenced_a_live_writer_refuses_them(tmp_path, remote):
    from test_remote_cli import cli
    a = open_store(tmp_path / "a", remote)
    a.save(1, state(1)).wait()
    assert a.wait(uploads=True, timeout=60)
    with CheckpointStore(tmp_path / "b") as other:  # another run's checkpoints, local only
        other.save(7, state(7)).wait()
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "f.bin").write_bytes(b"x" * 1000)
    endpoint = remote.options.get("endpoint_url")
    pushed = cli("push", tmp_path / "b", "--remote", remote.url, endpoint=endpoint)
    assert pushed.returncode != 0 and "another writer owns this remote" in pushed.stderr, pushed.stderr
    pushed_dir = cli("push-dir", tmp_path / "c", 8, tmp_path / "folder", "--remote", remote.url, endpoint=endpoint)
    assert pushed_dir.returncode != 0 and "another writer owns this remote" in pushed_dir.stderr, pushed_dir.stderr
    assert remote_tier(remote).steps() == [1]  # neither reached the remote
    assert a.uploader.lease.renew()  # and the owner still owns it
    a.close()


def close_quietly(store: CheckpointStore) -> None:
    """Close a writer that lost its lease: the uploads it could not make may be raised here."""
    try:
        store.close()
    except UploadError as exc:
        assert "remote" in str(exc)


@pytest.mark.parametrize("hostile", ["fifo", "symlink", "huge"])
def test_a_planted_writer_record_on_a_disk_remote_is_refused_at_once_never_followed_or_blocked_on(
        tmp_path, hostile):
    import os
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text('{"token": "x", "host": "h", "pid": 1, "seq": 1, "heartbeat_unix": 0}')
    record = remote_dir / "writer.json"
    if hostile == "fifo":
        os.mkfifo(record)
    elif hostile == "symlink":
        os.symlink(target, record)
    else:
        with open(record, "wb") as f:
            f.truncate(1 << 40)  # sparse: 1 TiB declared
    started = time.monotonic()
    with pytest.raises(Exception, match=r"writer.json: (is a FIFO|is a symlink|larger than)"):
        CheckpointStore(tmp_path / "run", f"file://{remote_dir}", takeover=True)
    assert time.monotonic() - started < 10
    assert target.read_text().startswith('{"token": "x"')  # never written through
