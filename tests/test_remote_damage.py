"""A damaged remote is noticed: ``ls`` never calls a step that does not restore up to date, and
a running store sends its newest step again from the local copy."""

from __future__ import annotations

import time

import torch
from test_remote_cli import cli

from tieredckpt import CheckpointNotFoundError, CheckpointStore
from tieredckpt._tiers.remote import RemoteTier


def state(step: int) -> dict:
    frozen = torch.arange(400_000, dtype=torch.float32)  # 1.6 MB: parts of its own, shared by every step
    return {"frozen": frozen, "head": torch.full((5000,), float(step)), "step": step}


def flip_shared_object(remote: RemoteTier, step: int) -> str:
    """Flip one byte in the middle of the largest object ``step`` names (the frozen tensor's)."""
    upload = remote.upload_manifest(step)
    part = max((p for f in upload.files for p in f.parts), key=lambda p: p.stored_size)
    rel = upload.part_rel(part)
    data = bytearray(remote.t.get(rel, part.stored_size))
    data[len(data) // 2] ^= 0xFF
    remote.t.put(rel, bytes(data))
    return rel


def sound(remote: RemoteTier, step: int) -> bool:
    """Committed and undamaged now (the store may be deleting or re-sending it meanwhile)."""
    try:
        return remote.is_committed(step) and not remote.damage(step)
    except CheckpointNotFoundError:
        return False


def test_ls_says_a_damaged_newest_step_does_not_restore_and_the_store_sends_it_again(tmp_path, moto_server):
    moto_server.make_bucket("damaged")
    url, run = "s3://damaged/run", tmp_path / "run"
    opts = moto_server.options()
    with CheckpointStore(run, url, remote_options=opts, compression=None) as store:
        for step in (1, 2):
            store.save(step, state(step)).wait()
            assert store.wait(uploads=True, timeout=60)
    remote = RemoteTier(url, opts)
    flip_shared_object(remote, 2)
    assert remote.damage(2)
    out = cli("ls", run, "--remote", url, endpoint=moto_server.endpoint)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "its newest step 2 is DAMAGED and does not restore" in out.stdout
    assert "the remote is up to date" not in out.stdout

    with CheckpointStore(run, url, remote_options=opts, compression=None, audit_interval=0.2) as store:
        deadline = time.monotonic() + 60
        while not sound(remote, 2):
            assert time.monotonic() < deadline, "the damaged step was never sent again"
            time.sleep(0.2)
        assert store.wait(uploads=True, timeout=60)
    assert "the remote is up to date" in cli("ls", run, "--remote", url, endpoint=moto_server.endpoint).stdout
    with CheckpointStore(tmp_path / "fresh", url, remote_options=opts, read_only=True) as fresh:
        got = fresh.restore(2)
    assert torch.equal(got["frozen"], state(2)["frozen"]) and torch.equal(got["head"], state(2)["head"])


def test_damage_finds_a_missing_and_a_cut_short_object_and_nothing_on_a_sound_step(tmp_path, remote):
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options, compression=None) as store:
        store.save(1, state(1)).wait()
        assert store.wait(uploads=True, timeout=60)
    tier = RemoteTier(remote.url, remote.options)
    assert tier.damage(1) == {}
    upload = tier.upload_manifest(1)
    rels = sorted({upload.part_rel(p) for f in upload.files for p in f.parts})
    tier.t.rm(rels[0])
    data = tier.t.get(rels[-1], 1 << 30)
    tier.t.put(rels[-1], data[:-1])
    bad = tier.damage(1)
    assert set(bad) == {rels[0], rels[-1]}
    assert "missing" in bad[rels[0]] and "the upload manifest records" in bad[rels[-1]]


