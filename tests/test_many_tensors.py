"""States of tens of thousands of tensors (mixture-of-experts, per-layer adapters): bit-identical
round trips with views, tied tensors and plain values among them (issue 47), and the pause of the
garbage collector the save takes for them."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from tieredckpt import CheckpointStore
from tieredckpt._format.compare import first_difference
from tieredckpt._format.gcpause import gc_paused


def many(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
    experts = {}
    for i in range(n):
        t = torch.randn(8 + i % 5, generator=g).to(dtypes[i % len(dtypes)])
        experts[f"layer{i // 64}.expert{i % 64}"] = t
    base = torch.randn(4, 6, generator=g)
    return {"experts": experts, "tied": [base, base], "view": base[1:3], "transposed": base.t(),
            "step": seed, "lr": 1e-3, "names": ["a", "b"], "none": None}


def advance(state: dict, step: int) -> None:
    """A training step, in place: every tensor changes, the structure does not."""
    torch._foreach_add_(list(state["experts"].values()), 1)
    state["tied"][0].mul_(2)
    state["step"], state["lr"] = step, 1e-3 / step


@pytest.mark.parametrize("n", [30_000, 100_000])
def test_a_state_of_many_tensors_round_trips_bit_identically_with_its_views_and_ties(tmp_path, n):
    """Three saves of one state updated in place: the second reuses the first's buffers, the
    third the second's structure (treecache.py); the third restores exactly (and the second, at
    30,000)."""
    state = many(n, 1)
    with CheckpointStore(tmp_path / "run", every=0, keep_local=3) as store:
        for step in (1, 2, 3):
            advance(state, step)
            store.save(step, state).wait()
        assert store._stager._flattens.hits == 1
        checked = (2, 3) if n < 100_000 else (3,)  # 100,000: the reused structure's step (time)
        got = {step: store.restore(step, mark_resume=False) for step in checked}
    for step in checked:
        want = many(n, 1)
        for k in range(1, step + 1):
            advance(want, k)
        assert first_difference(want, got[step]) is None, step
        assert got[step]["tied"][0] is got[step]["tied"][1]  # tied: one tensor again
        assert got[step]["view"].untyped_storage().data_ptr() == got[step]["tied"][0].untyped_storage().data_ptr()
        assert got[step]["step"] == step and got[step]["lr"] == 1e-3 / step
        assert got[step]["names"] == ["a", "b"] and got[step]["none"] is None


def test_a_changed_structure_between_saves_is_saved_as_it_now_is(tmp_path):
    """A key renamed, a shape and a dtype changed between two saves of many tensors."""
    with CheckpointStore(tmp_path / "run", every=0) as store:
        first = many(2000, 1)
        store.save(1, first).wait()
        second = many(2000, 2)
        second["experts"]["renamed"] = second["experts"].pop("layer0.expert0")
        second["experts"]["layer0.expert1"] = torch.zeros(3, 3)
        second["experts"]["layer0.expert2"] = second["experts"]["layer0.expert2"].double()
        store.save(2, second).wait()
        assert first_difference(second, store.restore(2, mark_resume=False)) is None
        assert first_difference(first, store.restore(1, mark_resume=False)) is None


def test_the_gc_pause_nests_across_threads_and_restores_what_was_there():
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            entered.set()
            leave.wait(10)
    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        entered.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still holds
    leave.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
