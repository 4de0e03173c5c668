"""How replicas keep their weights in step: the synchronisation policy.

``Synchronous()`` (the default): every step's gradients meet in the sample-weighted
allreduce, so all replicas take the same steps on the same weights. ``Async(...)``:
the weights live in a parameter store; each replica pushes its gradient and pulls
fresh weights without a barrier, at most ``staleness`` versions behind. ``Local(...)``:
each replica steps on its own gradients for a period (a window of the engine), then
all replicas average their weights and optimizer state, weighted by the samples each
trained on (post-local SGD; Lin et al. 2020). With the balancer's speed-proportional
split a fast replica trains more samples per period, so nobody waits for a step count.

The fit state machine asks the policy before it commits a window: both policies
commit a window once every replica finished it, in window order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from dataflow.core.errors import ConfigError


@runtime_checkable
class SyncPolicy(Protocol):
    """Decides from the results a window has so far whether it may commit, and declares
    what the driver plans around (read as attributes, never probed): windows of
    ``period_samples`` samples (None: of seconds or steps), a period adapted to the
    measured drift (``max_drift``, None: fixed), sample leases between replicas
    (``leases``), pushes overlapped with the next step (``overlap``), whether an
    epoch's end ends a window (``ends_windows_at_epochs``: the replicas' weights meet
    there, so an evaluation sees one model), and whether the others can finish a
    window in flight without lost replicas (``survives_loss``)."""

    period_samples: int | None
    max_drift: float | None
    leases: bool | None
    overlap: bool
    ends_windows_at_epochs: bool

    def may_commit(self, results: Mapping[int, Any], replicas: int) -> bool: ...

    def survives_loss(self, lost: tuple[int, ...], replicas: int) -> bool: ...


@dataclass(frozen=True)
class Synchronous:
    """Every step's gradients meet in the weighted allreduce: a window commits when all
    ``replicas`` finished it (windows commit in order)."""

    period_samples: ClassVar[int | None] = None
    max_drift: ClassVar[float | None] = None
    leases: ClassVar[bool] = False
    overlap: ClassVar[bool] = False
    ends_windows_at_epochs: ClassVar[bool] = False  # every step is in step already

    def may_commit(self, results: Mapping[int, Any], replicas: int) -> bool:
        return len(results) == replicas

    def survives_loss(self, lost: tuple[int, ...], replicas: int) -> bool:
        """Never: every step's allreduce needs every replica."""
        return False

    def describe(self) -> str:
        return "synchronous: every step's gradients allreduced, weighted by samples"


