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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .._tiers.retention import AnyOf, KeepEvery, KeepLast, Policy


@dataclass(frozen=True)
class StoreConfig:
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

    def store_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> StoreConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: the checkpoint section must be a table/mapping")
        raw = _expand(raw, source)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{source}: unknown checkpoint settings {unknown} (known: {sorted(known)})")
        if "local" not in raw:
            raise ValueError(f"{source}: 'local' (the run directory) is required")
        values = dict(raw)
        if values.get("compression") in ("none", "raw"):
            values["compression"] = None
        if "keep_remote" in values:
            values["keep_remote"] = _policy(values["keep_remote"], source)
        return cls(**values)

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
