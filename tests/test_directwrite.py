"""Shards past the page cache (directwrite.py): O_DIRECT from aligned buffers where the disk takes it,
the page cache where it does not; the file and its checksums are exactly the bytes, whatever path
they took, and a failed write leaves no thread and no half-returned buffer behind."""

from __future__ import annotations

import errno
import hashlib
import os
import threading

import crc32c
import pytest
import torch
from conftest import disk_full_at_write

from tieredckpt._format import directwrite
from tieredckpt._format.checksum import crc_hex
from tieredckpt._format.memview import byte_view
from tieredckpt._tiers.sharded import load_sharded, save_sharded, verify_checkpoint

MB = 1 << 20


def pieces() -> list[memoryview]:
    """A read-only header, then tensors of odd sizes that straddle every 16 MiB block edge."""
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (7, 16 * MB - 3, 13, 20 * MB + 5)]
    return [memoryview(b"header bytes, read-only")] + [byte_view(t) for t in tensors]


def new_file(path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def direct_or_skip(fd: int) -> None:
    if not directwrite.enable_direct(fd):
        os.close(fd)
        pytest.skip("this filesystem refuses O_DIRECT: the page cache path is the one taken here")


def no_writer_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name == "tieredckpt-direct-write"]


@pytest.mark.parametrize("sha256", [True, False])
def test_a_direct_write_is_exactly_the_bytes_and_its_checksums_are_theirs(tmp_path, sha256):
    parts, path = pieces(), tmp_path / "f"
    expected = b"".join(bytes(p) for p in parts)
    fd = new_file(path)
    direct_or_skip(fd)
    try:
        digest = directwrite.write_direct(fd, parts, sha256)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == expected  # the tail's padding truncated away
    assert digest.size == len(expected) and digest.crc32c == crc_hex(crc32c.crc32c(expected))
    assert digest.sha256 == (hashlib.sha256(expected).hexdigest() if sha256 else None)
    assert no_writer_threads()


def test_a_filesystem_that_wants_another_alignment_gets_the_rest_through_the_page_cache(tmp_path, monkeypatch):
    parts, path = pieces(), tmp_path / "f"
    real_write, calls = directwrite.write_block, []

    def picky(fd, data):  # the second direct write is refused, as a disk with larger blocks would
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)
    monkeypatch.setattr(directwrite, "write_block", picky)
    fd = new_file(path)
    direct_or_skip(fd)
    try:
        digest = directwrite.write_direct(fd, parts, True)
    finally:
        os.close(fd)
    expected = b"".join(bytes(p) for p in parts)
    assert len(calls) >= 3 and path.read_bytes() == expected
    assert digest.sha256 == hashlib.sha256(expected).hexdigest()


def test_a_full_disk_mid_write_raises_on_the_callers_thread_and_leaves_nothing_running(tmp_path, monkeypatch):
    disk_full_at_write(monkeypatch, 2)
    big = [byte_view(torch.zeros(80 * MB, dtype=torch.uint8))]  # five blocks: the caller waits for buffers
    fd = new_file(tmp_path / "f")
    direct_or_skip(fd)
    try:
        with pytest.raises(OSError) as raised:
            directwrite.write_direct(fd, big, True)
    finally:
        os.close(fd)
    assert raised.value.errno == errno.ENOSPC and no_writer_threads()
    monkeypatch.undo()
    fd = new_file(tmp_path / "g")  # the pool's buffers are whole again: the next write is right
    directwrite.enable_direct(fd)
    try:
        parts = pieces()
        directwrite.write_direct(fd, parts, False)
    finally:
        os.close(fd)
    assert (tmp_path / "g").read_bytes() == b"".join(bytes(p) for p in parts)


def test_a_large_shard_is_written_past_the_page_cache_and_loads_bit_identically(tmp_path, monkeypatch):
    taken = []
    real = directwrite.write_direct
    monkeypatch.setattr("tieredckpt._format.shardfile.write_direct", lambda *a: taken.append(1) or real(*a))
    fd = new_file(tmp_path / "probe")
    direct_or_skip(fd)
    os.close(fd)
    g = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(9 * MB, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16), "step": 7}
    manifest = save_sharded([state], tmp_path / "c", 7)
    assert taken and manifest.total_size >= directwrite.MIN_DIRECT
    verify_checkpoint(tmp_path / "c", full=True)
    (back,) = load_sharded(tmp_path / "c", 1, verify="sha256")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]) and back["step"] == 7


def test_where_the_platform_has_no_o_direct_a_large_shard_goes_through_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(directwrite, "direct_supported", lambda: False)  # as on macOS
    monkeypatch.setattr("tieredckpt._format.shardfile.write_direct", None)  # never reached
    state = {"w": torch.randn(9 * MB)}
    save_sharded([state], tmp_path / "c", 1)
    (back,) = load_sharded(tmp_path / "c", 1, verify="sha256")
    assert torch.equal(back["w"], state["w"])


def test_a_large_shard_on_a_tmpfs_round_trips_whichever_path_it_takes(tmpfs):
    root = tmpfs(200 * MB)  # kernels before 6.6 refuse O_DIRECT on tmpfs, later ones take it
    state = {"w": torch.randn(9 * MB)}
    save_sharded([state], root / "c", 1)
    (back,) = load_sharded(root / "c", 1, verify="sha256")
    assert torch.equal(back["w"], state["w"])


def _huge_pages_backing(address: int) -> int:
    """AnonHugePages (bytes) of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def test_buffers_are_whole_aligned_blocks_on_huge_page_boundaries():
    buffer = directwrite._Buffer()
    assert buffer.address % directwrite._HUGE == 0
    assert len(buffer.view) == directwrite.BLOCK and not buffer.view.readonly
    buffer.view[-1:] = b"\x01"  # the last byte is inside the mapping


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="this kernel has transparent huge pages off")
def test_buffers_are_backed_by_huge_pages_so_a_direct_write_goes_out_in_large_requests():
    """From 4 KiB pages a direct write's requests were 0.6-0.8 MiB here, at half the speed."""
    buffer = directwrite._Buffer()
    buffer.view[:] = bytes(directwrite.BLOCK)  # touched after the madvise: faulted in as huge pages
    assert _huge_pages_backing(buffer.address) >= directwrite.BLOCK // 2
