"""Unchanged bytes are sent once: the parts of a step are objects shared by every later step whose
bytes there did not change (objects.py), and deleting a step never breaks another's reference.

Real torch models and AdamW, moto's S3 server over HTTP and file:// (the ``remote`` fixture),
real subprocesses killed with SIGKILL.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT
from forkserver import ForkServer
from lostpart import losing_commit

from tieredckpt import CheckpointStore, KeepLast
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.objects import part_bounds
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt.errors import CheckpointExistsError, CheckpointNotFoundError, RemoteError


def frozen_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen 9.4 MB embedding (a vision tower, a reference model) beside a trainable 1 MB head:
    with AdamW's two moments on the head, the frozen bytes are 75% of the checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(2304, 1024), torch.nn.Linear(1024, 256))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        x = torch.randint(0, 2304, (8,))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def checkpoint(model, opt, step: int) -> dict:
    """A copy: state_dict() hands out the live tensors, which the next steps change."""
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "step": step})


def objects_present(remote: RemoteTier) -> dict[str, int]:
    return {f"objects/{name}": size for name, size in remote.t.list_files("objects").items()}


def assert_no_dangling(remote: RemoteTier) -> set[str]:
    """Every object every committed step names is on the remote with its stored size."""
    present, named = objects_present(remote), set()
    for step in remote.steps():
        upload = remote.upload_manifest(step)
        for f in upload.files:
            for part in f.parts:
                assert present.get(part.path) == part.stored_size, (step, part.path)
                named.add(part.path)
    return named


def test_part_bounds_cut_at_every_large_tensor_and_cover_every_byte():
    tensors = [(100, 164), (192, 192 + 3000), (3200, 3264), (3264, 3264 + 5000)]
    bounds = part_bounds(8264, tensors, part_size=2048, alone=1000)
    assert bounds[0] == (0, 100)  # the header alone
    assert all(b[0] == a[1] for a, b in zip(bounds, bounds[1:])) and bounds[-1][1] == 8264
    starts = {a for a, _ in bounds}
    assert {192, 3264} <= starts and 3192 in starts  # both large tensors begin a part, and end one
    assert max(b - a for a, b in bounds) <= 2048
    assert part_bounds(0, [], 2048) == [(0, 0)]


def test_frozen_weights_are_sent_once_and_every_kept_step_restores_on_a_fresh_machine(tmp_path, remote):
    """5 checkpoints 10 steps apart; frozen 75% of the bytes: checkpoints 2-5 each send <= 0.3x the
    first's bytes. KeepLast(2) then deletes steps 10-30: 40 and 50 restore bit-identically, and
    no object only the deleted steps named is left."""
    model, opt = frozen_model()
    expected, status = {}, {}
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options, keep_local=2,
                         keep_remote=KeepLast(2), upload_part_size=1 << 20) as store:
        for step in range(10, 60, 10):
            train(model, opt, 10)
            expected[step] = checkpoint(model, opt, step)
            store.save(step, expected[step]).wait()
            assert store.wait(uploads=True, timeout=60)
            status[step] = store.upload_status()["steps"][step]  # (kept while the step is local)
    sent = {s: status[s]["bytes_sent"] for s in expected}
    referenced = {s: status[s]["bytes_referenced"] for s in expected}
    assert sent[10] == referenced[10]
    for step in (20, 30, 40, 50):
        assert sent[step] <= 0.3 * sent[10], (sent, referenced)
        assert referenced[step] >= 0.95 * referenced[10]  # whole checkpoints, made mostly of references
    r = RemoteTier(remote.url, remote.options)
    assert r.steps() == [40, 50]
    named = assert_no_dangling(r)
    assert set(objects_present(r)) == named  # retention left nothing only 10-30 used
    assert r.orphan_objects(grace=0) == ([], None)
    for step in (40, 50):
        fresh = tmp_path / f"fresh{step}"
        with CheckpointStore(fresh, remote.url, remote_options=remote.options, read_only=True) as reader:
            assert first_difference(expected[step], reader.restore(step, mark_resume=False)) is None
    upload = r.upload_manifest(50)
    assert upload.sent_size == sent[50] and upload.stored_size == referenced[50]


def test_a_fully_trainable_model_sends_every_byte_and_references_nothing(tmp_path, remote):
    torch.manual_seed(1)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options) as store:
        for step in (1, 2):
            train_linear(model, opt)
            store.save(step, checkpoint(model, opt, step)).wait()
            assert store.wait(uploads=True, timeout=60)
        status = store.upload_status()["steps"]
    assert status[2]["bytes_sent"] == status[2]["bytes_referenced"]


def train_linear(model, opt) -> None:
    loss = model(torch.randn(4, 512)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_a_part_whose_crc32c_matches_but_bytes_differ_is_sent_not_referenced(tmp_path, remote, monkeypatch):
    """A crc32c can collide: reuse compares bytes with the local copy. Here every crc32c is made to
    collide, so only the byte comparison stands between a changed tensor and a wrong reference."""
    import tieredckpt._tiers.download as download_mod
    import tieredckpt._tiers.partsource as partsource
    import tieredckpt._tiers.remote as remote_mod
    for module in (remote_mod, download_mod):  # sent, and checked when read back
        monkeypatch.setattr(module, "crc_hex", lambda value: "00000000")
    # the forged parts' crc32c no longer chain into the file's own, which the sent-check rightly
    # refuses (test_files proves it); here it stands aside so that only the byte comparison is tested
    monkeypatch.setattr(partsource.SentCheck, "verify", lambda self: None)
    # the forged crc32c must not travel as the request's checksum: a real server checks it and
    # refuses the write (SeaweedFS does: BadDigest), which is the point of sending it
    options = {**remote.options, "config_kwargs": {"request_checksum_calculation": "when_required"}} \
        if remote.url.startswith("s3://") else remote.options
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=options, compression=None,
                         upload_part_size=1 << 20) as store:
        for step in (1, 2):
            store.save(step, {"w": torch.full((300_000,), float(step)), "step": step}).wait()
            assert store.wait(uploads=True, timeout=60)
    shutil.rmtree(tmp_path / "run")
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options, read_only=True) as reader:
        got = reader.restore(2, mark_resume=False)
    assert torch.equal(got["w"], torch.full((300_000,), 2.0))


def test_hostile_object_references_are_refused_by_name_and_the_restore_falls_back(tmp_path, remote):
    model, opt = frozen_model()
    states = {}
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options,
                         upload_part_size=1 << 20) as store:
        for step in (1, 2):
            train(model, opt, 2)
            states[step] = checkpoint(model, opt, step)
            store.save(step, states[step]).wait()
            assert store.wait(uploads=True, timeout=60)
    r = RemoteTier(remote.url, remote.options)
    rel = r.path("step_000002", "upload.json")
    original = r.fs.cat_file(rel)
    sent = next(p for p in r.upload_manifest(2).files[0].parts if p.sent)  # an object only step 2 names
    shared = next(p for p in r.upload_manifest(2).files[0].parts if not p.sent)
    outside = f"../objects/{shared.raw_crc32c}-{shared.raw_size}-{'a' * 16}"
    cases = {
        "outside the run's object store": lambda doc, part: part.update(path=outside),
        "a step's own directory": lambda doc, part: part.update(path="step_000001/upload.json"),
        "named for other bytes": lambda doc, part: part.update(raw_crc32c=f"{int(part['raw_crc32c'], 16) ^ 1:08x}"),
    }
    for why, edit in cases.items():
        doc = json.loads(original)
        part = next(p for p in doc["files"][0]["parts"] if p["path"] == shared.path)
        edit(doc, part)
        r.fs.pipe_file(rel, json.dumps(doc).encode())
        fresh = tmp_path / f"fresh-{len(why)}"
        with CheckpointStore(fresh, remote.url, remote_options=remote.options, read_only=True) as reader:
            with pytest.warns(RuntimeWarning, match=r"step 2 refused .*upload\.json"):
                got = reader.restore(mark_resume=False)
        assert got["step"] == 1 and first_difference(states[1], got) is None, why
        written = sorted(p.name for p in fresh.iterdir() if p.name.startswith("step_")) if fresh.exists() else []
        assert "step_000002" not in written, why  # nothing of the refused step was kept
    r.fs.pipe_file(rel, original)
    # an object whose content does not match its name: found at the read, named, the restore falls back
    body = bytearray(r.fs.cat_file(r.path(sent.path)))
    body[len(body) // 2] ^= 0xFF
    r.fs.pipe_file(r.path(sent.path), bytes(body))
    with CheckpointStore(tmp_path / "fresh-corrupt", remote.url, remote_options=remote.options,
                         read_only=True) as reader:
        with pytest.warns(RuntimeWarning, match=sent.path.split("/")[-1] + r".*corrupt remote object"):
            got = reader.restore(mark_resume=False)
    assert got["step"] == 1 and first_difference(states[1], got) is None


def test_another_run_on_the_bucket_rewriting_its_objects_never_touches_ours(tmp_path, remote):
    """Each run's objects live under its own root: nothing another run writes or deletes is named
    by our steps, so its rewrites and its retention cannot break them."""
    model, opt = frozen_model()
    ours = checkpoint(model, opt, 1)
    other_url = remote.url.rstrip("/") + "-other"
    for url in (remote.url, other_url):
        with CheckpointStore(tmp_path / url.rsplit("-", 1)[-1], url, remote_options=remote.options) as store:
            store.save(1, ours).wait()
            assert store.wait(uploads=True, timeout=60)
    other = RemoteTier(other_url, remote.options)
    for rel in objects_present(other):
        other.fs.pipe_file(other.path(rel), b"rewritten")
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as reader:
        assert first_difference(ours, reader.restore(mark_resume=False)) is None


def test_a_fork_onto_the_same_storage_sends_no_step_bytes_and_outlives_the_parents_retention(tmp_path, proxied):
    """fork(step, dir, remote=URL) copies the step's objects on the storage's side: the request bodies
    that cross the wire (counted by the proxy in front of moto) are the manifests, <= 1% of the
    step; the fork restores bit-identically on a fresh machine, a store opened on it sends nothing,
    and the parent's retention deleting that step (then gc) never touches the fork's copies."""
    model, opt = frozen_model()
    child_url = proxied.url + "-fork"
    states = {}
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options, keep_local=2,
                         keep_remote=KeepLast(1), upload_part_size=1 << 20) as parent:
        states[1] = checkpoint(model, opt, 1)
        parent.save(1, states[1]).wait()
        assert parent.wait(uploads=True, timeout=60)
        step_bytes = parent.remote.upload_manifest(1).stored_size
        before = proxied.proxy.body_bytes
        parent.fork(1, tmp_path / "child", remote=child_url)
        sent = proxied.proxy.body_bytes - before
        assert sent <= 0.01 * step_bytes, (sent, step_bytes)
        train(model, opt, 5)
        for step in (2, 3):  # KeepLast(1): the parent deletes step 1 and every object only it named
            states[step] = checkpoint(model, opt, step)
            parent.save(step, states[step]).wait()
            assert parent.wait(uploads=True, timeout=60)
    parent_remote = RemoteTier(proxied.url, proxied.direct)
    assert parent_remote.steps() == [3] and parent_remote.orphan_objects(grace=0) == ([], None)
    child = RemoteTier(child_url, proxied.direct)
    assert child.steps() == [1] and child.upload_manifest(1).sent_size == 0
    assert_no_dangling(child)
    with CheckpointStore(tmp_path / "fresh", child_url, remote_options=proxied.options, read_only=True) as reader:
        assert first_difference(states[1], reader.restore(mark_resume=False)) is None
    assert "provenance.json" in child.get_side_files(tmp_path / "sides")  # the run's history travels with it
    assert json.loads((tmp_path / "sides" / "provenance.json").read_text())["parent_step"] == 1
    before = proxied.proxy.body_bytes
    with CheckpointStore(tmp_path / "child", child_url, remote_options=proxied.options) as store:
        assert store.wait(uploads=True, timeout=60)
    assert proxied.proxy.body_bytes - before <= 0.01 * step_bytes  # the step is there: not sent again


def test_a_fork_needs_its_step_on_the_remote_and_a_new_remote_prefix(tmp_path, remote):
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options) as parent:
        parent.save(1, {"w": torch.ones(3)}).wait()
        assert parent.wait(uploads=True, timeout=60)
        with pytest.raises(CheckpointNotFoundError, match="step 7 is not on this store's remote"):
            parent.fork(7, tmp_path / "nope", remote=remote.url + "-x")
        with pytest.raises(CheckpointExistsError, match="a fork's remote must be a new prefix"):
            parent.fork(1, tmp_path / "child", remote=remote.url)  # its own remote holds step 1



def test_a_fork_whose_copy_fails_leaves_nothing_behind_and_can_be_retried(tmp_path, proxied):
    """The storage refuses the copies mid-fork (after the local fork and the new remote's lease): the
    error names the object, the local fork that call made is gone again, the new remote holds no
    step, the parent is untouched; the same call then succeeds and the fork restores identically."""
    model, opt = frozen_model()
    child_url = proxied.url + "-fork"
    state = checkpoint(model, opt, 1)
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options,
                         upload_part_size=1 << 20) as parent:
        parent.save(1, state).wait()
        assert parent.wait(uploads=True, timeout=60)
        proxied.proxy.set("403", methods=["PUT"], path="-fork/objects/")  # CopyObject is a PUT
        with pytest.raises(RemoteError, match="copy .*objects/"):
            parent.fork(1, tmp_path / "child", remote=child_url)
        assert proxied.proxy.injected, "the fault never fired: the test proved nothing"
        assert not (tmp_path / "child").exists()
        assert RemoteTier(child_url, proxied.direct).steps() == []
        proxied.proxy.clear()
        parent.fork(1, tmp_path / "child", remote=child_url)
    assert RemoteTier(proxied.url, proxied.direct).steps() == [1]
    with CheckpointStore(tmp_path / "fresh", child_url, remote_options=proxied.options, read_only=True) as reader:
        assert first_difference(state, reader.restore(mark_resume=False)) is None



def test_a_part_lost_before_the_commit_is_sent_again_and_the_step_commits_whole(tmp_path, remote, monkeypatch):
    """The server loses a part between its send and the commit (or it is deleted as an object no
    step named): the commit finds it missing and fails, the next attempt sends it again (and only
    it), and the step restores bit-identically on a fresh machine."""
    lost: list[str] = []
    monkeypatch.setattr(RemoteTier, "commit_upload", losing_commit(0, lost))
    state = {"w": torch.randn(300_000), "step": 1}
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options, upload_part_size=256 << 10,
                         upload_backoff=(0.05, 0.2)) as store:
        store.save(1, state).wait()
        assert store.wait(uploads=True, timeout=60)
    tier = RemoteTier(remote.url, remote.options)
    assert lost and lost[0] not in objects_present(tier)  # sent again under a new name
    assert_no_dangling(tier)
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as reader:
        assert first_difference(state, reader.restore(mark_resume=False)) is None

CUT_SHORT = textwrap.dedent("""
    import json, os, signal, sys, torch
    sys.path.insert(0, sys.argv[3])
    from tieredckpt import CheckpointStore
    from tieredckpt._tiers.remote import RemoteTier
    def killed(*args, **kwargs):  # every part of step 2 is on the remote; its marker never will be
        os.kill(os.getpid(), signal.SIGKILL)
    RemoteTier.commit_upload = killed
    with CheckpointStore(sys.argv[1], sys.argv[2], remote_options=json.loads(sys.argv[4])) as store:
        store.save(2, {"w": torch.full((300_000,), 2.0)}).wait()
        store.wait(uploads=True, timeout=60)
""")


@pytest.mark.parametrize("grace", [0.0, 3600.0])
def test_the_writer_deletes_objects_a_killed_upload_left_once_they_are_older_than_orphan_grace(tmp_path, remote,
                                                                                                grace):
    """A writer SIGKILLed between its parts and its marker leaves objects no step names. The next
    store on that remote deletes them after a commit once they are ``orphan_grace`` old, and nothing
    any committed step names; with the default grace (an hour) a fresh leftover is kept."""
    run = tmp_path / "run"
    with CheckpointStore(run, remote.url, remote_options=remote.options, upload_part_size=256 << 10) as store:
        store.save(1, {"w": torch.ones(300_000)}).wait()
        assert store.wait(uploads=True, timeout=60)
    proc = subprocess.run([sys.executable, "-c", CUT_SHORT, str(run), remote.url, ROOT, json.dumps(remote.options)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    tier = RemoteTier(remote.url, remote.options)
    left, _ = tier.orphan_objects(grace=0)
    assert left, "the killed upload left no objects: the test proved nothing"
    states = {3: {"w": torch.full((300_000,), 3.0)}}
    with CheckpointStore(run, remote.url, remote_options=remote.options, upload_part_size=256 << 10,
                         orphan_grace=grace) as store:
        store.save(3, states[3]).wait()
        assert store.wait(uploads=True, timeout=60)
    present = set(objects_present(tier))
    assert set(left) & present == (set() if grace == 0 else set(left))
    assert_no_dangling(tier)
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as reader:
        assert first_difference(states[3], reader.restore(mark_resume=False)) is None
        assert reader.restore(1, mark_resume=False)["w"].eq(1).all()

KILLED = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from tieredckpt import CheckpointStore, KeepLast
    start = int(sys.argv[2])
    torch.manual_seed(0)
    frozen = torch.randn(600_000)
    with CheckpointStore(sys.argv[1], "file://" + sys.argv[1] + "-remote", keep_local=2, keep_remote=KeepLast(2),
                         upload_part_size=256 << 10, upload_backoff=(0.01, 0.05, 0.05)) as store:
        print("READY", flush=True)
        for step in range(start, start + 1000):
            state = {"frozen": frozen, "head": torch.full((200_000,), float(step)), "step": step}
            store.save(step, state).wait()
            store.wait(uploads=True, timeout=30)
""")


