"""Benchmarks: an nccl-tests-style sweep, the cost model against measurement, PS vs AllReduce.

* ``sweep``: every collective and algorithm over a range of sizes, checked and
  timed on the same buffers (``python -m mpiring bench``).
* ``measure``: timing helpers, ping-pong and ring-exchange fits of the
  alpha-beta model, single-core memory bandwidth.
* ``gloo``: torch.distributed's gloo backend started from the MPI ranks.
* ``ps``: parameter server vs ring AllReduce, traffic counted from the trace.
* ``report``: the tables, JSON rows, progress bar and plots (pure).
"""
