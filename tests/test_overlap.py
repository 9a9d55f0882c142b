"""save(overlap=True): the copy of what an optimizer owns runs beside the next forward and
backward; its step() waits for it; the checkpoint is exactly the state at the saved step."""

from __future__ import annotations

import threading

import torch
from conftest import train_step, trained

from tieredckpt import CheckpointStore, capture_rng
from tieredckpt._format.compare import first_difference
from tieredckpt._loop import staging
from tieredckpt._loop.handoff import Handoff

real_now, real_rest = Handoff.copy_now, Handoff.copy_all


def slow_background_copy(log: list, trained_on: threading.Event | None = None):
    """The deferred copy, held back until the loop has trained on (or, when the loop is
    itself held in step(), for 0.3 s): without the hold, the next step overtakes it."""
    def logged(real):
        def copy(self, which):
            on_writer = threading.current_thread().name.startswith("tieredckpt-writer")
            if which:
                log.append((on_writer, len(which)))
            if on_writer and which:
                (trained_on or threading.Event()).wait(0.3)
            real(self, which)
        return copy
    return logged(real_now), logged(real_rest)


def slowed(monkeypatch, log: list, trained_on: threading.Event | None = None) -> None:
    now, rest = slow_background_copy(log, trained_on)
    monkeypatch.setattr(Handoff, "copy_now", now)
    monkeypatch.setattr(Handoff, "copy_all", rest)


def save_then_train(tmp_path, name, overlap: bool, monkeypatch, hold: bool = True):
    log: list = []
    trained_on = threading.Event()
    slowed(monkeypatch, log, trained_on)
    if not hold:
        monkeypatch.setattr(staging.StepHold, "_hold", lambda self, opt, args, kwargs: None)
    model, opt = trained(steps=3)
    torch.manual_seed(1)
    with CheckpointStore(tmp_path / name, stall_budget=1.0) as store:
        handle = store.save(3, {"model": model, "optim": opt, "rng": capture_rng(), "step": 3}, overlap=overlap)
        for _ in range(2):  # the loop goes on at once: forward (BatchNorm stats move), backward, step
            train_step(model, opt)
        trained_on.set()
        handle.wait()
        saved = store.restore(3)
    monkeypatch.undo()
    return saved, model, opt, log


def test_an_overlapped_save_is_bit_identical_to_a_plain_one_and_training_goes_on_identically(tmp_path, monkeypatch):
    plain, model_a, opt_a, _ = save_then_train(tmp_path, "plain", False, monkeypatch)
    overlapped, model_b, opt_b, log = save_then_train(tmp_path, "overlap", True, monkeypatch)
    assert first_difference(plain, overlapped) is None  # params, m, v, step counts, BN stats, RNG
    n_owned = sum(1 for _ in model_b.parameters()) + sum(
        sum(isinstance(v, torch.Tensor) for v in st.values()) for st in opt_b.state.values())
    assert (True, n_owned) in log  # the optimizer's tensors really were copied on the writer thread
    assert first_difference({"m": model_a.state_dict(), "o": opt_a.state_dict()},
                            {"m": model_b.state_dict(), "o": opt_b.state_dict()}) is None


def test_without_holding_step_the_overlapped_copy_would_be_wrong(tmp_path, monkeypatch):
    """What the hold is for: with it disabled, the next step() overtakes the copy."""
    plain, *_ = save_then_train(tmp_path, "plain", False, monkeypatch)
    torn, *_ = save_then_train(tmp_path, "torn", True, monkeypatch, hold=False)
    assert first_difference(plain["model"], torn["model"]) is not None


def test_overlap_without_an_optimizer_object_copies_everything_at_once(tmp_path, monkeypatch):
    log: list = []
    slowed(monkeypatch, log)
    model, opt = trained(steps=2)
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    with CheckpointStore(tmp_path / "run", overlap=True, stall_budget=1.0) as store:
        handle = store.save(2, {"model": model.state_dict(), "optim": opt.state_dict()})  # no object to hold
        assert handle.wait_copied(timeout=0)  # nothing left to copy
        train_step(model, opt)
        handle.wait()
        assert first_difference(expected["model"], store.restore(2)["model"]) is None
    assert all(not on_writer for on_writer, _ in log)


def test_wait_copied_and_close_release_the_hold_and_the_hooks(tmp_path):
    model, opt = trained(steps=1)
    store = CheckpointStore(tmp_path / "run", stall_budget=1.0)
    handle = store.save(1, {"model": model, "optim": opt}, overlap=True)
    assert handle.wait_copied(timeout=60)
    assert len(opt._optimizer_step_pre_hooks) == 1
    store.close()
    assert len(opt._optimizer_step_pre_hooks) == 0  # the optimizer is as it was
    train_step(model, opt)  # and steps freely
