"""Names only: how every file and object tieredckpt writes is spelled.

    RUN_DIR/
      step_000100/            one committed checkpoint (exists => complete)
        manifest.json         written last; its presence is the commit marker
        rank0.bin ...         one pickle-free shard file per rank
      step_000200.tmp-<pid>-<hex>/   a checkpoint being written (never listed)
      latest                  text file naming the newest committed step dir
      .loss.json .samples.json .state.json    the run's side files
      archive/pivot_step_NNNNNN/              samples and state archived at a pivot
      provenance.json         where a forked run came from
      .uploads.json           the uploader's status (local only, never uploaded)
      .lock                   the writer's lock (flock) and who holds it
      quarantine/step_000300.<unix>/  a refused copy, moved aside (never deleted by us)

    REMOTE_ROOT/
      objects/<crc32c>-<size>-<hex16>    one part of a shard, immutable once written: steps whose
                                         bytes there are unchanged reference it instead of re-sending
      step_000100/upload.json            written last: the remote commit marker, naming its objects
      step_000100/rank0.bin.p00000 ...   parts of a step uploaded before objects/ (still read)
      latest                             newest uploaded step (a hint, confirmed on use)
      writer.json                        the owning writer's lease and heartbeat
      run/.loss.json ...                 the side files (only the names above)
"""

from __future__ import annotations

import os
import re
import secrets

MANIFEST = "manifest.json"
LATEST = "latest"
UPLOAD_MANIFEST = "upload.json"
WRITER_LEASE = "writer.json"
RUN_PREFIX = "run"
STATUS_FILE = ".uploads.json"
EVENTS_FILE = ".events.jsonl"  # what each save and upload cost (stats.py); local only
LOCK_FILE = ".lock"
LOSS = ".loss.json"
SAMPLES = ".samples.json"
STATE = ".state.json"
ARCHIVE = "archive"
PROVENANCE = "provenance.json"
QUARANTINE = "quarantine"
FOLDER_FILES_DIR = "files"  # a folder step's files inside its step directory (folder.py)
CODECS = ("raw", "zstd", "zstd-planes", "zstd-dtype")  # how a part of a shard is stored on the remote (codec.py)
# Keys of the state a checkpoint holds, where tieredckpt itself gives the state its shape:
FLAT_FILE_KEY = "flat_v1"  # a state converted from (or for) a flat step_NNNNNN.bin file (flat.py)
PARTITIONED_KEY = "flat"  # a rank's slice of the flat parameter space, ZeRO-style (reshard.py)
SIDE_FILES = (LOSS, SAMPLES, STATE)
SYNCED_FILES = (LOSS, SAMPLES, STATE, PROVENANCE)  # travel with the run to the remote
_ARCHIVE_RE = re.compile(r"^archive/pivot_step_\d{6,}(?:-\d+)?/[\w.-]+$")
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


OBJECTS = "objects"
_OBJECT_RE = re.compile(r"^objects/([0-9a-f]{8})-(\d{1,19})-[0-9a-f]{16}$")


def object_name(raw_crc32c: str, raw_size: int) -> str:
    """A new remote object's path for a part with these raw bytes. The random suffix makes every
    name written once only: an object is never overwritten, whoever else sends the same bytes."""
    return f"{OBJECTS}/{raw_crc32c}-{raw_size}-{secrets.token_hex(8)}"


def parse_object(path: str) -> tuple[str, int] | None:
    """(raw crc32c, raw size) an object's name declares, or None if it is not an object path."""
    match = _OBJECT_RE.match(path) if isinstance(path, str) else None
    return (match.group(1), int(match.group(2))) if match else None


def part_name(shard: str, index: int) -> str:
    return f"{shard}.p{index:05d}"


def is_synced_name(rel: str) -> bool:
    """True for the side-file names a run keeps on its remote (nothing else is ever fetched)."""
    return rel in SYNCED_FILES or (bool(_ARCHIVE_RE.match(rel)) and rel.rsplit("/", 1)[-1] not in (".", ".."))
