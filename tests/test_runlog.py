"""The run directory's side files: append-only loss history, torn lines, resumes, pivots, forks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tieredckpt import CheckpointStore, RunLog
from tieredckpt._loop.runlog import LOSS, SAMPLES, STATE


def test_200k_appends_read_back_exactly(run_dir):
    log = RunLog(run_dir)
    for step in range(200_000):
        log.append_loss(step, step * 0.5)
    log.sync()
    size_before = os.path.getsize(run_dir / LOSS)
    log.append_loss(200_000, 1.0)
    # One append adds one line; nothing earlier is rewritten.
    assert os.path.getsize(run_dir / LOSS) - size_before == len('{"step":200000,"loss":1.0}\n')
    history = log.read_loss()
    assert history.torn == 0 and len(history.entries) == 200_001
    by_step = history.by_step()
    assert by_step[199_999] == 199_999 * 0.5 and len(by_step) == 200_001


def test_torn_last_line_is_skipped_and_never_corrupts_the_next_entry(run_dir):
    log = RunLog(run_dir)
    for step in range(5):
        log.append_loss(step, 1.0)
    log.close()
    with open(run_dir / LOSS, "ab") as f:
        f.write(b'{"step":5,"lo')  # a crash mid-append
    history = RunLog(run_dir).read_loss()
    assert history.torn == 1 and sorted(history.by_step()) == [0, 1, 2, 3, 4]
    log = RunLog(run_dir)
    log.append_loss(5, 2.0)  # the next run appends after the torn fragment, not into it
    history = log.read_loss()
    assert history.torn == 1 and history.by_step()[5] == 2.0


def test_resume_marks_replayed_steps(run_dir):
    log = RunLog(run_dir)
    for step in range(1, 8):  # crashed after step 7; last checkpoint was step 5
        log.append_loss(step, float(step))
    log.mark_resume(5)
    for step in (6, 7, 8):
        log.append_loss(step, step + 0.5)
    history = log.read_loss()
    assert [e["step"] for e in history.replayed()] == [6, 7]
    assert history.by_step() == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 6.5, 7: 7.5, 8: 8.5}
    assert len(history.entries) == 11  # nothing removed from the file


def test_pivot_archives_samples_and_state_but_never_the_loss_history(run_dir):
    log = RunLog(run_dir)
    for step in range(10):
        log.append_loss(step, 1.0)
    log.write_samples([{"step": 9, "text": "hello"}])
    log.write_state({"arms": {"wiki": 3, "gone_source": 9}})
    loss_before = (run_dir / LOSS).read_bytes()
    archive = log.pivot(9, note="new caps")
    assert json.loads((archive / SAMPLES).read_text()) == [{"step": 9, "text": "hello"}]
    assert json.loads((archive / STATE).read_text())["arms"]["gone_source"] == 9
    assert log.read_samples() == [] and log.read_state() == {}  # really reset
    assert (run_dir / LOSS).read_bytes().startswith(loss_before)  # untouched, only appended to
    assert log.pivots()[0]["step"] == 9
    log.append_loss(10, 0.9)
    assert sorted(log.read_loss().by_step()) == list(range(11))
    assert log.pivot(9) != archive  # a second pivot at the same step never overwrites the first


def test_fork_makes_an_independent_run_with_provenance(tmp_path):
    parent = tmp_path / "parent"
    with CheckpointStore(parent, every=5) as store:
        for step in range(1, 11):
            store.log_loss(step, float(step))
            store.step_end(step, lambda: {"w": torch.full((3,), float(step)), "step": step})
        child = store.fork(5, tmp_path / "child")
    provenance = json.loads((child / "provenance.json").read_text())
    assert provenance["parent_step"] == 5 and provenance["parent_run"] == str(parent.resolve())
    with CheckpointStore(child) as fork:
        assert fork.latest_step() == 5
        assert fork.restore()["w"][0] == 5.0
        assert sorted(fork.run.read_loss().by_step()) == [1, 2, 3, 4, 5]
        fork.save(6, {"w": torch.zeros(3), "step": 6}).wait()
    with CheckpointStore(parent) as store:  # the parent is untouched by the fork's progress
        assert store.latest_step() == 10 and 6 not in [c.step for c in store.list()]
    with pytest.raises(FileExistsError):
        CheckpointStore(parent).fork(5, child)
