"""How the command line prints sizes, ages and rank lists."""

from __future__ import annotations

import time


def fmt_ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def fmt_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def fmt_age(created: float) -> str:
    seconds = max(0.0, time.time() - created)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
