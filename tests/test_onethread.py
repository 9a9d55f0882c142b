"""Encoding and decoding parts run their torch ops on their own thread, and no one else's changes."""

from __future__ import annotations

import threading

import pytest
import torch

from tieredckpt._format import codec
from tieredckpt._tiers.local import LocalTier
from tieredckpt._tiers.onethread import _runtime, one_thread
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.sharded import save_sharded

OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def test_torchs_openmp_runtime_is_found_where_torch_uses_openmp():
    if not OPENMP:
        pytest.skip("this torch does not run its ops on OpenMP: one_thread() rightly does nothing")
    assert _runtime() is not None


def test_one_thread_holds_for_the_block_on_this_thread_only_and_is_undone_after():
    if not OPENMP:
        pytest.skip("this torch does not run its ops on OpenMP")
    torch.get_num_threads()
    before = torch.get_num_threads()
    assert before > 1, "the machine the suite runs on has more than one core"
    seen = {}
    inside, go_on = threading.Event(), threading.Event()

    def other():  # a thread that is busy with torch while another is in one_thread()
        inside.wait(10)
        seen["other"] = torch.get_num_threads()
        go_on.set()
    t = threading.Thread(target=other)
    t.start()
    with one_thread():
        seen["inside"] = torch.get_num_threads()
        inside.set()
        go_on.wait(10)
    t.join()
    assert seen == {"inside": 1, "other": before}
    assert torch.get_num_threads() == before


def test_uploads_encode_and_restores_decode_on_one_thread_and_the_callers_count_comes_back(tmp_path, monkeypatch):
    if not OPENMP:
        pytest.skip("this torch does not run its ops on OpenMP")
    counts = []
    real_encode, real_decode = codec.encode, codec.decode_into

    def encode(*args, **kwargs):
        counts.append(("encode", torch.get_num_threads()))
        return real_encode(*args, **kwargs)

    def decode_into(*args, **kwargs):
        counts.append(("decode", torch.get_num_threads()))
        return real_decode(*args, **kwargs)
    monkeypatch.setattr(codec, "encode", encode)
    monkeypatch.setattr(codec, "decode_into", decode_into)
    before = torch.get_num_threads()
    state = {"w": torch.randn(300_000) * 0.02, "m": (torch.randn(100_000) * 1e-3).bfloat16()}
    manifest = save_sharded([state], tmp_path / "local" / "step_000001", 1)
    remote = RemoteTier(f"file://{tmp_path / 'remote'}", part_size=256 << 10, concurrency=2)
    remote.upload(tmp_path / "local" / "step_000001", manifest, codec="zstd-dtype")
    LocalTier(tmp_path / "fresh").download(1, remote)
    assert {kind for kind, _ in counts} == {"encode", "decode"}
    assert all(n == 1 for _, n in counts), counts
    assert torch.get_num_threads() == before
