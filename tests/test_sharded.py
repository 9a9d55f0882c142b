"""save_sharded / load_sharded: byte-equal round trips and every failure mode caught before any state is returned."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import flip_byte, rewrite_manifest, trained
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredckpt import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    ManifestError,
    MissingShardError,
    ShardCountMismatchError,
    ShardManifest,
    WorldSizeMismatchError,
    load_sharded,
    save_sharded,
    verify_checkpoint,
)
from tieredckpt._format.compare import first_difference


def rank_states(world_size=4, n=1000):
    g = torch.Generator().manual_seed(1)
    return [{"params": torch.randn(n, generator=g).half(),
             "optim": {0: {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}},
             "step": 1234} for _ in range(world_size)]


@pytest.fixture
def ckpt(tmp_path):
    states = rank_states()
    save_sharded(states, tmp_path / "step_001234", 1234, wall_clock_seconds=4521)
    return tmp_path / "step_001234", states


def test_round_trip_is_byte_equal_and_manifest_has_seed_schema(ckpt):
    path, states = ckpt
    for verify in ("crc", "sha256", "none"):
        assert first_difference(states, load_sharded(path, 4, verify=verify)) is None
    raw = json.loads((path / "manifest.json").read_text())
    assert raw["world_size"] == 4 and raw["step"] == 1234 and raw["wall_clock_seconds"] == 4521
    assert raw["schema_version"] == 1
    assert [s["path"] for s in raw["shards"]] == ["rank0.bin", "rank1.bin", "rank2.bin", "rank3.bin"]
    first = raw["shards"][0]
    assert {"rank", "path", "sha256", "param_shard_offset", "param_shard_numel"} <= set(first)
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank0.bin", "rank1.bin", "rank2.bin", "rank3.bin"]
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


def test_manifest_json_round_trip_is_exact(ckpt):
    path, _ = ckpt
    text = (path / "manifest.json").read_text()
    manifest = ShardManifest.from_json(text)
    assert manifest.to_json() == text
    assert ShardManifest.from_json(manifest.to_json()) == manifest


def test_real_model_state_per_rank(tmp_path):
    model, opt = trained(steps=3)
    states = [{"model": model.state_dict(), "optim": opt.state_dict()}] * 2
    save_sharded(states, tmp_path / "c", 3)
    assert first_difference(states, load_sharded(tmp_path / "c", 2, verify="sha256")) is None


def test_committed_checkpoint_is_never_overwritten(ckpt):
    path, states = ckpt
    before = (path / "manifest.json").read_bytes()
    with pytest.raises(CheckpointExistsError, match="step_001234"):
        save_sharded(rank_states(n=5), path, 1234)
    assert (path / "manifest.json").read_bytes() == before
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


def test_world_size_change_is_refused(ckpt):
    path, _ = ckpt
    with pytest.raises(WorldSizeMismatchError, match=r"manifest.json.*world_size 4.*loading with 8"):
        load_sharded(path, 8)


def test_shard_count_mismatch_is_refused(ckpt):
    path, _ = ckpt
    rewrite_manifest(path, lambda raw: raw["shards"].pop())
    with pytest.raises(ShardCountMismatchError, match="3 shards for world_size 4"):
        load_sharded(path, 4)


def test_missing_shard_is_refused(ckpt):
    path, _ = ckpt
    os.unlink(path / "rank2.bin")
    with pytest.raises(MissingShardError, match="rank2.bin"):
        load_sharded(path, 4)
    with pytest.raises(FileNotFoundError):  # builtin still catches it
        load_sharded(path, 4)


def test_truncated_shard_is_refused(ckpt):
    path, _ = ckpt
    os.truncate(path / "rank1.bin", os.path.getsize(path / "rank1.bin") - 1)
    with pytest.raises(ChecksumMismatchError, match=r"rank1.bin.*truncated"):
        load_sharded(path, 4, verify="none")


@pytest.mark.parametrize("verify", ["crc", "sha256"])
def test_flipped_byte_in_a_shard_is_refused(ckpt, verify):
    path, _ = ckpt
    flip_byte(path / "rank3.bin", os.path.getsize(path / "rank3.bin") // 2)
    with pytest.raises(ChecksumMismatchError, match="rank3.bin.*does not match"):
        load_sharded(path, 4, verify=verify)
    with pytest.raises(ChecksumMismatchError, match="rank3.bin"):
        verify_checkpoint(path, full=verify == "sha256")


def test_flipped_byte_in_the_manifest_is_refused(ckpt):
    path, _ = ckpt
    text = (path / "manifest.json").read_text()
    # Flipping any single byte of the manifest must be caught: as bad JSON, as a
    # failed field check, or as a checksum that no longer matches the shard.
    for offset in range(0, len(text), 7):
        flip_byte(path / "manifest.json", offset)
        try:
            with pytest.raises(CorruptCheckpointError):
                load_sharded(path, 4)
        finally:
            flip_byte(path / "manifest.json", offset)


def test_no_single_bit_flip_in_a_manifest_changes_what_it_says(ckpt):
    path, _ = ckpt
    data = (path / "manifest.json").read_bytes()
    original = ShardManifest.from_json(data)
    accepted = 0
    for offset in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[offset] ^= 1 << bit
            try:
                parsed = ShardManifest.from_json(bytes(flipped))
            except ManifestError:
                continue
            accepted += 1  # only a flip that changes nothing it records (its own digest's key name)
            assert parsed == original, (offset, bit)
    assert accepted < 8 * len("manifest_sha256")


def test_missing_manifest_means_no_checkpoint(ckpt):
    path, _ = ckpt
    os.unlink(path / "manifest.json")
    with pytest.raises(ManifestError, match="manifest.json: manifest is missing"):
        load_sharded(path, 4)
    with pytest.raises(CheckpointNotFoundError):
        load_sharded(path.parent / "nope", 4)


@pytest.mark.parametrize("bad_path", ["../x", "/etc/passwd", "a/../../x", "", ".", "a//b", "..\\x"])
def test_manifest_paths_must_stay_inside(ckpt, bad_path):
    path, _ = ckpt
    rewrite_manifest(path, lambda raw: raw["shards"][0].update(path=bad_path))
    with pytest.raises(ManifestError, match="shard path"):
        load_sharded(path, 4)


def test_symlink_escaping_the_checkpoint_is_refused(ckpt, tmp_path):
    path, _ = ckpt
    outside = tmp_path / "outside.bin"
    os.replace(path / "rank0.bin", outside)
    os.symlink(outside, path / "rank0.bin")
    with pytest.raises(CorruptCheckpointError, match="rank0.bin: shard of rank 0 is a symlink; refused"):
        load_sharded(path, 4)


def _valid_manifest():
    return {"world_size": 2, "step": 5, "wall_clock_seconds": 1.0, "schema_version": 1,
            "shards": [{"rank": r, "path": f"rank{r}.bin", "sha256": "ab" * 32, "crc32c": "0badf00d",
                        "size": 10, "param_shard_offset": 10 * r, "param_shard_numel": 10} for r in range(2)]}


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.update(schema_version=2), "schema_version 2"),
    (lambda m: m.pop("world_size"), "world_size"),
    (lambda m: m.update(world_size="2"), "world_size"),
    (lambda m: m.update(step=-1), "out of range"),
    (lambda m: m.update(world_size=True), "world_size"),
    (lambda m: m["shards"][1].update(rank=0), "duplicate or missing rank"),
    (lambda m: m["shards"][1].update(param_shard_offset=-5), "param_shard_offset"),
    (lambda m: m["shards"][1].update(param_shard_numel=2**63), "out of range"),
    (lambda m: m["shards"][1].update(param_shard_offset=2**62, param_shard_numel=2**62), "overflows"),
    (lambda m: m["shards"][1].update(size=1.5), "size"),
    (lambda m: m["shards"][1].update(sha256="xyz"), "sha256"),
    (lambda m: m["shards"][1].update(codec="pickle"), "codec"),
    (lambda m: m["shards"][1].update(path="rank0.bin"), "share one path"),
    (lambda m: m.update(shards={}), "list"),
    (lambda m: m.update(wall_clock_seconds=float("nan")), "wall_clock_seconds"),
])
def test_from_json_rejects_bad_fields(mutate, match):
    raw = _valid_manifest()
    ShardManifest.from_json(json.dumps(raw), "m.json")  # the valid one parses
    mutate(raw)
    with pytest.raises(ManifestError, match=match):
        ShardManifest.from_json(json.dumps(raw), "m.json")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_from_json_never_fails_with_anything_but_manifest_error(data):
    try:
        ShardManifest.from_json(data, "fuzz.json")
    except ManifestError:
        pass
