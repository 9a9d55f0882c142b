"""Encoded parts reuse their frame buffers, and a buffer a failed request may still read is never reused."""

from __future__ import annotations

import pytest
import torch

from tieredckpt import CheckpointStore
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers import download as download_module
from tieredckpt._tiers import remote as remote_module
from tieredckpt._tiers.framepool import FramePool
from tieredckpt._tiers.local import LocalTier
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.sharded import save_sharded
from tieredckpt.errors import RemoteError


def test_the_pool_hands_back_only_buffers_large_enough_and_holds_no_more_than_were_in_use():
    pool = FramePool(100)
    small = pool.take(60)
    assert len(small) == 100  # more than half a part: a whole part's buffer, for any part after it
    pool.give(small)
    assert pool.take(50) is small
    pool.give(small)
    assert len(FramePool(100).take(40)) == 100  # a small part: its size class (>= 1 MiB), never above a part
    assert len(FramePool(64 << 20).take(3 << 20)) == 4 << 20 and len(FramePool(64 << 20).take(10)) == 1 << 20
    big = pool.take(500)
    assert big is not small and len(big) == 500 + 500 // 16  # more than a part: 1/16 to spare for the next
    pool.give(big)
    assert pool.take(400) is big
    sized = FramePool(0)
    held = [sized.take(n) for n in (1000, 2000)]
    for buf in held:
        sized.give(buf)
    for n in range(3000, 3010):  # growing parts: each new buffer lets a too-small one go
        sized.give(sized.take(n))
    assert len(sized._free) <= 2


class RecordingFS:
    """A real local filesystem whose first part write fails after the request took the body (as a
    timed-out request still on the event loop would); every body handed over is recorded."""

    def __init__(self, inner) -> None:
        self._inner, self.bodies, self.failed = inner, [], None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def pipe_file(self, path, data, **kwargs):
        if "/objects/" in path:
            self.bodies.append(data)
            if self.failed is None:
                self.failed = (data, bytes(data))
                raise TimeoutError("read timed out")
        return self._inner.pipe_file(path, data, **kwargs)


def _state(n: int = 400_000) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(n, generator=g) * 0.02, "m": (torch.randn(n, generator=g) * 1e-3).bfloat16(),
            "step": torch.tensor(5)}


def test_frames_are_reused_and_one_a_failed_request_holds_is_never_overwritten(tmp_path, monkeypatch):
    taken: list[bytearray] = []
    given: list[bytearray] = []

    class Counting(FramePool):
        def take(self, need):
            buf = super().take(need)
            taken.append(buf)
            return buf

        def give(self, buf):
            given.append(buf)
            super().give(buf)
    monkeypatch.setattr(remote_module, "FramePool", Counting)
    manifest = save_sharded([_state()], tmp_path / "local" / "step_000005", 5)
    url = f"file://{tmp_path / 'remote'}"
    fs = RecordingFS(RemoteTier(url).fs)
    r = RemoteTier(url, fs=fs, part_size=64 << 10, concurrency=2)
    done: dict = {}
    with pytest.raises(RemoteError, match="objects/.* failed: TimeoutError"):  # the uploader retries the step
        r.upload(tmp_path / "local" / "step_000005", manifest, done=done)
    r.upload(tmp_path / "local" / "step_000005", manifest, done=done)  # resumes: sends what is missing

    parts = sum(len(f.parts) for f in r.upload_manifest(5).files)
    assert parts >= 30
    # Reuse: a handful of buffers carried every part of the step (each a fresh 64 KiB + slack here).
    assert len({id(b) for b in taken}) <= 2 * (r.concurrency + 2), len({id(b) for b in taken})
    # The failed request's buffer left the pool for good: never handed back, so its body still
    # holds what it held when the request failed.
    body, then = fs.failed
    assert isinstance(body, memoryview) and body.obj in taken
    assert all(b is not body.obj for b in given) and len(given) >= parts - r.concurrency - 2
    assert bytes(body) == then
    with CheckpointStore(tmp_path / "fresh", url, read_only=True) as fresh:
        assert first_difference(_state(), fresh.restore()) is None


def test_compressed_parts_download_through_reused_buffers_and_a_failed_one_is_let_go(tmp_path, monkeypatch):
    taken, given = [], []

    class Counting(FramePool):
        def take(self, need):
            taken.append(super().take(need))
            return taken[-1]

        def give(self, buf):
            given.append(buf)
            super().give(buf)
    monkeypatch.setattr(download_module, "FramePool", Counting)
    local = tmp_path / "local" / "step_000005"
    manifest = save_sharded([_state()], local, 5)
    url = f"file://{tmp_path / 'remote'}"
    RemoteTier(url, part_size=64 << 10).upload(local, manifest)
    r = RemoteTier(url, concurrency=1)  # one part at a time: the buffer last taken is the failing part's
    real = r.t.get_stream
    broken = []

    def get_stream(rel, max_size, open_sink):
        if not broken:  # the first part's body breaks after its first chunk, for good
            def failing_sink():
                write = open_sink()

                def first_then_fail(chunk):
                    write(chunk[:10])
                    broken.append(taken[-1])
                    raise ConnectionResetError("reset by peer")
                return first_then_fail
            return real(rel, max_size, failing_sink)
        return real(rel, max_size, open_sink)
    monkeypatch.setattr(r.t, "get_stream", get_stream)
    with pytest.raises(ConnectionResetError):
        LocalTier(tmp_path / "a").download(5, r)
    assert broken and all(b is not broken[0] for b in given)  # never handed to another part
    taken.clear(), given.clear()
    LocalTier(tmp_path / "b").download(5, r)
    parts = sum(len(f.parts) for f in r.upload_manifest(5).files)
    assert len(given) == parts and len({id(b) for b in taken}) <= r.concurrency + 1
    with CheckpointStore(tmp_path / "b", read_only=True) as fresh:
        assert first_difference(_state(), fresh.restore()) is None


def test_the_next_steps_upload_reuses_the_buffers_of_the_last_and_close_lets_them_go(tmp_path, monkeypatch):
    """Fresh memory costs page faults: the buffers of one upload carry the next step's parts too."""
    taken: list[bytearray] = []

    class Counting(FramePool):
        def take(self, need):
            taken.append(super().take(need))
            return taken[-1]
    monkeypatch.setattr(remote_module, "FramePool", Counting)
    r = RemoteTier(f"file://{tmp_path / 'remote'}", part_size=64 << 10, concurrency=2)
    firsts = []
    for step in (5, 6):
        manifest = save_sharded([_state()], tmp_path / "local" / f"step_00000{step}", step)
        taken.clear()
        r.upload(tmp_path / "local" / f"step_00000{step}", manifest)
        firsts.append({id(b) for b in taken})
    assert len(taken) >= 30
    # the second step's parts go into the first's buffers: all in all no more buffers than can be
    # in use at once (concurrency + 2: the parts in flight, the one encoded, the one waiting), however they interleave
    assert firsts[0] & firsts[1] and len(firsts[0] | firsts[1]) <= r.concurrency + 2, firsts
    r.close()
    assert not r._frames._free


def test_a_small_checkpoint_holds_buffers_of_its_own_size_not_of_a_full_part(tmp_path):
    manifest = save_sharded([_state()], tmp_path / "local" / "step_000005", 5)  # one part of ~2.4 MB
    r = RemoteTier(f"file://{tmp_path / 'remote'}")  # 64 MiB parts
    r.upload(tmp_path / "local" / "step_000005", manifest)
    held = [len(b) for b in r._frames._free]
    assert held and max(held) < 2 * manifest.total_size, (held, manifest.total_size)
