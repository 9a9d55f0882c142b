"""Hugging Face Trainer and accelerate on the tiers: real transformers and accelerate, a tiny
GPT-2 built from a config on CPU, moto over HTTP."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest
import torch
from conftest import signal_training
from hf_run import run
from s3server import CREDS

from tieredckpt import CheckpointStore, KeepLast
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt.hf import STORE_DIR, TieredCheckpointCallback, load_state, prepare_resume, save_state

HERE = Path(__file__).parent


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def bucket(moto_server) -> str:
    name = f"hf-{uuid.uuid4().hex[:10]}"
    moto_server.make_bucket(name)
    return f"s3://{name}/runs/x"


def test_every_trainer_checkpoint_is_a_step_and_a_wiped_machine_resumes_bit_identically(tmp_path, moto_server):
    url, options = bucket(moto_server), moto_server.options()
    out = tmp_path / "out"
    callback = TieredCheckpointCallback(remote=url, remote_options=options, keep_remote=KeepLast(3), uploads="all")
    run(out, 20, [callback])
    # the Trainer's own save_total_limit=2 removed its older folders; the store keeps its own policy
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-20"]
    with CheckpointStore(out / STORE_DIR, read_only=True) as store:
        assert store.local.steps() == [10, 15, 20]  # keep_local=3
        step_files = store.local.step_path(20) / "files"
        assert folder_files(step_files) == folder_files(out / "checkpoint-20")
    assert RemoteTier(url, options).steps() == [10, 15, 20]  # keep_remote=KeepLast(3)

    trainers_own = tmp_path / "own"
    shutil.copytree(out / "checkpoint-20", trainers_own / "checkpoint-20")
    shutil.rmtree(out)  # a fresh machine: nothing local at all

    resumed, losses = run(out, 30, [TieredCheckpointCallback(remote=url, remote_options=options)], resume=True)
    reference, want = run(trainers_own, 30, [], resume=True)
    assert resumed.state.global_step == reference.state.global_step == 30
    assert sorted(losses) == list(range(21, 31)) and losses == want
    for (name, a), (_, b) in zip(resumed.model.state_dict().items(), reference.model.state_dict().items()):
        assert torch.equal(a, b), name
    opt_a, opt_b = resumed.optimizer.state_dict()["state"], reference.optimizer.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)
    assert RemoteTier(url, options).steps()[-1] == 30


def test_prepare_resume_brings_the_newest_folder_back_and_leaves_a_present_one_alone(tmp_path, moto_server):
    url, options = bucket(moto_server), moto_server.options()
    src = tmp_path / "checkpoint-40"
    src.mkdir()
    (src / "trainer_state.json").write_text('{"global_step": 40}')
    with CheckpointStore(tmp_path / "writer", url, remote_options=options) as store:
        store.save_files(40, src).wait()
    out = tmp_path / "fresh"
    assert prepare_resume(out, url, remote_options=options) == out / "checkpoint-40"
    assert (out / "checkpoint-40" / "trainer_state.json").read_text() == '{"global_step": 40}'
    (out / "checkpoint-40" / "mine").write_text("x")
    assert prepare_resume(out, url, remote_options=options) == out / "checkpoint-40"  # present: untouched
    assert (out / "checkpoint-40" / "mine").exists()
    assert prepare_resume(tmp_path / "none", None) is None


def test_sigusr1_saves_and_goes_on_and_sigterm_saves_stops_and_exits_0(tmp_path, moto_server):
    url = bucket(moto_server)
    out = tmp_path / "out"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
               AWS_ENDPOINT_URL=moto_server.endpoint, PYTHONPATH=str(HERE))
    status, rest = signal_training(HERE / "hf_run.py", [str(out), url, "100000"], env,
                                   {3: signal.SIGUSR1, 12: signal.SIGTERM})
    assert status == 0
    stopped = int(rest.strip().splitlines()[-1].split()[-1])
    assert stopped >= 12
    with CheckpointStore(out / STORE_DIR, read_only=True) as store:
        steps = store.local.steps()
        assert len(steps) == 2 and 3 <= steps[0] < 12 and steps[1] == stopped, steps
        for step in steps:
            store.local.verify(step, full=True)
    assert folder_files(out / STORE_DIR / f"step_{stopped:06d}" / "files") == folder_files(out / f"checkpoint-{stopped}")
    # preempted: the node never comes back; the SIGTERM step went up before the exit
    assert RemoteTier(url, moto_server.options()).newest_step() == stopped
    shutil.rmtree(out)
    resumed, losses = run(out, stopped + 2, [TieredCheckpointCallback(remote=url, remote_options=moto_server.options())],
                          resume=True)
    assert resumed.state.global_step == stopped + 2 and sorted(losses) == [stopped + 1, stopped + 2], losses


def test_accelerate_two_lines_save_and_restore_a_loop_on_a_fresh_machine_bit_identically(tmp_path, remote):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    def loop(project: Path, seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1))
        model, opt, sched = acc.prepare(model, opt, sched)
        return acc, model, opt, sched

    def steps(model, opt, sched, n):
        losses = []
        for _ in range(n):
            x = torch.randn(4, 8)  # the RNG accelerate saves and restores
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    acc, model, opt, sched = loop(tmp_path / "proj", 0)
    steps(model, opt, sched, 3)
    with CheckpointStore(tmp_path / "a", remote.url, remote_options=remote.options) as store:
        save_state(acc, store, 3).wait()
        steps(model, opt, sched, 2)
        save_state(acc, store, 5).wait()  # automatic naming goes on: checkpoint_1
        assert store.wait(uploads=True)
    want = steps(model, opt, sched, 5)
    weights = [p.detach().clone() for p in model.parameters()]
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "proj")

    acc, model, opt, sched = loop(tmp_path / "proj2", 1)  # another init: everything must come back
    with CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options) as store:
        assert load_state(acc, store) == 5
        assert acc.project_configuration.iteration == 2  # the next save does not collide
        assert steps(model, opt, sched, 5) == want
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
        save_state(acc, store, 10).wait()
    assert not list((tmp_path / "b").glob(".accelerate-*"))  # the restore's scratch is gone


def test_with_enable_jit_checkpoint_the_sigterm_step_is_saved_once_committed_and_on_the_remote(
        tmp_path, moto_server):
    """The Trainer's own SIGTERM checkpointing (transformers >= 4.57) beside the callback: one
    save of the stopped step, through the callback (committed, on the remote), not a second
    one written by the JIT handler past every callback into the hard-linked folder."""
    url = bucket(moto_server)
    out = tmp_path / "out"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
               AWS_ENDPOINT_URL=moto_server.endpoint, PYTHONPATH=str(HERE), HF_RUN_JIT="1")
    status, rest = signal_training(HERE / "hf_run.py", [str(out), url, "100000"], env, {6: signal.SIGTERM})
    assert status == 0
    stopped = int(rest.strip().splitlines()[-1].split()[-1])
    folders = sorted(p.name for p in out.glob("checkpoint-*"))
    assert folders == [f"checkpoint-{stopped}"], folders
    assert not list(out.rglob("checkpoint-is-incomplete.txt"))
    with CheckpointStore(out / STORE_DIR, read_only=True) as store:
        assert store.local.steps() == [stopped]
        store.local.verify(stopped, full=True)  # the committed folder was not written through
    assert RemoteTier(url, moto_server.options()).newest_step() == stopped


def test_the_jit_checkpoint_handler_is_taken_out_of_the_sigterm_chain(tmp_path):
    """In-process: with enable_jit_checkpoint the Trainer installs a SIGTERM handler that starts a
    3 s timer and then saves past every callback. Once training begins, SIGTERM reaches the
    callback only: no JIT timer starts, no JIT save is requested, and the handler the JIT
    manager replaced is the one put back at the end."""
    import threading

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.trainer_callback import TrainerControl, TrainerState

    before = signal.getsignal(signal.SIGTERM)
    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, use_cpu=True, report_to=[],
                             enable_jit_checkpoint=True)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    cb = TieredCheckpointCallback(restore=False)
    trainer = Trainer(model=model, args=args, callbacks=[cb])
    jit = signal.getsignal(signal.SIGTERM).__self__  # the Trainer's CheckpointManager
    state, control = TrainerState(), TrainerControl()
    trainer.callback_handler.on_train_begin(args, state, control)
    try:
        timers = len([t for t in threading.enumerate() if isinstance(t, threading.Timer)])
        signal.raise_signal(signal.SIGTERM)
        assert cb.requests.stop_requested()
        assert len([t for t in threading.enumerate() if isinstance(t, threading.Timer)]) == timers
        assert not jit.is_checkpoint_requested
    finally:
        trainer.callback_handler.on_train_end(args, state, control)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_trainer_folder_left_half_written_is_set_aside_and_the_trainer_resumes_from_the_newest_committed_step(
        tmp_path, caplog):
    """A Trainer killed inside its save of checkpoint-15 left the model but no trainer_state.json:
    resume_from_checkpoint=True would pick it and fail at every relaunch. The callback renames it
    (never deletes) and the Trainer resumes from step 10, the newest committed."""
    out = tmp_path / "out"
    run(out, 10, [TieredCheckpointCallback()], save_total_limit=None)
    half = out / "checkpoint-15"
    shutil.copytree(out / "checkpoint-10", half)
    (half / "trainer_state.json").unlink()
    resumed, losses = run(out, 20, [TieredCheckpointCallback()], resume=True, save_total_limit=None)
    assert resumed.state.global_step == 20 and sorted(losses) == list(range(11, 21)), sorted(losses)
    aside = out / "checkpoint-15.incomplete"
    assert aside.is_dir() and (aside / "model.safetensors").is_file()  # set aside, not deleted
    assert "checkpoint-15: incomplete" in caplog.text and "checkpoint-15.incomplete" in caplog.text
    with CheckpointStore(out / STORE_DIR, read_only=True) as store:
        assert store.local.steps()[-2:] == [15, 20]  # the Trainer's own new checkpoint-15 was committed


def test_accelerate_save_state_into_one_fixed_folder_twice_with_the_remote_down_keeps_both_steps(tmp_path, proxied):
    """accelerate rewrites a fixed output_dir's files in place (same names, same inodes): both
    committed steps stay what the folder held at their save, restorable from the local tier while
    the remote is down; a fresh machine restores the newest once it is back."""
    from accelerate import Accelerator
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    fixed, held = tmp_path / "ckpt", {}
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options, close_timeout=30) as store:
        proxied.proxy.set("dead")
        for step in (3, 5):
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
            save_state(acc, store, step, output_dir=fixed)  # returns with the snapshot taken
            held[step] = folder_files(fixed)
        assert held[3] != held[5]
        for step in (3, 5):
            assert store.restore_files(step, to=tmp_path / f"back{step}") == step
            assert folder_files(tmp_path / f"back{step}") == held[step]
        proxied.proxy.clear()
        assert store.wait(uploads=True, timeout=60)
    with CheckpointStore(tmp_path / "fresh", proxied.url, remote_options=proxied.options) as fresh:
        assert load_state(acc, fresh) == 5
        assert fresh.restore_files(5, to=tmp_path / "fresh5") == 5
        assert folder_files(tmp_path / "fresh5") == held[5]


def test_the_documented_snippet_runs_as_written_on_a_first_run_and_on_a_wiped_machine(tmp_path, moto_server):
    """The integrations page's lines, as a user pastes them: a first run (no tier holds a step:
    transformers' resume_from_checkpoint=True would raise), then the same script on a wiped
    machine, which resumes from the remote."""
    from hf_run import dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    url, options = bucket(moto_server), moto_server.options()

    def script(max_steps: int):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
        args = TrainingArguments(str(tmp_path / "out"), max_steps=max_steps, save_steps=5, use_cpu=True,
                                 report_to=[], per_device_train_batch_size=4, disable_tqdm=True)
        callback = TieredCheckpointCallback(remote=url, remote_options=options)
        trainer = Trainer(model, args, train_dataset=dataset(), callbacks=[callback])
        resumed_from = callback.resume_path()
        trainer.train(resume_from_checkpoint=resumed_from)
        return trainer, resumed_from
    first, resumed_from = script(5)
    assert first.state.global_step == 5 and resumed_from is None
    shutil.rmtree(tmp_path / "out")  # a wiped machine
    again, resumed_from = script(10)
    assert resumed_from == str(tmp_path / "out" / "checkpoint-5") and again.state.global_step == 10
    assert RemoteTier(url, options).steps()[-1] == 10


def test_remote_and_local_are_keywords_and_the_old_positional_order_still_works_with_a_warning(tmp_path):
    cb = TieredCheckpointCallback(remote="s3://b/run", local=tmp_path / "x", keep_local=2)
    assert (cb.remote, cb.local, cb.options) == ("s3://b/run", tmp_path / "x", {"keep_local": 2})
    with pytest.warns(DeprecationWarning, match=r"pass remote=\.\.\. and local=\.\.\. by keyword"):
        old = TieredCheckpointCallback("s3://b/run", tmp_path / "x")
    assert (old.remote, old.local) == ("s3://b/run", tmp_path / "x")
    with pytest.raises(TypeError, match="as keywords"):
        TieredCheckpointCallback("s3://b/run", remote="s3://b/other")
