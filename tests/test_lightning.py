"""PyTorch Lightning on the tiers: real lightning, a small LightningModule on CPU, moto over HTTP."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import signal_training
from lightning_run import Model, data, run
from s3server import CREDS

from tieredckpt import CheckpointStore, KeepLast, UnsupportedStateError
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt.lightning import STORE_DIR, TieredCheckpointIO, TieredModelCheckpoint, load_checkpoint, read_pointer

HERE = Path(__file__).parent
PICKLE, ZIP = b"\x80", b"PK\x03\x04"  # torch.save writes a zip (or, legacy, a pickle)


def bucket(moto_server) -> str:
    name = f"pl-{uuid.uuid4().hex[:10]}"
    moto_server.make_bucket(name)
    return f"s3://{name}/runs/pl"


def tiered(url, options, **kw):
    return TieredCheckpointIO(remote=url, remote_options=options, **kw)


def checkpointing(**kw):
    return TieredModelCheckpoint(every_n_train_steps=4, save_top_k=2, monitor="train_loss", save_last=True, **kw)


def test_fit_saves_every_checkpoint_through_the_store_and_a_wiped_machine_resumes_exactly(tmp_path, moto_server):
    url, options = bucket(moto_server), moto_server.options()
    root = tmp_path / "root"
    _, first = run(root, 3, [tiered(url, options, keep_remote=KeepLast(3), uploads="all")], [checkpointing()])
    ckpts = root / "checkpoints"
    pointers = {p.name: read_pointer(p) for p in ckpts.glob("*.ckpt")}
    assert pointers["last.ckpt"] == 24 and len(pointers) == 3  # save_top_k=2 + last
    with CheckpointStore(ckpts / STORE_DIR, read_only=True) as store:
        local = store.local.steps()
        assert set(pointers.values()) <= set(local) and local == [16, 20, 24]  # keep_local=3
    remote = RemoteTier(url, options)
    assert remote.steps() == [16, 20, 24]  # keep_remote, whatever save_top_k removed
    files = [p for p in root.rglob("*") if p.is_file()]
    objects = [remote.t.get(rel, 1 << 30)[:4] for rel in remote.t.list_files("")]
    assert all(not p.read_bytes()[:4].startswith((PICKLE, ZIP)) for p in files)
    assert all(not head.startswith((PICKLE, ZIP)) for head in objects)  # no torch.save output anywhere

    reference_root = tmp_path / "lightning"  # Lightning's own checkpoints, same run
    run(reference_root, 3, [], [L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=4, save_last=True)])
    shutil.rmtree(root)  # a fresh machine: ckpt_path="best" from the scores recorded at save time
    best = checkpointing()
    evaluating = L.Trainer(plugins=[tiered(url, options)], callbacks=[best], default_root_dir=str(root),
                           accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    path = Path(best.find_best(evaluating))
    held = {s: first.losses[s - 1] for s in (16, 20, 24)}  # train_loss logged at the step before the save
    assert read_pointer(path) == min(held, key=held.get) and path.parent == ckpts
    tested = Model()
    evaluating.test(tested, data(), ckpt_path="best", verbose=False)
    saved = load_checkpoint(path, remote=url, remote_options=options)["state_dict"]
    assert all(torch.equal(v, tested.state_dict()[k]) for k, v in saved.items())
    shutil.rmtree(root)
    resumed, model = run(root, 5, [tiered(url, options)], [checkpointing()], ckpt_path="last")
    own, own_model = run(reference_root, 5, [], [L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=4)],
                         ckpt_path=str(reference_root / "checkpoints" / "last.ckpt"))
    _, straight = run(tmp_path / "straight", 5)  # an uninterrupted run: the resume is at an epoch boundary
    assert resumed.global_step == own.global_step == 40 and resumed.current_epoch == 5
    assert sorted(model.losses) == list(range(24, 40))
    assert model.losses == own_model.losses == {s: v for s, v in straight.losses.items() if s >= 24}
    for a, b in zip(model.parameters(), straight.parameters()):
        assert torch.equal(a, b)
    opt = resumed.optimizers[0].state_dict()
    assert opt["param_groups"][0]["lr"] == own.optimizers[0].state_dict()["param_groups"][0]["lr"]


class Opaque:
    """An arbitrary object in the hyper-parameters (picklable, so Lightning keeps it)."""


def test_an_unstorable_hyper_parameter_is_named_or_dropped_when_asked(tmp_path):
    model = Model(note=Opaque())
    with pytest.raises(UnsupportedStateError, match=r"\['hyper_parameters'\]\['note'\].*Opaque.*drop_unsupported"):
        run(tmp_path / "a", 1, [TieredCheckpointIO()], [checkpointing()], model=model)
    with pytest.warns(RuntimeWarning, match=r"\['note'\].*left out"):
        run(tmp_path / "b", 1, [TieredCheckpointIO(drop_unsupported=True)], [checkpointing()], model=Model(note=Opaque()))
    ckpt = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert "note" not in ckpt["hyper_parameters"] and ckpt["hyper_parameters"]["width"] == 16
    from lightning.fabric.utilities.data import AttributeDict

    from tieredckpt.lightning import from_plain, to_plain
    saved = to_plain({"hparams_type": AttributeDict, "h": AttributeDict(betas=(0.9, 0.99), inf=float("inf"))})
    assert from_plain(saved) == {"hparams_type": AttributeDict, "h": {"betas": (0.9, 0.99), "inf": float("inf")}}
    with pytest.raises(UnsupportedStateError, match=r"\['t'\] holds the class .*Opaque"):  # not allow-listed
        to_plain({"t": Opaque})


def test_a_foreign_pickle_checkpoint_is_never_unpickled_unless_weights_only(tmp_path):
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, foreign)
    io = TieredCheckpointIO(tmp_path / "store")
    with pytest.raises(UnsupportedStateError, match="not unpickled.*weights_only=True"):
        io.load_checkpoint(foreign)
    assert torch.equal(io.load_checkpoint(foreign, weights_only=True)["state_dict"]["w"], torch.ones(2))
    io.teardown()


def test_sigusr1_saves_and_goes_on_sigterm_saves_stops_and_exits_0(tmp_path, moto_server):
    url = bucket(moto_server)
    root = tmp_path / "root"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
               AWS_ENDPOINT_URL=moto_server.endpoint, PYTHONPATH=str(HERE))
    status, rest = signal_training(HERE / "lightning_run.py", [str(root), url], env,
                                   {5: signal.SIGUSR1, 30: signal.SIGTERM})
    assert status == 0
    stopped = int(rest.strip().splitlines()[-1].split()[-1])
    with CheckpointStore(root / "checkpoints" / STORE_DIR, read_only=True) as store:
        steps = store.local.steps()
        assert len(steps) == 2 and 5 <= steps[0] < 30 <= steps[1] == stopped, steps
        store.local.verify(stopped, full=True)
    assert read_pointer(root / "checkpoints" / "last.ckpt") == stopped
    # preempted: the node never comes back; the SIGTERM step went up before the exit
    options = moto_server.options()
    assert RemoteTier(url, options).newest_step() == stopped
    shutil.rmtree(root)
    _, model = run(root, stopped // 8 + 2, [tiered(url, options)], [checkpointing()], ckpt_path="last",
                   max_steps=stopped + 1)
    assert sorted(model.losses) == [stopped]  # the fresh machine resumed from the SIGTERM step


def fsdp(root: Path, url: str, epochs: int, devices: int, out: Path, env: dict) -> int:
    """lightning_fsdp.py: Lightning's own launcher starts the other rank; the global step it ended at."""
    out.mkdir()
    done = subprocess.run([sys.executable, str(HERE / "lightning_fsdp.py"), str(root), url, str(epochs),
                           str(devices), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return int(done.stdout.split()[-1])


def gathered(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and any(k.startswith("optim/") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def launch_env(moto_server=None) -> dict:
    """No torchrun variables: Lightning's own launcher starts the ranks and picks a free port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["PYTHONPATH"] = str(HERE)
    if moto_server is not None:
        env.update(AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
                   AWS_ENDPOINT_URL=moto_server.endpoint)
    return env


def test_fsdp2_run_saves_through_the_store_and_resumes_at_1_then_2_ranks_on_fresh_machines(tmp_path, moto_server):
    url, root, env = bucket(moto_server), tmp_path / "root", launch_env(moto_server)
    assert fsdp(root, url, 2, 2, tmp_path / "a", env) == 16
    with CheckpointStore(root / "checkpoints" / STORE_DIR, read_only=True) as store:
        assert store.local.steps() == [8, 16] and store.local.manifest(16).world_size == 2
    remote = RemoteTier(url, moto_server.options())
    assert remote.steps() == [8, 16]
    files = [p for p in root.rglob("*") if p.is_file()]
    heads = [p.read_bytes()[:4] for p in files] + [remote.t.get(rel, 1 << 30)[:4] for rel in remote.t.list_files("")]
    assert not any(head.startswith((PICKLE, ZIP)) for head in heads)  # no torch.save output: no .metadata pickle

    shutil.rmtree(root)  # a fresh machine, one rank: the two ranks' pieces resharded
    assert fsdp(root, url, 3, 1, tmp_path / "b", env) == 24
    assert_same(gathered(tmp_path / "a", "end"), gathered(tmp_path / "b", "start"))
    loop = gathered(tmp_path / "b", "start-loop")
    assert loop["global_step"] == 16 and loop["lr"] == pytest.approx(0.01 * 0.5 ** 2)  # scheduler state too

    shutil.rmtree(root)  # and back to two ranks, from the step one rank saved
    assert fsdp(root, url, 4, 2, tmp_path / "c", env) == 32
    assert_same(gathered(tmp_path / "b", "end"), gathered(tmp_path / "c", "start"))
    assert gathered(tmp_path / "c", "start-loop")["global_step"] == 24


def test_sigkill_mid_save_leaves_the_previous_step_live_and_last_resumes_from_it(tmp_path):
    """A real Lightning process (a 48 MB state) killed with SIGKILL at moments of its second save
    (which takes some tens of ms: its shard is written past the page cache)."""
    env = dict(os.environ, PYTHONPATH=str(HERE))
    for attempt, delay in enumerate((0.0, 0.005, 0.02)):
        root = tmp_path / f"root{attempt}"
        proc = subprocess.Popen([sys.executable, str(HERE / "lightning_run.py"), str(root), "-", "2048", "3"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            for line in proc.stdout:
                if line.strip() == "saving 6":
                    break
            time.sleep(delay)
        finally:
            proc.kill()
        proc.wait(30)
        ckpts = root / "checkpoints"
        with CheckpointStore(ckpts / STORE_DIR, read_only=True) as store:
            steps = store.local.steps()
            assert steps in ([3], [3, 6]), steps
            for step in steps:
                store.local.verify(step, full=True)  # whatever is committed is whole
        trainer, model = run(root, 1, [TieredCheckpointIO()], [checkpointing()], ckpt_path="last",
                             model=Model(width=2048), max_steps=steps[-1] + 1)
        assert sorted(model.losses) == [steps[-1]]  # resumed from the newest committed step
        assert all(read_pointer(p) <= steps[-1] + 1 for p in ckpts.glob("*.ckpt"))  # none names the lost save


def test_sigterm_to_one_rank_of_an_fsdp2_run_saves_on_every_rank_and_exits_0(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, str(HERE / "lightning_fsdp.py"), str(root), (tmp_path / "remote").as_uri(),
                             "0", "2", str(out)], stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"), text=True,
                            env=launch_env())
    pids = {}
    try:
        for line in proc.stdout:  # both ranks print here: Lightning's launcher shares the pipe
            if line.startswith("rank "):
                pids[int(line.split()[1])] = int(line.split()[3])
            elif line.startswith("step ") and int(line.split()[1]) >= 5 and len(pids) == 2:
                os.kill(pids[1], signal.SIGTERM)  # to the other rank only
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    stopped = int(rest.split()[-1])
    with CheckpointStore(root / "checkpoints" / STORE_DIR, read_only=True) as store:
        assert store.local.steps()[-1] == stopped >= 5  # saved at a step boundary after the signal
        assert store.local.manifest(stopped).world_size == 2  # by both ranks, one commit
        store.local.verify(stopped, full=True)
    assert read_pointer(root / "checkpoints" / "last.ckpt") == stopped


def test_pointers_written_during_a_save_are_fsynced_once_their_step_commits(tmp_path, monkeypatch):
    import tieredckpt.lightning as tl
    written, synced, committed = [], [], []
    real_write, real_sync, real_save = tl.write_pointer, tl.sync_pointer, CheckpointStore.save

    def write(path, step, durable=True):
        if not durable:
            written.append((path.name, step))
        real_write(path, step, durable)

    def sync(path):
        synced.append((path.name, set(committed)))
        real_sync(path)

    def save(self, step, state, **kw):
        handle = real_save(self, step, state, **kw)
        handle._future.add_done_callback(lambda _: committed.append(step))  # runs before the pointer's
        return handle

    monkeypatch.setattr(tl, "write_pointer", write)
    monkeypatch.setattr(tl, "sync_pointer", sync)
    monkeypatch.setattr(CheckpointStore, "save", save)
    run(tmp_path / "root", 1, [TieredCheckpointIO()], [checkpointing()])
    assert {name for name, _ in written} >= {"last.ckpt", "epoch=0-step=4.ckpt"}
    assert len(synced) == len(written)
    for name in {n for n, _ in written}:  # each pointer's fsync ran after its own step committed
        steps = [step for n, step in written if n == name]
        seen = [done for n, done in synced if n == name]
        assert all(step in done for step, done in zip(steps, seen)), (name, steps, seen)


def test_a_fifo_under_a_checkpoint_name_is_not_ours_and_never_waited_on(tmp_path):
    fifo = tmp_path / "last.ckpt"
    os.mkfifo(fifo)
    assert read_pointer(fifo) is None  # open() of a FIFO would block until a writer came
    with pytest.raises(UnsupportedStateError, match="not a tieredckpt checkpoint"):
        TieredCheckpointIO(tmp_path / "store").load_checkpoint(fifo)


def test_lightnings_own_model_checkpoint_starting_over_on_a_fresh_machine_is_named_with_the_fix(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    root = tmp_path / "root"
    own = L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=4, save_last=True)
    run(root, 2, [TieredCheckpointIO(remote=remote, uploads="all")], [own])  # steps 4..16 on the remote
    shutil.rmtree(root)  # a fresh machine: Lightning's ModelCheckpoint finds no last.ckpt and starts at 0
    again = L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=4, save_last=True)
    with pytest.warns(RuntimeWarning, match=r"saves step 4, but the store already holds step 16: it started over.*"
                                            r"TieredModelCheckpoint in place of ModelCheckpoint"):
        trainer, _ = run(root, 1, [TieredCheckpointIO(remote=remote)], [again], ckpt_path="last")
    assert trainer.global_step == 8  # it did start over: what the warning is there to say
    shutil.rmtree(root)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*started over.*")
        resumed, _ = run(root, 3, [TieredCheckpointIO(remote=remote)], [checkpointing()], ckpt_path="last")
    assert resumed.global_step == 24  # the tiered callback resumed from step 16: no warning
