"""``train --metrics FILE``: one JSON line per step, so that runs can be compared line by line.

    {"step": 3, "loss": 5.3966, "tokens": 1024, "ms": 41.2}

``loss`` is the global mean loss of the step (the mean over the data-parallel
replicas of the last pipeline stage: what a one-rank run on the global batch
reports), ``tokens`` the step's global tokens, ``ms`` the step's time on the
writing rank. Rank 0 writes; every rank takes part in the loss's reduction.
"""

from __future__ import annotations

import json

from mpiring.backends import control as wire


class MetricsWriteError(OSError):
    """Rank 0 could not open the metrics file (raised on every rank)."""


class MetricsWriter:
    """A ``train()`` callback that appends one JSON line per step to ``path`` (rank 0).

    Args:
        path: the file (truncated at the start of the run, or appended to on a resume).
        tokens_per_step: global tokens per step.
    """

    def __init__(self, path: str, tokens_per_step: int):
        self.path, self.tokens = path, int(tokens_per_step)
        self._fh = None

    def on_start(self, job) -> None:
        error = None
        if job.comm.rank == 0:
            # A resumed run continues the file the interrupted one wrote.
            try:
                self._fh = open(self.path, "a" if job.step else "w", encoding="utf-8")  # noqa: SIM115
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Every rank must hear of it: the others would wait in the first step's reduction.
        if job.comm.size > 1:
            error = wire.bcast_json(job.comm, error, root=0)
        if error is not None:
            raise MetricsWriteError(f"--metrics {self.path} could not be opened on rank 0: "
                                    f"{error}; give a writable file")

    def on_step_end(self, job) -> None:
        loss = job.global_mean(job.losses[-1:])[0]  # collective: every rank calls it
        if self._fh is not None:
            row = {"step": job.step, "loss": loss, "tokens": self.tokens,
                   "ms": round(job.step_times[-1] * 1e3, 3)}
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()
            if job.step == job.cfg.steps:
                self._fh.close()
                self._fh = None
