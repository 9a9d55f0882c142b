"""Raw parts stream from S3 into the file as they arrive: never held whole, checked on the way,
and a body that breaks part way is fetched again from its start."""

from __future__ import annotations

import os
import random
import tracemalloc

import pytest
import torch

from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.sharded import save_sharded
from tieredckpt._tiers.transport import Transport
from tieredckpt.errors import CorruptCheckpointError, RemoteError


def uploaded(tmp_path, proxied, n=400_000):
    state = {"w": torch.randn(n, generator=torch.Generator().manual_seed(5)), "step": 9}
    path = tmp_path / "step_000009"
    manifest = save_sharded([state], path, 9)
    upload = RemoteTier(proxied.url, proxied.direct, part_size=512 << 10).upload(path, manifest, codec="raw")
    return path, upload


def part(upload, i: int) -> str:
    """The object name of the shard's i-th part (what a request for it carries in its URL)."""
    return upload.files[0].parts[i].path.rsplit("/", 1)[-1]


def fetch(tmp_path, proxied, upload, name="fetched"):
    dest = tmp_path / name
    dest.mkdir()
    remote = RemoteTier(proxied.url, {**proxied.options, "config_kwargs": {"read_timeout": 5}}, request_timeout=20)
    remote.fetch_files(upload, upload.files, dest)
    return (dest / "rank0.bin").read_bytes()


def test_a_body_cut_off_half_way_is_fetched_again_from_its_start(tmp_path, proxied):
    path, upload = uploaded(tmp_path, proxied)
    proxied.proxy.set("truncate", methods=["GET"], path=part(upload, 1), times=1)
    assert fetch(tmp_path, proxied, upload) == (path / "rank0.bin").read_bytes()
    assert len(proxied.proxy.requests("GET", part(upload, 1))) == 2  # the cut one, then the whole one


def test_a_body_cut_off_every_time_is_a_transient_error_not_a_hang(tmp_path, proxied):
    _, upload = uploaded(tmp_path, proxied)
    proxied.proxy.set("truncate", methods=["GET"], path=part(upload, 2))
    with pytest.raises(RemoteError) as err:
        fetch(tmp_path, proxied, upload)
    assert err.value.transient and part(upload, 2) in str(err.value)


def test_a_flipped_byte_in_a_streamed_part_is_named_as_corrupt(tmp_path, proxied):
    _, upload = uploaded(tmp_path, proxied)
    proxied.proxy.set("flip", methods=["GET"], path=part(upload, 3), times=1)
    with pytest.raises(CorruptCheckpointError, match=part(upload, 3) + ".*corrupt remote object"):
        fetch(tmp_path, proxied, upload)


def test_an_object_larger_than_its_manifest_declares_is_refused(tmp_path, proxied):
    _, upload = uploaded(tmp_path, proxied)
    direct = RemoteTier(proxied.url, proxied.direct)
    part = upload.files[0].parts[1]
    rel = direct.path(upload.part_rel(part))
    direct.fs.pipe_file(rel, direct.fs.cat_file(rel) + b"0123456789")  # planted: 10 bytes more
    fd = os.open(tmp_path / "scratch", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(RemoteError, match="larger than the"):
            direct.fetch_part(upload, fd, part)
        assert os.fstat(fd).st_size <= part.offset + part.raw_size  # nothing written past the part
    finally:
        os.close(fd)


def test_a_streamed_object_is_never_held_whole(proxied):
    data = random.Random(1).randbytes(24 << 20)
    t = Transport(proxied.url, proxied.direct)
    t.put("big", data)
    del data

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    chunks = []
    streamed = peak(lambda: t.get_stream("big", 24 << 20, lambda: lambda c: chunks.append(len(c))))
    whole = peak(lambda: t.get("big", 24 << 20))
    assert sum(chunks) == 24 << 20 and max(chunks) <= 1 << 20
    assert whole >= 24 << 20  # the measure sees a buffer of the whole object...
    assert streamed < 8 << 20, streamed  # ... and streaming holds a few chunks at a time
