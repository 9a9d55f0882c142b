"""The flat step_NNNNNN.bin format: exact bytes, round trips, model+AdamW conversion, bad files."""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import train_step, trained

from tieredckpt import CheckpointNotFoundError, FlatFormatError, UnsupportedStateError
from tieredckpt._format.compare import first_difference
from tieredckpt._format.flat import flat_state, flat_to_model, model_to_flat, read_flat, write_flat
from tieredckpt._tiers.convert import checkpoint_to_flat, flat_to_checkpoint


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_exact_layout_and_round_trip(tmp_path, n):
    g = torch.Generator().manual_seed(n)
    w, m, v = (torch.randn(n, generator=g) for _ in range(3))
    path = tmp_path / "step_000042.bin"
    write_flat(path, 42, w, m, v)
    raw = path.read_bytes()
    assert len(raw) == 8 + 12 * n
    assert struct.unpack("<ii", raw[:8]) == (42, n)
    assert raw[8:8 + 4 * n] == w.numpy().astype("<f4").tobytes()
    assert raw[8 + 8 * n:] == v.numpy().astype("<f4").tobytes()
    flat = read_flat(path)
    assert flat.step == 42 and flat.n_params == n
    assert first_difference([w, m, v], [flat.weights, flat.m, flat.v]) is None
    assert [p.name for p in tmp_path.iterdir()] == ["step_000042.bin"]  # no temp file left


def test_model_adamw_to_flat_and_back_is_bit_identical_and_trains_on_identically(tmp_path):
    model, opt = trained(steps=5)
    path = tmp_path / "step_000005.bin"
    flat = model_to_flat(model, opt)
    assert flat.step == 5
    write_flat(path, flat.step, flat.weights, flat.m, flat.v)
    # The seed's layout: weights in parameters() order.
    assert torch.equal(read_flat(path).weights[:88], model.emb.weight.detach().reshape(-1))

    model2, opt2 = trained(steps=0, seed=123)
    flat_to_model(read_flat(path), model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert first_difference(opt.state[p][key], opt2.state[q][key]) is None
    model2.bn.load_state_dict(model.bn.state_dict())  # buffers are not in the flat format
    torch.manual_seed(3)
    a = [train_step(model, opt) for _ in range(3)]
    torch.manual_seed(3)
    b = [train_step(model2, opt2) for _ in range(3)]
    assert a == b


def test_flat_file_to_checkpoint_and_back_is_byte_identical(tmp_path):
    model, opt = trained(steps=2)
    flat = model_to_flat(model, opt)
    src = tmp_path / "step_000002.bin"
    write_flat(src, 2, flat.weights, flat.m, flat.v)
    assert flat_to_checkpoint(src, tmp_path / "run") == 2
    assert checkpoint_to_flat(tmp_path / "run", tmp_path / "back.bin") == 2
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_flat_state_can_be_saved_by_the_store_then_exported(tmp_path):
    from tieredckpt._tiers.local import LocalTier
    model, opt = trained(steps=1)
    LocalTier(tmp_path / "run").save(1, [flat_state(model, opt)])
    checkpoint_to_flat(tmp_path / "run", tmp_path / "out.bin")
    assert read_flat(tmp_path / "out.bin").n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("content, match", [
    (b"", "shorter than the 8-byte header"),
    (b"\x01\x00\x00", "shorter than the 8-byte header"),
    (struct.pack("<ii", -1, 0), "must be >= 0"),
    (struct.pack("<ii", 1, -3), "must be >= 0"),
    (struct.pack("<ii", 1, 2) + b"\x00" * 23, "needs exactly 32.*truncated"),
    (struct.pack("<ii", 1, 2) + b"\x00" * 25, "needs exactly 32"),
])
def test_bad_files_are_refused(tmp_path, content, match):
    path = tmp_path / "step_000001.bin"
    path.write_bytes(content)
    with pytest.raises(FlatFormatError, match=match):
        read_flat(path)
    with pytest.raises(CheckpointNotFoundError):
        read_flat(tmp_path / "missing.bin")


def test_conversion_refuses_what_the_format_cannot_hold(tmp_path):
    model, _ = trained(steps=0)
    with pytest.raises(UnsupportedStateError, match="AMSGrad"):
        model_to_flat(model, torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(UnsupportedStateError, match="not in the optimizer"):
        model_to_flat(model, torch.optim.AdamW(model.fc.parameters()))
    model2, opt2 = trained(steps=0)
    model2.head = torch.nn.Linear(16, 4)
    flat = model_to_flat(*trained(steps=1))
    with pytest.raises((FlatFormatError, UnsupportedStateError)):
        flat_to_model(flat, model2, torch.optim.AdamW(model2.parameters()))
    with pytest.raises(ValueError, match="float32"):
        write_flat(tmp_path / "x.bin", 1, torch.zeros(2, dtype=torch.float64), torch.zeros(2), torch.zeros(2))
