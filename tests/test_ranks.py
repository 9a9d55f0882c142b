"""Many ranks: spawned gloo process groups saving, committing, restoring and resharding together."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import ROOT
from forkserver import Forked
from s3server import free_port

from tieredckpt import load_sharded
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.local import LocalTier
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.reshard import even_spans

WORKER = Path(__file__).with_name("rank_worker.py")
ZERO = ROOT / "examples" / "train_zero.py"


def launch(world: int, argv: list[str]) -> list[Forked]:
    """``world`` ranks of ``python SCRIPT ...`` as torchrun starts them (its environment), each a
    process forked from this test process's fork server: torch is imported once, not per rank."""
    port, server = free_port(), forkserver.shared()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(server.popen(argv, env=env))
    return procs


def results(procs, timeout=180) -> list[dict]:
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def run(world, scenario, run_dir, *extra):
    return results(launch(world, [str(WORKER), scenario, str(run_dir), *extra]))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_every_rank_saves_its_shard_and_restores_it_byte_equal(tmp_path, world, layout):
    run_dir = tmp_path / ("run" if layout == "shared" else "node{rank}")
    saved = run(world, "save", run_dir)
    assert all(r["steps"] == [1, 2, 3] for r in saved)
    restored = run(world, "restore", run_dir)
    assert [r["step"] for r in restored] == [3] * world and all(r["diff"] is None for r in restored)
    dirs = [tmp_path / "run"] if layout == "shared" else [tmp_path / f"node{r}" for r in range(world)]
    for d in dirs:
        manifest = LocalTier(d).manifest(3)
        assert manifest.world_size == world and (d / "latest").read_text().strip() == "step_000003"
        spans = [(s.param_shard_offset, s.param_shard_numel) for s in manifest.shards]
        assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if layout == "shared":
        states = load_sharded(tmp_path / "run" / "step_000003", world, verify="sha256")
        assert [s["owner"] for s in states] == list(range(world))
    else:  # each node holds its own ranks' shards and the global manifest
        assert sorted(p.name for p in (tmp_path / "node1" / "step_000003").iterdir()) == ["manifest.json", "rank1.bin"]
        cli = [sys.executable, "-m", "tieredckpt.cli"]
        ls = subprocess.run([*cli, "ls", str(tmp_path / "node1")], capture_output=True, text=True)
        assert ls.returncode == 0 and f"ranks [1] of {world} on this node" in ls.stdout
        strict = subprocess.run([*cli, "verify", str(tmp_path / "node1")], capture_output=True, text=True)
        assert strict.returncode == 1 and "rank0.bin: shard of rank 0 is missing" in strict.stdout
        node = subprocess.run([*cli, "verify", str(tmp_path / "node1"), "--node-local"], capture_output=True, text=True)
        assert node.returncode == 0 and "step 3: ok (ranks [1]" in node.stdout


def test_a_rank_killed_mid_save_leaves_no_commit_anywhere(tmp_path):
    procs = launch(2, [str(WORKER), "kill", str(tmp_path / "run")])
    victim, survivor = procs[1], procs[0]
    victim.wait(timeout=120)
    assert victim.returncode == -signal.SIGKILL
    try:
        out, err = survivor.communicate(timeout=60)
        assert "error" in json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        survivor.kill()  # a survivor stuck in a collective is killed too: the result must hold either way
        survivor.wait()
    tier = LocalTier(tmp_path / "run")
    assert tier.steps() == [1] and tier.latest_pointer() == 1
    states = load_sharded(tmp_path / "run" / "step_000001", 2, verify="sha256")
    assert [s["step"] for s in states] == [1, 1]
    tier.save(5, [{"x": 1}])  # the next run cleans the dead ranks' scratch
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name]


def test_a_rank_without_its_local_copy_fetches_its_shard_from_the_remote(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    saved = run(2, "save", tmp_path / "node{rank}", "--remote", remote)
    assert all(r["steps"] == [1, 2, 3] for r in saved)
    upload = RemoteTier(remote).upload_manifest(3)
    assert [f.path for f in upload.files] == ["rank0.bin", "rank1.bin"]  # one upload manifest, both ranks
    node0_before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "node0").rglob("rank0.bin"))
    shutil.rmtree(tmp_path / "node1")  # rank 1's machine was replaced
    restored = run(2, "restore", tmp_path / "node{rank}", "--remote", remote)
    assert [r["step"] for r in restored] == [3, 3] and all(r["diff"] is None for r in restored)
    assert (tmp_path / "node1" / "step_000003" / "rank1.bin").exists()  # fetched, verified, committed
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "node0").rglob("rank0.bin")) == node0_before


