"""What a save returns (SaveHandle) and what ``list()`` returns (CheckpointInfo)."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from .._format.manifest import ShardManifest
from ..errors import BackgroundSaveError
from .staging import StepHold


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path | None  # the local directory, or None when only the remote holds it
    size: int
    created_unix: float
    world_size: int
    local: bool = True
    remote: bool = False
    upload: str | None = None  # pending / uploading / retrying / failed / None


class SaveHandle:
    """The pending background write of one save."""

    def __init__(self, step: int, future: Future, hold: StepHold | None = None) -> None:
        self.step = step
        self._future = future
        self._hold = hold

    def done(self) -> bool:
        """Whether the background write has finished (committed or failed)."""
        return self._future.done()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """With ``overlap=True``: block until the background copy of the state is done (the
        live tensors may change from then on). True once it is."""
        return self._hold.wait(timeout) if self._hold is not None else True

    def wait(self, timeout: float | None = None) -> ShardManifest:
        """Block until committed; raise BackgroundSaveError if the write failed."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise
        except Exception as exc:
            self.raised = True  # the store will not raise it a second time
            raise BackgroundSaveError(f"saving step {self.step} failed: {exc}") from exc

    raised = False
