"""A replica's state, as host copies: the one capture and restore behind commits (the
state at each window's start, for rollbacks after a lost worker), joiners' snapshots,
checkpoints and ``keep_best``; and the digest replicas compare at a phase's end. A
mixin of :class:`~dataflow.runtime.replica.ReplicaRuntime` (its ``spec``, ``context``,
``stages``, ``order``, ``slot`` and the commit bookkeeping its ``__init__`` sets up).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from dataflow.core.rng import capture_rng, restore_rng
from dataflow.core.window import WINDOWS_AHEAD
from dataflow.runtime.host_copies import HostArena, HostCopies, host_copy
from dataflow.runtime.replica_spec import ReplicaState
from dataflow.stages.averaging import averaged_state_dict

# dropped commits' buffers kept for reuse: the one dropped a window ago serves the next
# commit, so a replica holds three states' bytes (two live commits, one spare)
SPARE_ARENAS = 1


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(saved)``, but each param group keeps the live
    optimizer's options (weight decay, momentum, betas, ...) other than the LR.

    The live optimizer was built by the fit's factory: within a fit the engine changes
    only the LR (which comes from ``saved``, as the schedule left it), so a rollback or
    a joiner loads the same options either way; a fit resumed with an edited factory
    (another weight decay, or ``SGD`` -> ``FusedLARS``, whose state has torch's names)
    trains with what the factory now says, not silently with the checkpoint's."""
    kept = [
        {k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups
    ]
    optimizer.load_state_dict(saved)
    for group, options in zip(optimizer.param_groups, kept, strict=True):
        group.update(options)


class StateSide:
    """The replica's state captured and restored."""

    spec: Any
    context: Any
    stages: Any
    order: Any
    slot: int
    commits: dict[int, ReplicaState]
    commit_arenas: dict[int, HostArena]
    spare_arenas: list[HostArena]
    completed_step: int | None
    in_window: bool
    rollbacks: int

    def capture(
        self,
        *,
        model: bool = False,
        optimizer: bool = False,
        stages: bool = False,
        rng: bool = False,
        buffers: bool = False,
        settled: bool = True,
        arena: HostArena | None = None,
    ) -> ReplicaState:
        """The parts of this replica's state asked for, as host copies: the one capture
        behind commits, rollbacks, joiners' snapshots and checkpoints. The device's
        tensors are copied without a sync per tensor (into ``arena``, if given); unless
        ``settled``, the state is returned before the copies end (a commit: ``restore``
        settles it)."""
        ctx, state, copies = self.context, ReplicaState(), HostCopies(arena)
        if model and ctx.model is not None:
            state.model = host_copy(ctx.model.state_dict(), copies)
            if ctx.loss_scale is not None:  # fp16: the scale goes with the weights
                state.loss_scale = ctx.loss_scale.state_dict()
        if optimizer and ctx.optimizer is not None:
            state.optimizer = host_copy(ctx.optimizer.state_dict(), copies)
        if stages:
            state.stages = {name: self.stages[name].phase_state() for name in self.order}
        if rng:
            state.rng = capture_rng()
            dropout = getattr(ctx.model, "dropout_generator", None)  # a spatial group's
            if dropout is not None:
                state.rng["spatial_dropout"] = dropout.get_state()
        if buffers and ctx.model is not None:
            state.buffers = host_copy(dict(ctx.model.named_buffers()), copies)
        state.pending = copies.done()
        return state.settle() if settled else state

    def restore(self, state: ReplicaState) -> None:
        """Take the parts ``state`` holds: the one restore behind rollbacks, joiners and
        resumes. ``state`` is not changed (the optimizer gets a copy, so a commit can be
        rolled back to again)."""
        ctx = self.context
        state.settle()  # a commit's copies may still run
        if state.model is not None and ctx.model is not None:
            ctx.model.load_state_dict(state.model)
        if state.loss_scale is not None and ctx.loss_scale is not None:
            ctx.loss_scale.load_state_dict(state.loss_scale)
        if state.optimizer is not None and ctx.optimizer is not None:
            load_optimizer_state(ctx.optimizer, host_copy(state.optimizer))
        for name, settings in (state.stages or {}).items():
            if settings is not None and name in self.stages:
                self.stages[name].load_phase_state(settings)
        if state.buffers and ctx.model is not None:
            named = dict(ctx.model.named_buffers())
            with torch.no_grad():
                for name, value in state.buffers.items():
                    named[name].copy_(value)
        if state.rng is not None:
            restore_rng(state.rng)
            dropout = getattr(ctx.model, "dropout_generator", None)
            if dropout is not None and state.rng.get("spatial_dropout") is not None:
                dropout.set_state(state.rng["spatial_dropout"])

    def commit(self, step: int, keep: int = WINDOWS_AHEAD) -> None:
        """Keep the state before ``step`` (weights, optimizer, random state) in host
        memory; the last ``keep`` of them. A peer may die holding the results of every
        window it finished that the driver did not yet receive; the driver queues at
        most ``WINDOWS_AHEAD`` windows past its commit, so its commit is among them."""
        # not settled: the copies run on the device's stream while the window trains
        arena = self._spare_arena()
        state = self.capture(model=True, optimizer=True, rng=True, settled=False, arena=arena)
        arena.pending = state.pending
        if step in self.commits:  # committed again at this step (after a rollback)
            self._drop_commit(step)
        self.commits[step], self.commit_arenas[step] = state, arena
        for old in sorted(self.commits)[:-keep]:
            self._drop_commit(old)
        del self.spare_arenas[SPARE_ARENAS:]

    def _drop_commit(self, step: int) -> None:
        del self.commits[step]
        self.spare_arenas.append(self.commit_arenas.pop(step))

    def _spare_arena(self) -> HostArena:
        """A dropped commit's buffers whose copies have ended, emptied; else new ones."""
        for i, arena in enumerate(self.spare_arenas):
            if arena.ready():
                del self.spare_arenas[i]
                arena.reset()
                return arena
        return HostArena()

    def checkpoint_state(self) -> ReplicaState:
        """What a checkpoint needs of this replica: its random state and its buffers
        (BatchNorm statistics drift apart between replicas until the phase ends); rank 0
        adds the weights, optimizer state and stage settings, which every replica shares
        (its first worker in a spatial layout: slot 0 of the fit's workers)."""
        leader = self.slot == 0
        return self.capture(model=leader, optimizer=leader, stages=leader, rng=True, buffers=True)

    def weights_state(self) -> ReplicaState:
        """What ``keep_best`` needs of this replica at an epoch's end: its buffers (the
        kept weights hold their mean over the replicas, as a phase end does), and on
        rank 0 the weights (``keep_average``: their moving average, an ``eval_ema_``
        metric watched)."""
        state = self.capture(model=self.slot == 0, buffers=True)
        if state.model is not None and self.spec.keep_average:
            state.model = self.averaged_state_dict()
        return state

    def snapshot(self) -> ReplicaState:
        """What a replica joining the fit takes from rank 0."""
        return self.capture(model=True, optimizer=True, stages=True)

    def rollback(self, step: int) -> None:
        """Return to the state before ``step``: the last commit all replicas share."""
        self.rollbacks += 1  # on every replica, alike: a replayed window's leases are new
        if self.context.parameter_store is not None:
            self.context.parameter_store.rolled_back()
        if not self.in_window and self.completed_step in (step, None):
            # finished exactly there, or ran no window since it was built or restored
            # (its state is where the driver started it): the state is the commit
            return
        if step not in self.commits:
            raise RuntimeError(
                f"replica {self.context.rank} cannot roll back to step {step}: it holds "
                f"commits {sorted(self.commits)} and finished step "
                f"{self.completed_step}"
            )
        self.restore(self.commits[step])
        # The aborted step may have left local gradients behind: the replay must not add
        # to them (Backward accumulates).
        if self.context.optimizer is not None:
            self.context.optimizer.zero_grad()
        elif self.context.model is not None:
            self.context.model.zero_grad()
        self.in_window, self.completed_step = False, step

    def weights_digest(self) -> str:
        """A hash of the parameters, buffers and moving average (``ema_decay``: it never
        feeds back into the weights, so only this sees it go astray): replicas agree."""
        digest = hashlib.blake2b(digest_size=16)
        model = self.context.model
        if model is not None:
            averaged = averaged_state_dict(model, self.context.optimizer) or {}
            for t in (*model.state_dict().values(), *averaged.values()):
                digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        return digest.hexdigest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.context.model.state_dict().items()}

    def averaged_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights' moving average as a state dict (``ema_decay``), or None."""
        return averaged_state_dict(self.context.model, self.context.optimizer)
