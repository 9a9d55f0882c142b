"""A dependency-free progress line for long work (training, transfers, verification).

On a terminal it redraws one line on stderr; elsewhere (CI, a log file) it
prints a plain line at every 10% so logs stay readable.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", start: int = 0, stream=None, unit: str = "") -> None:
        self.total = max(1, total)
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start_value = start
        self.start_time = time.monotonic()
        self._last_decile = (start * 10) // self.total

    def update(self, value: int, note: str = "") -> None:
        fraction = min(1.0, value / self.total)
        rate = (value - self.start_value) / max(1e-9, time.monotonic() - self.start_time)
        if self.unit == "B":  # byte counts read better in MB
            text = (f"{self.label} {value / 1e6:,.1f}/{self.total / 1e6:,.1f} MB {fraction:4.0%} "
                    f"{rate / 1e6:,.1f} MB/s {note}")
        else:
            text = f"{self.label} {value}/{self.total}{self.unit} {fraction:4.0%} {rate:,.1f}{self.unit}/s {note}"
        if self.tty:
            width = 24
            filled = int(width * fraction)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            self.stream.flush()
        elif (value * 10) // self.total > self._last_decile or value >= self.total:
            self._last_decile = (value * 10) // self.total
            self.stream.write(text.rstrip() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
