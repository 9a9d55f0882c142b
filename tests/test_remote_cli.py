"""The remote side of the command line, and an S3 server that dies mid-upload."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import torch
from s3server import CREDS, MotoServer

from tieredckpt import CheckpointStore
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.local import LocalTier
from tieredckpt._tiers.remote import RemoteTier


def cli(*args, endpoint=None):
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"])
    extra = ["--endpoint-url", endpoint] if endpoint else []
    return subprocess.run([sys.executable, "-m", "tieredckpt.cli", *map(str, args), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def state(step, n=20_000):
    return {"w": torch.arange(n, dtype=torch.float32) * step, "step": step}


def test_ls_push_and_restore_on_a_fresh_machine(tmp_path, moto_server):
    moto_server.make_bucket("clibucket")
    url = "s3://clibucket/run1"
    run = tmp_path / "run"
    with CheckpointStore(run, url, remote_options=moto_server.options(), every=1) as s:
        s.log_loss(1, 0.5)
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
    # Two more steps saved while the store ran without its remote: they are pending.
    with CheckpointStore(run, every=1) as s:
        s.save(2, state(2)).wait()
        s.save(3, state(3)).wait()
    out = cli("ls", run, "--remote", url, endpoint=moto_server.endpoint)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:] if line.split()[0].isdigit()}
    assert "local+remote" in rows["1"] and "upload pending" in rows["2"] and "upload pending" in rows["3"]
    assert "2 checkpoint(s) not uploaded yet; the remote's newest is step 1, 2 steps behind" in out.stdout

    out = cli("push", run, "--remote", url, endpoint=moto_server.endpoint)
    assert out.returncode == 0, out.stderr
    assert "uploaded steps [2, 3]" in out.stdout
    assert "the remote is up to date" in cli("ls", run, "--remote", url, endpoint=moto_server.endpoint).stdout

    fresh = tmp_path / "fresh-machine"
    out = cli("restore", url, "--to", fresh, endpoint=moto_server.endpoint)
    assert out.returncode == 0, out.stderr
    assert "restored step 3" in out.stdout and ".loss.json" in out.stdout
    (restored,) = LocalTier(fresh).load(3)
    assert first_difference(state(3), restored) is None
    out = cli("restore", url, "--to", tmp_path / "old", "--step", 2, endpoint=moto_server.endpoint)
    assert out.returncode == 0 and LocalTier(tmp_path / "old").steps() == [2]
    out = cli("restore", url, "--to", tmp_path / "x", "--step", 9, endpoint=moto_server.endpoint)
    assert out.returncode == 3 and "no uploaded checkpoint for step 9" in out.stderr and "Traceback" not in out.stderr


class GatedFS:
    """Passes every call to a real filesystem, but holds calls while the gate is closed.

    moto keeps buckets in memory, so a restarted moto is empty; a real server comes
    back with its buckets. The gate holds the uploader's retries while the test brings
    the server back and recreates the bucket, so they meet the server a real outage
    would end with."""

    def __init__(self, inner) -> None:
        import threading
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.in_flight = 0  # calls past the gate, not returned yet
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def gated(*args, **kwargs):
            self.gate.wait(60)
            with self._lock:
                self.in_flight += 1
            try:
                return attr(*args, **kwargs)
            finally:
                with self._lock:
                    self.in_flight -= 1
        return gated


def until(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_server_stopped_mid_upload_nothing_visible_nothing_evicted_then_it_completes(tmp_path):
    server = MotoServer().start()
    try:
        server.make_bucket("outage")
        url = "s3://outage/run"
        fs = GatedFS(RemoteTier(url, server.options()).fs)
        s = CheckpointStore(tmp_path / "run", url, remote_options=server.options(), keep_local=1, uploads="all",
                            max_pending_uploads=None, upload_part_size=256 << 10, upload_backoff=(0.2, 1.0),
                            remote_fs=fs)
        s.save(1, state(1)).wait()
        s.wait(uploads=True)
        big = {"w": torch.randn(6_000_000), "step": 2}  # 24 MB: ~90 parts
        s.save(2, big).wait()
        direct = RemoteTier(url, server.options())
        before = len(direct.upload_manifest(1).objects())
        until(lambda: len(direct.t.list_files("objects")) >= 3 + before, "some parts of step 2 on the server")
        server.kill()  # the server dies mid-upload
        s.save(3, state(3)).wait()  # training goes on locally
        until(lambda: s.uploader.status()[2]["state"] == "retrying", "the uploader to notice")
        assert s.local.steps() == [2, 3]  # keep_local=1: 1 (uploaded) went; 2 and 3 (not uploaded) stay
        fs.gate.clear()  # hold new calls; calls already past the gate fail against the dead port
        until(lambda: fs.in_flight == 0, "the calls past the gate to fail against the dead port")
        server.start()  # back, on the same port
        server.make_bucket("outage")
        assert RemoteTier(url, server.options()).steps() == []  # nothing half-written is visible
        fs.gate.set()
        s.wait(uploads=True, timeout=120)
        assert set(RemoteTier(url, server.options()).steps()) >= {2, 3}
        assert s.local.steps() == [3]  # once uploaded, rotation evicts
        s.close()
        shutil.rmtree(tmp_path / "run")
        with CheckpointStore(tmp_path / "run", url, remote_options=server.options()) as fresh:
            assert fresh.restore(2)["w"].equal(big["w"])
    finally:
        server.kill()
