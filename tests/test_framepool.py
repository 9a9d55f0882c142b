"""Encoded parts reuse their frame buffers, and a buffer a failed request may still read is never reused."""

from __future__ import annotations

import pytest
import torch

from tieredckpt import CheckpointStore
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers import remote as remote_module
from tieredckpt._tiers.framepool import FramePool
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.sharded import save_sharded
from tieredckpt.errors import RemoteError


def test_the_pool_hands_back_only_buffers_large_enough():
    pool = FramePool(100)
    small = pool.take(10)
    assert len(small) == 100  # never smaller than the pool's size
    pool.give(small)
    assert pool.take(50) is small
    pool.give(small)
    big = pool.take(500)
    assert big is not small and len(big) == 500
    pool.give(big)
    assert pool.take(400) is big and pool.take(80) is small


class RecordingFS:
    """A real local filesystem whose first part write fails after the request took the body (as a
    timed-out request still on the event loop would); every body handed over is recorded."""

    def __init__(self, inner) -> None:
        self._inner, self.bodies, self.failed = inner, [], None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def pipe_file(self, path, data, **kwargs):
        if ".p0" in path:
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
    with pytest.raises(RemoteError, match="p00000 failed: TimeoutError"):  # the uploader retries the step
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
