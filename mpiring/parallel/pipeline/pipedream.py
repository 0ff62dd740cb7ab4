"""PipeDream: asynchronous 1F1B with weight stashing.

Each stage updates its own weights after every micro-batch's backward, without
waiting for the others (no flush between the updates). So micro-batch k's
forward on stage i sees the weights after k - (p - 1 - i) of its updates, not k
as sequential SGD would: the staleness is p - 1 - i micro-batches, none on the
last stage. Weight stashing makes the backward of micro-batch k use the very
weights its forward used (a copy kept from F to B, one per micro-batch in
flight: at most p - i copies on stage i), so each gradient is a true gradient
of some version of the weights, though not of the latest one. The step ends
with the pipeline drained, so ``step()`` returns with every update applied.
"""

from __future__ import annotations

from mpiring.parallel.pipeline.runtime import PipelineSchedule
from mpiring.parallel.pipeline.stage import PipelineStage


class SchedulePipeDream(PipelineSchedule):
    """1F1B order; after each micro-batch's backward, ``optimizer.step()`` on this stage.

    Args:
        optimizer: over this stage's parameters; stepped once per micro-batch with
            the gradient of that micro-batch's loss (times 1/m with scale_grads).
    """

    name = "pipedream"
    stash = True
    allows_ddp = False  # refused on every rank by PipelineSchedule's agreement

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None, *,
                 optimizer, scale_grads: bool = True):
        if stage.has_tied:
            raise ValueError("SchedulePipeDream updates each stage on its own, so a weight "
                             "tied between stages would drift apart: untie it, or use "
                             "Schedule1F1B")
        self.optimizer = optimizer
        super().__init__(stage, n_microbatches, loss_fn, scale_grads=scale_grads)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs):
        """Refused: each stage steps (and clears its gradients) after every micro-batch,
        so after step() no gradient is left to clip."""
        raise ValueError("SchedulePipeDream steps each stage after every micro-batch's "
                         "backward, so step() leaves no gradient to clip: clip inside the "
                         "optimizer, or use Schedule1F1B")

    def after_backward(self, mb: int) -> None:
        grads = self.stage.stashed_grads(mb)
        for name, p in self.stage.module.named_parameters():
            p.grad = grads[name]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
