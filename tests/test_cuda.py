"""CUDA tensors end to end. These run wherever ``torch.cuda.is_available()``; elsewhere (this
CPU-only machine) every one is reported as skipped, never as passed."""

from __future__ import annotations

import pytest
import torch

from tieredckpt import CheckpointStore, capture_rng, restore_rng
from tieredckpt._format.compare import first_difference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")]


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, 64, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_gpu_model_saves_through_pinned_buffers_and_restores_into_a_gpu_model_bit_identical(tmp_path):
    model, opt = model_and_optimizer()
    with CheckpointStore(tmp_path / "run") as store:
        store.save(3, {"model": model, "optim": opt}).wait()
        buffers = store._stager._buffers
        assert buffers and all(b.is_pinned() and b.device.type == "cpu" for b in buffers)  # D2H into pinned memory
    fresh, fresh_opt = model_and_optimizer(seed=1)
    with CheckpointStore(tmp_path / "run", read_only=True) as store:
        store.restore(into={"model": fresh, "optim": fresh_opt})
    assert all(p.device.type == "cuda" for p in fresh.parameters())
    assert first_difference(model.state_dict(), fresh.state_dict()) is None
    assert first_difference(opt.state_dict(), fresh_opt.state_dict()) is None


def test_a_save_is_the_state_at_the_call_even_when_the_gpu_changes_it_right_after(tmp_path):
    model, opt = model_and_optimizer()
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with CheckpointStore(tmp_path / "run") as store:
        handle = store.save(3, {"model": model})
        with torch.no_grad():  # non-blocking copies must be complete before save() returned
            for p in model.parameters():
                p.add_(1.0)
        handle.wait()
        saved = store.restore()
    assert first_difference(want, {k: v.cpu() for k, v in saved["model"].items()}) is None


def test_cuda_rng_state_comes_back(tmp_path):
    torch.cuda.manual_seed_all(7)
    torch.randn(4, device="cuda")
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, {"rng": capture_rng()}).wait()
        want = torch.randn(8, device="cuda")
        restore_rng(store.restore()["rng"])
    assert torch.equal(torch.randn(8, device="cuda"), want)
