"""A replica's admission count: requests admitted and not yet given back, against its limit.

Counted at admission (on the caller's side, before a stream starts), so a burst cannot
overshoot the limit before its streams run; each admission is given back exactly once.
"""

from __future__ import annotations

from deployments.frontend.engine.engine_types import EngineOverloaded


class Admissions:
    """Running + waiting requests on one replica, one per fork (`n`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def admit(self, n: int) -> Admission:
        """An admission of `n` places, or EngineOverloaded. NOTE: one request alone on an idle
        replica is admitted whatever its n, so an n above the limit is slow rather than refused
        forever."""
        if self.count and self.count + n > self.limit:
            raise EngineOverloaded(
                f"{self.count} requests are already queued or running on this replica "
                f"(its admission limit)"
            )
        return Admission(self, n)


class Admission:
    """One request's places in its replica's admission count; `release` is idempotent."""

    def __init__(self, owner: Admissions, n: int) -> None:
        self._owner: Admissions | None = owner
        self._n = n
        owner.count += n

    def release(self) -> None:
        if self._owner is not None:
            self._owner.count -= self._n
            self._owner = None
