"""PyTorch Lightning on the tiers: real lightning, a small LightningModule on CPU, moto over HTTP."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning_run import Model, run
from conftest import signal_training
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
    run(root, 3, [tiered(url, options, keep_remote=KeepLast(3), uploads="all")], [checkpointing()])
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
    shutil.rmtree(root)  # a fresh machine
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
