"""Reading a remote safely and in O(1): everything in a bucket is untrusted input.

Planted objects, a step-mismatched or oversized upload manifest, a part that
claims 1,000 times its stored size, a malformed newest step, side files after a
killed restore, and the number of requests opening a store costs at 10 and at
2,000 remote steps (counted by the fault proxy between s3fs and moto).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zstandard
from remotefill import fill

from tieredckpt import CheckpointStore, ManifestError
from tieredckpt._format.checksum import crc32c_update, crc_hex
from tieredckpt._format.compare import first_difference
from tieredckpt._format.layout import scratch_owner_pid
from tieredckpt._tiers.remote import RemoteTier


def state(step: int, n: int = 50_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def uploaded(tmp_path, remote, steps=(1,), **kw) -> Path:
    run = tmp_path / "origin"
    with CheckpointStore(run, remote.url, remote_options=remote.options, upload_part_size=64 << 10, **kw) as s:
        for step in steps:
            s.log_loss(step, 1.0 / step)
            s.save(step, state(step)).wait()
            assert s.wait(uploads=True, timeout=60)
    return run


def test_planted_objects_under_run_are_ignored_and_nothing_outside_the_known_names_appears(tmp_path, remote):
    uploaded(tmp_path, remote)
    r = RemoteTier(remote.url, remote.options)
    planted = {"run/step_000050/manifest.json": b"{}", "run/step_000050/rank0.bin": b"x" * 100,
               "run/.uploads.json": json.dumps({"remote": "s3://elsewhere/x"}).encode(),
               "run/unknown.txt": b"hello", "run/archive/not_a_pivot/x.json": b"{}", "run/.lock": b""}
    for rel, data in planted.items():
        r.t.put(rel, data)
    fresh = tmp_path / "fresh"
    with pytest.warns(RuntimeWarning) as caught:
        with CheckpointStore(fresh, remote.url, remote_options=remote.options) as s:
            assert first_difference(state(1), s.restore()) is None
            assert s.local.steps() == [1]  # the planted step_000050 did not become a step
    for rel in planted:
        assert any(rel in str(w.message) and "ignored" in str(w.message) for w in caught), rel
    names = {str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file()}
    assert names <= {".loss.json", ".lock", "latest", ".uploads.json", "step_000001/manifest.json",
                     "step_000001/rank0.bin"}
    status = json.loads((fresh / ".uploads.json").read_text())
    assert status["remote"] == remote.url.split("@")[-1] or "elsewhere" not in status["remote"]


def test_an_upload_manifest_copied_to_another_step_is_refused_and_the_previous_step_used(tmp_path, remote):
    uploaded(tmp_path, remote, steps=(1,))
    r = RemoteTier(remote.url, remote.options)
    for path in r.fs.find(r.path("step_000001")):  # a copy of step 1 placed as step 9
        r.fs.pipe_file(path.replace("step_000001", "step_000009"), r.fs.cat_file(path))
    r.write_latest(9)
    fresh = tmp_path / "fresh"
    with CheckpointStore(fresh, remote.url, remote_options=remote.options) as s:
        with pytest.raises(ManifestError, match="names step 1, but it lies in the directory of step 9"):
            s.restore(9)
        with pytest.warns(RuntimeWarning, match="step 9 refused .*names step 1"):
            assert s.restore()["step"] == 1
        s.save(10, state(10)).wait()  # and the run goes on


def test_a_malformed_newest_remote_step_falls_back_to_the_previous_good_one(tmp_path, remote):
    uploaded(tmp_path, remote, steps=(1, 2))
    r = RemoteTier(remote.url, remote.options)
    r.t.put("step_000002/upload.json", b'{"schema_version": 1, "step": 2, "codec": ')  # torn by a broken tool
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options) as s:
        with pytest.warns(RuntimeWarning, match=r"step 2 refused .*step_000002/upload.json: not valid JSON"):
            assert first_difference(state(1), s.restore()) is None
        s.save(3, state(3)).wait()
        assert s.wait(uploads=True, timeout=60)
    assert RemoteTier(remote.url, remote.options).newest_step() == 3


def test_an_oversized_upload_manifest_is_refused_without_being_read(tmp_path, remote):
    uploaded(tmp_path, remote, steps=(1,))
    r = RemoteTier(remote.url, remote.options)
    r.t.put("step_000001/upload.json", b" " * (9 << 20))
    with pytest.raises(ManifestError, match=r"larger than the 8388608 bytes allowed"):
        r.upload_manifest(1)


BOMB_READER = """
import sys, json, threading, time
sys.path.insert(0, {root!r})
from tieredckpt import CheckpointStore

