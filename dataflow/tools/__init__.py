"""What a user runs around a fit: the ``dataflow`` command line (:mod:`~dataflow.tools.cli`)
with its ``demo``, ``convert`` and ``info`` commands, and the small datasets the examples
and benchmarks make on the spot (:mod:`~dataflow.tools.datasets`)."""