@dataclass(frozen=True)
class Local:
    """Local updates: each replica trains on its own gradients for one period, then
    all replicas average weights (and, by default, optimizer state) weighted by the
    samples each trained on in it. The period is one window of the engine:
    ``period_steps`` steps, ``period_samples`` samples (whole steps, as many as it
    takes to train that many samples, so a batch that grows averages as often per
    epoch), or ``period_seconds`` of work (the engine fits whole steps into it).
    ``Local(period_steps=1)`` with SGD equals synchronous training
    (tests/test_local_updates.py).

    Steps and samples make the same averages on any machine; seconds make a fast
    machine run more local steps between averages than a slow or loaded one, so
    accuracy then depends on the machine (docs/sync.md, "Choosing the period").

    Communication falls by the steps per period; the price is that replicas drift
    apart inside a period (keep periods short early in training, where gradients are
    large). ``average_optimizer_state=False`` keeps each replica's momentum or Adam
    moments its own (DiLoCo's inner optimizer does).

    ``outer_lr``, ``outer_momentum``, ``nesterov``: an outer optimizer on the averaged
    pseudo-gradient ``Δ = θ_start − average(θ_r)`` (DiLoCo, Douillard et al. 2023: SGD
    with Nesterov momentum, ``outer_lr=0.7, outer_momentum=0.9``): ``u ← μ u + Δ``,
    ``θ ← θ_start − outer_lr (Δ + μ u)`` (without Nesterov ``− outer_lr u``). The
    defaults (1, 0) are the plain average. The outer momentum is kept in the
    optimizer's state (``"outer_momentum"``), so commits and checkpoints hold it.

    The average is made at the fit's parameter store on replica 0's worker (not by an
    allreduce; a spatial layout still allreduces): a replica lost mid-period is
    released, the survivors train again the parts it never handed in and average
    among themselves, so the period is kept (``dataflow/ps/average.py``)."""

    period_seconds: float | None = None
    period_steps: int | None = None
    period_samples: int | None = None
    average_optimizer_state: bool = True
    # None: on with period_seconds (each replica trains what it can in the period; a fast
    # one takes over a slow one's remaining parts), off with period_steps (k steps each)
    leases: bool | None = None
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    # With period_samples: the most the replicas' weights may drift apart between
    # averages (their weighted |θ_r − θ̄|² / |θ̄|² when averaged; None: no limit).
    # Above it the next period is half as long, under a quarter of it twice as long,
    # never longer than period_samples nor shorter than one step.
    max_drift: float | None = None
    overlap: ClassVar[bool] = False
    ends_windows_at_epochs: ClassVar[bool] = True  # the weights are averaged at an epoch's end

    def __post_init__(self) -> None:
        given = [self.period_seconds, self.period_steps, self.period_samples]
        if sum(value is not None for value in given) != 1:
            raise ConfigError(
                "sync.Local: give period_steps (steps between averages, e.g. 8), "
                "period_samples (samples between averages, e.g. 4096) or period_seconds "
                "(wall-clock work between averages, e.g. 2.0), one of them"
            )
        for name in ("period_steps", "period_samples"):
            count = getattr(self, name)
            if count is not None and (
                isinstance(count, bool) or not isinstance(count, int) or count < 1
            ):
                raise ConfigError(f"sync.Local({name}={count!r}): an int >= 1")
        seconds = self.period_seconds
        if seconds is not None and not (
            isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds > 0
        ):
            raise ConfigError(f"sync.Local(period_seconds={seconds!r}): seconds > 0")
        if not (isinstance(self.outer_lr, int | float) and 0 < self.outer_lr <= 10):
            raise ConfigError(
                f"sync.Local(outer_lr={self.outer_lr!r}): in (0, 10]; 1.0 is the plain "
                "average, DiLoCo uses 0.7 with outer_momentum=0.9"
            )
        if not (isinstance(self.outer_momentum, int | float) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"sync.Local(outer_momentum={self.outer_momentum!r}): in [0, 1)")
        drift = self.max_drift
        if drift is not None:
            if isinstance(drift, bool) or not isinstance(drift, int | float) or drift <= 0:
                raise ConfigError(
                    f"sync.Local(max_drift={drift!r}): a relative drift > 0 (e.g. 1e-3), or "
                    "None for periods that never change"
                )
            if self.period_samples is None:
                raise ConfigError(
                    "sync.Local(max_drift=...) adapts a period of samples: give "
                    "period_samples=N (the longest period) with it"
                )
        if self.leases is None:
            object.__setattr__(self, "leases", self.period_seconds is not None)
        if not isinstance(self.leases, bool):
            raise ConfigError(f"sync.Local(leases={self.leases!r}): True or False")

    def next_period(self, current: int, drift: float | None, shortest: int) -> int:
        """The samples of the next period after an average that measured ``drift``:
        halved above ``max_drift``, doubled under a quarter of it, kept in between (and
        without a measurement), within ``[shortest, period_samples]``."""
        longest = self.period_samples or current
        if self.max_drift is None or drift is None:
            return min(current, longest)
        if drift > self.max_drift:
            current //= 2
        elif drift < self.max_drift / 4:
            current *= 2
        return max(min(shortest, longest), min(current, longest))

    @property
    def outer(self) -> bool:
        """Whether an outer optimizer runs (anything but the plain average)."""
        return self.outer_lr != 1.0 or self.outer_momentum != 0.0

    def may_commit(self, results: Mapping[int, Any], replicas: int) -> bool:
        return len(results) == replicas

    def survives_loss(self, lost: tuple[int, ...], replicas: int) -> bool:
        """Whether the other replicas can finish the period in flight without ``lost``:
        the average's store (``dataflow/ps/average.py``) and the sample leases live on
        replica 0's worker, so any loss but replica 0's keeps the period; the survivors
        train the lost replica's parts again and average among themselves."""
        return 0 < len(lost) < replicas and 0 not in lost

    def describe(self) -> str:
        if self.period_steps is not None:
            period = f"{self.period_steps} step(s)"
        elif self.period_samples is not None:
            period = f"{self.period_samples} samples"
        else:
            period = f"{self.period_seconds:g} s of work"
        state = "weights and optimizer state" if self.average_optimizer_state else "weights"
        if self.max_drift is not None:
            period = f"at most {period} (shorter while the drift exceeds {self.max_drift:g})"
        text = f"local updates: {state} averaged every {period}, weighted by samples"
        if self.leases:
            text += "; sample leases (a fast replica takes over a slow one's parts)"
        if self.outer:
            kind = "Nesterov " if self.nesterov and self.outer_momentum else ""
            text += (
                f"; outer {kind}SGD on the pseudo-gradient (lr {self.outer_lr:g}, momentum "
                f"{self.outer_momentum:g})"
            )
        return text


