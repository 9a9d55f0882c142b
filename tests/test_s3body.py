"""Upload parts go to S3 from the mapped shard without copies, with our crc32c as S3's checksum.

The body object (s3body.PartBody) is reused by every attempt s3fs and botocore make;
these tests prove each attempt sends the whole part, that the server receives the
checksum of the bytes we read, and what the S3 options become per endpoint.
"""

from __future__ import annotations

import base64
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.s3body import PartBody
from tieredckpt._tiers.sharded import save_sharded
from tieredckpt._tiers.transport import Transport


def b64(crc_hex: str) -> str:
    return base64.b64encode(int(crc_hex, 16).to_bytes(4, "big")).decode()


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), sizes=st.lists(st.integers(-1, 64), max_size=12))
def test_reads_are_views_of_the_buffer_and_reassemble_it(data, sizes):
    body = PartBody(data)
    got = bytearray()
    for size in sizes:
        chunk = body.read(size)
        assert isinstance(chunk, memoryview) and (len(chunk) == 0 or chunk.obj is data)  # no copy
        got += chunk
    got += body.read()
    assert bytes(got) == data and len(body) == len(data)
    body.seek(0)
    assert bytes(body.read()) == data  # a retry seeks back and sends it all again


def test_a_body_read_to_its_end_or_part_way_starts_over_for_the_next_attempt():
    body = PartBody(b"abcdef")
    assert bytes(body.read()) == b"abcdef"
    assert body.tell() == 0 and bytes(body.read(3)) == b"abc"  # a new reader asks where it is first
    assert body.tell() == 0 and bytes(body.read()) == b"abcdef"  # ... also after a send broke mid-way
    body.seek(3)
    buf = bytearray(10)
    assert body.readinto(buf) == 3 and bytes(buf[:3]) == b"def"
    assert bytes(body.getbuffer()) == b"abcdef" and body.getvalue() == b"abcdef"
    with pytest.raises(ValueError):
        body.seek(-1)


def shard(tmp_path, n=300_000):
    state = {"w": torch.randn(n, generator=torch.Generator().manual_seed(1)), "step": 7}
    path = tmp_path / "step_000007"
    return path, save_sharded([state], path, 7)


@pytest.mark.parametrize("codec", ["raw", "zstd-dtype"])
def test_the_server_holds_our_crc32c_of_every_part(tmp_path, moto_server, codec):
    bucket = f"crc-{codec}-{random.randrange(1 << 30)}"
    moto_server.make_bucket(bucket)
    path, manifest = shard(tmp_path)
    remote = RemoteTier(f"s3://{bucket}/run", moto_server.options(), part_size=256 << 10)
    upload = remote.upload(path, manifest, codec=codec)
    s3 = remote.fs
    parts = upload.files[0].parts
    assert len(parts) > 3
    for part in parts:
        head = s3.call_s3("head_object", Bucket=bucket, Key=f"run/{part.path}", ChecksumMode="ENABLED")
        assert head["ChecksumCRC32C"] == b64(part.stored_crc32c), part.path
        assert head["ContentLength"] == part.stored_size


def test_retried_puts_send_every_byte_again(tmp_path, proxied):
    """503s on most PUTs: botocore retries inside one call, s3fs retries the call with the same
    body object; every attempt must send the whole part, and what lands is what we read."""
    path, manifest = shard(tmp_path)
    options = {**proxied.options, "config_kwargs": {"connect_timeout": 2, "read_timeout": 5}}
    remote = RemoteTier(proxied.url, options, part_size=128 << 10, request_timeout=20)
    remote.t.fs.retries = 4
    proxied.proxy.set("503", rate=0.5, methods=["PUT"])
    done: dict = {}
    for _ in range(30):  # the uploader's own retry loop, in short
        try:
            upload = remote.upload(path, manifest, codec="raw", done=done)
            break
        except Exception:  # noqa: BLE001 - a part that ran out of retries; the next round resumes
            continue
    else:
        pytest.fail("the upload never finished at a 50% error rate")
    proxied.proxy.clear()
    assert proxied.proxy.requests("PUT") and len(proxied.proxy.requests("PUT")) > len(upload.files[0].parts)
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    proxied.remote().fetch_files(upload, upload.files, fetched)  # checks every part's crc32c
    assert (fetched / "rank0.bin").read_bytes() == (path / "rank0.bin").read_bytes()


@pytest.mark.parametrize("options, signs, checksums", [
    ({}, False, True),  # AWS itself: https
    ({"endpoint_url": "https://minio.example:9000"}, False, True),
    ({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}, None, True),  # plain HTTP: signed as before
    ({"endpoint_url": "https://r2.example", "config_kwargs": {"request_checksum_calculation": "when_required"}},
     None, False),  # a server that refuses checksum headers: none from us either
    ({"config_kwargs": {"s3": {"payload_signing_enabled": True}}}, True, True),  # the user's choice stands
    ({"use_ssl": False}, None, True),  # AWS without TLS: signed
])
def test_s3_options_per_endpoint(options, signs, checksums):
    t = Transport("s3://bucket/run", {"key": "k", "secret": "s", **options})
    assert (t.fs.config_kwargs.get("s3") or {}).get("payload_signing_enabled") is signs
    assert t._checksums is checksums


def test_a_put_that_s3fs_itself_retries_sends_the_whole_part(tmp_path, proxied):
    """botocore makes one attempt here and gives up on a 503; s3fs then calls put_object again
    with the same body object, which the first call read to its end."""
    options = {**proxied.options, "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}
    t = Transport(proxied.url, options)
    t.fs.retries = 3
    data = bytes(random.Random(3).randbytes(300_000))
    proxied.proxy.set("503", methods=["PUT"], times=2)
    t.put("part", memoryview(data), crc32c=None)
    assert len(proxied.proxy.requests("PUT")) == 3
    assert Transport(proxied.url, proxied.direct).get("part", len(data)) == data
