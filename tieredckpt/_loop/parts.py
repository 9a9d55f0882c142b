"""What the store's working modules (saving, folders, room, closing, forks, the DCP writer and
reader) see of a store: its parts, as a Protocol, so that they depend on these parts and never
on the facade that holds them (store.py imports them; none of them imports store.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .._tiers.local import LocalTier
    from .._tiers.ranks import RankGroup
    from .._tiers.remote import RemoteTier
    from .._tiers.restore import Restorer
    from .._tiers.runlock import RunLock
    from .._tiers.uploader import Uploader
    from .handle import SaveHandle
    from .room import Room
    from .runlog import RunLog
    from .sha256fill import Sha256Fill
    from .signals import Requests
    from .staging import Stager, StepHold
    from .stats import Stats


class StoreParts(Protocol):
    local: LocalTier
    remote: RemoteTier | None
    uploader: Uploader | None
    run: RunLog
    ranks: RankGroup | None
    _commit_ranks: RankGroup | None
    rank: int
    _node_leader: bool
    _node_ranks: int
    read_only: bool
    keep_local: int
    on_save_error: str
    overlap: bool
    close_timeout: float | None
    exit_timeout: float
    upload_on_exit: float
    requests: Requests
    _stats: Stats
    _stager: Stager
    _hold: StepHold
    _writer: ThreadPoolExecutor
    _sha256: Sha256Fill
    _room: Room
    _restorer: Restorer
    _lock: RunLock
    _pending: SaveHandle | None
    _closed: bool
    _fell_back_to_reading: bool

    def _check_open(self) -> None: ...

    def _check_writable(self) -> None: ...

    def _training_seconds(self) -> float: ...

    def _resume_clock(self, seconds: float) -> None: ...

    def should_stop(self) -> bool: ...
