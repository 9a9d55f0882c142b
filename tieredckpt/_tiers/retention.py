"""Which checkpoints to keep: small policy objects with one pure method.

    KeepLast(3).keep([100, 200, 300, 400])            -> {200, 300, 400}
    KeepEvery(10_000).keep(...)                       -> steps divisible by 10,000
    AnyOf(KeepLast(3), KeepEvery(10_000))             -> keep what either keeps

:func:`plan_eviction` turns a policy and the protected steps (the one ``latest``
names, the one being restored from, ones not yet uploaded) into the list of
steps to delete. No disk is touched here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Policy(Protocol):
    def keep(self, steps: Iterable[int]) -> set[int]: ...


def pins(policy: Policy | None, step: int) -> bool:
    """True when ``policy`` keeps ``step`` whatever steps come later (a KeepEvery milestone).

    Such a step is owed to the remote: the uploader never supersedes it."""
    return policy is not None and bool(getattr(policy, "pins", lambda s: False)(step))


@dataclass(frozen=True)
class KeepLast:
    n: int

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"KeepLast needs n >= 1, got {self.n!r}")

    def keep(self, steps: Iterable[int]) -> set[int]:
        """The steps of ``steps`` this policy keeps on the remote."""
        return set(sorted(set(steps))[-self.n:])

    def pins(self, step: int) -> bool:
        """Whether ``step`` is a milestone: kept however uploads lag (``uploads="newest"``
        never supersedes it)."""
        return False


@dataclass(frozen=True)
class KeepEvery:
    every: int

    def __post_init__(self) -> None:
        if type(self.every) is not int or self.every < 1:
            raise ValueError(f"KeepEvery needs every >= 1, got {self.every!r}")

    def keep(self, steps: Iterable[int]) -> set[int]:
        """The steps of ``steps`` this policy keeps on the remote."""
        return {s for s in steps if s % self.every == 0}

    def pins(self, step: int) -> bool:
        """Whether ``step`` is a milestone: kept however uploads lag (``uploads="newest"``
        never supersedes it)."""
        return step % self.every == 0


@dataclass(frozen=True)
class AnyOf:
    policies: tuple

    def __init__(self, *policies: Policy) -> None:
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Iterable[int]) -> set[int]:
        """The steps of ``steps`` this policy keeps on the remote."""
        steps = list(steps)
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps)
        return kept

    def pins(self, step: int) -> bool:
        """Whether ``step`` is a milestone: kept however uploads lag (``uploads="newest"``
        never supersedes it)."""
        return any(pins(policy, step) for policy in self.policies)


def plan_eviction(steps: Iterable[int], policy: Policy, protected: Iterable[int] = ()) -> list[int]:
    """Steps to delete, oldest first: those the policy drops and nobody protects."""
    steps = sorted(set(steps))
    kept = policy.keep(steps) | set(protected)
    return [s for s in steps if s not in kept]
