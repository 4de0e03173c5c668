"""Unroll a phase over replicas and steps, and fuse steps into windows.

Pure data and pure functions: no Dask, no torch. A Dask task costs about a
millisecond of scheduler time (more on a loaded scheduler), so one task per stage
per step would drown a fast step in overhead. Each replica's consecutive steps are
fused into a *window* that carries at least ``window_seconds`` of work; all
replicas share the same window boundaries, because the steps inside a window
meet in collectives.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dataflow.core.errors import BatchSizeError, ConfigError
from dataflow.core.phase import PhaseSpec
from dataflow.core.step import StepSpec
from dataflow.io.sampler import steps_per_epoch


def phase_steps(
    *,
    num_samples: int,
    phase: PhaseSpec,
    split: Callable[[int], tuple[int, ...]],
    drop_last: bool = False,
    first_index: int = 0,
    micro_batches: Callable[[tuple[int, ...], int], tuple[int, ...]] | None = None,
    lr_decay: Callable[[float], float] | None = None,
) -> tuple[StepSpec, ...]:
    """Every global step of ``phase``: its epoch, its slice of the epoch order, its split,
    (``micro_batches`` given) each replica's number of accumulation micro-batches, and
    (``lr_decay`` given) the factor on its LR at its progress in epochs."""
    if phase.global_batch > num_samples:
        raise BatchSizeError(
            f"global batch size {phase.global_batch} (phase {phase.index}) is larger than the "
            f"dataset ({num_samples} samples); use a batch size <= {num_samples}"
        )
    steps: list[StepSpec] = []
    n_steps = steps_per_epoch(num_samples, phase.global_batch, drop_last=drop_last)
    for epoch in range(phase.start_epoch, phase.end_epoch):
        for s in range(n_steps):
            start = s * phase.global_batch
            size = min(phase.global_batch, num_samples - start)
            local = tuple(split(size))
            if sum(local) != size:
                raise ConfigError(f"the balancer split {size} samples into {local}")
            steps.append(
                StepSpec(
                    index=first_index + len(steps),
                    epoch=epoch,
                    step_in_epoch=s,
                    start=start,
                    global_batch=size,
                    local_batches=local,
                    last_in_epoch=s == n_steps - 1,
                    micro_batches=()
                    if micro_batches is None
                    else tuple(micro_batches(local, first_index + len(steps))),
                    lr_decay=None if lr_decay is None else lr_decay(epoch + start / num_samples),
                )
            )
    return tuple(steps)


def resplit_steps(
    steps: tuple[StepSpec, ...],
    commit: int,
    split: Callable[[int], tuple[int, ...]] | None,
    micro_batches: Callable[[tuple[int, ...], int], tuple[int, ...]] | None = None,
) -> tuple[StepSpec, ...]:
    """The steps of ``steps`` from index ``commit`` on, split anew (other replicas).

    Used when workers are lost mid-phase: the steps before ``commit`` were trained
    and stay; the rest keep their global batches and get a new split. The epoch in
    progress records how far each replica had read under the old split
    (``StepSpec.earlier_splits``), so the new split reads exactly the samples the
    epoch has not trained on yet, and later epochs are sharded as usual.

    ``split=None`` keeps every step's split and micro-batches (a fit resumed from a
    mid-phase checkpoint on as many replicas): each replica then reads exactly what
    it would have read without the interruption.
    """
    rest = [spec for spec in steps if spec.index >= commit]
    if not rest:
        return ()
    current = (rest[0].epoch, rest[0].earlier_splits)
    segment = [s for s in steps if (s.epoch, s.earlier_splits) == current]
    width = len(segment[0].local_batches)
    given = tuple(sum(s.local_batches[r] for s in segment) for r in range(width))
    consumed = tuple(
        sum(s.local_batches[r] for s in segment if s.index < commit) for r in range(width)
    )
    out = []
    for spec in rest:
        earlier = spec.earlier_splits
        if (spec.epoch, earlier) == current and any(consumed):
            earlier = (*earlier, (given, consumed))
        if split is None:
            out.append(dataclasses.replace(spec, earlier_splits=earlier))
            continue
        local = tuple(split(spec.global_batch))
        if sum(local) != spec.global_batch:
            raise ConfigError(f"the balancer split {spec.global_batch} samples into {local}")
        out.append(
            dataclasses.replace(
                spec,
                local_batches=local,
                micro_batches=()
                if micro_batches is None
                else tuple(micro_batches(local, spec.index)),
                earlier_splits=earlier,
            )
        )
    return tuple(out)


def checkpoint_windows(
    plan: Plan, every: int, countdown: int, phase_stop: int
) -> tuple[frozenset[int], int]:
    """The windows of ``plan`` after which a mid-phase checkpoint is written: every
    ``every``-th one, the first after ``countdown`` windows, but never a window that
    ends the phase (the phase boundary writes its own). Returns the windows' indices
    and the countdown left for the next plan of the phase."""
    marked = []
    for window in plan.windows:
        countdown -= 1
        ends_phase = plan.steps[window.stop - 1].index + 1 >= phase_stop
        if countdown <= 0 and not ends_phase:
            marked.append(window.index)
            countdown = every
    return frozenset(marked), max(countdown, 1)


def steps_per_window(step_seconds: float | None, window_seconds: float, max_steps: int) -> int:
    """Steps a window needs to carry ``window_seconds`` of work (1 while unmeasured)."""
    if step_seconds is None or step_seconds <= 0:
        return 1
    return max(1, min(max_steps, math.ceil(window_seconds / step_seconds)))


@dataclass(frozen=True)
class Window:
    """Steps ``[first, stop)`` (positions in ``Plan.steps``) run as one task per replica."""

    index: int
    first: int
    stop: int

    @property
    def n_steps(self) -> int:
        return self.stop - self.first


@dataclass(frozen=True)
class TaskSpec:
    """One Dask task: a window on a replica (the executor queues each replica's tasks in
    window order, each behind the one before)."""

    key: str
    replica: int
    window: Window


@dataclass(frozen=True)
class Plan:
    """A phase unrolled: ``replicas`` x ``steps``, fused into ``windows``."""

    stage_names: tuple[str, ...]
    phase: PhaseSpec
    replicas: int
    steps: tuple[StepSpec, ...]
    windows: tuple[Window, ...]
    tag: str = "plan"
    run: str = ""  # the fit's id: task keys must not collide with another fit's
    layout: str = ""  # how workers form replicas (Layout.describe()); "" = one each
    sync: str = ""  # how replicas keep in step (SyncPolicy.describe()); "" = synchronous

    @classmethod
    def build(
        cls,
        stage_names: tuple[str, ...],
        phase: PhaseSpec,
        steps: tuple[StepSpec, ...],
        replicas: int,
        *,
        step_seconds: float | None = None,
        window_seconds: float = 1.0,
        max_window_steps: int = 10_000,
        window_steps: int | None = None,
        window_samples: int | None = None,
        epoch_ends_window: bool = False,
        max_windows: int | None = None,
        tag: str = "plan",
        run: str = "",
        layout: str = "",
        sync: str = "",
    ) -> Plan:
        """``window_steps`` fixes the steps per window; ``window_samples`` ends a window
        at the first step that brings its samples (global batches) to that many;
        otherwise windows carry about ``window_seconds`` of ``step_seconds`` steps (the
        two counts make the same windows on any machine). ``epoch_ends_window``: a window
        also ends at each epoch's last step (local updates average there, so the
        epoch's evaluation sees the averaged weights). ``max_windows``: plan only the
        first so many windows (the plan's steps end with them)."""
        if replicas < 1:
            raise ConfigError(f"Plan: replicas must be >= 1, got {replicas}")
        if not window_seconds > 0:
            raise ConfigError(f"Plan: window_seconds must be > 0, got {window_seconds}")
        for spec in steps:
            if len(spec.local_batches) != replicas:
                raise ConfigError(
                    f"Plan: step {spec.index} is split over {len(spec.local_batches)} replicas, "
                    f"the plan has {replicas}"
                )
        size = window_steps or steps_per_window(step_seconds, window_seconds, max_window_steps)
        bounds, first, samples = [], 0, 0
        for position, spec in enumerate(steps):
            samples += spec.global_batch
            full = samples >= window_samples if window_samples else position + 1 - first >= size
            if full or position == len(steps) - 1 or (epoch_ends_window and spec.last_in_epoch):
                bounds.append((first, position + 1))
                first, samples = position + 1, 0
                if max_windows is not None and len(bounds) == max_windows:
                    steps = steps[: position + 1]
                    break
        windows = tuple(Window(index=i, first=a, stop=b) for i, (a, b) in enumerate(bounds))
        return cls(
            tuple(stage_names), phase, replicas, tuple(steps), windows, tag, run, layout, sync
        )

    def task_prefix(self, replica: int) -> str:
        """What the Dask dashboard groups by: the stages and the replica."""
        return f"{'+'.join(self.stage_names)}@replica{replica}"

    def task_key(self, replica: int, window: Window) -> str:
        run = f"-{self.run}" if self.run else ""
        return f"{self.task_prefix(replica)}-{self.tag}{run}-p{self.phase.index}w{window.index}"

    def tasks(self, windows: Sequence[Window] | None = None) -> list[TaskSpec]:
        """Each replica's tasks of ``windows`` (default: every window), in window order."""
        out = []
        for r in range(self.replicas):
            for window in self.windows if windows is None else windows:
                out.append(TaskSpec(key=self.task_key(r, window), replica=r, window=window))
        return out

    def __str__(self) -> str:
        sizes = sorted({w.n_steps for w in self.windows})
        splits = list(dict.fromkeys(s.local_batches for s in self.steps))  # in step order
        name = "Plan" if self.tag == "plan" else f"Plan ({self.tag})"
        start, end = self.phase.start_epoch, self.phase.end_epoch - 1
        epochs = f"epoch {start}" if start == end else f"epochs {start}-{end}"
        head = (
            f"{name}, phase {self.phase.index}: {epochs}, global batch "
            f"{self.phase.global_batch}, {self.replicas} replica(s), {len(self.steps)} steps, "
            f"{len(self.windows)} window(s) of {sizes} steps, "
            f"{len(self.windows) * self.replicas} tasks"
        )
        lines = [head, f"  stages per step: {' -> '.join(self.stage_names)}"]
        if self.layout:
            lines.append(f"  layout: {self.layout}")
        if self.sync:
            lines.append(f"  sync: {self.sync}")
        more = f" and {len(splits) - 4} more" if len(splits) > 4 else ""
        lines.append(f"  local batches per replica: {', '.join(map(str, splits[:4]))}{more}")
        micro = list(dict.fromkeys(s.micro_batches for s in self.steps if s.micro_batches))
        if any(n > 1 for counts in micro for n in counts):  # accumulating: in how many
            more = f" and {len(micro) - 4} more" if len(micro) > 4 else ""
            lines.append(f"  micro-batches per replica: {', '.join(map(str, micro[:4]))}{more}")
        for window in self.windows[:3]:
            first, last = self.steps[window.first], self.steps[window.stop - 1]
            lines.append(
                f"  window {window.index}: steps {first.index}-{last.index} "
                f"(epoch {first.epoch} step {first.step_in_epoch} .. "
                f"epoch {last.epoch} step {last.step_in_epoch})"
            )
        if len(self.windows) > 3:
            lines.append(f"  ... {len(self.windows) - 3} more windows")
        return "\n".join(lines)

    def to_dot(self, max_windows: int = 6) -> str:
        """Graphviz source: one row per replica, windows chained, collectives dashed."""
        windows = self.windows[:max_windows]
        lines = ["digraph plan {", "  rankdir=LR;", "  node [shape=box];"]
        for r in range(self.replicas):
            lines.append(f'  subgraph "cluster_r{r}" {{ label="replica {r}";')
            for w in windows:
                first, last = self.steps[w.first].index, self.steps[w.stop - 1].index
                lines.append(f'    "r{r}w{w.index}" [label="steps {first}-{last}"];')
            lines.append("  }")
            for a, b in itertools.pairwise(windows):
                lines.append(f'  "r{r}w{a.index}" -> "r{r}w{b.index}";')
        for w in windows:
            for r in range(1, self.replicas):
                lines.append(
                    f'  "r0w{w.index}" -> "r{r}w{w.index}" '
                    '[style=dashed, dir=both, label="allreduce"];'
                )
        lines.append("}")
        return "\n".join(lines)


def phase_line(phase: Any, steps: tuple, todo: tuple, config: Any) -> str:
    """The console's line for a phase as a fit begins it: ``Plan, phase 0: epochs 0-2,
    global batch 64, 2 replica(s), 120 steps in windows of about 1 s (after 2 one-step
    calibration windows)`` (one epoch: ``epoch 0``); a resumed phase says where it goes
    on from."""
    replicas = len(todo[0].local_batches)
    done = todo[0].index - steps[0].index
    resumed = f" (resumed at step {todo[0].index}: {done} done)" if done else ""
    window_samples = config.sync.period_samples
    if config.window_steps:
        windows = f"windows of {config.window_steps} step(s)"
    elif window_samples and config.sync.max_drift is not None:
        windows = (
            f"windows of at most {window_samples} samples, halved while the replicas drift "
            f"apart more than {config.sync.max_drift:g} (local updates average at each end)"
        )
    elif window_samples:
        windows = f"windows of {window_samples} samples (local updates average at each end)"
    else:
        windows = (
            f"windows of about {config.window_seconds:.3g} s (after "
            f"{config.calibration_steps} one-step calibration windows)"
        )
    start, end = phase.start_epoch, phase.end_epoch - 1
    epochs = f"epoch {start}" if start == end else f"epochs {start}-{end}"
    return (
        f"Plan, phase {phase.index}: {epochs}, global batch {phase.global_batch}, "
        f"{replicas} replica(s), {len(steps)} steps{resumed} in {windows}"
    )


class Plans(list):
    """The phase plans of a fit (``Trainer.plan``): a list that shows as the plans'
    summaries, so ``pipe.plan(...)`` at a prompt or in a notebook reads as ``print``
    does (each plan keeps its full dataclass ``repr``)."""

    def __str__(self) -> str:
        return "\n".join(str(plan) for plan in self)

    __repr__ = __str__
