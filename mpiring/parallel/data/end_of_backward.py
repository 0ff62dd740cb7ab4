"""The end of a synced backward: wait for the buckets, check the status tail, trace.

Queued with ``queue_callback`` so it runs when autograd finishes: it waits for
every bucket's AllReduce, copies the means back to ``.grad`` (unless they are
views of the buckets), reads the status tail every rank received with the last
bucket, and raises the same error on every rank when some rank missed a
gradient or reported one twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpiring.parallel.data.eager import outside_compile
from mpiring.runtime.trace import clock

_OK = 0
_MISSING = 1   # a parameter got no gradient and find_unused_parameters is off
_TWICE = 2     # a parameter reported a gradient after it was already reduced or marked unused
_CODES = 4     # error codes are bits below this; the step count is carried above them
#: The step count in the status tail is taken modulo this: code + 4 * (step + 1)
#: stays an exact integer in bfloat16 (below 256).
STEP_MOD = 32


class EndOfBackward:
    """The reducer's end-of-backward methods (a mixin of ``Reducer``)."""

    def _finalize(self) -> None:
        t_end_backward = clock()
        missing = [i for i in range(len(self.params)) if not self._ready[i]]
        # static_graph: the first synced backward finds the unused set (torch does
        # the same in its iteration 0), so a gap there is not an error.
        learning = self.static_graph and self._static_unused is None
        if missing and not (self.find_unused_parameters or learning):
            # Still launch every bucket (zeros in the holes): the other ranks may
            # already be inside these AllReduces, and only the status tail tells
            # them to raise instead of waiting for us forever.
            self._error_code = max(self._error_code, _MISSING)
        for i in missing:
            self._mark_ready(i, zero=True)
        self._launch_ready_buckets()
        t_wait = clock()
        try:
            self._thread.wait()
        finally:
            self._started = False
            self._expect = False
        t_done = clock()
        self._exposed_s = t_done - t_wait
        last = self.buckets[-1]
        status = last.flat[last.tail:]
        status = (status.real if status.is_complex() else status).to(device="cpu",
                                                                    dtype=torch.float64)
        slots = [int(round(v)) for v in status[:self.size].tolist()]
        codes = [v % _CODES for v in slots]
        steps = [v // _CODES for v in slots]
        no_grad = [int(round(v)) for v in status[self.size:].tolist()]
        self._write_trace(t_end_backward, t_wait, t_done)
        self._synced_forward = True
        self._lost = self._local = 0
        if len(set(steps)) > 1:
            self._raise_steps(steps)
        if any(codes):
            self._raise_status(codes, no_grad)
        if self._error_code & ~self._sent_code:
            # Recorded after the status tail went out (a gradient that came after its
            # bucket was reduced): no other rank can know, so this one raises alone
            # rather than step on a gradient that was never averaged.
            self._raise_status([self._error_code if r == self.rank else 0
                                for r in range(self.size)], no_grad)
        if self.find_unused_parameters or learning:
            self._finish_unused(no_grad)
        if learning:
            self._static_unused = [i for i, c in enumerate(no_grad) if c >= self.size]
        if self.iteration == 0 and not self.rebuilt and not self.find_unused_parameters:
            # torch DDP rebuilds only with a static set of used parameters.
            self._rebuild_due = True
        self.iteration += 1

    @outside_compile
    def shadow_backward(self) -> None:
        """Take part in one synced backward with zero gradients (collective).

        A rank that has run out of inputs under ``DDP.join()`` calls this for
        each backward the other ranks still run: the same buckets go out in the
        same order, so their AllReduces complete, and this rank's share of the
        mean is zero. No parameter is marked fired, so the status tail reports
        every one as unused here and no error is raised on its account.
        """
        if self._started:
            raise RuntimeError("shadow_backward: a backward is still reducing on this rank")
        self._reset_iteration()
        self._expect = True
        self._started = True
        self._t_backward = clock()
        for i in range(len(self.params)):
            self._mark_ready(i, zero=True)
        self._finalize()

    def _finish_unused(self, no_grad: list[int]) -> None:
        # A parameter that got no gradient here but did on another rank takes the
        # mean (our zeros included); one unused on every rank keeps its .grad
        # untouched, as in torch DDP.
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if self._fired[i] or no_grad[i] >= self.size:
                    continue
                view = self._view(i)
                if self.gradient_as_bucket_view:
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def _raise_steps(self, steps: list[int]) -> None:
        # Every rank read the same tail: all raise, before any optimizer step.
        counts = " ".join(f"r{r}={s - 1}" for r, s in enumerate(steps))
        raise RuntimeError(
            "DistributedDataParallel: the ranks reduced gradients of different steps "
            f"(synced backward count mod {STEP_MOD}: {counts}): a rank's backward "
            "failed and the exception was caught, or a rank ran a step under no_sync() or "
            "skipped one alone. The gradients are mixed; stop training (restart from a "
            "checkpoint), and let a failed backward end the job")

    def _raise_status(self, codes: list[int], no_grad: list[int]) -> None:
        missing_ranks = [r for r, c in enumerate(codes) if c & _MISSING]
        twice_ranks = [r for r, c in enumerate(codes) if c & _TWICE]
        if missing_ranks:
            names = [self.names[i] for i, c in enumerate(no_grad) if c]
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise RuntimeError(
                "DistributedDataParallel: parameter(s) " + shown + " got no gradient in this "
                f"backward on rank(s) {_ranks(missing_ranks)}, so their buckets could not be "
                "reduced. If some parameters take no part in the loss in some iterations, pass "
                "find_unused_parameters=True to DistributedDataParallel; otherwise make every "
                "parameter contribute to the loss")
        raise RuntimeError(
            "DistributedDataParallel: a parameter reported a gradient after it had already been "
            f"reduced or marked unused (rank(s) {_ranks(twice_ranks)}). Use each forward's "
            "outputs for the loss, and run one backward per forward")

    def _write_trace(self, t_end_backward: float, t_wait: float, t_done: float) -> None:
        tracer = self.comm.tracer
        for rec in self._records:
            if "t_end" in rec:
                tracer.event("ddp.all_reduce", "ddp", rec["t_start"], rec["t_end"],
                             bucket=rec["bucket"], iteration=rec["iteration"], bytes=rec["bytes"],
                             t_peers=rec["t_peers"],
                             params=rec["params"], launch=rec["launch"], overlap=self.overlap,
                             algo=self.algo)
        tracer.event("ddp.backward", "ddp", self._t_backward or t_end_backward, t_end_backward,
                     iteration=self.iteration, overlap=self.overlap)
        tracer.event("ddp.wait", "ddp", t_wait, t_done, iteration=self.iteration,
                     overlap=self.overlap)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(f"r{r}" for r in ranks)
