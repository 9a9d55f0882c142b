"""A Hypothesis state machine over saves, uploads, outages, remote retention, rotation and restarts.

The remote is a file:// directory behind a filesystem wrapper that fails every
call on cue (transient: connection reset; permanent: access denied). After every
step the tiers are read directly, as a new machine would, and must show:

- every step either tier lists restores bit-exactly (no partial step is visible);
- the newest saved step is on local disk and restore() returns it;
- every step the remote policy pins (KeepEvery) is on some tier;
- rotation kept at most keep_local + the steps still owed + 2 local steps
  (the one being sent and the newest the remote holds);
- when the remote is healthy and uploads are drained, the newest step is on the
  remote and the remote keeps exactly what its policy says.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tieredckpt import AnyOf, CheckpointNotFoundError, CheckpointStore, CorruptCheckpointError, KeepEvery, KeepLast
from tieredckpt._format.compare import first_difference
from tieredckpt._tiers.local import LocalTier
from tieredckpt._tiers.remote import RemoteTier

KEEP_LOCAL = 2
POLICY = AnyOf(KeepLast(2), KeepEvery(5))


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "b": torch.arange(3) + step, "step": step}


class FaultFS:
    """A real filesystem whose every call fails while ``mode`` says so."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.mode = None  # None | "transient" | "permanent"

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("_") or name in ("invalidate_cache",):
            return attr

        def call(*args, **kwargs):
            if self.mode == "transient":
                raise ConnectionResetError("connection reset by peer (injected)")
            if self.mode == "permanent":
                raise PermissionError("Access Denied (injected)")
            return attr(*args, **kwargs)
        return call


class Checkpoints(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tieredckpt-sm-"))
        self.url = f"file://{self.root / 'remote'}"
        self.run = self.root / "run"
        self.saved: list[int] = []
        self.fs = FaultFS(RemoteTier(self.url).fs)
        self.store = self._open()

    def _open(self) -> CheckpointStore:
        return CheckpointStore(self.run, self.url, remote_fs=self.fs, keep_local=KEEP_LOCAL, keep_remote=POLICY,
                               upload_backoff=(0.01, 0.05, 0.05), audit_interval=0.2, close_timeout=10,
                               upload_part_size=128)

    @rule(gap=st.integers(1, 3))
    def save(self, gap: int) -> None:
        step = (self.saved[-1] if self.saved else 0) + gap
        self.store.save(step, state(step)).wait()  # never raises, whatever the remote does
        self.saved.append(step)

    @rule(mode=st.sampled_from([None, "transient", "permanent"]))
    def remote_becomes(self, mode) -> None:
        self.fs.mode = mode

    @precondition(lambda self: self.fs.mode is None)
    @rule()
    def drain(self) -> None:
        assert self.store.wait(uploads=True, timeout=30)
        remote = set(self._remote().steps())
        if self.saved:
            assert self.saved[-1] in remote
        # what the remote keeps is what its policy keeps of what was uploaded; a step the policy
        # drops may still be there while its delete, failed under an earlier fault, waits its retry
        queued = set(self.store.uploader._deletions) if self.store.uploader is not None else set()
        assert remote - POLICY.keep(remote) <= queued, (remote, queued)

    @rule(drain=st.booleans())
    def restart(self, drain: bool) -> None:
        try:
            self.store.close(drain_uploads=drain and self.fs.mode is None)
        except Exception:  # noqa: BLE001 - permanent upload failures are raised here, by design
            assert self.fs.mode == "permanent" or self._had_permanent
        self._had_permanent = False
        mode, self.fs.mode = self.fs.mode, None  # a store opens against a reachable remote
        self.store = self._open()
        self.fs.mode = mode

    _had_permanent = False

    @rule()
    def restore(self) -> None:
        if not self.saved:
            return
        got = self.store.restore(mark_resume=False)
        assert got["step"] == self.saved[-1]
        assert first_difference(state(self.saved[-1]), got) is None

    @invariant()
    def tiers_hold_only_whole_steps(self) -> None:
        if self.fs.mode == "permanent":
            self._had_permanent = True
        # The uploader and rotation run while this looks: read the remote, then the local
        # steps, then the remote again. A step rotated out after the local read was on the
        # remote before it went (so in the second read); one already gone was in the first.
        remote = self._remote()
        owed_before = [s for s in self.saved if s % 5 == 0 and s not in remote.steps()]
        local = LocalTier(self.run, create=False)
        local_steps = local.steps()
        for step in local_steps:
            try:
                got = local.load(step)[0]
            except CheckpointNotFoundError:  # rotated away since it was listed: not a partial step
                assert step not in local.steps()
                continue
            assert first_difference(state(step), got) is None
        on_remote = remote.steps()
        with tempfile.TemporaryDirectory() as tmp:
            fresh = LocalTier(tmp)
            for step in on_remote:
                try:
                    fresh.download(step, remote)
                except (CorruptCheckpointError, CheckpointNotFoundError):  # deleted by retention meanwhile?
                    assert not remote.is_committed(step)
                    continue
                assert first_difference(state(step), fresh.load(step)[0]) is None
        if self.saved:
            assert self.saved[-1] in local.steps()
        pinned = [s for s in self.saved if s % 5 == 0]
        assert set(pinned) <= set(local_steps) | set(on_remote), (local_steps, on_remote)
        assert len(local_steps) <= KEEP_LOCAL + len(owed_before) + 2, (local_steps, on_remote, owed_before)

    def _remote(self) -> RemoteTier:
        return RemoteTier(self.url)

    def teardown(self) -> None:
        self.fs.mode = None
        try:
            self.store.close(drain_uploads=False)
        except Exception:  # noqa: BLE001 - failures of a faulty remote were checked above
            pass
        shutil.rmtree(self.root, ignore_errors=True)


Checkpoints.TestCase.settings = settings(max_examples=int(__import__("os").environ.get("SM_EXAMPLES", "25")), stateful_step_count=14, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_checkpoints_state_machine = Checkpoints.TestCase
_ = uuid
