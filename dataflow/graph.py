"""The per-replica step template: stages and the edges between them.

A graph is built once on the driver, validated once (cycles, dangling inputs, a
Forward with no Backward, an Update with no AllReduce upstream when there is more
than one replica), then unrolled over replicas and steps by :mod:`dataflow.planning.plan`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

from dataflow.core.errors import GraphError
from dataflow.core.protocols import Stage
from dataflow.stages import AllReduce, Backward, Forward, Update


@dataclass(frozen=True)
class Node:
    """A handle to a stage in a graph, returned by :meth:`Graph.add` to wire inputs."""

    name: str

    def __str__(self) -> str:
        return self.name


class Graph:
    """Stages with their inputs. ``add`` returns a :class:`Node` to use as an input."""

    def __init__(self) -> None:
        self._stages: dict[str, Stage] = {}
        self._inputs: dict[str, tuple[str, ...]] = {}

    # -- building ---------------------------------------------------------------
    def add(self, stage: Stage, *inputs: Node | str) -> Node:
        """Add ``stage`` fed by ``inputs`` (nodes, or names of stages added later)."""
        if not isinstance(stage, Stage):
            raise GraphError(
                f"Graph.add: expected a dataflow stage, got {type(stage).__name__}; "
                "subclass dataflow.stages.Stage for a custom stage"
            )
        if any(stage is existing for existing in self._stages.values()):
            raise GraphError(f"Graph.add: stage {stage.name!r} was already added to this graph")
        stage.name = self._unique_name(stage.name)
        names = []
        for item in inputs:
            if isinstance(item, Node | str):
                names.append(str(item))
            else:
                raise GraphError(
                    f"Graph.add({stage.name!r}): an input must be the Node returned by "
                    f"Graph.add or a stage name, got {type(item).__name__}"
                )
        self._stages[stage.name] = stage
        self._inputs[stage.name] = tuple(names)
        return Node(stage.name)

    def _unique_name(self, name: str) -> str:
        if name not in self._stages:
            return name
        suffix = 2
        while f"{name}{suffix}" in self._stages:
            suffix += 1
        return f"{name}{suffix}"

    def shallow_copy(self) -> Graph:
        """The same wiring with shallow copies of the stages (shared configs and sources)."""
        other = Graph()
        other._stages = {name: copy.copy(stage) for name, stage in self._stages.items()}
        other._inputs = dict(self._inputs)
        return other

    # -- reading ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._stages)

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._stages.values())

    def __getitem__(self, name: str) -> Stage:
        return self._stages[name]

    def __contains__(self, name: object) -> bool:
        """Whether a stage of that name is in the graph."""
        return name in self._stages

    def inputs_of(self, name: str) -> tuple[str, ...]:
        return self._inputs[name]

    def _downstream(self, name: str) -> set[str]:
        seen: set[str] = set()
        frontier = [name]
        while frontier:
            current = frontier.pop()
            for other, inputs in self._inputs.items():
                if current in inputs and other not in seen:
                    seen.add(other)
                    frontier.append(other)
        return seen

    def _upstream(self, name: str) -> set[str]:
        seen: set[str] = set()
        frontier = [name]
        while frontier:
            for parent in self._inputs.get(frontier.pop(), ()):
                if parent not in seen and parent in self._stages:
                    seen.add(parent)
                    frontier.append(parent)
        return seen

    # -- validation ---------------------------------------------------------------
    def validate(self, *, replicas: int = 1) -> tuple[str, ...]:
        """Check the graph for ``replicas`` replicas; return stage names in run order."""
        if not self._stages:
            raise GraphError("Graph is empty: add a Load, Forward, Backward and Update stage")
        for name, inputs in self._inputs.items():
            for parent in inputs:
                if parent not in self._stages:
                    known = ", ".join(sorted(self._stages))
                    raise GraphError(
                        f"stage {name!r} has input {parent!r}, which is not a stage of this "
                        f"graph (stages: {known}); add {parent!r} or fix the input name"
                    )
        order = self._topological_order()
        kinds = {name: stage for name, stage in self._stages.items()}
        for name, stage in kinds.items():
            if isinstance(stage, Forward) and not any(
                isinstance(kinds[d], Backward) for d in self._downstream(name)
            ):
                raise GraphError(
                    f"Forward stage {name!r} has no Backward stage downstream; add "
                    f"g.add(stages.Backward(), <{name} node>) (use Evaluate for inference only)"
                )
            if isinstance(stage, Backward) and not any(
                isinstance(kinds[u], Forward) for u in self._upstream(name)
            ):
                raise GraphError(f"Backward stage {name!r} has no Forward stage upstream")
            if (
                replicas > 1
                and isinstance(stage, Update)
                and not any(isinstance(kinds[u], AllReduce) for u in self._upstream(name))
            ):
                raise GraphError(
                    f"Update stage {name!r} has no AllReduce stage upstream, so with "
                    f"{replicas} replicas their weights would drift apart; add "
                    "stages.AllReduce() between Backward and Update"
                )
        return order

    def capture_blocker(self) -> str | None:
        """Why this graph's steps cannot be captured as CUDA graphs (``capture=True``),
        or None. A captured step computes Forward's loss and the gradients in one
        replay, so each Forward's only consumer must be a plain Backward: a stage between
        them (one that changes the loss) would be skipped, and a stage reading Forward's
        output would see the graph's buffers, overwritten at the next replay."""
        for name, stage in self._stages.items():
            if not isinstance(stage, Forward):
                continue
            if type(stage) is not Forward:
                return (
                    f"Forward stage {name!r} is a {type(stage).__name__}, whose run the "
                    "captured step would bypass"
                )
            readers = [other for other, inputs in self._inputs.items() if name in inputs]
            plain = [r for r in readers if type(self._stages[r]) is Backward]
            if len(readers) != 1 or len(plain) != 1:
                others = ", ".join(repr(r) for r in readers if r not in plain) or "none"
                return (
                    f"Forward stage {name!r} feeds {len(readers)} stage(s) (besides a plain "
                    f"Backward: {others}); a captured step hands its loss only to one "
                    "stages.Backward()"
                )
        return None

    def _topological_order(self) -> tuple[str, ...]:
        pending = {name: set(inputs) for name, inputs in self._inputs.items()}
        order: list[str] = []
        while pending:
            ready = [name for name, deps in pending.items() if not deps]  # insertion order
            if not ready:
                cycle = ", ".join(sorted(pending))
                raise GraphError(
                    f"the graph has a cycle through stages {cycle}; a step's stages must "
                    "form a DAG (state carried across steps lives on the replica)"
                )
            for name in ready:
                order.append(name)
                del pending[name]
            for deps in pending.values():
                deps.difference_update(ready)
        return tuple(order)

    def to_dot(self) -> str:
        """Graphviz source of the template (``dot -Tpng``)."""
        lines = ["digraph dataflow {", "  rankdir=LR;", "  node [shape=box];"]
        for name, stage in self._stages.items():
            lines.append(f'  "{name}" [label="{name}\\n{type(stage).__name__}"];')
        for name, inputs in self._inputs.items():
            lines.extend(f'  "{parent}" -> "{name}";' for parent in inputs)
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        edges = "; ".join(
            f"{', '.join(inputs) or '∅'} -> {name}" for name, inputs in self._inputs.items()
        )
        return f"Graph({edges})"
