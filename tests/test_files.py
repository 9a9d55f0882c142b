"""Folders as steps: save_files / restore_files on both tiers, and what they refuse."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from forkserver import ForkServer

from tieredckpt import CheckpointStore, IncompatibleStateError, KeepLast, UnreadableFileError
from tieredckpt._tiers.sharded import read_manifest

HERE = Path(__file__).parent


def make_folder(root: Path, seed: int = 0, big: int = 300_000) -> dict[str, bytes]:
    """A framework-like checkpoint folder: a large file, small ones, a subdirectory."""
    files = {
        "model.safetensors": os.urandom(big),
        "optimizer.pt": os.urandom(5000 + seed),
        "trainer_state.json": json.dumps({"global_step": seed}).encode(),
        "sub/dir/rng_state_1.pth": os.urandom(100),
        ".hidden": b"",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_folder_is_committed_as_a_step_and_later_changes_to_it_never_reach_the_step(tmp_path):
    src = tmp_path / "checkpoint-5"
    src.mkdir()
    want = make_folder(src, 5)
    with CheckpointStore(tmp_path / "run") as store:
        manifest = store.save_files(5, src).wait()
        # the Trainer rotates its folder away, or a framework writes a new file under an old name
        (src / "model.safetensors").unlink()
        (src / "new.tmp").write_bytes(b"another")
        os.replace(src / "new.tmp", src / "optimizer.pt")
        assert manifest.layout == "files" and manifest.world_size == len(want)
        assert [e.path for e in manifest.shards] == sorted(f"files/{n}" for n in want)
        assert store.restore_files(to=tmp_path / "back") == 5
    assert read_tree(tmp_path / "back") == want
    step_dir = tmp_path / "run" / "step_000005"
    assert all(e.sha256 for e in read_manifest(step_dir).shards)  # recorded after the commit
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_000005"


def test_files_are_copied_unless_told_to_link(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    with CheckpointStore(tmp_path / "run") as store:
        store.save_files(1, src).wait()
        store.save_files(2, src, link=True).wait()
    ino = (src / "model.safetensors").stat().st_ino
    assert (tmp_path / "run/step_000001/files/model.safetensors").stat().st_ino != ino
    assert (tmp_path / "run/step_000002/files/model.safetensors").stat().st_ino == ino


def test_a_file_rewritten_in_place_through_its_link_is_named_at_the_next_save(tmp_path, caplog):
    src = tmp_path / "ckpt"  # accelerate.save_state("ckpt") every time: the same names, opened "wb"
    src.mkdir()
    make_folder(src)
    with CheckpointStore(tmp_path / "run") as store:
        store.save_files(1, src, link=True).wait()
        (src / "optimizer.pt").write_bytes(b"rewritten in place")
        store.save_files(2, src).wait()
        assert "optimizer.pt: was rewritten in place after it was saved" in caplog.text
        assert "without link=True" in caplog.text
        with pytest.raises(Exception, match="crc32c"):  # step 1's copy is refused, never loaded
            store.restore_files(1, to=tmp_path / "back")
        (src / "optimizer.pt").write_bytes(b"again")  # step 2 was copied: it is not affected
        assert store.restore_files(2, to=tmp_path / "back2") == 2
    assert (tmp_path / "back2" / "optimizer.pt").read_bytes() == b"rewritten in place"


def test_a_folder_on_another_filesystem_is_copied(tmp_path, tmpfs):
    src = tmpfs(8 << 20) / "ckpt"
    src.mkdir()
    want = make_folder(src)
    with CheckpointStore(tmp_path / "run") as store:
        store.save_files(1, src).wait()
        (src / "model.safetensors").write_bytes(b"x")  # in place: a copy is not affected
        store.restore_files(1, to=tmp_path / "back")
    assert read_tree(tmp_path / "back") == want


def test_rotation_and_the_newest_step_apply_to_folder_steps(tmp_path):
    src = tmp_path / "src"
    with CheckpointStore(tmp_path / "run", keep_local=2) as store:
        for step in (5, 10, 15):
            src.mkdir()
            make_folder(src, step, big=1000)
            store.save_files(step, src)
            os.system(f"rm -rf '{src}'")  # the Trainer's save_total_limit
        store.wait()
        assert store.local.steps() == [10, 15]
        assert store.restore_files(to=tmp_path / "back") == 15
    assert json.loads((tmp_path / "back/trainer_state.json").read_text()) == {"global_step": 15}


def test_a_fresh_machine_restores_a_folder_from_the_remote(tmp_path, remote):
    src = tmp_path / "src"
    src.mkdir()
    want = make_folder(src, 3, big=3 << 20)
    with CheckpointStore(tmp_path / "a", remote.url, remote_options=remote.options, keep_remote=KeepLast(2),
                         upload_part_size=1 << 20) as store:
        store.save_files(3, src).wait()
        assert store.wait(uploads=True)
    os.system(f"rm -rf '{tmp_path / 'a'}'")
    with CheckpointStore(tmp_path / "b", remote.url, remote_options=remote.options) as store:
        assert store.restore_files(to=tmp_path / "back") == 3
        assert store.local.steps() == [3]  # downloaded into the local tier, verified, then copied out
    assert read_tree(tmp_path / "back") == want
    with CheckpointStore(tmp_path / "reader", remote.url, remote_options=remote.options, read_only=True) as reader:
        assert reader.restore_files(to=tmp_path / "again") == 3
    assert read_tree(tmp_path / "again") == want
    assert not (tmp_path / "reader").exists()  # a reader writes nothing of its own


def test_a_damaged_local_file_is_detected_and_the_remote_copy_restored(tmp_path, remote):
    src = tmp_path / "src"
    src.mkdir()
    want = make_folder(src)
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options) as store:
        store.save_files(7, src).wait()
        assert store.wait(uploads=True)
        # the step's own copy damaged on disk after the commit
        with open(tmp_path / "run/step_000007/files/model.safetensors", "r+b") as f:
            f.seek(1234)
            f.write(b"\xff\x00")
        with pytest.warns(RuntimeWarning, match="from the remote copy"):
            assert store.restore_files(to=tmp_path / "back") == 7
    assert read_tree(tmp_path / "back") == want
    assert list((tmp_path / "run" / "quarantine").iterdir())  # the bad copy set aside, not deleted


def test_a_damaged_folder_with_no_other_copy_is_refused_and_nothing_is_written(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    with CheckpointStore(tmp_path / "run") as store:
        store.save_files(7, src, link=True).wait()
        with open(src / "optimizer.pt", "r+b") as f:  # rewritten in place through the hard link
            f.write(b"!")
        with pytest.raises(Exception, match="crc32c"):
            store.restore_files(7, to=tmp_path / "back")
    assert not (tmp_path / "back").exists()
    assert [p.name for p in tmp_path.iterdir() if "back" in p.name] == []  # no scratch left


@pytest.mark.parametrize("hostile", ["symlink", "fifo", "dir_symlink"])
def test_save_files_refuses_what_is_not_a_regular_file_by_name(tmp_path, hostile):
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    bad = src / "sub" / "bad"
    if hostile == "symlink":
        os.symlink("/etc/passwd", bad)
    elif hostile == "fifo":
        os.mkfifo(bad)
    else:
        os.symlink("/etc", bad)
    with CheckpointStore(tmp_path / "run") as store:
        with pytest.raises(UnreadableFileError, match=r"sub/bad: is a (symlink|FIFO)"):
            store.save_files(1, src)
        assert store.local.steps() == []
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step_")) == []


def test_save_files_refuses_an_empty_or_missing_folder_and_an_existing_step(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    with CheckpointStore(tmp_path / "run") as store:
        with pytest.raises(ValueError, match="holds no files"):
            store.save_files(1, tmp_path / "empty")
        with pytest.raises(NotADirectoryError):
            store.save_files(1, tmp_path / "nope")
        store.save_files(1, src).wait()
        with pytest.raises(Exception, match="already committed"):
            store.save_files(1, src)


def test_restore_files_never_writes_into_a_directory_that_holds_anything(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    (tmp_path / "empty").mkdir()
    with CheckpointStore(tmp_path / "run") as store:
        store.save_files(1, src).wait()
        with pytest.raises(FileExistsError, match="not empty"):
            store.restore_files(to=tmp_path / "full")
        assert store.restore_files(to=tmp_path / "empty") == 1
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep me"
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_state_steps_and_folder_steps_are_not_mistaken_for_each_other(tmp_path):
    import torch
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, {"w": torch.ones(3)}).wait()
        store.save_files(2, src).wait()
        with pytest.raises(IncompatibleStateError, match="restore_files"):
            store.restore()
        with pytest.raises(IncompatibleStateError, match="restore\\(\\)"):
            store.restore_files(1, to=tmp_path / "back")
        assert store.local.steps() == [1, 2]  # nothing was quarantined as corrupt
        assert not (tmp_path / "back").exists()


def test_a_planted_upload_manifest_whose_file_leaves_the_step_is_refused(tmp_path, remote):
    src = tmp_path / "src"
    src.mkdir()
    make_folder(src)
    with CheckpointStore(tmp_path / "run", remote.url, remote_options=remote.options) as store:
        store.save_files(4, src).wait()
        assert store.wait(uploads=True)
    fs, root = remote.fs(), remote.root()
    rel = f"{root}/step_000004/upload.json"
    doc = json.loads(fs.cat_file(rel))
    doc["checkpoint"]["shards"][0]["path"] = "files/../../../escape"
    doc["checkpoint"].pop("manifest_sha256")
    doc["files"][0]["path"] = "files/../../../escape"
    fs.rm_file(rel)
    fs.pipe_file(rel, json.dumps(doc).encode())
    with CheckpointStore(tmp_path / "fresh", remote.url, remote_options=remote.options, read_only=True) as reader:
        with pytest.raises(Exception, match="escapes"):
            reader.restore_files(4, to=tmp_path / "back")
    assert not (tmp_path / "back").exists() and not (tmp_path / "escape").exists()


def test_sigkill_at_any_moment_of_save_files_leaves_the_previous_step_live_and_nothing_half_written(tmp_path):
    """A real process killed with SIGKILL at several moments of a 64 MB folder's save."""
    server, writer, err = ForkServer(), (HERE / "folder_writer.py").read_text(), tmp_path / "stderr"
    for attempt, delay in enumerate((0.0, 0.02, 0.05, 0.1, 0.3)):
        run = tmp_path / f"run{attempt}"
        pid = server.spawn(writer, run, tmp_path / f"src{attempt}", stderr=err)
        assert server.readline().strip() == "step 1 committed", err.read_text()
        assert server.readline().strip() == "saving step 2"
        time.sleep(delay)
        server.kill(pid, signal.SIGKILL)
        assert server.reap(pid) in (-signal.SIGKILL, 0), err.read_text()  # 0: step 2 was committed first
        with CheckpointStore(run) as store:
            steps = store.local.steps()
            assert steps in ([1], [1, 2]), steps
            for step in steps:
                store.local.verify(step, full=True)  # whatever is committed is whole
            assert store.restore_files(to=tmp_path / f"back{attempt}") == steps[-1]
            store.save_files(3, tmp_path / f"src{attempt}").wait()  # the step numbers go on
        leftovers = [p.name for p in run.iterdir() if ".tmp-" in p.name or ".del-" in p.name]
        assert leftovers == [], leftovers  # the killed save's scratch went at the next start
    server.close()


def test_cli_push_dir_and_restore_dir_on_a_fresh_machine(tmp_path, moto_server):
    from test_remote_cli import cli
    moto_server.make_bucket("dirbucket")
    url = "s3://dirbucket/hf"
    src = tmp_path / "checkpoint-500"
    src.mkdir()
    want = make_folder(src, 500)
    pushed = cli("push-dir", tmp_path / "run", 500, src, "--remote", url, endpoint=moto_server.endpoint)
    assert pushed.returncode == 0, pushed.stderr
    assert "committed step 500" in pushed.stdout and "uploaded" in pushed.stdout
    got = cli("restore-dir", url, "--to", tmp_path / "fresh" / "checkpoint-500", endpoint=moto_server.endpoint)
    assert got.returncode == 0, got.stderr
    assert "restored step 500" in got.stdout
    assert read_tree(tmp_path / "fresh" / "checkpoint-500") == want
    again = cli("restore-dir", tmp_path / "run", "--to", tmp_path / "fresh" / "checkpoint-500")
    assert again.returncode == 3 and "not empty" in again.stderr
    bad = cli("push-dir", tmp_path / "run", 501, tmp_path / "missing")
    assert bad.returncode == 3 and "missing" in bad.stderr and "Traceback" not in bad.stderr
