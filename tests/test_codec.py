"""zstd-dtype: byte planes by each tensor's element size, from the shard header."""

import struct
from unittest import mock

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredckpt import CheckpointStore, CorruptCheckpointError
from tieredckpt._format import codec as codec_module
from tieredckpt._format.codec import decode, encode, frame_bound, runs_in
from tieredckpt._format.compare import first_difference
from tieredckpt._format.shardheader import float_spans
from tieredckpt._tiers.remote import RemoteTier

spans_st = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 5000), st.sampled_from([2, 4, 8])), max_size=6)


@settings(max_examples=150, deadline=None)
@given(layout=spans_st, offset=st.integers(0, 20000), length=st.integers(0, 20000))
def test_runs_cover_a_part_in_whole_elements_and_keep_each_tensors_alignment(layout, offset, length):
    spans, pos = [], 0
    for gap, n, width in layout:  # tensors one after another, as a shard file lays them out
        start = pos + gap
        spans.append((start, start + n * width, width))
        pos = start + n * width
    runs = runs_in(spans, offset, length)
    assert sum(n for n, _ in runs) == length
    at = offset
    for n, width in runs:
        assert n > 0 and n % width == 0
        if width > 1:  # a plane run holds only that width's tensors (and padding between two), whole elements
            covered = {b for a, z, w in spans if w == width for b in range(a, z)}
            covered |= {b for (a0, z0, w0), (a1, _, w1) in zip(spans, spans[1:])
                        if w0 == w1 == width and a1 - z0 <= 64 and (a1 - z0) % width == 0 for b in range(z0, a1)}
            assert set(range(at, at + n)) <= covered
            start = max(a for a, _, w in spans if w == width and a <= at)
            assert (at - start) % width == 0
        at += n


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_zstd_dtype_round_trips_any_runs_and_any_bytes(data):
    runs = data.draw(st.lists(st.sampled_from([1, 2, 4, 8]).flatmap(
        lambda w: st.tuples(st.integers(1, 600).map(lambda k: k * w), st.just(w))), max_size=8))
    size = sum(n for n, _ in runs)
    raw_bytes = data.draw(st.binary(min_size=size, max_size=size))
    raw = torch.frombuffer(bytearray(raw_bytes), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    stored = encode(raw, "zstd-dtype", 1, runs)
    assert bytes(decode(stored, "zstd-dtype", size, "x")) == raw_bytes


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_frame_written_into_a_reused_buffer_is_the_same_frame_and_old_bytes_never_leak_into_it(data):
    """The uploader writes every part into buffers it reuses: leftovers of a longer earlier frame
    (here 0xAB filler) must never become part of a later one."""
    runs = data.draw(st.lists(st.sampled_from([1, 2, 4, 8]).flatmap(
        lambda w: st.tuples(st.integers(1, 3000).map(lambda k: k * w), st.just(w))), min_size=1, max_size=6))
    size = sum(n for n, _ in runs)
    kind = data.draw(st.sampled_from(["normal", "zeros", "bytes"]))
    if kind == "normal":  # compressible exponent planes, as in weights
        raw = (torch.randn((size + 3) // 4) * 0.02).view(torch.uint8)[:size].clone()
    elif kind == "zeros":
        raw = torch.zeros(size, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(bytearray(data.draw(st.binary(min_size=size, max_size=size))), dtype=torch.uint8)
    buffer = bytearray(b"\xab" * (frame_bound(size, runs) + 1000))
    stored = encode(raw, "zstd-dtype", 1, runs, out=buffer)
    assert stored.obj is buffer  # written in place, not copied out
    assert bytes(stored) == encode(raw, "zstd-dtype", 1, runs)
    assert bytes(decode(stored, "zstd-dtype", size, "x")) == bytes(raw.numpy())


def test_a_frame_buffer_too_small_for_the_part_is_refused_before_anything_is_written():
    raw = torch.randn(1000).view(torch.uint8)
    runs = [(4000, 4)]
    small = bytearray(frame_bound(4000, runs) - 1)
    with pytest.raises(ValueError, match=f"{len(small)} bytes is smaller than the {len(small) + 1}"):
        encode(raw, "zstd-dtype", 1, runs, out=small)
    assert small == bytearray(len(small))


def test_sign_and_exponent_planes_compress_smaller_than_zstd_level_1_at_the_default_level():
    """At the default level, float planes get zstd parameters of their own (a small match table:
    fewer chance matches, Huffman-coded bytes). This shows the tuning is in use: the whole frame is
    smaller than the same frame would be with the top plane at plain zstd level 1."""
    torch.manual_seed(0)
    values = torch.cat([torch.randn(1 << 19) * 0.02, torch.randn(1 << 19) * 1e-3])
    raw = values.view(torch.uint8)
    frame = encode(raw, "zstd-dtype", 1, [(raw.numel(), 4)])
    top = bytes(values.view(torch.uint8).view(-1, 4)[:, 3].contiguous().numpy())
    level1 = zstandard.ZstdCompressor(level=1).compress(top)
    stored_planes = 3 * values.numel()  # the three mantissa-heavy bytes go as they are
    assert len(frame) < stored_planes + len(level1)
    assert len(encode(raw, "zstd-dtype", 3, [(raw.numel(), 4)])) != len(frame)  # other levels: their own


def _frame(values: torch.Tensor) -> tuple[bytes, int]:
    raw = values.contiguous().view(torch.uint8)
    return encode(raw, "zstd-dtype", 1, [(raw.numel(), values.element_size())]), raw.numel()


def test_damaged_frames_are_refused_naming_the_object():
    stored, size = _frame(torch.randn(3000).to(torch.bfloat16))
    count_plus_run = 4 + 9
    lying_run = stored[:4] + struct.pack("<QB", 6000, 4) + stored[count_plus_run:]   # width changed
    too_long = stored[:4] + struct.pack("<QB", 6002, 2) + stored[count_plus_run:]    # more than declared
    many_runs = struct.pack("<I", 10**9) + stored[4:]
    for bad in (stored[:3], stored[:-1], stored + b"x", lying_run, too_long, many_runs, b"\xff" * 40):
        with pytest.raises(CorruptCheckpointError, match="obj"):
            decode(bad, "zstd-dtype", size, "obj")
    with pytest.raises(CorruptCheckpointError, match="obj"):
        decode(stored, "zstd-dtype", size + 2, "obj")  # the manifest's raw size is what counts


def test_bf16_and_fp16_state_is_split_in_2_byte_planes_and_sends_fewer_bytes_than_4_byte_planes(tmp_path):
    torch.manual_seed(0)
    state = {"w": (torch.randn(200_000) * 0.02).to(torch.bfloat16), "h": torch.randn(100_000).half(),
             "step": torch.tensor(7), "f": torch.randn(50_000)}
    sent = {}
    for codec in ("zstd-planes", "zstd-dtype"):
        url = f"file://{tmp_path}/remote-{codec}"
        with CheckpointStore(tmp_path / codec, url, compression=codec) as s:
            s.save(1, state).wait()
            assert s.wait(uploads=True, timeout=60)
        r = RemoteTier(url)
        sent[codec] = r.upload_manifest(1).stored_size
        with CheckpointStore(tmp_path / f"fresh-{codec}", url, read_only=True) as fresh:
            assert first_difference(state, fresh.restore()) is None
    assert sent["zstd-dtype"] < 0.9 * sent["zstd-planes"], sent


def test_float_spans_come_from_the_shard_header(tmp_path):
    with CheckpointStore(tmp_path / "run") as s:
        s.save(1, {"a": torch.zeros(2000, dtype=torch.bfloat16), "i": torch.arange(3000),
                   "d": torch.ones(900).double()}).wait()
    shard = next((tmp_path / "run" / "step_000001").glob("*.bin"))
    widths = sorted((end - start, w) for start, end, w in float_spans(shard))
    assert widths == [(4000, 2), (7200, 8)]  # the int64 tensor is not a float: plain bytes


def _plane_modes(frame) -> list[int]:
    """The mode of every plane of a zstd-dtype frame (0 stored, 1 zstd), in frame order."""
    frame = bytes(frame)
    (count,) = struct.unpack_from("<I", frame)
    runs = [struct.unpack_from("<QB", frame, 4 + 9 * i) for i in range(count)]
    pos, modes = 4 + 9 * count, []
    for width in sorted({w for _, w in runs}):
        for _ in range(width):
            mode, length = struct.unpack_from("<BQ", frame, pos)
            modes.append(mode)
            pos += 9 + length
    return modes


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_planes_gathered_a_chunk_at_a_time_round_trip_aligned_or_not_and_wherever_a_plane_shrinks(data):
    """Planes are gathered as shifted integers, a few elements at a time (the chunk made tiny
    here so that runs span many chunks), or byte by byte where a run is not aligned for its
    width; a plane that compresses pulls the planes after it to the front. Mantissa planes of
    zeros (values cast up from bf16) compress, so later planes move."""
    runs, parts = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        width = data.draw(st.sampled_from([1, 2, 4, 8]))
        n = data.draw(st.integers(1, 2000))
        kind = data.draw(st.sampled_from(["from-bf16", "normal", "random"]))
        if kind == "from-bf16" and width > 1:  # low bytes zero: compressible mantissa planes
            words = (torch.randn(n) * 0.02).to(torch.bfloat16).to(torch.float32).view(torch.uint8)
            chunk = words.repeat((n * width + words.numel() - 1) // words.numel())[:n * width]
        elif kind == "normal":
            chunk = (torch.randn((n * width + 3) // 4) * 0.02).view(torch.uint8)[:n * width]
        else:
            chunk = torch.frombuffer(bytearray(data.draw(st.binary(min_size=n * width, max_size=n * width))),
                                     dtype=torch.uint8)
        runs.append((n * width, width))
        parts.append(chunk)
    lead = data.draw(st.integers(0, 3))  # unaligned runs too: the part starts at an odd address
    backing = torch.zeros(lead + sum(n for n, _ in runs), dtype=torch.uint8)
    raw = backing[lead:]
    raw.copy_(torch.cat(parts))
    with mock.patch.object(codec_module, "_CHUNK", 37):
        frame = encode(raw, "zstd-dtype", 1, runs)
    assert bytes(decode(frame, "zstd-dtype", raw.numel(), "x")) == bytes(raw.numpy())


def test_mantissa_planes_are_compressed_when_they_compress_and_stored_when_only_their_head_does():
    torch.manual_seed(0)
    cast_up = (torch.randn(1 << 18) * 0.02).to(torch.bfloat16).to(torch.float32)  # low 2 bytes zero
    assert _plane_modes(_frame(cast_up)[0]) == [1, 1, 0, 1]
    # A part that starts with a LayerNorm's weights (all 1.0) and goes on with random weights:
    # its mantissa planes begin with 64 KiB of zeros, but as a whole they do not compress.
    head_only = torch.cat([torch.ones(1 << 16), torch.randn(1 << 20) * 0.02])
    assert _plane_modes(_frame(head_only)[0]) == [0, 0, 0, 1]
