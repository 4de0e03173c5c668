"""What a fit runs before it runs: the plan of a phase unrolled over replicas and steps
and fused into windows (:mod:`~dataflow.planning.plan`), how the workers form replicas
(:mod:`~dataflow.planning.layout`) and which layout a fit chooses
(:mod:`~dataflow.planning.layout_choice`)."""
