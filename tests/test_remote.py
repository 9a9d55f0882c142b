"""The remote tier against real endpoints: moto's S3 server over HTTP and a file:// directory."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time

import pytest
import torch
from conftest import FlakyFS, flip_byte, trained

from tieredckpt import CheckpointStore, CorruptCheckpointError, KeepEvery, KeepLast, RemoteNotFoundError
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt.errors import UploadError


def state(step, n=5000):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "m": torch.randn(n, generator=g).bfloat16(), "step": step}


def store(run_dir, remote, **kw):
    kw.setdefault("upload_backoff", (0.05, 0.2))
    return CheckpointStore(run_dir, remote.url, remote_options=remote.options, **kw)


@pytest.mark.parametrize("compression", ["zstd-dtype", "zstd-planes", "zstd", None])
def test_fresh_machine_restore_brings_back_state_and_side_files(tmp_path, remote, compression):
    run_dir = tmp_path / "run"
    model, opt = trained(steps=2)
    with store(run_dir, remote, compression=compression, upload_part_size=4096) as s:
        for step in range(1, 4):
            s.log_loss(step, 1.0 / step)
        s.run.write_samples([{"step": 3, "text": "abc"}])
        s.run.write_state({"arms": [1, 2]})
        s.pivot(2, note="mix change")
        s.run.write_samples([{"step": 3, "text": "after pivot"}])
        s.save(3, {"model": model, "optim": opt, "step": 3}).wait()
        s.wait(uploads=True)
    expected = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    side = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file() and ("archive" in p.parts or p.name in (".loss.json", ".samples.json", ".state.json"))}
    shutil.rmtree(run_dir)  # the machine is gone

    fresh = tmp_path / "new-machine"
    with store(fresh, remote) as s:
        restored = s.restore()
        assert first_difference(expected, restored) is None
        for rel, data in side.items():
            got = (fresh / rel).read_bytes()
            assert got == data or rel.name == ".loss.json" and got.startswith(data), rel
        assert sorted(s.run.read_loss().by_step()) == [1, 2, 3]
        assert s.run.pivots()[0]["note"] == "mix change"


def test_upload_manifest_is_the_commit_marker_and_partial_uploads_stay_invisible(tmp_path, remote):
    real = RemoteTier(remote.url, remote.options)
    flaky = FlakyFS(real.fs, {"pipe_file": []})
    s = store(tmp_path / "run", remote, remote_fs=flaky, upload_part_size=2048, upload_backoff=(0.05, 0.2, 0.2))
    s.save(1, state(1)).wait()
    s.wait(uploads=True)
    # The next upload dies after its first parts reach the server, and keeps failing (access denied).
    flaky.fail["pipe_file"] = [None, None] + [PermissionError("Access Denied")] * 1000
    s.save(2, state(2)).wait()
    with pytest.raises(UploadError, match="Access Denied"):
        s.wait(uploads=True)
    r = RemoteTier(remote.url, remote.options)
    assert r.steps() == [1]
    sent = r.orphan_objects(grace=0)[0]
    assert sent and r.uncommitted() == []  # objects step 2 sent are there, named by no upload.json: no step
    # Readers on other machines restore step 1 and delete nothing, however often they open.
    for i in range(3):
        with CheckpointStore(tmp_path / f"reader{i}", remote.url, remote_options=remote.options, read_only=True) as rd:
            assert rd.restore()["step"] == 1
    assert set(sent) <= set(RemoteTier(remote.url, remote.options).orphan_objects(grace=0)[0])
    flaky.fail["pipe_file"] = []  # access restored: the writer finishes step 2 on its own
    assert s.wait(uploads=True, timeout=60)
    s.close()
    assert RemoteTier(remote.url, remote.options).steps() == [1, 2]
    with CheckpointStore(tmp_path / "reader", remote.url, remote_options=remote.options, read_only=True) as rd:
        assert first_difference(state(2), rd.restore()) is None


def test_transient_errors_are_retried_and_the_upload_resumes(tmp_path, remote):
    real = RemoteTier(remote.url, remote.options)
    errors = [OSError("503 Service Unavailable"), None, ConnectionResetError("reset"),
              TimeoutError("read timed out"), None, None, OSError("SlowDown: please reduce your request rate")]
    flaky = FlakyFS(real.fs, {"pipe_file": errors})
    with store(tmp_path / "run", remote, remote_fs=flaky, upload_part_size=4096) as s:
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
        assert [c.step for c in s.list() if c.remote] == [1]
    assert errors == []  # every injected fault was hit, and retried past
    shutil.rmtree(tmp_path / "run")
    with store(tmp_path / "run", remote) as s:
        assert first_difference(state(1), s.restore()) is None


def test_permanent_errors_never_reach_the_loop_every_step_is_reported_and_nothing_unsent_is_evicted(
        tmp_path, remote):
    real = RemoteTier(remote.url, remote.options)
    flaky = FlakyFS(real.fs, {"pipe_file": []})
    seen = []
    s = store(tmp_path / "run", remote, remote_fs=flaky, keep_local=1, uploads="all", max_pending_uploads=None,
              upload_backoff=(0.05, 0.2, 0.2), on_upload_error=lambda step, exc: seen.append(step))
    flaky.fail["pipe_file"] = [PermissionError("Access Denied")] * 10_000  # credentials expired mid-run
    for step in (1, 2, 3):
        s.save(step, state(step)).wait()  # training goes on: nothing is raised into the loop
    deadline = time.monotonic() + 30
    while not {1, 2, 3} <= set(seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    status = json.loads((tmp_path / "run" / ".uploads.json").read_text())
    assert status["last_error"]["transient"] is False and "Access Denied" in status["last_error"]["message"]
    assert s.local.steps() == [1, 2, 3]  # keep_local=1, yet nothing un-uploaded is evicted
    with pytest.raises(UploadError) as failure:
        s.close()
    assert set(failure.value.failures) == {1, 2, 3}  # every failed step is reported, not only the first
    assert all(f"step {n}:" in str(failure.value) for n in (1, 2, 3))
    # A restart with a working remote uploads what never made it, then rotation catches up.
    with store(tmp_path / "run", remote, keep_local=1, uploads="all") as s:
        assert s.wait(uploads=True, timeout=60)
        assert RemoteTier(remote.url, remote.options).steps() == [1, 2, 3]
    with CheckpointStore(tmp_path / "run") as s:
        assert s.local.steps() == [3]


def test_corrupt_remote_object_is_named_on_restore(tmp_path, remote):
    with store(tmp_path / "run", remote, upload_part_size=4096) as s:
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
    r = RemoteTier(remote.url, remote.options)
    rel = r.upload_manifest(1).files[0].parts[2].path  # objects/<crc32c>-<size>-<hex>
    part = r.path(rel)
    data = bytearray(r.fs.cat_file(part))
    data[10] ^= 0xFF
    r.fs.pipe_file(part, bytes(data))
    shutil.rmtree(tmp_path / "run")
    with store(tmp_path / "run", remote) as s:
        with pytest.raises(CorruptCheckpointError, match=re.escape(rel) + ".*corrupt remote object"):
            s.restore()
        assert s.local.steps() == []  # nothing half-downloaded is left looking like a checkpoint
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith("step_")]


def test_a_raw_part_is_checked_once_unless_its_manifest_records_two_crcs(tmp_path, remote):
    """A raw part's stored bytes are its raw bytes, so one crc32c check covers both; an upload
    manifest that records two different crcs for them still gets the second check, and fails."""
    with store(tmp_path / "run", remote, compression=None, upload_part_size=4096) as s:
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
    r = RemoteTier(remote.url, remote.options)
    rel = r.path("step_000001", "upload.json")
    upload = json.loads(r.fs.cat_file(rel))
    assert upload["codec"] == "raw"
    part = upload["files"][0]["parts"][1]
    assert part["raw_crc32c"] == part["stored_crc32c"]
    part["raw_crc32c"] = f"{int(part['raw_crc32c'], 16) ^ 1:08x}"
    forged = f"objects/{part['raw_crc32c']}-{part['raw_size']}-{'0' * 16}"  # named for the forged crc
    r.fs.pipe_file(r.path(forged), r.fs.cat_file(r.path(part["path"])))
    part["path"] = forged
    r.fs.pipe_file(rel, json.dumps(upload).encode())
    shutil.rmtree(tmp_path / "run")
    with store(tmp_path / "run", remote) as s:
        with pytest.raises(CorruptCheckpointError, match=re.escape(part["path"]) + ".*decoded bytes fail their crc32c"):
            s.restore()


def test_corrupt_local_copy_falls_back_to_the_remote_with_a_warning(tmp_path, remote):
    with store(tmp_path / "run", remote) as s:
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
    flip_byte(tmp_path / "run" / "step_000001" / "rank0.bin", 500)
    with store(tmp_path / "run", remote) as s:
        with pytest.warns(RuntimeWarning, match="rank0.bin.*remote copy"):
            restored = s.restore()
    assert first_difference(state(1), restored) is None
    with CheckpointStore(tmp_path / "run") as s:
        assert s.local.verify(1).step == 1  # the local copy was replaced by a good one
    (moved,) = (tmp_path / "run" / "quarantine").iterdir()  # the bad one kept aside, not deleted
    assert moved.name.startswith("step_000001.")


def test_remote_retention_keeps_last_n_and_every_mth(tmp_path, remote):
    from tieredckpt import AnyOf
    with store(tmp_path / "run", remote, keep_remote=AnyOf(KeepLast(2), KeepEvery(4)), keep_local=1,
               every=1) as s:
        for step in range(1, 10):
            s.save(step, {"step": step})
            s.wait(uploads=True)
    assert RemoteTier(remote.url, remote.options).steps() == [4, 8, 9]
    assert RemoteTier(remote.url, remote.options).latest_pointer() == 9


def test_credentials_never_appear_in_logs_manifests_status_or_cli(tmp_path, moto_server, caplog):
    import subprocess
    import sys
    key, secret = "AKIASECRETKEYID12345", "VerySecret/Value+0987654321"
    moto_server.make_bucket("creds")
    options = {**moto_server.options(), "key": key, "secret": secret}
    caplog.set_level(logging.DEBUG)
    url = "s3://creds/run"
    with CheckpointStore(tmp_path / "run", url, remote_options=options, upload_backoff=(0.05, 0.1)) as s:
        s.log_loss(1, 0.5)
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
    # and a failing remote (missing bucket), whose error is raised at open
    with pytest.raises(RemoteNotFoundError) as failure:
        CheckpointStore(tmp_path / "bad", "s3://no-such-bucket/x", remote_options=options)
    cli = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", str(tmp_path / "run"),
                          "--endpoint-url", moto_server.endpoint],
                         capture_output=True, text=True, env={"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                                                              "PATH": "/usr/bin:/bin"})
    assert cli.returncode == 0, cli.stderr
    assert "remote" in cli.stdout
    assert "no-such-bucket" in str(failure.value) and "does not exist" in str(failure.value)
    # botocore's own DEBUG log prints the access key *id* in the Authorization header (never the
    # secret); everything tieredckpt writes, logs, raises or prints must hold neither.
    assert secret not in caplog.text
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tieredckpt"))
    texts = [ours, str(failure.value), cli.stdout, cli.stderr]
    texts += [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".json"]
    fs = RemoteTier(url, options).fs
    texts += [fs.cat_file(p).decode(errors="replace") for p in fs.find("creds") if p.endswith(".json")]
    for text in texts:
        assert key not in text and secret not in text


def test_codecs_round_trip_every_length_and_refuse_garbage():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tieredckpt._format.codec import decode, encode

    @settings(max_examples=80, deadline=None)
    @given(data=st.binary(max_size=3000), codec=st.sampled_from(["raw", "zstd", "zstd-planes", "zstd-dtype"]))
    def round_trip(data, codec):
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        assert bytes(decode(encode(raw, codec), codec, len(data), "x")) == data

    round_trip()
    stored = encode(torch.arange(4000, dtype=torch.float32).view(torch.uint8), "zstd-planes")
    for bad in (stored[:5], stored[:-1], b"\xff" * 40):
        with pytest.raises(CorruptCheckpointError, match="obj"):
            decode(bad, "zstd-planes", 16000, "obj")


def test_memory_remote_for_unit_tests(tmp_path):
    import uuid
    url = f"memory://tieredckpt-{uuid.uuid4().hex}"
    with CheckpointStore(tmp_path / "run", url) as s:
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
    with CheckpointStore(tmp_path / "fresh", url) as s:
        assert first_difference(state(1), s.restore()) is None


class SlowFS(FlakyFS):
    """A remote so slow at taking parts that an upload is still running when the process leaves."""

    def __init__(self, inner, gate) -> None:
        super().__init__(inner, {})
        self.gate = gate

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name != "pipe_file":
            return attr

        def slow(path, *args, **kwargs):
            if "/objects/" in path:
                self.gate.wait(60)
            return attr(path, *args, **kwargs)
        return slow


@pytest.mark.parametrize("how", ["sigterm", "exception"])
def test_stopping_or_failing_leaves_pending_uploads_to_the_next_start(tmp_path, remote, how):
    import threading
    gate = threading.Event()
    # the held part outlasts the second SIGTERM allows for the newest step (upload_on_exit)
    s = store(tmp_path / "run", remote, remote_fs=SlowFS(RemoteTier(remote.url, remote.options).fs, gate),
              upload_on_exit=1.0)
    if how == "sigterm":
        s.requests.request_stop()  # what SIGTERM does
        assert s.step_end(7, {"step": 7}) is True  # committed locally before it returns
        s.close()
    else:
        with pytest.raises(RuntimeError, match="training blew up"):
            with s:
                s.save(7, {"step": 7}).wait()
                raise RuntimeError("training blew up")
    # close() returned while the part upload was still held at the gate: it did not wait for it
    assert s.local.steps() == [7] and 7 not in RemoteTier(remote.url, remote.options).steps()
    gate.set()
    with store(tmp_path / "run", remote) as again:  # the next start resumes it
        again.wait(uploads=True)
        assert 7 in RemoteTier(remote.url, remote.options).steps()