def test_kill_9_during_uploads_and_retention_never_leaves_a_kept_step_naming_a_missing_object(tmp_path):
    """30 SIGKILLs at random moments of a loop whose every step uploads (sending the changed head,
    referencing the frozen tensor) and then runs retention (deleting markers, then objects). After
    every kill a fresh reader finds every committed step whole; gc then removes exactly the orphans."""
    run = tmp_path / "run"
    remote = RemoteTier(f"file://{run}-remote")
    rng = random.Random(7)
    start, kills, server = 1, 0, ForkServer()  # torch imported once: the loop's time goes to killing
    for _ in range(30):
        pid = server.spawn(KILLED, run, start, ROOT, stderr=tmp_path / "stderr")
        line = server.readline()
        assert line.startswith("READY"), line + (tmp_path / "stderr").read_text()
        time.sleep(rng.uniform(0.05, 0.8))
        server.kill(pid, signal.SIGKILL)
        assert server.reap(pid) == -signal.SIGKILL, (tmp_path / "stderr").read_text()
        kills += 1
        assert_no_dangling(remote)
        steps = remote.steps()
        if steps:
            with CheckpointStore(tmp_path / f"fresh{kills}", remote.t.display_url, read_only=True) as reader:
                got = reader.restore(steps[-1], mark_resume=False)
            assert torch.equal(got["head"], torch.full((200_000,), float(steps[-1])))
            shutil.rmtree(tmp_path / f"fresh{kills}", ignore_errors=True)
        held = CheckpointStore(run, read_only=True).list()
        start = max([c.step for c in held], default=start - 1) + 1
    server.close()
    assert kills == 30 and remote.steps()
    named = assert_no_dangling(remote)
    out = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "gc", remote.t.display_url, "--grace", "0"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert set(objects_present(remote)) == named  # every orphan of a killed upload or retention gone
    assert_no_dangling(remote)
