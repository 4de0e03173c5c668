"""Bounded staleness as a pure state machine: which pushes a shard may apply, when.

A replica *pulls* version ``v`` (it computes its next gradient on ``θ_v``), then
*pushes* that gradient. Pushes wait in ``pending`` and are applied together as one
version. Applying ``v → v + 1`` is allowed only while every replica still computing
(pulled, not yet pushed) would stay within ``staleness`` versions: ``v + 1 - p ≤ s``
for its pulled version ``p``. So every applied gradient is at most ``s`` versions
stale, and with ``s = 0`` a version is applied once every replica pushed against it
(synchronous training). A replica that finished its window no longer holds others
back. No clocks, threads or tensors here: the shard drives it, the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class StalenessError(RuntimeError):
    """A push or pull that breaks the protocol (a replica pushing twice, or unknown)."""


@dataclass
class StalenessGate:
    replicas: int
    staleness: int
    version: int = 0
    # replica -> the version its in-flight gradient is computed on
    pulled: dict[int, int] = field(default_factory=dict)
    # replica -> the pulled version of its pushed, not yet applied gradient
    pending: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.pulled and not self.finished:  # every replica starts on this version
            self.pulled = dict.fromkeys(range(self.replicas), self.version)

    def push(self, replica: int) -> int:
        """``replica`` pushed the gradient of its pulled version; returns that version."""
        if replica not in self.pulled:
            raise StalenessError(
                f"replica {replica} pushed without a pulled version (pending: "
                f"{replica in self.pending}, finished: {replica in self.finished})"
            )
        base = self.pulled.pop(replica)
        self.pending[replica] = base
        return base

    def may_apply(self) -> bool:
        """Whether the pending pushes may become the next version now."""
        if not self.pending:
            return False
        after = self.version + 1
        return all(after - base <= self.staleness for base in self.pulled.values())

    def apply(self) -> dict[int, int]:
        """Apply the pending pushes as version ``v + 1``: their staleness by replica
        (``v - pulled``, at most ``staleness``). Their replicas pull the new version."""
        if not self.may_apply():
            raise StalenessError(
                f"version {self.version + 1} may not be applied: pending {self.pending}, "
                f"in flight {self.pulled}, staleness bound {self.staleness}"
            )
        applied = {r: self.version - base for r, base in self.pending.items()}
        self.version += 1
        for replica in self.pending:
            self.pulled[replica] = self.version
        self.pending = {}
        return applied

    def finish(self, replica: int) -> None:
        """``replica`` ran its window's last step: it holds nobody back any more."""
        if replica in self.pending:
            raise StalenessError(f"replica {replica} finished with a push still pending")
        self.pulled.pop(replica, None)
        self.finished.add(replica)

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.replicas

    def expected_staleness(self) -> int:
        """The staleness of replicas at equal speed pushing in turn: ``min(s, R - 1)``."""
        return min(self.staleness, max(self.replicas - 1, 0))