STALENESS_LR = ("relative", "inverse", "none")


@dataclass(frozen=True)
class Async:
    """Asynchronous updates through a parameter store (BPT-CNN's AGWU; Ji et al. 2019).

    The global weights and the optimizer live in ``servers`` shards on the cluster
    (shard ``k`` on replica ``k``'s worker, a contiguous share of the parameters each).
    Every step a replica pushes its local mean gradient, weighted by its share of the
    global batch ``n_r / B``, and pulls the weights the push produced: nobody waits for
    a global barrier. A shard applies the pushes it holds as one update only while no
    replica still computing would fall more than ``staleness`` versions behind, so every
    applied gradient was computed on weights at most ``staleness`` versions old
    (bounded staleness); a replica that would exceed it waits. ``Async(staleness=0)``
    applies each version once every replica pushed: synchronous training.

    ``staleness_lr``: how a stale gradient's step shrinks. ``"relative"`` (default)
    scales it by ``(1 + τ₀) / (1 + τ)`` capped at 1, ``τ₀ = min(staleness, replicas - 1)``
    the staleness of replicas pushing in turn, so on-time pushes keep the fit's LR and
    a straggler's late one counts less; ``"inverse"`` by ``1 / (1 + τ)`` (Zhang et al.
    2016); ``"none"`` not at all. ``delay_compensation=λ > 0``: DC-ASGD (Zheng et al.
    2017), ``g + λ g ⊙ g ⊙ (θ_now − θ_pulled)``. ``lookahead`` (on by default): a replica
    gets the weights extrapolated to where the momentum will have carried them by the
    time its gradient applies, ``θ + Δ Σ_{k=1..τ} μ^k`` (``Δ`` the last version's
    update, ``μ`` SGD's momentum or Adam's β₁, ``τ`` the staleness its last push was
    applied at), so a stale gradient is taken near where it is used (DANA, Hakimi et
    al. 2019): with momentum 0.9 it recovered 1.7-4.6 points of held-out score where
    plain asynchronous updates lost them (docs/sync.md).

    With the ``Throughput`` balancer each replica's batch follows its measured speed,
    so all push at about the same rate and staleness stays low (Ji et al.). With
    ``leases=True`` a replica out of work in a window takes over a slower one's
    remaining parts (``dataflow/runtime/leases.py``): fast replicas train more steps,
    every sample still once per epoch; the price is that the slow replica's pushes
    arrive staler (measured on the digits: about 1 point of accuracy, docs/sync.md).
    ``overlap=True`` sends each push and computes the next step meanwhile, on the
    weights of the reply before (one more version of staleness, counted exactly): the
    push's round trip hides behind compute, as DDP hides its allreduce behind backward.
    A whole step's delay acts as extra momentum: lower the optimizer's (0.9 trained
    badly on the digits, 0.5 well; docs/sync.md).
    Windows are the commit points: at each window's end every replica takes the
    store's weights and optimizer state, so commits, rollbacks and checkpoints work as
    in synchronous training."""

    staleness: int = 1
    servers: int = 1
    staleness_lr: str = "relative"
    delay_compensation: float = 0.0
    leases: bool = False
    overlap: bool = False
    lookahead: bool = True
    period_samples: ClassVar[int | None] = None
    max_drift: ClassVar[float | None] = None
    ends_windows_at_epochs: ClassVar[bool] = True  # the store's weights are pulled there

    def __post_init__(self) -> None:
        for name in ("staleness", "servers"):
            value, least = getattr(self, name), 0 if name == "staleness" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"sync.Async({name}={value!r}): an int >= {least}"
                    + (
                        " (0 is synchronous; 1-4 is usual)"
                        if name == "staleness"
                        else " (parameter-store shards; one per ~16 replicas)"
                    )
                )
        if self.staleness_lr not in STALENESS_LR:
            raise ConfigError(
                f"sync.Async(staleness_lr={self.staleness_lr!r}): one of {STALENESS_LR}"
            )
        if not isinstance(self.leases, bool):
            raise ConfigError(f"sync.Async(leases={self.leases!r}): True or False")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"sync.Async(overlap={self.overlap!r}): True or False")
        if not isinstance(self.lookahead, bool):
            raise ConfigError(f"sync.Async(lookahead={self.lookahead!r}): True or False")
        if self.overlap and self.staleness < 1:
            raise ConfigError(
                "sync.Async(overlap=True, staleness=0): a push overlapped with the next "
                "step's compute is at least 1 version stale; give staleness >= 1"
            )
        lam = self.delay_compensation
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not 0 <= lam <= 10:
            raise ConfigError(
                f"sync.Async(delay_compensation={lam!r}): DC-ASGD's lambda in [0, 10] "
                "(0 turns it off; Zheng et al. use 0.04-2)"
            )

    def lr_factor(self, staleness: int, replicas: int) -> float:
        """How much of its step a gradient ``staleness`` versions old takes."""
        if self.staleness_lr == "none":
            return 1.0
        if self.staleness_lr == "inverse":
            return 1.0 / (1 + staleness)
        usual = min(self.staleness, max(replicas - 1, 0))
        return min(1.0, (1 + usual) / (1 + staleness))

    def may_commit(self, results: Mapping[int, Any], replicas: int) -> bool:
        return len(results) == replicas

    def survives_loss(self, lost: tuple[int, ...], replicas: int) -> bool:
        """Whether the other replicas can finish the window in flight without ``lost``:
        none of them hosted a shard of the store (replica ``k < servers`` hosts shard
        ``k``), so every update they pushed is kept, and only their gradients in
        flight are trained again."""
        hosts = min(self.servers, replicas)
        return 0 < len(lost) < replicas and all(rank >= hosts for rank in lost)

    def describe(self) -> str:
        text = (
            f"asynchronous: a parameter store of {self.servers} shard(s); pushes applied at "
            f"most {self.staleness} version(s) stale, LR scaled '{self.staleness_lr}'"
        )
        if self.delay_compensation:
            text += f", delay compensation {self.delay_compensation:g}"
        if self.leases:
            text += "; sample leases (a fast replica takes over a slow one's parts)"
        if self.overlap:
            text += "; each push overlapped with the next step"
        if self.lookahead:
            text += "; replicas compute on weights extrapolated along the momentum"
        return text
