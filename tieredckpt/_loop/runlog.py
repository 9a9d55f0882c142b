"""The run directory's side files: loss history, samples, bandit state; pivots and forks.

``.loss.json`` is JSON Lines, one object per line, opened with O_APPEND: an
append is one ``write`` whatever the file's length (O(1) at 200,000 entries),
and it is never rewritten, archived or reset. Entries are
``{"step": s, "loss": x, ...}``; events are ``{"event": "resume"|"pivot"|"fork", ...}``.
A crash can tear only the last line: readers skip it (and count it), and the
next writer first terminates it with a newline so it never glues onto a new
entry. Appends are fsynced when a checkpoint is committed, so the history is
durable up to every committed step; entries after it are redone on resume.

After a resume from step S, entries for steps > S written by the crashed
process stay in the file (append-only) but the ``resume`` event marks them as
replayed: :meth:`LossHistory.by_step` gives each step's effective loss.

``.samples.json`` and ``.state.json`` are small JSON documents replaced
atomically. A pivot archives both under ``archive/pivot_step_NNNNNN/`` and
starts them clean; the loss history continues untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._format import layout
from .._format.atomic import atomic_write_bytes, building, fsync_file
from .._format.layout import ARCHIVE, LOSS, PROVENANCE, SAMPLES, SIDE_FILES, STATE  # noqa: F401 (re-exported)
from .._format.lossfile import merge_loss  # noqa: F401 (the remote merges with it)


@dataclass
class LossHistory:
    entries: list[dict] = field(default_factory=list)  # every valid line, in file order
    torn: int = 0  # lines that could not be parsed (a crash mid-append)

    def by_step(self) -> dict[int, float]:
        """Each step's effective loss: later writes win, a resume drops what it replays."""
        effective: dict[int, float] = {}
        for entry in self.entries:
            if entry.get("event") == "resume":
                for step in [s for s in effective if s > entry["step"]]:
                    del effective[step]
            elif "step" in entry and "loss" in entry:
                effective[entry["step"]] = entry["loss"]
        return effective

    def replayed(self) -> list[dict]:
        """Entries that a later resume superseded (steps redone after a crash)."""
        out: list[dict] = []
        live: list[dict] = []
        for entry in self.entries:
            if entry.get("event") == "resume":
                out += [e for e in live if e["step"] > entry["step"]]
                live = [e for e in live if e["step"] <= entry["step"]]
            elif "loss" in entry:
                live.append(entry)
        return out

    def events(self, kind: str | None = None) -> list[dict]:
        """The history's events (resume, pivot, fork), or those of one ``kind``."""
        return [e for e in self.entries if "event" in e and (kind is None or e["event"] == kind)]


