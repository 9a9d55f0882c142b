"""The checkpoint section of a training config: a dict, a TOML file or a YAML file.

    [checkpoint]
    local = "/nvme/runs/lm"
    remote = "s3://my-bucket/runs/lm"
    every = 100
    keep_local = 3
    compression = "zstd-dtype"           # or "zstd-planes", "zstd", or "none"
    compression_level = 1
    max_pending_uploads = 2               # with uploads = "all"
    uploads = "newest"                    # or "all"
    stall_budget = 0.02                   # warn when save() blocks the loop more than 2% of the time
    keep_remote = { last = 5, every = 10000 }
    [checkpoint.remote_options]
    endpoint_url = "${S3_ENDPOINT}"
    key = "${AWS_ACCESS_KEY_ID}"
    secret = "${AWS_SECRET_ACCESS_KEY}"

``${NAME}`` in any string is replaced by the environment variable NAME, so
secrets stay out of the file (s3fs also reads the usual AWS_* variables by
itself). Unknown keys are refused with the key named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._tiers.retention import AnyOf, KeepEvery, KeepLast, Policy

# The options a file cannot hold: functions and filesystem objects (pass them to from_config).
NOT_IN_FILES = ("on_upload_error", "on_stats", "remote_fs", "fs", "storage_options")
# Options whose value may be None; in a file (TOML has no null) the string "none" says so.
_NONE_OK = ("remote", "keep_remote", "compression", "max_pending_uploads", "close_timeout",
            "distributed", "orphan_grace")
ENV_PREFIX = "TIEREDCKPT_"


@dataclass(frozen=True)
class StoreConfig:
    """The checkpoint section of a training config, as a file holds it: every option of
    ``CheckpointStore`` but its functions and filesystem objects, under the same name and with
    the same default (a test holds the two together). In a file, ``"none"`` stands for None,
    ``keep_remote`` is a table (``{ last = 5, every = 10000 }``), ``upload_backoff`` a list,
    ``storage_options`` is accepted for ``remote_options``, and ``${NAME}`` in a string is the
    environment variable NAME.

    :param local: the run directory (required).
    :param remote: the remote's fsspec URL.
    :param remote_options: the remote filesystem's options (a table).
    :param every: the save interval in steps.
    :param keep_local: committed steps kept on local disk.
    :param keep_remote: a table with ``last`` and/or ``every``.
    :param compression: "zstd-dtype", "zstd-planes", "zstd" or "none".
    :param compression_level: the zstd level.
    :param max_pending_uploads: with ``uploads = "all"``, steps that may wait before save blocks.
    :param uploads: "newest" or "all".
    :param stall_budget: the share of time save() may block before a warning.
    :param exit_timeout: seconds close() spends on the remote at the end.
    :param upload_on_exit: seconds close() spends uploading the step saved on SIGTERM.
    :param on_save_error: "raise" or "warn".
    :param allow_unfenced: open where the server ignores conditional writes.
    :param verify: "crc", "sha256" or "none".
    :param upload_backoff: ``[first, cap, slow]`` seconds between upload retries.
    :param request_timeout: seconds per remote request, plus one per MB.
    :param audit_interval: seconds between an idle uploader's checks of the remote.
    :param upload_part_size: bytes per uploaded part.
    :param close_timeout: seconds close() waits for pending uploads.
    :param read_only: open as a reader.
    :param takeover: take the remote's lease from a writer that still holds it.
    :param distributed: one shard per rank ("none": when a process group is initialized).
    :param overlap: the default of ``save(..., overlap=)``.
    :param orphan_grace: seconds before orphaned remote objects are deleted.

    Each is described in full under ``CheckpointStore``."""

    local: str
    remote: str | None = None
    remote_options: dict = field(default_factory=dict)
    every: int = 100
    keep_local: int = 3
    keep_remote: Policy | None = None
    compression: str | None = "zstd-dtype"
    compression_level: int = 1
    max_pending_uploads: int | None = 2
    uploads: str = "newest"
    stall_budget: float = 0.02
    exit_timeout: float = 2.0
    upload_on_exit: float = 20.0
    on_save_error: str = "raise"
    allow_unfenced: bool = False
    verify: str = "crc"
    upload_backoff: tuple[float, ...] = (0.5, 10.0, 60.0)
    request_timeout: float = 60.0
    audit_interval: float = 60.0
    upload_part_size: int = 64 << 20
    close_timeout: float | None = 600.0
    read_only: bool = False
    takeover: bool = False
    distributed: bool | None = None
    overlap: bool = False
    orphan_grace: float | None = 3600.0

    def store_kwargs(self) -> dict[str, Any]:
        """The options as ``CheckpointStore``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> StoreConfig:
        """A config from the checkpoint section as a dict (``source`` names it in errors)."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: the checkpoint section must be a table/mapping")
        raw = _expand(raw, source)
        if "storage_options" in raw:  # fsspec's name for remote_options
            if "remote_options" in raw:
                raise ValueError(f"{source}: give remote_options or storage_options, not both (one is the other's alias)")
            raw["remote_options"] = raw.pop("storage_options")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{source}: unknown checkpoint settings {unknown} (known: {sorted(known)})")
        if "local" not in raw:
            raise ValueError(f"{source}: 'local' (the run directory) is required")
        values: dict[str, Any] = {k: None if k in _NONE_OK and v == "none" else v for k, v in raw.items()}
        if values.get("compression") == "raw":
            values["compression"] = None
        if "keep_remote" in values:
            values["keep_remote"] = _policy(values["keep_remote"], source)
        if isinstance(values.get("upload_backoff"), list):
            values["upload_backoff"] = tuple(values["upload_backoff"])
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> StoreConfig:
        """A config from environment variables: ``TIEREDCKPT_LOCAL``, ``TIEREDCKPT_REMOTE``,
        ``TIEREDCKPT_KEEP_LOCAL=5``, ... (the option's name in capitals after ``prefix``). A value
        that parses as JSON is that value (numbers, true/false, tables as ``{"last": 5}``),
        anything else a string."""
        source = os.environ if environ is None else environ
        raw = {name[len(prefix):].lower(): json_or_text(value) for name, value in source.items()
               if name.startswith(prefix) and name != prefix + "DEBUG"}
        return cls.from_dict(raw, f"the environment ({prefix}*)")

    @classmethod
    def load(cls, path: str | os.PathLike, section: str = "checkpoint") -> StoreConfig:
        """Read ``section`` of a .toml, .yaml/.yml or .json file."""
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            doc = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); TOML and JSON need nothing") from None
            doc = yaml.safe_load(text)
        else:
            import json
            doc = json.loads(text)
        if section not in (doc or {}):
            raise ValueError(f"{path}: no [{section}] section")
        return cls.from_dict(doc[section], f"{path} [{section}]")


def json_or_text(text: str) -> Any:
    """``true``/``false``/``null``, numbers, lists and objects as JSON; anything else, the text."""
    import json
    try:
        return json.loads(text)
    except ValueError:
        return text


def _policy(raw: Any, source: str) -> Policy | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw or set(raw) - {"last", "every"}:
        raise ValueError(f"{source}: keep_remote must be a table with 'last' and/or 'every', got {raw!r}")
    policies: list[Policy] = []
    if "last" in raw:
        policies.append(KeepLast(raw["last"]))
    if "every" in raw:
        policies.append(KeepEvery(raw["every"]))
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: Any, source: str) -> Any:
    if isinstance(value, dict):
        return {k: _expand(v, source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, source) for v in value]
    if isinstance(value, str):
        def var(match):
            name = match.group(1)
            if name not in os.environ:
                raise ValueError(f"{source}: environment variable {name} is not set")
            return os.environ[name]
        return _VAR.sub(var, value)
    return value
