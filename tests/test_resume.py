"""Bitwise resume of the real demo, as subprocesses stopped with real signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from tieredckpt import RunLog
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.local import LocalTier

DEMO = ROOT / "examples" / "train_tiny_lm.py"
STEPS, EVERY = 120, 25


def start(run_dir: Path, steps: int = STEPS, remote=None) -> subprocess.Popen:
    """The demo; ``remote``: (url, S3 server of the suite) to upload to."""
    extra, env = [], None
    if remote is not None:
        from s3server import CREDS
        url, server = remote
        extra = ["--remote", url, "--endpoint-url", server.endpoint]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"])
    return subprocess.Popen([sys.executable, str(DEMO), "--run-dir", str(run_dir), "--steps", str(steps),
                             "--every", str(EVERY), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    return out


def logged_steps(run_dir: Path) -> int:
    try:
        return sum(1 for _ in open(run_dir / ".loss.json"))
    except FileNotFoundError:
        return 0


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 120
    while logged_steps(run_dir) < step:
        assert proc.poll() is None, f"demo ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, "demo made no progress"
        time.sleep(0.01)


def final(run_dir: Path) -> dict:
    (state,) = LocalTier(run_dir).load(STEPS, verify="sha256")
    return {k: state[k] for k in ("model", "optim", "step", "rng", "data_order")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("straight")
    finish(start(run_dir))
    return final(run_dir)


def test_sigterm_saves_the_current_step_exits_0_and_resume_is_bit_identical(tmp_path, straight):
    proc = start(tmp_path)
    wait_for_step(proc, tmp_path, 37)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)  # exit status 0
    stopped_at = LocalTier(tmp_path).latest_step()
    assert f"checkpoint for step {stopped_at} committed" in out
    assert 37 <= stopped_at < STEPS
    out = finish(start(tmp_path))
    assert "resumed from" in out and f"(step {stopped_at})" in out
    assert first_difference(straight, final(tmp_path)) is None
    assert RunLog(tmp_path).read_loss().replayed() == []  # nothing was lost, nothing redone


def test_sigterm_uploads_the_stopped_step_so_a_fresh_machine_resumes_from_it_bit_identical(
        tmp_path, straight, seaweed_server):
    """Preemption: the node that got SIGTERM never comes back. The step saved on SIGTERM is on
    the remote when the process exits 0, and a fresh machine (the run directory wiped) resumes
    from exactly that step -- not the last cadence step -- bit-identical to the run that never
    stopped. On SeaweedFS, the suite's production server (test_exit and test_ranks use moto)."""
    seaweed_server.make_bucket("preempted")
    remote = ("s3://preempted/tiny", seaweed_server)
    proc = start(tmp_path / "run", remote=remote)
    wait_for_step(proc, tmp_path / "run", EVERY + 12)  # past a cadence step: the SIGTERM step is newer
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    stopped = LocalTier(tmp_path / "run").latest_step()
    assert stopped % EVERY != 0 and f"checkpoint for step {stopped} committed" in out
    assert f"step {stopped} is on s3://preempted/tiny: a fresh machine resumes from it" in out, out
    shutil.rmtree(tmp_path / "run")  # the node is gone
    out = finish(start(tmp_path / "run", remote=remote))
    assert f"resumed from s3://preempted/tiny (downloaded) (step {stopped})" in out, out
    assert first_difference(straight, final(tmp_path / "run")) is None


def test_sigkill_resumes_from_last_cadence_checkpoint_and_is_still_bit_identical(tmp_path, straight):
    proc = start(tmp_path)
    wait_for_step(proc, tmp_path, 2 * EVERY + 8)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed_from = LocalTier(tmp_path).latest_step()
    assert resumed_from % EVERY == 0 and resumed_from >= 2 * EVERY
    finish(start(tmp_path))
    assert first_difference(straight, final(tmp_path)) is None
    history = RunLog(tmp_path).read_loss()
    assert history.events("resume")[0]["step"] == resumed_from
    assert history.replayed() and all(e["step"] > resumed_from for e in history.replayed())
    assert sorted(history.by_step()) == list(range(1, STEPS + 1))
    # The redone steps computed the same losses as the lost ones.
    lost = {e["step"]: e["loss"] for e in history.replayed()}
    assert all(history.by_step()[s] == loss for s, loss in lost.items())


def test_sigusr1_saves_the_current_step_and_training_goes_on(tmp_path):
    proc = start(tmp_path, steps=400)
    wait_for_step(proc, tmp_path, 30)
    proc.send_signal(signal.SIGUSR1)
    wait_for_step(proc, tmp_path, 60)
    held = LocalTier(tmp_path).steps()
    assert proc.poll() is None  # still training
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    (answered,) = [int(m) for m in re.findall(r"SIGUSR1: saving step (\d+)", out)]  # cadence step or not
    assert 30 <= answered < 60 and answered in held  # the checkpoint SIGUSR1 asked for
    assert [s for s in held if s % EVERY] in ([], [answered])  # and no other one off the cadence
    assert LocalTier(tmp_path).latest_step() >= 60
    samples = json.loads((tmp_path / ".samples.json").read_text())
    assert [s["step"] for s in samples] == [25, 50] and all(len(s["text"]) == 81 for s in samples)


def test_a_second_demo_on_the_same_run_is_refused_in_one_line_and_the_first_goes_on(tmp_path):
    from forkserver import shared
    run = tmp_path / "run"
    first = shared().popen([str(DEMO), "--run-dir", str(run), "--steps", "100000", "--every", str(EVERY)])
    wait_for_step(first, run, 2)  # training: the store is open and its signal handlers are in place
    second = shared().popen([str(DEMO), "--run-dir", str(run), "--steps", "10"])
    out, err = second.communicate(timeout=120)
    assert second.returncode == 1, (out, err)
    assert "another writer holds this run directory" in err and "Traceback" not in err, err
    assert first.poll() is None  # untouched by the second
    first.terminate()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "committed" in out, (out, err)
