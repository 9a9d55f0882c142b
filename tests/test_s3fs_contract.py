"""What the transport relies on in s3fs beyond its documented API, checked on the installed s3fs.

transport.py calls s3fs's private coroutine ``_call_s3(method, **kwargs)`` (conditional PUTs,
ranged GETs with their headers, a bucket listing), ``split_path`` (bucket, key, version), and
relies on ``pipe_file(path, body, chunksize=C, **kw)`` sending a body under 2*C as one
``put_object`` with that very body object and the extra keywords (s3body.PartBody: no copy,
our crc32c as the checksum header). A new s3fs that changes any of this fails here, by name,
before it silently copies every part or drops the checksum. This test, not an upper bound in
pyproject (which would hold users back from s3fs's fixes), is the pin: last passed on s3fs
2026.9.0 with aiobotocore 3.10.
"""

from __future__ import annotations

import inspect
import uuid

import pytest
import s3fs

from tieredckpt._format.checksum import crc32c_update, crc_hex
from tieredckpt._tiers.s3body import PartBody
from tieredckpt._tiers.transport import Transport


@pytest.fixture
def spied(moto_server):
    """A transport on a fresh moto bucket whose s3fs records every _call_s3 (method, kwargs)."""
    bucket = f"contract-{uuid.uuid4().hex[:8]}"
    moto_server.make_bucket(bucket)
    t = Transport(f"s3://{bucket}/run", moto_server.options())
    calls: list[tuple[str, dict]] = []
    real = t.fs._call_s3

    async def spy(method, *args, **kwargs):
        calls.append((method, kwargs))
        return await real(method, *args, **kwargs)
    t.fs._call_s3 = spy
    return t, bucket, calls


def test_call_s3_is_a_coroutine_taking_the_method_name_then_keywords():
    call = s3fs.S3FileSystem._call_s3
    assert inspect.iscoroutinefunction(call), "s3fs.S3FileSystem._call_s3 is no longer a coroutine"
    params = list(inspect.signature(call).parameters.values())
    assert params[1].name == "method" and any(p.kind is p.VAR_KEYWORD for p in params), params


def test_split_path_gives_bucket_key_and_version(spied):
    t, bucket, _ = spied
    assert t.fs.split_path(t.path("objects/x")) == (bucket, "run/objects/x", None)


def test_a_part_goes_up_as_one_put_object_with_our_body_object_and_checksum(spied):
    t, bucket, calls = spied
    data = bytes(range(256)) * 4096  # 1 MiB
    t.put("objects/part", memoryview(data), crc32c=crc_hex(crc32c_update(data)))
    puts = [(m, kw) for m, kw in calls if m in ("put_object", "create_multipart_upload", "upload_part")]
    assert [m for m, _ in puts] == ["put_object"], puts  # one request, never a multipart upload
    kwargs = puts[0][1]
    assert isinstance(kwargs["Body"], PartBody), type(kwargs["Body"])  # ours, not a copy s3fs made
    assert kwargs["ChecksumAlgorithm"] == "CRC32C" and kwargs["ChecksumCRC32C"]  # the keywords reach botocore
    assert (kwargs["Bucket"], kwargs["Key"]) == (bucket, "run/objects/part")
    assert t.get("objects/part", len(data)) == data


def test_conditional_writes_and_reads_go_through_call_s3_with_their_headers(spied):
    t, _, calls = spied
    first = t.put_if_absent("lease", b"one")
    assert t.put_if_match("lease", b"two", first) is not None
    data, version, age = t.read_versioned("lease", 100)
    assert data == b"two" and version and age is not None and age >= 0
    puts = [kw for m, kw in calls if m == "put_object"]
    assert puts[0]["IfNoneMatch"] == "*" and puts[1]["IfMatch"] == first
    gets = [kw for m, kw in calls if m == "get_object"]
    assert gets and gets[-1]["Range"] == "bytes=0-100"