def test_one_rank_failing_its_upload_means_no_upload_manifest(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    out = run(2, "upload_fails_on_last_rank", tmp_path / "node{rank}", "--remote", remote)
    assert "Access Denied" in out[1]["error"]
    assert "rank 1 could not upload its shard" in out[0]["error"]
    assert all(r["remote_steps"] == [] for r in out)  # nothing visible on the remote
    assert all(r["local_steps"] == [1] for r in out)  # and the local copies stay
    assert RemoteTier(remote).steps() == [] and RemoteTier(remote).orphan_objects(grace=0)[0]  # its parts, named by no marker


def test_a_part_of_another_rank_lost_before_the_commit_is_sent_again_by_that_rank(tmp_path):
    """The leader's commit finds one of rank 1's parts missing (lost by the server, or deleted as an
    object no step named): rank 1 must send it again -- its own record says it was sent -- and the
    step commits whole and restores on fresh machines."""
    remote = f"file://{tmp_path / 'remote'}"
    out = run(2, "part_lost_before_commit", tmp_path / "node{rank}", "--remote", remote)
    assert [r["error"] for r in out] == [None, None]
    assert all(r["remote_steps"] == [1] for r in out)
    out = run(2, "restore", tmp_path / "fresh{rank}", "--remote", remote)
    assert [(r["step"], r["diff"]) for r in out] == [(1, None), (1, None)]


def zero_run(world, run_dir, steps, *extra):
    return launch(world, [str(ZERO), "--run-dir", str(run_dir), "--steps", str(steps), "--every", "20", *extra])


def wait_logged(run_dir: Path, step: int, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if sum(1 for _ in open(run_dir / ".loss.json")) >= step:
                return
        except FileNotFoundError:
            pass
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_signals_to_one_rank_make_every_rank_save_the_same_step(tmp_path):
    procs = zero_run(2, tmp_path / "run", 100_000)
    wait_logged(tmp_path / "run", 25, procs)
    procs[1].send_signal(signal.SIGUSR1)  # only rank 1 is told
    wait_logged(tmp_path / "run", 50, procs)
    extra = [s for s in LocalTier(tmp_path / "run").steps() if s % 20]
    assert len(extra) == 1  # one off-cadence checkpoint, committed by both ranks
    assert [s["step"] for s in load_sharded(tmp_path / "run" / f"step_{extra[0]:06d}", 2)] == [extra[0]] * 2
    procs[0].send_signal(signal.SIGTERM)  # only rank 0 is told; both save, both exit 0
    for proc in procs:
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    last = LocalTier(tmp_path / "run").latest_step()
    assert last % 20 and last > 50
    assert [s["step"] for s in load_sharded(tmp_path / "run" / f"step_{last:06d}", 2)] == [last, last]


def test_zero_training_resumed_after_sigterm_is_bit_identical_and_reshards(tmp_path):
    for proc in zero_run(2, tmp_path / "straight", 60):
        assert proc.wait(timeout=120) == 0
    procs = zero_run(2, tmp_path / "stopped", 60)
    wait_logged(tmp_path / "stopped", 33, procs)
    procs[1].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert LocalTier(tmp_path / "stopped").latest_step() < 60
    for proc in zero_run(2, tmp_path / "stopped", 60):
        assert proc.wait(timeout=120) == 0
    a = load_sharded(tmp_path / "straight" / "step_000060", 2, verify="sha256")
    b = load_sharded(tmp_path / "stopped" / "step_000060", 2, verify="sha256")
    assert first_difference(a, b) is None
    # the same state resumed on 3 ranks: re-split exactly, then training goes on
    for proc in zero_run(3, tmp_path / "stopped", 70, "--reshard"):
        assert proc.wait(timeout=120) == 0
    assert LocalTier(tmp_path / "stopped").manifest(70).world_size == 3
    flat = torch.cat([s["flat"]["exp_avg_sq"] for s in a])
    assert [n for _, n in even_spans(flat.numel(), 3)] == [
        s.param_shard_numel for s in LocalTier(tmp_path / "stopped").manifest(70).shards]


def test_sigterm_to_one_rank_puts_every_ranks_shard_of_that_step_on_the_remote_for_fresh_machines(
        tmp_path, moto_server, monkeypatch):
    """Two ranks, SIGTERM to rank 1 only: the step both save on it is committed on the remote
    (every rank's shard, one marker) before they exit, so two fresh machines resume from it."""
    from s3server import CREDS
    moto_server.make_bucket("zero-preempted")
    url = "s3://zero-preempted/run"
    for key, value in {"AWS_ACCESS_KEY_ID": CREDS["key"], "AWS_SECRET_ACCESS_KEY": CREDS["secret"],
                       "AWS_ENDPOINT_URL": moto_server.endpoint}.items():
        monkeypatch.setenv(key, value)  # launch() hands the environment to both ranks
    procs = zero_run(2, tmp_path / "run", 100_000, "--remote", url)
    wait_logged(tmp_path / "run", 27, procs)  # past the step-20 cadence
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    stopped = LocalTier(tmp_path / "run").latest_step()
    assert stopped > 20 and stopped % 20 != 0
    saved = load_sharded(tmp_path / "run" / f"step_{stopped:06d}", 2, verify="sha256")
    remote = RemoteTier(url, {"endpoint_url": moto_server.endpoint})
    assert remote.newest_step() == stopped  # committed there, both shards under one marker
    shutil.rmtree(tmp_path / "run")  # both nodes are gone
    procs = zero_run(2, tmp_path / "fresh", stopped + 1, "--remote", url)
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert f"resumed at step {stopped}" in outs[0][0], outs[0][0]
    downloaded = load_sharded(tmp_path / "fresh" / f"step_{stopped:06d}", 2, verify="sha256")
    assert first_difference(saved, downloaded) is None  # what the stopped ranks saved, bit for bit
