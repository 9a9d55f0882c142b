"""Keeping credentials out of everything we print, log, raise or write.

URLs are shown without their ``user:password@`` part; option values whose key
looks like a credential (key, secret, token, password...), and the AWS_*
environment variables' values, are replaced by ``***`` in every message.
"""

from __future__ import annotations

import re


def redact_url(url: str) -> str:
    """The URL without any user:password@ part."""
    return re.sub(r"^([a-zA-Z0-9+.-]+://)[^/@]*@", r"\1***@", url)


_SECRET_KEY = re.compile(r"(key|secret|token|password|passwd|credential)", re.IGNORECASE)


def secret_values(options: dict, env: bool = False) -> list[str]:
    """String values that look like credentials, from options (recursively) or AWS_* variables."""
    found = []
    for key, value in options.items():
        if env and not str(key).startswith(("AWS_", "TIEREDCKPT_")):
            continue
        if isinstance(value, dict):
            found += secret_values(value)
        elif isinstance(value, str) and len(value) >= 4 and _SECRET_KEY.search(str(key)):
            found.append(value)
    return sorted(set(found), key=len, reverse=True)


def url_secrets(url: str) -> list[str]:
    match = re.match(r"^[a-zA-Z0-9+.-]+://([^/@]*)@", url)
    return [s for s in re.split(r"[:]", match.group(1)) if len(s) >= 4] if match else []


def scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