def test_a_running_store_that_uploaded_the_step_sends_it_again_without_the_damaged_object(tmp_path, moto_server):
    """The store's own index knows the damaged object (it sent it): the step sent again must not
    name it, or the fresh copy would be as broken as the first."""
    moto_server.make_bucket("damaged-live")
    url, opts = "s3://damaged-live/run", moto_server.options()
    remote = RemoteTier(url, opts)
    with CheckpointStore(tmp_path / "run", url, remote_options=opts, compression=None, audit_interval=0.2) as store:
        for step in (1, 2):
            store.save(step, state(step)).wait()
            assert store.wait(uploads=True, timeout=60)
        rel = flip_shared_object(remote, 2)
        assert rel in remote.upload_manifest(1).objects()  # step 1 names it too: the index knows it
        deadline = time.monotonic() + 60
        while not sound(remote, 2):
            assert time.monotonic() < deadline, "the damaged step was never sent again"
            time.sleep(0.2)
        upload = remote.upload_manifest(2)
        assert rel not in {upload.part_rel(p) for f in upload.files for p in f.parts}
    with CheckpointStore(tmp_path / "fresh", url, remote_options=opts, read_only=True) as fresh:
        assert torch.equal(fresh.restore(2)["frozen"], state(2)["frozen"])


def test_an_object_found_damaged_is_never_named_again_by_a_later_step_while_a_kept_step_still_knows_it(
        tmp_path, moto_server):
    """Step 1 (kept, locally and remotely) names the same frozen-weights object as step 2. When
    the audit finds that object damaged in step 2, step 1's entry for it must be forgotten too:
    otherwise step 3, whose frozen bytes are the same and whose local step 1 compares equal,
    would reference the damaged object and be committed as broken as step 2 was."""
    moto_server.make_bucket("damaged-reuse")
    url, opts = "s3://damaged-reuse/run", moto_server.options()
    remote = RemoteTier(url, opts)
    with CheckpointStore(tmp_path / "run", url, remote_options=opts, compression=None, uploads="all",
                         audit_interval=3600) as store:  # no audit of its own: the test runs it
        for step in (1, 2):
            store.save(step, state(step)).wait()
            assert store.wait(uploads=True, timeout=60)
        rel = flip_shared_object(remote, 2)
        index = store.uploader.index
        assert any(k.entry.path == rel and k.step == 1 for known in index._by_key.values() for k in known)
        assert store.uploader._replace_if_damaged(2)  # what the audit does when it finds the damage
        assert not any(k.entry.path == rel for known in index._by_key.values() for k in known)
        store.save(3, state(3)).wait()
        assert store.wait(uploads=True, timeout=60)
        assert rel not in remote.upload_manifest(3).objects()
    assert remote.damage(3) == {}
    with CheckpointStore(tmp_path / "fresh", url, remote_options=opts, read_only=True) as fresh:
        assert torch.equal(fresh.restore(3)["frozen"], state(3)["frozen"])


def test_an_idle_store_reads_a_steps_objects_back_once_not_at_every_audit(tmp_path, proxied):
    """The damage check reads objects back (up to 16 MB): at every audit (each minute by default)
    that would be gigabytes a day from a run that only waits. A step is checked at its first
    audit; later audits look at its marker alone, until DAMAGE_EVERY audits have passed."""
    from tieredckpt._tiers.uploadkeeping import DAMAGE_EVERY
    audit = 0.05
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options, compression=None,
                         audit_interval=audit) as store:
        store.save(1, state(1)).wait()
        assert store.wait(uploads=True, timeout=60)
        parts = len(proxied.remote().upload_manifest(1).objects())
        proxied.proxy.reset_counts()
        time.sleep(audit * DAMAGE_EVERY * 0.5)  # about 30 audits, none of them due a damage check but the first
        reads = len(proxied.proxy.requests("GET", contains="/run/objects/"))
        markers = len(proxied.proxy.requests(contains="/run/step_000001/upload.json"))
    assert reads <= parts, (reads, parts)  # one check's sample at most, never one per audit
    assert markers >= 10, markers  # the audits did run, looking at the marker each time