def anon_kb():  # heap and other private memory; a mapped file's pages are not counted here
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon_kb())
        time.sleep(0.002)
store = CheckpointStore(sys.argv[1], sys.argv[2], remote_options=json.loads(sys.argv[3]), read_only=True)
base = anon_kb()
threading.Thread(target=sample, daemon=True).start()
try:
    store.restore(1)
    outcome = "restored"
except Exception as exc:
    outcome = f"{{type(exc).__name__}}: {{exc}}"
done.set()
print(json.dumps({{"outcome": outcome, "grew_mb": (peak[0] - base) / 1024}}))
"""


@pytest.mark.parametrize("codec", ["zstd", "zstd-dtype"])
def test_a_part_claiming_1000x_its_stored_size_is_decoded_in_bounded_memory(tmp_path, remote, codec):
    """Four 64 MB parts from 64 KB each: decoding streams into the file, chunk by chunk."""
    uploaded(tmp_path, remote, steps=(1,), compression=codec)
    r = RemoteTier(remote.url, remote.options)
    upload = json.loads(r.fs.cat_file(r.path("step_000001", "upload.json")))
    raw_size, zeros = 64 << 20, bytes(64 << 20)
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(zeros)
    if codec == "zstd-dtype":  # one run of plain bytes, its one plane the bomb
        bomb = struct.pack("<I", 1) + struct.pack("<QB", raw_size, 1) + struct.pack("<BQ", 1, len(bomb)) + bomb
    assert len(bomb) * 1000 < raw_size
    parts = []
    for i in range(4):
        name = f"objects/{crc_hex(crc32c_update(zeros))}-{raw_size}-{i:016x}"
        r.fs.pipe_file(r.path(name), bomb)
        parts.append({"path": name, "offset": i * raw_size, "raw_size": raw_size, "stored_size": len(bomb),
                      "raw_crc32c": crc_hex(crc32c_update(zeros)), "stored_crc32c": crc_hex(crc32c_update(bomb))})
    upload["files"][0].update(size=4 * raw_size, parts=parts)
    upload["checkpoint"]["shards"][0]["size"] = 4 * raw_size
    from tieredckpt._format.manifest import DIGEST_KEY, canonical_digest
    upload["checkpoint"][DIGEST_KEY] = canonical_digest(upload["checkpoint"])
    r.fs.pipe_file(r.path("step_000001", "upload.json"), json.dumps(upload).encode())
    script = tmp_path / "bomb.py"
    script.write_text(BOMB_READER.format(root=str(Path(__file__).resolve().parent.parent)))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "reader"), remote.url,
                          json.dumps(remote.options)], capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "crc32c" in result["outcome"]  # 256 MB of zeros are not the shard the manifest names
    assert result["grew_mb"] < 100, result  # a whole part decoded at once would be 64 MB each, four at a time


def test_side_files_are_fetched_one_by_one_after_a_killed_restore(tmp_path, remote):
    origin = tmp_path / "origin"
    with CheckpointStore(origin, remote.url, remote_options=remote.options) as s:
        for step in range(1, 6):
            s.log_loss(step, 1.0 / step)
        s.run.write_samples([{"text": "a"}])
        s.run.write_state({"arms": [1]})
        s.pivot(3, "mix")
        s.run.write_state({"arms": [2]})
        s.save(5, state(5)).wait()
        assert s.wait(uploads=True, timeout=60)
    side = {str(p.relative_to(origin)): p.read_bytes() for p in origin.rglob("*")
            if p.is_file() and (p.name in (".loss.json", ".samples.json", ".state.json") or "archive" in p.parts)}
    assert len(side) == 6  # loss, samples, state, and the pivot's archived samples, state and note
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".loss.json").write_bytes(side[".loss.json"][:20])  # a killed restore left a torn prefix
    (fresh / ".samples.json").write_text('[{"text": "newer, written here"}]')  # a newer local copy
    with CheckpointStore(fresh, remote.url, remote_options=remote.options) as s:
        assert s.restore()["step"] == 5
        assert sorted(s.run.read_loss().by_step()) == [1, 2, 3, 4, 5]
    for rel, data in side.items():
        got = (fresh / rel).read_bytes()
        if rel == ".samples.json":
            assert got == b'[{"text": "newer, written here"}]'  # never overwritten where the local copy is newer
        elif rel == ".loss.json":
            assert got.startswith(data)  # then the resume event
        else:
            assert got == data, rel


def test_a_restore_killed_mid_download_leaves_nothing_that_outlives_the_next_open(tmp_path, remote):
    big = {"w": torch.randn(8_000_000), "step": 1}  # 32 MB in 128 parts of 256 KB
    with CheckpointStore(tmp_path / "origin", remote.url, remote_options=remote.options,
                         upload_part_size=256 << 10, compression=None) as s:
        s.save(1, big).wait()
        assert s.wait(uploads=True, timeout=120)
    fresh = tmp_path / "fresh"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    code = ("import sys, json; from tieredckpt import CheckpointStore; "
            "CheckpointStore(sys.argv[1], sys.argv[2], remote_options=json.loads(sys.argv[3])).restore()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(fresh), remote.url, json.dumps(remote.options)], env=env)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("step_000001.tmp-") for p in (fresh.iterdir() if fresh.exists() else [])):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # mid-download
    proc.wait()

    def left_by_the_killed_restorer():  # not the new store's own scratch: its uploader may be
        return [p.name for p in fresh.iterdir() if scratch_owner_pid(p.name) == proc.pid]  # writing status

    assert left_by_the_killed_restorer()
    assert not (fresh / "step_000001").exists()  # nothing half-downloaded looks like a checkpoint
    with CheckpointStore(fresh, remote.url, remote_options=remote.options) as s:
        assert not left_by_the_killed_restorer()  # cleaned at open
        assert s.restore()["w"].equal(big["w"])


def test_opening_a_store_and_latest_step_cost_the_same_requests_at_10_and_500_steps(tmp_path, proxied):
    counts = {}
    for n in (10, 500):
        prefix = f"{proxied.url}-{n}"
        direct = RemoteTier(prefix, proxied.direct)
        with CheckpointStore(tmp_path / f"origin{n}", prefix, remote_options=proxied.direct) as s:
            s.save(1, state(1, 1000)).wait()
            assert s.wait(uploads=True, timeout=60)
        fill(direct, 1, range(2, n + 1), with_parts={n})
        proxied.proxy.reset_counts()
        with CheckpointStore(tmp_path / f"reader{n}", prefix, remote_options=proxied.options, read_only=True) as r:
            assert r.latest_step() == n
        counts[("reader", n)] = proxied.proxy.total()
        proxied.proxy.reset_counts()
        with CheckpointStore(tmp_path / f"writer{n}", prefix, remote_options=proxied.options) as w:
            assert w.latest_step() == n
            deadline = time.monotonic() + 60  # with no local step, wait(uploads=True) need not wait
            while not w.upload_status()["remote_read"]:  # for the uploader to read the remote
                assert time.monotonic() < deadline
                time.sleep(0.01)
            counts[("writer", n)] = proxied.proxy.total()
        proxied.proxy.reset_counts()
        with CheckpointStore(tmp_path / f"restorer{n}", prefix, remote_options=proxied.options, read_only=True) as r:
            assert first_difference(state(1, 1000), {**r.restore(), "step": 1}) is None
        counts[("restore", n)] = proxied.proxy.total()
    print(counts)
    for kind in ("reader", "writer", "restore"):
        assert counts[(kind, 10)] == counts[(kind, 500)], counts
