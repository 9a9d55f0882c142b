"""A save's copy and its write run side by side (handoff.py): the writer reads the parts save() has
not reached from the live tensors while the loop is blocked, and the staged copies of the rest.
Whichever side is slow, the checkpoint is exactly the state at save(), even when the loop
overwrites every tensor the moment save() returns; a copy that fails commits nothing."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from conftest import disk_full_at_write

from tieredckpt import BackgroundSaveError, CheckpointStore, DiskFullError
from tieredckpt._format import directwrite
from tieredckpt._format.compare import first_difference
from tieredckpt._loop import handoff
from tieredckpt._loop.handoff import Handoff
from tieredckpt._loop.staging import Stager, _side_by_side

MB = 1 << 20


def state_of_every_kind() -> dict:
    """~44 MB (past MIN_DIRECT, so the O_DIRECT writer, which may read live tensors): tensors
    larger than a part and smaller, a transposed (non-contiguous) one, bf16, 0-d, plain values."""
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(9 * MB, generator=g),
            "mid": torch.randn(1 * MB + 7, generator=g),
            "t": torch.randn(512, 1024, generator=g).t(),
            "half": torch.randn(3 * MB, generator=g).to(torch.bfloat16),
            "small": [torch.randn(17, generator=g) for _ in range(40)],
            "count": torch.tensor(5), "step": 11}


def clone(state):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v] if isinstance(v, list) else v)
            for k, v in state.items()}


def overwrite(state) -> None:
    """What the loop does the moment save() returns: every tensor changes in place."""
    with torch.no_grad():
        for v in state.values():
            for t in (v if isinstance(v, list) else [v]):
                if isinstance(t, torch.Tensor):
                    t.fill_(-7)


def watch_takes(monkeypatch) -> list[bool]:
    """True for each part the writer read live, False for each it read staged."""
    taken: list[bool] = []
    real = Handoff._take

    def take(self, k, live_ok):
        live = real(self, k, live_ok)
        taken.append(live)
        return live
    monkeypatch.setattr(Handoff, "_take", take)
    return taken


def slow(monkeypatch, side: str) -> None:
    """"copy": the writer gets far into the live tensors. "writer" too: it also holds each part
    a while before it copies it into its own buffers, so save() must wait for it to let go."""
    real = Handoff._copy
    monkeypatch.setattr(Handoff, "_copy", lambda self, k: (time.sleep(0.004), real(self, k)))
    if side == "writer":
        real_add = directwrite._Writer.add
        monkeypatch.setattr(directwrite._Writer, "add", lambda self, piece: (time.sleep(0.02), real_add(self, piece)))


def direct_or_skip(directory) -> None:
    fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if not directwrite.enable_direct(fd):
            pytest.skip("this filesystem refuses O_DIRECT: the writer never reads live tensors here")
    finally:
        os.close(fd)
        os.unlink(directory / "probe")


@pytest.mark.parametrize("side", ["copy", "writer"])
def test_whichever_side_is_slow_the_checkpoint_is_the_state_at_save_though_the_loop_overwrites_it(tmp_path, monkeypatch, side):
    direct_or_skip(tmp_path)
    taken = watch_takes(monkeypatch)
    slow(monkeypatch, side)
    state = state_of_every_kind()
    expected = clone(state)
    with CheckpointStore(tmp_path / "run", every=0) as store:
        handle = store.save(1, state)
        overwrite(state)  # at once: a live read after save() returned would catch this
        handle.wait()
        back = store.restore(1)
    assert first_difference(expected, back) is None
    assert True in taken and False in taken  # both ways really happened: live reads, staged copies


def test_every_save_of_a_run_is_its_own_state_and_only_new_buffers_are_read_around(tmp_path, monkeypatch):
    """Once the buffers are ours the copy is quick on all cores: the writer waits for it."""
    direct_or_skip(tmp_path)
    taken = watch_takes(monkeypatch)
    slow(monkeypatch, "copy")
    state = state_of_every_kind()
    saved = {}
    with CheckpointStore(tmp_path / "run", every=0, keep_local=3) as store:
        for step in (1, 2, 3):
            with torch.no_grad():
                state["big"].add_(step)
                state["t"].mul_(-1)
            saved[step] = clone(state)
            taken.clear()
            store.save(step, state).wait()
            assert (True in taken) == (step == 1)  # live reads into the first save's new buffers alone
            overwrite(state)
            state.update(clone(saved[step]))
        for step in (1, 2, 3):
            assert first_difference(saved[step], store.restore(step)) is None


@pytest.mark.parametrize("buffers", ["new", "reused"])
def test_a_copy_that_fails_midway_raises_from_save_and_commits_nothing(tmp_path, monkeypatch, buffers):
    calls = []
    real_copy = torch.Tensor.copy_

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the copy broke")
        return real_copy(self, *args, **kwargs)
    state = state_of_every_kind()
    with CheckpointStore(tmp_path / "run", every=0) as store:
        if buffers == "reused":
            store.save(1, state).wait()
        monkeypatch.setattr(Handoff, "_copy", lambda self, k: failing(self._buffers[self.parts[k][0]], self._sources[self.parts[k][0]]))
        monkeypatch.setattr(torch.Tensor, "copy_", failing)
        import tieredckpt._loop.handoff as handoff_module  # the batched copy of reused buffers, pair by pair
        monkeypatch.setattr(handoff_module, "_FOREACH_COPY",
                            lambda dsts, srcs: [failing(d, s) for d, s in zip(dsts, srcs)])
        with pytest.raises(RuntimeError, match="the copy broke"):
            store.save(2, state)
        monkeypatch.undo()
        assert store.latest_step() == (1 if buffers == "reused" else None)
        assert store.stats()["save_failures"] == 0  # save() raised it; no background failure to report
        store.save(2, state).wait()  # the same step, again: nothing of the failed one is in the way
        assert first_difference(state, store.restore(2)) is None


def test_a_disk_full_after_live_reads_fails_that_save_alone_and_is_not_written_again_from_stale_buffers(tmp_path, monkeypatch):
    """A retry after a full disk (room made by rotating step 1 out) would need the parts read
    live, and the loop has moved on since: that save fails as a full disk, step 1 stays."""
    direct_or_skip(tmp_path)
    state = state_of_every_kind()
    with CheckpointStore(tmp_path / "run", every=0, keep_local=2) as store:
        store.save(1, {"x": torch.ones(3)}).wait()
        store.save(2, {"x": torch.ones(3)}).wait()  # step 3's buffers are new: its writer reads live
        taken = watch_takes(monkeypatch)
        slow(monkeypatch, "copy")
        disk_full_at_write(monkeypatch, 2)
        handle = store.save(3, state)
        overwrite(state)
        with pytest.raises(BackgroundSaveError) as failed:
            handle.wait()
        assert isinstance(failed.value.__cause__, DiskFullError) and True in taken
        assert [c.step for c in store.list()] == [1, 2]  # nothing committed was given up for it
        fresh = state_of_every_kind()
        store.save(4, fresh).wait()
        assert first_difference(fresh, store.restore(4)) is None


def test_parts_are_whole_elements_and_cover_every_byte_once():
    buffers = [torch.empty(n, dtype=d) for n, d in ((0, torch.float32), (5, torch.bfloat16),
                                                     (handoff.PART // 4 + 3, torch.float32),
                                                     (handoff.PART // 2, torch.float16))]
    h = Handoff(buffers, buffers, list(range(len(buffers))), set(), set(range(len(buffers))))
    for i, b in enumerate(buffers):
        cuts = [(s, e) for j, s, e in h.parts if j == i]
        assert cuts[0][0] == 0 and cuts[-1][1] == b.numel() * b.element_size()
        assert all(a[1] == c[0] for a, c in zip(cuts, cuts[1:]))
        assert all(s % b.element_size() == 0 and e - s <= handoff.PART for s, e in cuts)


def small_state() -> dict:
    """Small tensors of every width (staged side by side), an empty and a 0-d one, and one too
    large to share (its own buffer)."""
    g = torch.Generator().manual_seed(5)
    kinds = (torch.float64, torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.int64, torch.float16)
    small = [torch.randn(3 + i % 7, generator=g).to(kinds[i % len(kinds)]) for i in range(300)]
    return {"small": small, "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5),
            "large": torch.randn((256 << 10) // 4, generator=g), "step": 0}


def test_small_tensors_are_staged_side_by_side_and_written_as_runs_of_one_part(tmp_path, monkeypatch):
    """From the second save on (the buffers reused) the small tensors' bytes reach the writer
    as a few runs, not a part each; every save restores exactly though the loop overwrites its
    tensors the moment save() returns; a small tensor whose shape changes gets a new side-by-side
    buffer, and the old one is never written from."""
    snapshots = []
    real = Stager.stage_split
    monkeypatch.setattr(Stager, "stage_split", lambda self, *a: snapshots.append(real(self, *a)) or snapshots[-1])
    state = small_state()
    saved = {}
    with CheckpointStore(tmp_path / "run", every=0, keep_local=4) as store:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                for t in state["small"]:
                    t.add_(1) if t.dtype != torch.bool else t.logical_not_()
            if step == 4:
                state["small"][7] = torch.arange(11, dtype=torch.float32)  # a new shape
            state["step"] = step
            saved[step] = copy.deepcopy(state)
            flat_before = store._stager._flat
            handle = store.save(step, state)
            parts = snapshots[-1].handoff.parts
            overwrite(state)
            handle.wait()
            state = copy.deepcopy(saved[step])
            if step in (2, 3):  # 303 tensors, in runs: the large one, the runs, nothing else
                assert len(parts) <= 5, parts
            if step == 4:
                assert store._stager._flat is not flat_before
        for step in (1, 2, 3, 4):
            assert first_difference(saved[step], store.restore(step, mark_resume=False)) is None, step


def test_runs_cover_every_byte_once_in_order_and_stop_at_a_deferred_tensor_or_a_part():
    tensors = [torch.arange(n).to(d) for n, d in ((5, torch.float64), (3, torch.float32), (0, torch.float32),
                                                      (7, torch.int8), (4, torch.int8), (1, torch.uint8))]
    order = list(range(len(tensors)))
    flat, views = _side_by_side(tensors, order, pin=False)
    buffers = [views[i] for i in order]
    for b, t in zip(buffers, tensors):
        b.copy_(t)
    parts = [(i, 0, b.numel() * b.element_size()) for i, b in enumerate(buffers)]
    merged, mviews = handoff._runs(parts, buffers, set(), flat)
    assert len(merged) == 1 and bytes(mviews[0]) == bytes(handoff.byte_view(flat))
    merged, mviews = handoff._runs(parts, buffers, {3}, flat)  # tensor 3 is copied later: its own part
    assert [p[0] for p in merged] == [0, 3, 4] and mviews[1] is None
    assert b"".join(bytes(v) if v is not None else bytes(handoff.byte_view(buffers[3])) for v in mviews) == \
        bytes(handoff.byte_view(flat))
    old = handoff.PART
    try:
        handoff.PART = 40  # runs stop at a part's size
        merged, mviews = handoff._runs(parts, buffers, set(), flat)
        assert len(merged) == 2 and all(len(v) <= 40 for v in mviews)
        assert b"".join(map(bytes, mviews)) == bytes(handoff.byte_view(flat))
    finally:
        handoff.PART = old