class RunLog:
    """A run directory's side files: the append-only loss history (``.loss.json``), samples
    and free-form state (``.samples.json``, ``.state.json``, replaced atomically), resume
    marks and pivots. The store keeps one as ``store.run``; open one alone to read them."""

    def __init__(self, run_dir: str | os.PathLike, create: bool = True) -> None:
        self.root = Path(run_dir)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None

    # ---- loss history: append-only ------------------------------------------------

    def append_loss(self, step: int, loss: float, **extra: Any) -> None:
        """Append one loss entry (one ``O_APPEND`` write; a torn last line is never glued onto)."""
        self._append({"step": step, "loss": float(loss), **extra})

    def mark_resume(self, step: int) -> None:
        """Record that the run resumed from ``step`` (the steps after it are replayed)."""
        self._append({"event": "resume", "step": step, "unix": time.time()})

    def _append(self, entry: dict) -> None:
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        os.write(self._loss_fd(), line)  # O_APPEND: one write, whatever the file's size

    def _loss_fd(self) -> int:
        if self._fd is None:
            path = self.root / LOSS
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.fstat(fd).st_size
            if size and _last_byte(path) != b"\n":
                os.write(fd, b"\n")  # close a line torn by a crash; never glue onto it
            self._fd = fd
        return self._fd

    def sync(self) -> None:
        """Make every appended entry durable (called before a checkpoint commits)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def read_loss(self) -> LossHistory:
        """The loss history as written; torn lines are counted, not raised."""
        history = LossHistory()
        try:
            with open(self.root / LOSS, "rb") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        entry = None
                    if isinstance(entry, dict):
                        history.entries.append(entry)
                    elif line.strip():
                        history.torn += 1
        except FileNotFoundError:
            pass
        return history

    def close(self) -> None:
        """Close the history's file (the store does it at close)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- samples and bandit state: atomic small documents ---------------------------

    def write_samples(self, samples: Any) -> None:
        """Replace the run's samples document (JSON), atomically."""
        atomic_write_bytes(self.root / SAMPLES, json.dumps(samples, indent=1).encode())

    def read_samples(self, default: Any = None) -> Any:
        """The run's samples document, or ``default`` when there is none."""
        return _read_json(self.root / SAMPLES, default)

    def write_state(self, state: Any) -> None:
        """Replace the run's state document (JSON: a bandit's state, a curriculum), atomically."""
        atomic_write_bytes(self.root / STATE, json.dumps(state, indent=1).encode())

    def read_state(self, default: Any = None) -> Any:
        """The run's state document, or ``default`` when there is none."""
        return _read_json(self.root / STATE, default)

    # ---- pivot ------------------------------------------------------------------------

    def pivot(self, step: int, note: str = "") -> Path:
        """Archive samples and state under ``archive/pivot_step_NNNNNN/`` and start them clean.

        Order: copy both into a scratch dir, fsync, commit it under its final
        name; only then reset the live files. A crash before the commit changes
        nothing; after it, a repeated pivot archives again (no loss either way).
        The loss history is never touched, only marked with a pivot event.
        """
        archive = self.root / ARCHIVE
        archive.mkdir(exist_ok=True)
        dest = _unused(archive / f"pivot_{layout.step_dir_name(step)}")
        with building(dest) as scratch:
            for name in (SAMPLES, STATE):
                if (self.root / name).exists():
                    shutil.copy2(self.root / name, scratch / name)
            (scratch / "pivot.json").write_text(json.dumps({"step": step, "note": note, "unix": time.time()}))
            for entry in scratch.iterdir():
                fsync_file(entry)
        for name in (SAMPLES, STATE):
            if (self.root / name).exists():
                atomic_write_bytes(self.root / name, b"{}" if name == STATE else b"[]")
        self._append({"event": "pivot", "step": step, "note": note, "unix": time.time()})
        self.sync()
        return dest

    def pivots(self) -> list[dict]:
        """The pivot events of the loss history, oldest first."""
        return self.read_loss().events("pivot")


def fork_run(parent: str | os.PathLike, step: int, new_run_dir: str | os.PathLike) -> Path:
    """An audit branch: copy checkpoint ``step`` into a new run with its provenance.

    The new run gets the checkpoint (copied and committed atomically), the
    parent's effective loss history up to ``step`` followed by a fork event,
    and ``provenance.json`` naming the parent run and step. Samples and bandit
    state start clean. The two runs share no files afterwards.
    """
    from .._tiers.local import LocalTier
    from .._tiers.sharded import copy_checkpoint
    source = LocalTier(parent, create=False)
    target = LocalTier(new_run_dir)
    if target.steps():
        raise FileExistsError(f"{target.root}: already holds checkpoints; a fork needs a new run directory")
    copy_checkpoint(source.require(step), target.step_path(step))
    target.update_latest()
    history = RunLog(parent).read_loss().by_step()
    lines = [json.dumps({"step": s, "loss": x}) for s, x in sorted(history.items()) if s <= step]
    lines.append(json.dumps({"event": "fork", "parent": str(Path(parent).resolve()), "step": step,
                             "unix": time.time()}))
    atomic_write_bytes(target.root / LOSS, ("\n".join(lines) + "\n").encode())
    atomic_write_bytes(target.root / PROVENANCE, json.dumps(
        {"parent_run": str(Path(parent).resolve()), "parent_step": step, "forked_unix": time.time()},
        indent=1).encode())
    return target.root


def _unused(path: Path) -> Path:
    candidate, n = path, 2
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return default


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)

