"""A request body for s3fs that is sent from the caller's buffer without a copy.

An upload part used to be copied three times on its way to the socket: out of the
mapped shard into ``bytes`` (ours), by botocore's BytesIO wrapper when aiohttp asks
for its buffer (``getbuffer`` un-shares a BytesIO made from ``bytes``: a fresh
64 MiB), and once more in 64 KiB ``read`` chunks. Those copies into fresh memory were
about 1.1 s of client CPU per GB here (bench_remote's profile).

:class:`PartBody` is a BytesIO as far as botocore and aiohttp can tell -- so botocore
leaves it alone and aiohttp sends it in 64 KiB writes, as it sends any BytesIO -- but
its reads return slices of the caller's buffer. The buffer must not change and must
stay alive until the request is done (a mapped, committed shard or a part's encoded
bytes).

Retries: botocore seeks a body back to 0 between its own attempts, but when it gives up
s3fs calls ``put_object`` again with the same object, read to its end (or part way, if
the connection broke mid-send), and every reader -- botocore's checksum and signature,
aiohttp's payload -- starts from ``tell()``: the request would declare the part's length
and send less. Each of those readers asks ``tell()`` once, before it reads the body
whole, and nothing asks it mid-read; so ``tell()`` starts the body over, and every
attempt sends every byte.
"""

from __future__ import annotations

import io


class PartBody(io.BytesIO):
    def __init__(self, data) -> None:
        super().__init__()  # empty: every method that reads goes to self._view instead
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def __len__(self) -> int:
        return len(self._view)

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]  # views, never copies
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        start, self._pos = self._pos, max(self._pos, end)
        return self._view[start:self._pos]

    read1 = read  # type: ignore[assignment]

    def readinto(self, buffer) -> int:
        chunk = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[:len(chunk)] = chunk
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        self._pos = 0  # only a reader about to read it whole asks (see the module docstring)
        return 0

    def getbuffer(self) -> memoryview:
        return self._view[:]  # a view of its own: aiohttp releases what getbuffer returns

    def getvalue(self) -> bytes:
        return bytes(self._view)

    def readline(self, size: int | None = -1):
        raise io.UnsupportedOperation("a request body is read in chunks, not lines")
