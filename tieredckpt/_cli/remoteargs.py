"""Which remote a command talks to: --remote, --endpoint-url and --remote-option, or the one the
run's store recorded in its status file (never one whose credentials were scrubbed from it)."""

from __future__ import annotations

import json

from .._format import layout
from .._loop.config import json_or_text
from .._tiers.local import LocalTier


def remote_options(args, url: str | None) -> dict:
    """--remote-option KEY=VALUE items and --endpoint-url (an S3 remote's), as fsspec options.
    A VALUE that parses as JSON is taken as that (``anon=true``, ``max_concurrency=8``,
    ``config_kwargs={"retries": {"max_attempts": 3}}``); any other is the string as given, and
    credentials and names are always strings."""
    options = {}
    for item in args.remote_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--remote-option {item!r}: expected KEY=VALUE")
        options[key] = value if key in _TEXT_OPTIONS else option_value(value)
    if args.endpoint_url and url and url.startswith("s3://"):
        options["endpoint_url"] = args.endpoint_url
    return options


_TEXT_OPTIONS = {"key", "secret", "token", "endpoint_url", "profile", "region_name"}  # a digits-only secret stays text


option_value = json_or_text  # the same rule as the TIEREDCKPT_* variables of a StoreConfig


def recorded_remote(run_dir, args) -> str | None:
    """--remote, or the remote the run's store last used (None: none, or one needing credentials)."""
    url = args.remote or read_status(LocalTier(run_dir, create=False, must_exist=False)).get("remote")
    return url if isinstance(url, str) and "***@" not in url else None


def open_remote(url: str, args, create: bool = False):
    from .._tiers.remote import RemoteTier
    remote = RemoteTier(url, remote_options(args, url))
    remote.t.probe(create=create)  # a missing bucket or refused credentials: say so now
    return remote


def run_remote(tier: LocalTier, args, create: bool = False):
    """The remote named on the command line, or the one the run's store recorded; and the status."""
    url = getattr(args, "remote", None)
    status = read_status(tier)
    url = url or status.get("remote")
    if url is not None and not isinstance(url, str):
        url = None
    if url and "***@" in url:
        raise ValueError(f"{tier.root}: the recorded remote {url} needs its credentials; pass --remote")
    return (open_remote(url, args, create) if url else None), status


def read_status(tier: LocalTier) -> dict:
    """The uploader's status file (informational; anything unreadable counts as none)."""
    try:
        with open(tier.root / layout.STATUS_FILE, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("steps", {}), dict):
        return {}
    return doc
