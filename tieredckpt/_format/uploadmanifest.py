"""The upload manifest: the remote tier's commit marker, and its validation.

``ROOT/step_NNNNNN/upload.json`` lists, for every shard, the parts it was sent
as (offset, raw and stored size, raw and stored crc32c), the codec, and embeds
the checkpoint manifest. It is written last; it is read as untrusted input.

Schema 2 (written now): each part is an object ``objects/<raw crc32c>-<raw size>-<hex16>``
under the remote's root, shared by every step whose bytes there are unchanged; ``sent``
says whether this step wrote it or referenced one an earlier step wrote. A part whose
name declares other raw bytes than its entry is refused. Schema 1 (read): parts are
files of the step's own directory.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from ..errors import ManifestError
from .layout import CODECS, parse_object, step_dir_name
from .manifest import ShardManifest, check_relative_path, parse_json

UPLOAD_SCHEMA = 2
READ_SCHEMAS = (1, 2)
MAX_UPLOAD_MANIFEST = 8 << 20  # ~40,000 parts; larger is not one we wrote (read with a bounded request)
MAX_PART_RAW = 1 << 30  # a part's raw size (we write 64 MiB); bounds every allocation on download


def max_stored(raw_size: int) -> int:
    """The most bytes any codec of ours stores for ``raw_size`` raw bytes (zstd's worst case + framing)."""
    return raw_size + raw_size // 64 + 4096


@dataclass(frozen=True)
class PartEntry:
    path: str
    offset: int
    raw_size: int
    stored_size: int
    raw_crc32c: str
    stored_crc32c: str
    sent: bool = True  # False: an object an earlier step wrote, referenced (schema 2)


@dataclass(frozen=True)
class UploadedFile:
    path: str
    size: int
    parts: list[PartEntry]


@dataclass(frozen=True)
class UploadManifest:
    step: int
    codec: str
    files: list[UploadedFile]
    checkpoint: dict  # the local manifest.json, embedded
    uploaded_unix: float
    schema_version: int = UPLOAD_SCHEMA
    writer: dict | None = None  # {"token", "host", "pid", "generation"} of the writer that committed it

    @property
    def generation(self) -> int:
        """The lease generation of the writer that committed it (0: recorded before generations)."""
        return generation_of(self.writer)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @property
    def stored_size(self) -> int:
        """The bytes the step's parts take on the remote (referenced, whoever sent them)."""
        return sum(p.stored_size for f in self.files for p in f.parts)

    @property
    def sent_size(self) -> int:
        """The bytes this step's upload wrote; the rest it referenced."""
        return sum(p.stored_size for f in self.files for p in f.parts if p.sent)

    def part_rel(self, part: PartEntry) -> str:
        """Where a part lies, relative to the remote's root."""
        return part.path if self.schema_version >= 2 else f"{step_dir_name(self.step)}/{part.path}"

    def objects(self) -> set[str]:
        """The shared objects this step references (none in schema 1)."""
        return {p.path for f in self.files for p in f.parts} if self.schema_version >= 2 else set()

    @classmethod
    def from_json(cls, text: str | bytes, source: str) -> UploadManifest:
        """Parse and validate an untrusted upload manifest."""
        raw = parse_json(text, MAX_UPLOAD_MANIFEST, source, "an upload manifest")
        if not isinstance(raw, dict) or raw.get("schema_version") not in READ_SCHEMAS:
            raise ManifestError(f"{source}: not an upload manifest of a schema_version this tieredckpt reads "
                                f"({', '.join(map(str, READ_SCHEMAS))})")
        schema = raw["schema_version"]
        if raw.get("codec") not in CODECS:
            raise ManifestError(f"{source}: unknown codec {raw.get('codec')!r}")
        checkpoint = ShardManifest.from_json(json.dumps(raw.get("checkpoint")), f"{source} (checkpoint)")
        files = raw.get("files")
        if not isinstance(files, list) or len(files) != len(checkpoint.shards):
            raise ManifestError(f"{source}: 'files' must list one entry per shard")
        parsed = [_uploaded_file(f, shard, f"{source}: files[{i}]", schema)
                  for i, (f, shard) in enumerate(zip(files, checkpoint.shards))]
        step = raw.get("step")
        if step != checkpoint.step:
            raise ManifestError(f"{source}: step {step!r} differs from its checkpoint's {checkpoint.step}")
        uploaded = raw.get("uploaded_unix")
        if not isinstance(uploaded, (int, float)) or isinstance(uploaded, bool):
            raise ManifestError(f"{source}: uploaded_unix must be a number")
        return cls(step, raw["codec"], parsed, raw["checkpoint"], float(uploaded), schema, _writer(raw.get("writer")))

    @property
    def shard_manifest(self) -> ShardManifest:
        return ShardManifest.from_json(json.dumps(self.checkpoint), "upload manifest")


def _uploaded_file(raw, shard, where, schema: int) -> UploadedFile:
    if not isinstance(raw, dict) or raw.get("path") != shard.path or raw.get("size") != shard.size:
        raise ManifestError(f"{where}: does not match shard {shard.path!r} of {shard.size} bytes")
    parts_raw = raw.get("parts")
    if not isinstance(parts_raw, list) or not parts_raw:
        raise ManifestError(f"{where}: 'parts' must be a non-empty list")
    parts, offset = [], 0
    for j, p in enumerate(parts_raw):
        if not isinstance(p, dict):
            raise ManifestError(f"{where}: parts[{j}] is not an object")
        ints = [p.get(k) for k in ("offset", "raw_size", "stored_size")]
        if not all(type(v) is int and 0 <= v < 2**63 for v in ints) or p["offset"] != offset:
            raise ManifestError(f"{where}: parts[{j}] offsets/sizes are invalid or not contiguous")
        if p["raw_size"] > MAX_PART_RAW or p["stored_size"] > max_stored(p["raw_size"]):
            raise ManifestError(f"{where}: parts[{j}] declares {p['raw_size']} raw / {p['stored_size']} stored "
                                f"bytes, beyond what tieredckpt writes (raw <= {MAX_PART_RAW})")
        crcs = [c if isinstance(c, str) else "" for c in (p.get("raw_crc32c"), p.get("stored_crc32c"))]
        if not all(re.fullmatch(r"[0-9a-f]{8}", c) for c in crcs):
            raise ManifestError(f"{where}: parts[{j}] checksums are not 8 hex digits")
        sent = p.get("sent", True)
        if type(sent) is not bool:
            raise ManifestError(f"{where}: parts[{j}] 'sent' must be true or false")
        parts.append(PartEntry(_part_path(p.get("path"), p, f"{where}: parts[{j}]", schema), p["offset"], p["raw_size"],
                               p["stored_size"], crcs[0], crcs[1], sent))
        offset += p["raw_size"]
    if offset != shard.size:
        raise ManifestError(f"{where}: parts cover {offset} bytes of {shard.size}")
    return UploadedFile(shard.path, shard.size, parts)


def _part_path(path, part: dict, where: str, schema: int) -> str:
    """Schema 1: a file of the step's directory. Schema 2: an object of the remote's objects/,
    whose name must declare exactly the raw bytes the entry records (crc32c and size)."""
    if schema < 2:
        return check_relative_path(path, where)
    declared = parse_object(path)
    if declared is None:
        raise ManifestError(f"{where}: {path!r} is not an object of this remote's objects/ (a path outside "
                            "the run's object store is never read)")
    if declared != (part["raw_crc32c"], part["raw_size"]):
        raise ManifestError(f"{where}: object {path!r} is named for other bytes than the entry records "
                            f"(crc32c {part['raw_crc32c']}, {part['raw_size']} bytes)")
    return path


def _writer(raw) -> dict | None:
    """The committing writer's identity, if it is well formed (informational: never trusted for access)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("token"), str) or len(raw["token"]) > 64:
        return None
    host, pid = raw.get("host"), raw.get("pid")
    return {"token": raw["token"], "host": host[:255] if isinstance(host, str) else "?",
            "pid": pid if type(pid) is int else None, "generation": generation_of(raw)}


def generation_of(record: dict | None) -> int:
    """A lease generation read from a writer record or a marker's writer (untrusted): 0 when absent."""
    gen = (record or {}).get("generation")
    return gen if type(gen) is int and 0 <= gen < 1 << 62 else 0
