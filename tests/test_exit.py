"""A stop request is a promise to exit: SIGTERM ends the process within seconds whatever the remote does.

The README's demo runs as a real subprocess against moto behind the fault proxy
(tests/faultproxy.py). Once a checkpoint has been uploaded the remote turns bad --
every request hangs unanswered, or is answered 503, or its connection is reset --
and a later SIGTERM must still end the process, exit status 0, within 10 s, with
its step committed locally. A restart against the healthy remote resumes from that
step and uploads it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from s3server import CREDS

from tieredckpt import CheckpointStore
from tieredckpt._tiers.local import LocalTier

DEMO = ROOT / "examples" / "train_tiny_lm.py"
EXIT_BOUND = 10.0  # seconds from SIGTERM to the process's end beyond the upload budget (the default aims at 5)
BUDGET = 1.5  # the demo's --upload-on-exit here: what it may spend sending the stopped step first


def demo(run_dir: Path, proxied, steps: int = 100_000, every: int = 20) -> subprocess.Popen:
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"])
    return subprocess.Popen([sys.executable, str(DEMO), "--run-dir", str(run_dir), "--steps", str(steps),
                             "--every", str(every), "--remote", proxied.url,
                             "--endpoint-url", proxied.proxy.endpoint, "--upload-on-exit", str(BUDGET)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_until(predicate, proc: subprocess.Popen | None, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the demo ended before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def remote_steps(proxied) -> list[int]:
    return proxied.remote().steps()


def term_and_time(proc: subprocess.Popen) -> tuple[float, str, str]:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return time.monotonic() - started, out, err


@pytest.mark.parametrize("fault", ["drop", "503", "reset"])
def test_sigterm_exits_within_seconds_while_the_remote_misbehaves_and_the_restart_uploads(tmp_path, proxied, fault):
    run = tmp_path / "run"
    proc = demo(run, proxied)
    wait_until(lambda: remote_steps(proxied), proc, 120, "a first uploaded step")
    proxied.proxy.set(fault)
    first = max(remote_steps(proxied))
    local = LocalTier(run)
    wait_until(lambda: (local.latest_step() or 0) >= first + 20, proc, 120, "a local checkpoint during the fault")
    seconds, out, err = term_and_time(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert seconds < BUDGET + EXIT_BOUND, f"SIGTERM took {seconds:.1f} s to end the process ({fault})\n{err[-2000:]}"
    assert "did not reach the remote in time" in out, out
    stopped = local.latest_step()
    assert f"checkpoint for step {stopped} committed" in out
    assert local.verify(stopped, full=False).step == stopped
    assert stopped not in remote_steps(proxied)  # the remote never got it: the next start owes it
    assert "Traceback" not in err, err[-3000:]

    proxied.proxy.clear()
    proc = demo(run, proxied, steps=stopped + 1)  # one more step, then it drains its uploads and ends
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert f"resumed from {local.step_path(stopped)} (step {stopped})" in out
    held = remote_steps(proxied)
    assert stopped + 1 in held  # the restart's own step; and the stopped one was owed, unless superseded
    assert proxied.remote().upload_manifest(max(held)).step == stopped + 1


def test_close_without_draining_never_waits_on_a_hanging_request(tmp_path, proxied):
    """In-process: an upload hangs mid-request; close(drain_uploads=False) returns within the
    exit timeout, the local step is committed, and nothing the store started is left waiting
    on the network for the interpreter to join."""
    s = CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options, request_timeout=60.0,
                        upload_part_size=256 << 10, exit_timeout=1.0)
    s.save(1, {"w": torch.randn(100_000)}).wait()
    assert s.wait(uploads=True, timeout=60)
    proxied.proxy.set("drop")
    s.save(2, {"w": torch.randn(400_000)}).wait()
    wait_until(lambda: proxied.proxy.injected["drop"] > 0, None, 30, "a hanging upload request")
    started = time.monotonic()
    s.close(drain_uploads=False)
    took = time.monotonic() - started
    assert took < 2.5, f"close took {took:.1f} s with exit_timeout=1"
    assert LocalTier(tmp_path / "run").steps() == [1, 2]
    stuck = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()
             and t.name.startswith("tieredckpt")]
    deadline = time.monotonic() + 2.0
    while stuck and time.monotonic() < deadline:  # workers whose request was cancelled are ending
        time.sleep(0.05)
        stuck = [t for t in stuck if t.is_alive()]
    assert not stuck, f"threads the interpreter would join at exit: {[t.name for t in stuck]}"


def test_exit_timeout_is_checked():
    with pytest.raises(ValueError, match="exit_timeout"):
        CheckpointStore("unused", exit_timeout=-1)


def test_sigterm_to_one_of_two_ranks_ends_both_within_seconds_with_the_remote_hanging(tmp_path, proxied):
    from test_ranks import launch, wait_logged
    env = {"AWS_ACCESS_KEY_ID": CREDS["key"], "AWS_SECRET_ACCESS_KEY": CREDS["secret"],
           "AWS_ENDPOINT_URL": proxied.proxy.endpoint}
    os.environ.update(env)  # launch() passes the environment on to both ranks
    try:
        procs = launch(2, [str(ROOT / "examples" / "train_zero.py"), "--run-dir", str(tmp_path / "run"),
                           "--steps", "100000", "--every", "20", "--remote", proxied.url,
                           "--upload-on-exit", str(BUDGET)])
    finally:
        for key in env:
            del os.environ[key]
    wait_until(lambda: remote_steps(proxied), procs[0], 180, "a first uploaded step")
    proxied.proxy.set("drop")
    logged = sum(1 for _ in open(tmp_path / "run" / ".loss.json"))
    wait_logged(tmp_path / "run", logged + 50, procs)  # two more checkpoints, their uploads hanging
    started = time.monotonic()
    procs[1].send_signal(signal.SIGTERM)  # one rank is told; both commit and exit
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            proc.kill()
            outs.append(proc.communicate())
    took = time.monotonic() - started
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert took < BUDGET + EXIT_BOUND, f"both ranks took {took:.1f} s to end after SIGTERM"
    last = LocalTier(tmp_path / "run").latest_step()
    assert last >= logged + 50 and last not in remote_steps(proxied)  # committed locally, owed to the remote
