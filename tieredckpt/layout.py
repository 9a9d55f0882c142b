"""Names only: how steps, shards, manifests and temporary files are spelled on disk.

    RUN_DIR/
      step_000100/            one committed checkpoint (exists => complete)
        manifest.json         written last; its presence is the commit marker
        rank0.bin ...         one pickle-free shard file per rank
      step_000200.tmp-<pid>-<hex>/   a checkpoint being written (never listed)
      latest                  text file naming the newest committed step dir
      .loss.json .samples.json .state.json    the run's side files
"""

from __future__ import annotations

import os
import re
import secrets

MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIGITS = 6

_STEP_RE = re.compile(r"^step_(\d{6,})$")
# Temporary and to-be-deleted directories carry the writer's pid so that a
# cleaner can tell a crashed writer's leftovers from a live writer's work.
_SCRATCH_RE = re.compile(r"^(?:step_\d{6,}|\.?[\w.-]+?)\.(?:tmp|del)-(\d+)-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    """``step_000100`` for step 100; wider steps keep all their digits."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a committed checkpoint directory name encodes, or None."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def shard_name(rank: int) -> str:
    return f"rank{rank}.bin"


def scratch_name(final_name: str, kind: str = "tmp") -> str:
    """A sibling name for work in progress: ``<final>.tmp-<pid>-<random>``."""
    return f"{final_name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def scratch_owner_pid(name: str) -> int | None:
    """The pid that created a scratch entry, or None if ``name`` is not scratch."""
    match = _SCRATCH_RE.match(name)
    return int(match.group(1)) if match else None
