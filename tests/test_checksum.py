"""crc32c combining (two threads per buffer) agrees with the one-pass checksum."""

from __future__ import annotations

import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredckpt._format.checksum import crc32c_combine, crc32c_parallel


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_combine_equals_crc_of_the_concatenation(a, b):
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), threads=st.integers(2, 5))
def test_parallel_crc_equals_one_pass(data, threads):
    assert crc32c_parallel(memoryview(data), threads=threads, min_split=0) == crc32c.crc32c(data)


def test_parallel_crc_on_a_large_buffer():
    import os
    data = os.urandom((64 << 20) + 12345)
    assert crc32c_parallel(memoryview(data)) == crc32c.crc32c(data)
