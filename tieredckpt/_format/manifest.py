"""The checkpoint manifest: which rank owns which shard, and how to verify it.

The seed schema (``world_size``, ``step``, ``wall_clock_seconds``, ``shards`` of
``rank``/``path``/``sha256``/``param_shard_offset``/``param_shard_numel``,
``schema_version``) plus what verification needs: each shard's ``size``,
``crc32c`` and ``codec``, and the save's ``created_unix`` time.

A manifest read from disk or a bucket is untrusted: :meth:`ShardManifest.from_json`
checks every field's type and range, that ranks are exactly 0..world_size-1,
that every path is a plain relative path inside the checkpoint directory, and
that ``user`` nests at most 32 levels deep.

A manifest also carries ``manifest_sha256``: the sha256 of its own canonical
JSON (sorted keys, no spaces, every field but this one). A bit flip anywhere in
the manifest -- a shard's checksum, an offset, ``user`` -- is refused on read.
Manifests without it (written before it existed) are read unchecked.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath

from ..errors import ManifestError, ShardCountMismatchError

SCHEMA_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_USER_DEPTH = 32
DIGEST_KEY = "manifest_sha256"
_INT_MAX = 2**63 - 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
CODECS = ("raw",)
LAYOUTS = ("plain", "dtensor", "files")  # files: a folder of ordinary files (_tiers/folder.py)


@dataclass(frozen=True)
class ShardEntry:
    rank: int
    path: str
    sha256: str
    param_shard_offset: int
    param_shard_numel: int
    size: int
    crc32c: str
    codec: str = "raw"
    header_crc32c: str = ""  # shards with DTensor pieces: crc32c of the length prefix and header


@dataclass(frozen=True)
class ShardManifest:
    world_size: int
    step: int
    wall_clock_seconds: float
    shards: list[ShardEntry]
    schema_version: int = SCHEMA_VERSION
    created_unix: float = 0.0
    user: dict = field(default_factory=dict)
    layout: str = "plain"  # "dtensor": shards hold DTensor pieces, restored by assembling them;
    # "files": a folder of ordinary files, one per entry of ``shards`` (rank = its index)

    def to_json(self) -> str:
        """The manifest as written to disk: JSON with its canonical digest."""
        raw = asdict(self)
        raw[DIGEST_KEY] = canonical_digest(raw)
        return json.dumps(raw, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> ShardManifest:
        """Parse and validate an untrusted manifest; ``source`` names it in errors."""
        raw = parse_json(text, MAX_MANIFEST_BYTES, source, "a manifest")
        if isinstance(raw, dict) and DIGEST_KEY in raw:
            want = raw.pop(DIGEST_KEY)
            if canonical_digest(raw) != want:
                raise ManifestError(f"{source}: its content does not match its own manifest_sha256 "
                                    "(corrupt or edited manifest)")
        return _validate(raw, source)

    @property
    def total_size(self) -> int:
        """The bytes of all shards."""
        return sum(s.size for s in self.shards)


def parse_json(text: str | bytes, limit: int, source: str, what: str):
    """Untrusted JSON of at most ``limit`` bytes; anything else is a ManifestError naming ``source``."""
    if len(text) > limit:
        raise ManifestError(f"{source}: {len(text)} bytes is too large for {what}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc})") from None


def canonical_digest(raw: dict) -> str:
    """sha256 of a manifest's canonical JSON, without its own digest field."""
    body = {k: v for k, v in raw.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def json_depth(value: object, limit: int) -> int:
    """How deeply ``value`` nests (without recursion), stopping once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return deepest


def check_user(user: object, source: str) -> dict:
    """A manifest's ``user`` entry: a JSON object nested at most MAX_USER_DEPTH levels."""
    if not isinstance(user, dict):
        raise ManifestError(f"{source}: 'user' must be an object")
    if json_depth(user, MAX_USER_DEPTH) > MAX_USER_DEPTH:
        raise ManifestError(f"{source}: 'user' nests deeper than {MAX_USER_DEPTH} levels")
    return user


def check_relative_path(path: object, source: str) -> str:
    """Refuse any path that is not a plain relative path below the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{source}: shard path {path!r} is not a non-empty string")
    pure = PurePosixPath(path)
    if ("\\" in path or "\x00" in path or pure.is_absolute()
            or any(part in ("..", ".") for part in path.split("/")) or "" in path.split("/")):
        raise ManifestError(f"{source}: shard path {path!r} escapes or is not a plain path inside the checkpoint directory")
    return path


def _validate(raw: object, source: str) -> ShardManifest:
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: top level is not a JSON object")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION or type(version) is not int:
        raise ManifestError(f"{source}: schema_version {version!r} is not supported (this tieredckpt reads {SCHEMA_VERSION})")
    world_size = _int(raw, "world_size", source, minimum=1)
    step = _int(raw, "step", source)
    wall = _number(raw, "wall_clock_seconds", source)
    created = _optional_number(raw, "created_unix", source)
    user = check_user(raw.get("user", {}), source)
    shards_raw = raw.get("shards")
    if not isinstance(shards_raw, list):
        raise ManifestError(f"{source}: 'shards' must be a list")
    if len(shards_raw) != world_size:
        raise ShardCountMismatchError(
            f"{source}: lists {len(shards_raw)} shards for world_size {world_size}")
    shards = [_shard(s, f"{source}: shards[{i}]") for i, s in enumerate(shards_raw)]
    ranks = sorted(s.rank for s in shards)
    if ranks != list(range(world_size)):
        raise ManifestError(f"{source}: shard ranks {ranks} are not exactly 0..{world_size - 1} (duplicate or missing rank)")
    paths = [s.path for s in shards]
    if len(set(paths)) != len(paths):
        raise ManifestError(f"{source}: two shards share one path")
    shards.sort(key=lambda s: s.rank)
    kind = raw.get("layout", "plain")
    if kind not in LAYOUTS:
        raise ManifestError(f"{source}: layout {kind!r} is not one of {LAYOUTS}")
    return ShardManifest(world_size, step, wall, shards, version, created or 0.0, user, kind)


def _shard(raw: object, where: str) -> ShardEntry:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} is not an object")
    offset = _int(raw, "param_shard_offset", where)
    numel = _int(raw, "param_shard_numel", where)
    if offset + numel > _INT_MAX:
        raise ManifestError(f"{where}: param_shard_offset + param_shard_numel overflows")
    sha, crc = raw.get("sha256"), raw.get("crc32c")
    if not isinstance(sha, str) or sha and not _HEX64.match(sha):  # "": not recorded yet (sharded.fill_sha256)
        raise ManifestError(f"{where}: sha256 {sha!r} is not 64 lowercase hex digits")
    if not isinstance(crc, str) or not _HEX8.match(crc):
        raise ManifestError(f"{where}: crc32c {crc!r} is not 8 lowercase hex digits")
    codec = raw.get("codec", "raw")
    if codec not in CODECS:
        raise ManifestError(f"{where}: unknown codec {codec!r}")
    head = raw.get("header_crc32c", "")
    if not isinstance(head, str) or head and not _HEX8.match(head):
        raise ManifestError(f"{where}: header_crc32c {head!r} is not 8 lowercase hex digits")
    return ShardEntry(rank=_int(raw, "rank", where), path=check_relative_path(raw.get("path"), where),
                      sha256=sha, param_shard_offset=offset, param_shard_numel=numel,
                      size=_int(raw, "size", where), crc32c=crc, codec=codec, header_crc32c=head)


def _int(raw: dict, key: str, where: str, minimum: int = 0) -> int:
    value = raw.get(key)
    if type(value) is not int:
        raise ManifestError(f"{where}: {key!r} must be an integer, got {value!r}")
    if not minimum <= value <= _INT_MAX:
        raise ManifestError(f"{where}: {key!r} = {value} is out of range [{minimum}, 2**63-1]")
    return value


def _number(raw: dict, key: str, where: str) -> float:
    value = raw.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e15:
        raise ManifestError(f"{where}: {key!r} must be a non-negative number, got {value!r}")
    return float(value)


def _optional_number(raw: dict, key: str, where: str) -> float | None:
    return None if raw.get(key) is None else _number(raw, key, where)
