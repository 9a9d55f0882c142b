"""A framework that rewrites its checkpoint folder in place can neither kill the run nor change a
committed step (issue 39): a real process, real torch.save and safetensors writes over the same
inodes, the store's background crc32c, sha256 and upload reads running meanwhile."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest
from forkserver import shared

from tieredckpt import CheckpointStore
from tieredckpt.errors import CorruptCheckpointError

HERE = Path(__file__).parent
SAVES = 20


def run_writer(tmp_path: Path, link: bool, url: str | None = None, options: dict | None = None,
               go: Path | None = None, before_go=None, exits=(0,)) -> dict[int, dict[str, str]]:
    """Run inplace_writer.py to its end; its per-step digests. It must exit with one of ``exits``:
    a SIGBUS (the mapping of a truncated file) or any other death fails here, with its stderr."""
    argv = [HERE / "inplace_writer.py", tmp_path / "run", tmp_path / "src", tmp_path / "digests.json", SAVES,
            "link" if link else "copy"]
    if url is not None:
        argv += [url, json.dumps(options or {})] + ([go] if go is not None else [])
    proc = shared().popen([str(a) for a in argv])
    if go is not None:
        assert proc.stdout.readline().strip() == "open"
        before_go()
        go.touch()
    out, err = proc.communicate(timeout=240)
    code = proc.returncode
    assert code in exits, f"the training process died ({signal.Signals(-code).name if code < 0 else code}): {err[-3000:]}"
    assert "Bus error" not in err and "saved" in out, err[-3000:]
    return {int(k): v for k, v in json.loads((tmp_path / "digests.json").read_text()).items()}


def restored_digests(store: CheckpointStore, step: int, to: Path) -> dict[str, str]:
    assert store.restore_files(step, to=to) == step
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in to.iterdir()}


def test_copied_steps_stay_what_the_folder_held_and_a_fresh_machine_restores_them(tmp_path, proxied):
    want = run_writer(tmp_path, link=False, url=proxied.url, options=proxied.options)
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options) as store:
        local = store.local.steps()
        assert len(local) >= 3 and local[-1] == SAVES, local
        for step in local:
            store.local.verify(step, full=True)
            assert restored_digests(store, step, tmp_path / f"back{step}") == want[step], step
        assert store.wait(uploads=True, timeout=120)
    with CheckpointStore(tmp_path / "fresh", proxied.url, remote_options=proxied.options, read_only=True) as reader:
        remote = [i.step for i in reader.list() if i.remote]
        assert SAVES in remote
        for step in remote:  # every step the remote committed holds what the folder held
            assert restored_digests(reader, step, tmp_path / f"fresh{step}") == want[step], step


def test_with_the_remote_down_for_the_whole_run_every_kept_step_restores_from_the_local_tier(tmp_path, proxied):
    want = run_writer(tmp_path, link=False, url=proxied.url, options=proxied.options, go=tmp_path / "go",
                      before_go=lambda: proxied.proxy.set("dead"))
    assert not [o for o in proxied.remote().t.list_files("") if "upload.json" in o]  # nothing reached it
    with CheckpointStore(tmp_path / "run") as store:  # local only: the remote is still down
        local = store.local.steps()
        assert len(local) >= 3 and local[-1] == SAVES, local
        for step in local:
            assert restored_digests(store, step, tmp_path / f"back{step}") == want[step], step


def test_hard_linked_steps_rewritten_in_place_never_kill_the_run_and_nothing_torn_is_committed_remotely(
        tmp_path, proxied):
    """link=True with a writer that breaks its rule (rewrites in place): the step can change under
    the store, as documented, but no background read may crash the process (no mapping of the
    framework's files), and the remote commits only bytes that match the step's checksums."""
    run_writer(tmp_path, link=True, url=proxied.url, options=proxied.options, exits=(0, 3))
    with CheckpointStore(tmp_path / "run", proxied.url, remote_options=proxied.options) as store:
        store.wait(uploads=True, timeout=60)
        for step in store.local.steps():
            try:
                store.local.verify(step, full=True)
            except CorruptCheckpointError as exc:
                assert str(tmp_path / "run") in str(exc)  # refused by name, never loaded
    with CheckpointStore(tmp_path / "fresh", proxied.url, remote_options=proxied.options, read_only=True) as reader:
        for info in reader.list():
            if info.remote:  # whatever the remote committed restores whole and checked
                assert reader.restore_files(info.step, to=tmp_path / f"fresh{info.step}") == info.step


@pytest.mark.parametrize("sha256", [False, True])
def test_a_file_truncated_under_a_checksum_read_is_an_error_naming_it(tmp_path, sha256):
    """A file of a step we own, truncated by another process while the crc32c (or sha256) pass
    reads it: an error naming the file; the process goes on."""
    from tieredckpt._format import checksum
    from tieredckpt._format.safefile import open_checked
    path = tmp_path / "shard.bin"
    path.write_bytes(b"\x01" * (3 * checksum.CHUNK))
    calls = []

    def truncate_on_second_read(fd, n, offset, _pread=checksum.os.pread):
        calls.append(offset)
        if len(calls) == 2:
            path.open("r+b").truncate(checksum.CHUNK // 2)  # another process's truncation
        return _pread(fd, n, offset)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checksum.os, "pread", truncate_on_second_read)
        with open_checked(tmp_path, "shard.bin", 1 << 40, "shard") as f:
            with pytest.raises(CorruptCheckpointError, match=r"shard\.bin: shrank while being read"):
                f.digest(sha256=sha256)
    assert len(calls) >= 2
