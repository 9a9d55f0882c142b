"""Ownership only moves forward: a writer that was taken over never writes to that remote again.

Real writer processes (tests/zombie_writer.py) on moto's S3 server and a file:// remote, at a
fast and a slow cadence: a zombie that outlives its replacement never takes the remote back
when the replacement releases it, never commits, never deletes; restore prefers the newest
generation's timeline over a zombie's higher-numbered step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import forkserver
import pytest
import torch

from tieredckpt import CheckpointNotFoundError, CheckpointStore, KeepLast
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers import lease as lease_module
from tieredckpt._tiers.lease import WriterLease
from tieredckpt._tiers.remote import RemoteTier

HERE = Path(__file__).parent


def state(step: int, timeline: str) -> dict:
    """What tests/zombie_writer.py saves at ``step`` on ``timeline``."""
    g = torch.Generator().manual_seed(step * 7 + (0 if timeline == "a" else sum(map(ord, timeline))))
    return {"w": torch.randn(50_000, generator=g), "step": step, "timeline": timeline}


def held(remote) -> dict[int, tuple[str, int]]:
    """step -> (token, generation) of every committed step on the remote, read around any proxy."""
    tier = RemoteTier(remote.url, remote.options)
    out = {}
    for step in tier.steps():
        try:
            upload = tier.upload_manifest(step)
        except CheckpointNotFoundError:  # pruned by a live owner's retention since the listing
            continue
        out[step] = ((upload.writer or {}).get("token"), upload.generation)
    return out


class Writer:
    """A zombie_writer.py process; ``lines`` fills from its stdout on a thread."""

    def __init__(self, run_dir, remote, interval: float, timeline: str, keep: int, takeover: bool = False) -> None:
        from s3server import CREDS
        env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
                   AWS_ENDPOINT_URL=remote.options.get("endpoint_url", ""))
        args = [str(HERE / "zombie_writer.py"), str(run_dir), remote.url, str(interval), timeline,
                str(keep)] + (["takeover"] if takeover else [])
        self.proc = forkserver.shared().popen(args, env=env)  # a process forked with torch imported
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def token(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith("resumed "):
                    return line.split()[-1]
            assert self.proc.poll() is None, self.proc.stderr.read()
            time.sleep(0.05)
        raise AssertionError("the writer did not start")

    def uploaded_at_least(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith("step ") and line.split()[-1] != "None" and int(line.split()[-1]) >= step
                   for line in list(self.lines)):
                return
            assert self.proc.poll() is None, self.proc.stderr.read()
            time.sleep(0.05)
        raise AssertionError(f"the writer did not upload step {step}")

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=60)
        finally:
            self.proc.kill()
        return err


@pytest.mark.parametrize("interval", [0.1, 0.6], ids=["fast", "slow"])
def test_a_zombie_never_takes_the_remote_back_after_its_replacement_releases_it(tmp_path, remote, interval):
    a = Writer(tmp_path / "a", remote, interval, "a", keep=4)
    try:
        a.token()
        a.uploaded_at_least(3)
        b = CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options, keep_remote=KeepLast(4),
                            takeover=True, upload_backoff=(0.05, 0.5, 0.5))
        mine, start = b.uploader.lease.token, b.restore()["step"]
        for step in range(start + 1, start + 7):  # B trains and saves while A goes on saving
            time.sleep(interval)
            b.save(step, state(step, "b")).wait()
            assert b.wait(uploads=True, timeout=60)
        b.close()  # B leaves normally: its record is marked free, its generation kept
        before = held(remote)
        assert sorted(before) == list(range(start + 3, start + 7))  # B's KeepLast(4)
        assert {token for token, _ in before.values()} == {mine}
        time.sleep(max(3.0, 8 * interval))  # A saves several more steps and tries to upload each
        assert a.proc.poll() is None  # the zombie is alive throughout
        err = a.stop()
    finally:
        a.proc.kill()
    assert held(remote) == before  # A committed nothing and deleted nothing after B's release
    assert "owns the remote again" not in err and "never writes there again" in err, err[-3000:]
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as r:
        restored = r.restore()  # a fresh machine restores B's newest
    assert restored["step"] == start + 6 and first_difference(state(start + 6, "b"), restored) is None


def test_a_then_b_then_c_with_a_and_b_alive_only_c_extends_or_prunes_the_remote(tmp_path, remote):
    a = Writer(tmp_path / "a", remote, 0.15, "a", keep=3)
    b = None
    try:
        a.token()
        a.uploaded_at_least(3)
        b = Writer(tmp_path / "b", remote, 0.15, "b", keep=3, takeover=True)  # A's relaunch; A lives on
        b_token = b.token()
        b.uploaded_at_least(max(held(remote)) + 2)
        c = CheckpointStore(tmp_path / "c", remote.url, remote_options=remote.options, keep_remote=KeepLast(3),
                            takeover=True, upload_backoff=(0.05, 0.5, 0.5))  # B's relaunch; B lives on too
        mine, start = c.uploader.lease.token, c.restore()["step"]
        assert held(remote)[start][0] == b_token  # C resumed from B's timeline
        time.sleep(2.0)  # A and B save and try to upload
        after_takeover = held(remote)
        for step in range(start + 1, start + 5):
            c.save(step, state(step, "c")).wait()
            assert c.wait(uploads=True, timeout=60)
            now = held(remote)
            assert all(now[s] == after_takeover[s] for s in now if s <= start), now  # nobody else touched them
            assert all(now[s][0] == mine for s in now if s > start), now  # every new step is C's
        c.close()
        final = held(remote)
        assert sorted(final) == list(range(start + 2, start + 5))  # C's KeepLast(3), C's steps only
        time.sleep(3.0)  # C has released: A and B go on trying
        errors = [w.stop() for w in (a, b)]
    finally:
        a.proc.kill()
        if b is not None:
            b.proc.kill()
    assert held(remote) == final
    assert all("never writes there again" in e for e in errors), [e[-2000:] for e in errors]
    generations = {g for _, g in final.values()}
    assert generations == {3}  # A took 1, B 2, C 3


def test_an_outage_longer_than_the_lease_with_nobody_else_the_writer_goes_on(tmp_path, proxied, monkeypatch):
    monkeypatch.setattr(WriterLease.__init__, "__kwdefaults__",
                        {**WriterLease.__init__.__kwdefaults__, "lease_seconds": 1.5, "heartbeat": 0.3})
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "host-a")  # its record is not checked by pid
    a = CheckpointStore(tmp_path / "a", proxied.url, remote_options=proxied.options,
                        upload_backoff=(0.05, 0.3, 0.3), request_timeout=1.5, uploads="all")
    a.save(1, state(1, "a")).wait()
    assert a.wait(uploads=True, timeout=60)
    generation = a.uploader.lease.generation
    proxied.proxy.set("dead")
    for step in (2, 3):
        a.save(step, state(step, "a")).wait()
    time.sleep(3.0)  # twice its lease with no heartbeat reaching the remote
    proxied.proxy.clear()
    assert a.wait(uploads=True, timeout=60)  # nobody came in between: it goes on
    assert a.uploader.lease.owned and not a.uploader.lease.replaced
    remote = proxied.remote()
    assert remote.steps() == [1, 2, 3]
    assert {remote.upload_manifest(s).generation for s in (1, 2, 3)} == {generation}
    a.close()


def late_commit(store: CheckpointStore, step: int, timeline: str) -> None:
    """What a replaced writer's in-flight request does: its marker (and latest) lands after the
    takeover, unfenced -- the one request a conditional fence cannot stop."""
    store.save(step, state(step, timeline)).wait()
    remote, local = store.uploader.remote, store.local
    manifest = local.manifest(step)
    files = remote.send_files(local.step_path(step), manifest, manifest.shards, "raw")
    remote.commit_upload(manifest, "raw", files, writer=store.uploader.lease.identity())
    remote.write_latest(step)


def test_restore_prefers_the_newest_generation_over_a_zombies_higher_step_and_the_owner_deletes_it(
        tmp_path, remote):
    a = CheckpointStore(tmp_path / "a", remote.url, remote_options=remote.options, upload_backoff=(0.05, 0.5, 0.5))
    for step in (10, 20):
        a.save(step, state(step, "a")).wait()
        assert a.wait(uploads=True, timeout=60)
    b = CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options, takeover=True,
                        keep_remote=KeepLast(5), upload_backoff=(0.05, 0.5, 0.5))
    assert b.restore()["step"] == 20
    b.save(21, state(21, "b")).wait()
    assert b.wait(uploads=True, timeout=60)
    late_commit(a, 40, "a")  # numbered above the owner's newest, by an earlier generation
    tier = RemoteTier(remote.url, remote.options)
    assert tier.latest_pointer() == 40 and 40 in tier.steps()
    assert tier.newest_step() == 21  # not "newer": the owner's timeline wins
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as r:
        assert first_difference(state(21, "b"), r.restore()) is None
    b.save(22, state(22, "b")).wait()  # the owner's next upload finds the late commit and deletes it
    assert b.wait(uploads=True, timeout=60)
    assert RemoteTier(remote.url, remote.options).steps() == [10, 20, 21, 22]
    b.close()
    try:
        a.close()
    except Exception:  # noqa: BLE001 - its refused uploads are raised at its close
        pass


def test_a_late_commit_on_the_owners_next_step_number_is_replaced_by_the_owners_step(tmp_path, remote):
    """The replaced writer's in-flight commit lands just above the step the owner resumed from,
    on the very number the owner saves next (seen as a permanent "already committed" failure of
    the owner's upload, under load): the owner's upload deletes it and commits its own."""
    a = CheckpointStore(tmp_path / "a", remote.url, remote_options=remote.options, upload_backoff=(0.05, 0.5, 0.5))
    a.save(10, state(10, "a")).wait()
    assert a.wait(uploads=True, timeout=60)
    b = CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options, takeover=True,
                        upload_backoff=(0.05, 0.5, 0.5))
    assert b.restore()["step"] == 10
    late_commit(a, 11, "a")  # after b took the remote, on b's next number
    b.save(11, state(11, "b")).wait()
    assert b.wait(uploads=True, timeout=60)
    mine = b.uploader.lease.token
    assert held(remote)[11] == (mine, b.uploader.lease.generation)
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as r:
        assert first_difference(state(11, "b"), r.restore()) is None
    b.close()
    try:
        a.close()
    except Exception:  # noqa: BLE001 - its refused uploads are raised at its close
        pass


def test_the_step_a_replaced_writer_died_sending_is_never_deleted_once_the_new_owner_commits_its_own(
        tmp_path, remote):
    """A writer whose uploads lag supersedes step 11 and notes step 12 as sending; then it is taken
    over. The new owner resumes from step 10 and cleans up that half-upload -- but it saves and
    commits its own steps 11, 12, 13: the cleanup must not delete its own step 12 (it did, seen as
    a kept-last-3 run missing a middle step, one run in twenty under load)."""
    a = CheckpointStore(tmp_path / "a", remote.url, remote_options=remote.options, upload_backoff=(0.05, 0.5, 0.5))
    a.save(10, state(10, "a")).wait()
    assert a.wait(uploads=True, timeout=60)
    a.uploader.lease.note_sending(12)  # what its record says when the takeover lands
    b = CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options, takeover=True,
                        upload_backoff=(0.05, 0.5, 0.5))
    assert b.uploader.lease.previous_sending() == 12 and b.restore()["step"] == 10
    for step in (11, 12, 13, 14):
        b.save(step, state(step, "b")).wait()
        assert b.wait(uploads=True, timeout=60)
    b.close()
    assert sorted(held(remote)) == [10, 11, 12, 13, 14]
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as r:
        assert first_difference(state(12, "b"), r.restore(12)) is None
    try:
        a.close()
    except Exception:  # noqa: BLE001 - its refused uploads are raised at its close
        pass


def test_a_step_of_a_later_generation_is_never_deleted_by_an_earlier_one(tmp_path, remote):
    a = CheckpointStore(tmp_path / "a", remote.url, remote_options=remote.options)
    a.save(1, state(1, "a")).wait()
    assert a.wait(uploads=True, timeout=60)
    b = CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options, takeover=True)
    b.save(2, state(2, "b")).wait()
    assert b.wait(uploads=True, timeout=60)
    stale = RemoteTier(remote.url, remote.options)
    assert stale.newest_step() == 2  # reads step 2's marker: generation 2
    with pytest.raises(Exception, match="committed by a later writer"):
        stale.delete(2, generation=a.uploader.lease.generation)
    assert 2 in RemoteTier(remote.url, remote.options).steps()
    b.close()
    try:
        a.close()
    except Exception:  # noqa: BLE001
        pass


def test_a_takeover_that_loses_one_race_to_the_zombies_heartbeat_still_takes_the_remote(remote):
    """The taker's first conditional write loses to the zombie's heartbeat: the retry is not a
    lease the taker held and lost (it never held it), so it takes the remote, one generation up."""
    from tieredckpt._tiers.transport import Transport
    zombie_t, taker_t = Transport(remote.url, remote.options), Transport(remote.url, remote.options)
    zombie_t.probe(create=True)
    zombie = WriterLease(zombie_t, heartbeat=3600)
    zombie.acquire()
    real, raced = taker_t.put_if_match, []

    def heartbeat_first(rel, data, version):
        if not raced:  # the zombie's heartbeat lands between the taker's read and its write
            raced.append(zombie.renew())
        return real(rel, data, version)
    taker_t.put_if_match = heartbeat_first
    taker = WriterLease(taker_t, heartbeat=3600)
    taker.acquire(takeover=True)
    assert raced == [True] and taker.owned and not taker.replaced
    assert taker.generation == zombie.generation + 1 == 2
    assert taker.read()["token"] == taker.token
    assert not zombie.renew() and zombie.replaced  # the zombie finds out at its next write
    taker.release()


def test_a_heartbeat_whose_answer_was_lost_is_still_ours_and_a_takers_record_is_not(remote):
    """A conditional write that landed although its answer timed out leaves our own record at a
    version we never learned: the next heartbeat finds our token there and goes on. A taker's
    record at that point still replaces us."""
    from tieredckpt._tiers.transport import Transport
    from tieredckpt.errors import RemoteError
    t = Transport(remote.url, remote.options)
    t.probe(create=True)
    lease = WriterLease(t, heartbeat=3600)
    lease.acquire()
    real = t.put_if_match

    def lands_then_times_out(rel, data, version):
        real(rel, data, version)
        raise RemoteError(f"{rel}: no answer within 2 s (injected)", transient=True)
    t.put_if_match = lands_then_times_out
    with pytest.raises(RemoteError):
        lease.renew()
    t.put_if_match = real
    assert lease.renew() and lease.owned and not lease.replaced  # our token is there: still ours
    taker = WriterLease(Transport(remote.url, remote.options), heartbeat=3600)
    taker.acquire(takeover=True)
    assert not lease.renew() and lease.replaced
    taker.release()
