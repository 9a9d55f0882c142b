"""CheckpointStore in a training loop: background saves, failures surfacing, restore into objects."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch
from conftest import train_step, trained

import tieredckpt._format.shardfile as shardfile
from tieredckpt import (
    BackgroundSaveError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStore,
    IncompatibleStateError,
    capture_rng,
    restore_rng,
)
from tieredckpt._format.compare import first_difference


def full_state(model, opt, step):
    return {"model": model, "optim": opt, "step": step, "rng": capture_rng()}


def test_save_restore_into_objects_then_train_on_identically(run_dir):
    model, opt = trained(steps=3)
    with CheckpointStore(run_dir, every=1) as store:
        assert store.restore() is None  # nothing yet
        handle = store.save(3, full_state(model, opt, 3))
        handle.wait()
        assert handle.done()
    expected = [train_step(model, opt) for _ in range(4)]

    fresh_model, fresh_opt = trained(steps=0, seed=42)
    with CheckpointStore(run_dir) as store:
        state = store.restore(into={"model": fresh_model, "optim": fresh_opt})
        restore_rng(state["rng"])
        assert state["step"] == 3 and store.latest_step() == 3
    assert [train_step(fresh_model, fresh_opt) for _ in range(4)] == expected
    assert first_difference(model.state_dict(), fresh_model.state_dict()) is None
    assert first_difference(opt.state_dict(), fresh_opt.state_dict()) is None


def test_save_snapshots_state_so_later_training_does_not_leak_into_it(run_dir):
    model, opt = trained(steps=1)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointStore(run_dir) as store:
        handle = store.save(1, {"model": model})
        train_step(model, opt)  # mutates the live tensors while the write may still run
        handle.wait()
        assert first_difference(store.restore()["model"], snapshot) is None


def test_staging_buffers_are_reused_across_saves(run_dir):
    model, _ = trained(steps=1)
    with CheckpointStore(run_dir) as store:
        store.save(1, {"model": model}).wait()
        first = [t.data_ptr() for t in store._stager._buffers]
        store.save(2, {"model": model}).wait()
        assert [t.data_ptr() for t in store._stager._buffers] == first


def test_rotation_keeps_last_k(run_dir):
    with CheckpointStore(run_dir, keep_local=2, every=10) as store:
        for step in range(1, 51):
            store.step_end(step, {"step": step})
        store.wait()
        assert [c.step for c in store.list()] == [40, 50]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_failed_background_write_surfaces_at_next_call_and_previous_checkpoint_stays(run_dir, monkeypatch, err):
    store = CheckpointStore(run_dir)
    store.save(1, {"x": torch.ones(1000)}).wait()
    real_write = shardfile.write_all

    def failing_write(fd, data):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(shardfile, "write_all", failing_write)
    handle = store.save(2, {"x": torch.zeros(1000)})  # returns: the failure is in the background
    with pytest.raises(BackgroundSaveError, match=rf"step 2 failed: .*{os.strerror(err)}"):
        store.save(3, {"x": torch.zeros(1000)})
    with pytest.raises(BackgroundSaveError):
        handle.wait()  # the handle keeps reporting it too
    monkeypatch.setattr(shardfile, "write_all", real_write)
    assert store.latest_step() == 1
    assert torch.equal(store.restore()["x"], torch.ones(1000))
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name]
    # The failure was reported once; the store keeps working afterwards.
    store.save(3, {"x": torch.full((1000,), 3.0)}).wait()
    store.close()
    assert CheckpointStore(run_dir).restore()["x"][0] == 3.0


@pytest.mark.parametrize("call", ["wait", "close"])
def test_failure_surfaces_at_wait_and_close(run_dir, monkeypatch, call):
    store = CheckpointStore(run_dir)
    monkeypatch.setattr(shardfile, "write_all", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    store.save(1, {"x": torch.ones(10)})
    with pytest.raises(BackgroundSaveError, match="No space left"):
        getattr(store, call)()


def test_restore_errors_are_clear(run_dir):
    model, opt = trained(steps=1)
    with CheckpointStore(run_dir) as store:
        store.save(1, {"model": model, "optim": opt}).wait()
        with pytest.raises(CheckpointNotFoundError, match="step 7"):
            store.restore(7)
        with pytest.raises(CheckpointExistsError):
            store.save(1, {"model": model})
        other = torch.nn.Linear(2, 2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(IncompatibleStateError, match="keys differ"):
            store.restore(into={"optim": opt, "model": other})
        with pytest.raises(IncompatibleStateError, match="no entries"):
            store.restore(into={"sched": model})
    assert first_difference(before, model.state_dict()) is None


def test_signals_set_flags_and_combine_with_cadence(run_dir):
    previous_calls = []

    def previous(signum, frame):
        previous_calls.append(signum)
    old = signal.signal(signal.SIGUSR1, previous)
    try:
        with CheckpointStore(run_dir, every=100) as store:
            with store.handle_signals():
                assert not store.should_save(7) and store.should_save(100)
                os.kill(os.getpid(), signal.SIGUSR1)
                assert store.should_save(7) and not store.should_stop()
                assert previous_calls == [signal.SIGUSR1]  # chained
                store.save(7, {"s": 7})
                assert not store.should_save(8)  # consumed by the save
                os.kill(os.getpid(), signal.SIGTERM)
                assert store.should_stop()
                assert store.step_end(9, lambda: {"s": 9}) is True
                assert store.latest_step() == 9  # committed before step_end returned
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR1) is previous  # the previous handler, put back
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_signal_during_a_save_is_not_lost(run_dir, monkeypatch):
    with CheckpointStore(run_dir, every=0) as store, store.handle_signals():
        real_stage = store._stager.stage_split

        def stage_and_get_signalled(state, defer):
            staged = real_stage(state, defer)
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives while this save is in progress
            return staged

        monkeypatch.setattr(store._stager, "stage_split", stage_and_get_signalled)
        store.save(1, {"s": 1})
        assert store.should_save(2)  # still pending for the next boundary


@pytest.mark.parametrize("kwargs, match", [
    ({"keep_local": 0}, "keep_local"), ({"every": -1}, "every"), ({"verify": "md5"}, "verify"),
    ({"compression": "gzip"}, "compression"), ({"orphan_grace": -1}, "orphan_grace"),
    ({"orphan_grace": "1h"}, "orphan_grace"), ({"orphan_grace": float("nan")}, "orphan_grace"),
])
def test_bad_settings_are_refused_naming_them(run_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointStore(run_dir, **kwargs)
