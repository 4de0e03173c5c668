"""Bounded staleness as a pure state machine: which pushes a shard may apply, when.

A replica *pulls* version ``v`` (it computes its next gradient on ``θ_v``), then
*pushes* that gradient. Pushes wait in ``pending`` and are applied together as one
version. Applying ``v → v + 1`` is allowed only while every replica still computing
(pulled, not yet pushed) would stay within ``staleness`` versions: ``v + 1 - p ≤ s``
for its pulled version ``p``. So every applied gradient is at most ``s`` versions
stale, and with ``s = 0`` a version is applied once every replica pushed against it
(synchronous training). A replica that finished its window no longer holds others
back, and neither does a *dropped* one (its worker was lost: its pushed gradients
still apply, its in-flight one is gone). With ``overlap`` a replica's next gradient is
computed on the weights of the reply before (its push is on the way meanwhile), and
the gate counts that base.
No clocks, threads or tensors here: the shard drives it, the tests check it.
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
    # Overlap (Async(overlap=True)): a replica computes its next gradient while its push
    # is on the way, on the weights of the reply before; ``replied`` is the version of
    # the last reply each replica got, the base of the gradient after the one in flight
    overlap: bool = False
    replied: dict[int, int] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)  # lost replicas (finished for good)

    def __post_init__(self) -> None:
        if not self.pulled and not self.finished:  # every replica starts on this version
            self.pulled = dict.fromkeys(range(self.replicas), self.version)
            self.replied = dict.fromkeys(range(self.replicas), self.version)

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
        after, bound = self.version + 1, self.staleness
        if not self.overlap:
            return all(after - base <= bound for base in self.pulled.values())
        # Overlap: a replica computing holds two gradients back, the one under way (on
        # ``pulled``) and the next (on ``replied``, pushed once it has pushed this one);
        # a pending one's next gradient is on ``replied``. Keeping both within the bound
        # here is what lets the version after a round of pushes always apply.
        for replica, base in self.pulled.items():
            if after - base > bound or after + 1 - self.replied[replica] > bound:
                return False
        return all(
            after - self.replied[replica] <= bound
            for replica in self.pending
            if replica not in self.dropped  # no next gradient will come
        )

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
            if replica in self.dropped:  # lost: it computes nothing more
                continue
            if self.overlap:  # its next gradient is under way, on the previous reply's weights
                self.pulled[replica] = self.replied[replica]
                self.replied[replica] = self.version
            else:
                self.pulled[replica] = self.version
        self.pending = {}
        return applied

    def finish(self, replica: int) -> None:
        """``replica`` ran its window's last step: it holds nobody back any more."""
        if replica in self.pending:
            raise StalenessError(f"replica {replica} finished with a push still pending")
        if replica in self.dropped:
            raise StalenessError(f"replica {replica} finished after it was dropped as lost")
        self.pulled.pop(replica, None)
        self.finished.add(replica)

    def drop(self, replica: int) -> None:
        """``replica`` is lost: its gradient in flight never comes, one it pushed still
        applies, and it holds nobody back any more."""
        if not 0 <= replica < self.replicas:
            raise StalenessError(f"replica {replica} dropped: not one of {self.replicas}")
        self.dropped.add(replica)
        self.pulled.pop(replica, None)
        self.finished.add(replica)

    def renewed(self) -> StalenessGate:
        """The gate of the next window (or retrain round): every replica starts on the
        current version, except the dropped ones, which stay dropped."""
        gate = StalenessGate(self.replicas, self.staleness, self.version, overlap=self.overlap)
        for replica in sorted(self.dropped):
            gate.drop(replica)
        return gate

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.replicas
