"""What runs on top of the library: benchmarks, the training job and its models,
the trace timeline, the planner and ``info``. The CLI (``mpiring.cli``) calls these."""
