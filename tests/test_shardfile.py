"""The pickle-free shard file: every dtype and shape, nested state, real optimizer state."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from conftest import flip_byte, train_step, trained
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredckpt import CorruptCheckpointError, UnsupportedStateError
from tieredckpt._format.compare import first_difference
from tieredckpt._format.shardfile import read_shard, write_shard
from tieredckpt._format.shardheader import read_header

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]
SHAPES = [(), (0,), (3, 0), (1,), (7,), (2, 3), (2, 3, 4), (1, 1, 1, 5)]


def make(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def roundtrip(tmp_path, state, verify="sha256"):
    path = tmp_path / "shard.bin"
    digest = write_shard(path, state)
    return read_shard(path, size=digest.size, crc32c=digest.crc32c, sha256=digest.sha256, verify=verify)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_round_trips(tmp_path, dtype):
    state = {f"t{i}": make(dtype, shape, i) for i, shape in enumerate(SHAPES)}
    out = roundtrip(tmp_path, state)
    assert first_difference(state, out) is None
    assert [out[k].shape for k in out] == [torch.Size(s) for s in SHAPES]


def test_non_contiguous_and_special_float_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    nan_payload = torch.tensor([0x7FC00001, -0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    state = {"transposed": base.t(), "strided": base[:, ::2], "expanded": torch.ones(3).expand(4, 3),
             "special": torch.tensor([float("inf"), -float("inf"), 0.0, -0.0]), "nan_bits": nan_payload}
    out = roundtrip(tmp_path, state)
    for k in state:
        assert out[k].is_contiguous()
    assert first_difference(state, out) is None  # byte-level: -0.0 and NaN payloads survive


def test_nested_state_keeps_key_types_and_containers(tmp_path):
    od = OrderedDict(a=torch.ones(2))
    od._metadata = OrderedDict({"": {"version": 1}, "a": {"version": 2}})
    state = {
        0: {"exp_avg": torch.randn(3), 1.5: "float key", None: True, False: [1, 2.5, None]},
        "betas": (0.9, 0.999), "lst": [torch.zeros(1), {"deep": (1, (2, [3]))}],
        "od": od, "big": 2**70, "neg": -3, "s": "üñíçødé", "inf": float("inf"), "nan": float("nan"),
    }
    out = roundtrip(tmp_path, state)
    assert first_difference(state, out) is None
    assert list(out[0].keys()) == [ "exp_avg", 1.5, None, False]
    assert isinstance(out["betas"], tuple) and isinstance(out["lst"], list)
    assert isinstance(out["od"], OrderedDict) and out["od"]._metadata == od._metadata


def test_real_model_and_adamw_state_dicts_load_bit_identically(tmp_path):
    model, opt = trained(steps=4)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 4}
    out = roundtrip(tmp_path, state)
    assert first_difference(state, out) is None
    assert isinstance(next(iter(out["optim"]["state"])), int)  # int param ids survive

    fresh_model, fresh_opt = trained(steps=0, seed=99)
    fresh_model.load_state_dict(out["model"])
    fresh_opt.load_state_dict(out["optim"])
    assert first_difference(model.state_dict(), fresh_model.state_dict()) is None
    assert first_difference(opt.state_dict(), fresh_opt.state_dict()) is None
    # And training on gives the same numbers on both.
    torch.manual_seed(7)
    a = [train_step(model, opt) for _ in range(3)]
    torch.manual_seed(7)
    b = [train_step(fresh_model, fresh_opt) for _ in range(3)]
    assert a == b
    assert first_difference(model.state_dict(), fresh_model.state_dict()) is None


def test_plain_safetensors_readers_can_read_our_shards(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"w": torch.randn(3, 4), "b": torch.tensor([1, 2], dtype=torch.int64), "h": torch.ones(5).half()}
    path = tmp_path / "shard.bin"
    write_shard(path, {"model": state})
    loaded = safetensors_torch.load_file(str(path))
    assert sorted(loaded) == sorted(f"model/{k}" for k in state)
    for k, v in state.items():
        assert first_difference(v, loaded[f"model/{k}"]) is None


def test_header_is_json_with_aligned_data(tmp_path):
    path = tmp_path / "shard.bin"
    write_shard(path, {"a": torch.ones(3, dtype=torch.bool), "b": torch.ones(5, dtype=torch.float64)})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 64 == 0
    header = json.loads(raw[8:8 + n])
    assert header["b"]["data_offsets"] == [0, 40]  # widest dtype first keeps every view aligned
    assert read_header(path)["a"]["dtype"] == "BOOL"


@pytest.mark.parametrize("bad, where", [
    (object(), "the top level"), ({"x": {"y": [1, object()]}}, "x/y/1"),
    ({("tuple", "key"): 1}, "tuple"), ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
    ({"c": torch.ones(2, dtype=torch.complex64)}, "complex"),
])
def test_unsupported_values_are_refused_with_their_location(tmp_path, bad, where):
    with pytest.raises(UnsupportedStateError, match=where.split("/")[0]):
        write_shard(tmp_path / "shard.bin", bad)


def test_corrupt_header_is_refused_cleanly(tmp_path):
    path = tmp_path / "shard.bin"
    write_shard(path, {"a": torch.ones(4)})
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    for mutate in (
        lambda b: b.__setitem__(slice(0, 8), (10**9).to_bytes(8, "little")),
        lambda b: b.__setitem__(slice(8, 9), b"["),
        lambda b: b.__setitem__(slice(8, 8 + n), json.dumps({"a": {"dtype": "F32", "shape": [9], "data_offsets": [0, 36]}}).encode().ljust(n)),
        lambda b: b.__setitem__(slice(8, 8 + n), json.dumps({"a": {"dtype": "PICKLE", "shape": [4], "data_offsets": [0, 16]}}).encode().ljust(n)),
    ):
        bad = bytearray(raw)
        mutate(bad)
        (tmp_path / "bad.bin").write_bytes(bad)
        with pytest.raises(CorruptCheckpointError, match="bad.bin"):
            read_shard(tmp_path / "bad.bin", verify="none")


def test_flipped_data_byte_is_caught_by_crc_and_sha(tmp_path):
    path = tmp_path / "shard.bin"
    d = write_shard(path, {"a": torch.randn(1000)})
    flip_byte(path, d.size - 10)
    for mode in ("crc", "sha256"):
        with pytest.raises(CorruptCheckpointError, match="does not match"):
            read_shard(path, size=d.size, crc32c=d.crc32c, sha256=d.sha256, verify=mode)


tensors = st.builds(make, st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple), st.integers(0, 99))
keys = st.one_of(st.text(max_size=5), st.integers(-5, 5), st.booleans(), st.none())
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8), tensors),
    lambda children: st.one_of(st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
                               st.dictionaries(keys, children, max_size=3)),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(state=values)
def test_any_supported_state_round_trips(tmp_path_factory, state):
    out = roundtrip(tmp_path_factory.mktemp("h"), state)
    assert first_difference(state, out) is None


def test_loaded_tensors_own_their_storage_so_storage_based_apis_work(tmp_path):
    rng = torch.get_rng_state()
    out = roundtrip(tmp_path, {"w": torch.randn(10), "rng": rng, "b": torch.ones(3, dtype=torch.bool)})
    assert all(t.storage_offset() == 0 for t in out.values())
    torch.set_rng_state(out["rng"])  # misreads (or crashes) on a tensor at a storage offset
    assert torch.equal(torch.get_rng_state(), rng)
    before = (tmp_path / "shard.bin").read_bytes()
    out["w"].add_(1)  # a private copy-on-write mapping: the file is untouched
    assert (tmp_path / "shard.bin").read_bytes() == before


def test_small_tensors_are_written_in_batches_and_read_back_exactly(tmp_path, monkeypatch):
    """Views under BATCH are joined into writes of about BATCH, around tensors larger than it
    and sizes right at it; the file reads back exactly."""
    from tieredckpt._format import atomic, shardfile
    writes = []
    real = atomic.os.write
    monkeypatch.setattr(atomic.os, "write", lambda fd, data: writes.append(len(data)) or real(fd, data))
    batch = shardfile.BATCH
    state = {"small": [torch.full((n,), float(n)) for n in range(1, 3000)],  # ~18 MB of small ones
             "big": torch.randn(batch // 4 * 3 + 1), "exact": torch.ones(batch // 4), "under": torch.ones(batch // 4 - 1),
             "tail": torch.arange(5)}
    path = tmp_path / "s.bin"
    shardfile.write_shard(path, state, sha256=True)
    assert first_difference(state, read_shard(path)) is None
    assert len(writes) < 40, writes  # 3,000 tensors and a header: a few dozen writes


def test_every_dtype_a_shard_holds_is_saved_through_the_store_too(tmp_path):
    """The store's staged path checks dtypes as a set: every dtype the format knows passes it,
    including those only newer torch has (uint16, float8)."""
    from tieredckpt import CheckpointStore
    from tieredckpt._format.shardfile import STORED_DTYPES
    state = {str(d): torch.zeros(4, dtype=torch.float32).to(d) for d in STORED_DTYPES}
    assert any("float8" in k or "uint16" in k for k in state)
    with CheckpointStore(tmp_path / "run", every=0) as store:
        store.save(1, state).wait()
        assert first_difference(state, store.restore(1, mark_resume=False)) is None
