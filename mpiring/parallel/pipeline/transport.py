"""The activations and gradients between neighbouring stages: shapes agreed once, buffers kept.

A run of consecutive sends and receives is posted together: a send is an
``isend`` (waited for at the end of the step, so a send never holds its rank
up), the receives are waited for before the next compute action. On NCCL the
run is one ``comm.group()``.

What a message costs beyond its bytes is paid once per input shape, not per
micro-batch:

* the shapes: the first step with a new input shape sends a small int64 header
  (dtype, dims) ahead of each micro-batch's activation (no pickle); later
  steps reuse them;
* the check: that first step's data goes on the pipeline's communicator with
  the argument check on (each message carries a descriptor that the receiver
  compares, so a stage whose output does not match what it announced is a
  ``MismatchError``). Later steps send on a duplicate with the check off: one
  message per tensor instead of two, and no comparison. A stage whose output
  shape can change while the input's does not (data-dependent shapes) must
  call ``sched.transport.renegotiate()`` before such a step;
* the buffers: each micro-batch's receive buffer is allocated on the first step
  and received into again on the next ones.

On MPI a stage waits by polling with short sleeps (``idle = "sleep"``) unless
``MPIRING_IDLE`` says otherwise.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from mpiring.parallel.pipeline.actions import RECV_B, RECV_F, SEND_F, Action

TAG_ACT, TAG_GRAD, TAG_META = 1, 2, 3
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8


def header(t: torch.Tensor) -> np.ndarray:
    """dtype index, number of dims, then the dims (-1 padded): what a receiver allocates from."""
    if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
        raise TypeError(f"activation of shape {tuple(t.shape)} and dtype {t.dtype}: a stage "
                        f"may pass up to {MAX_DIMS} dimensions of {', '.join(map(str, DTYPES))}")
    h = np.full(2 + MAX_DIMS, -1, dtype=np.int64)
    h[0], h[1] = DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = t.shape
    return h


def from_header(h: np.ndarray) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(int(v) for v in h[2:2 + int(h[1])]), DTYPES[int(h[0])]


class Transport:
    """One stage's point-to-point traffic. ``comm``: the stage's own (duplicated) communicator.

    ``comm.dup()`` is collective: every stage of the pipeline builds its Transport
    at the same point (``PipelineStage.__init__``).
    """

    def __init__(self, comm):
        self.checked = comm
        self.fast = comm.dup()
        self.fast.check = False  # shapes agreed by the header: the descriptors only repeat them
        if comm.idle is not None and not os.environ.get("MPIRING_IDLE"):
            # A stage waits through whole forwards and backwards of its neighbours
            # (the bubble): polling with sleeps leaves the core to the ranks that
            # compute, for at most mpi.SLEEP_S more latency per message.
            for c in (self.checked, self.fast):
                c.idle = "sleep"
        self.renegotiate()

    def renegotiate(self) -> None:
        """Agree the shapes again (and check them) on the next step."""
        self.meta: dict[int, tuple] = {}
        self.meta_sent: set[int] = set()
        self.fresh = True
        self.bufs: dict[tuple[str, int], torch.Tensor] = {}

    def end_step(self) -> None:
        self.fresh = False

    def _buffer(self, key: tuple[str, int], shape, dtype) -> torch.Tensor:
        buf = self.bufs.get(key)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self.bufs[key] = torch.empty(shape, dtype=dtype)
        elif buf.grad is not None:  # last step's input gradient must not accumulate
            buf.grad = None
        return buf.detach_() if buf.requires_grad else buf

    def exchange(self, run: list[Action], outgoing: dict, incoming: dict, grad_like,
                 sends: list) -> None:
        """Post one run of sends and receives; return once the receives have arrived.

        Args:
            outgoing: ("F" | "B", mb) -> tensor to send (popped).
            incoming: filled with ("F" | "B", mb) -> received tensor.
            grad_like: mb -> this stage's output (the gradient's shape and dtype).
            sends: the send requests, waited for by the caller at the end of the step.
        """
        meta_comm = self.checked
        comm = self.checked if self.fresh else self.fast
        recvs = []
        for a in run:  # headers first (first step only), so a group holds only the data
            if a.kind == RECV_F and a.mb not in self.meta:
                h = meta_comm.recv(np.empty(2 + MAX_DIMS, dtype=np.int64), a.peer, TAG_META)
                self.meta[a.mb] = from_header(h)
        grouped = comm.group() if comm.backend == "nccl" else contextlib.nullcontext()
        with grouped:
            for a in run:
                if a.kind == SEND_F:
                    t = outgoing.pop(("F", a.mb))
                    if a.mb not in self.meta_sent:
                        sends.append(meta_comm.isend(header(t), a.peer, TAG_META))
                        self.meta_sent.add(a.mb)
                    sends.append(comm.isend(t, a.peer, TAG_ACT))
                elif a.kind == RECV_F:
                    buf = incoming[("F", a.mb)] = self._buffer(("F", a.mb), *self.meta[a.mb])
                    recvs.append(comm.irecv(buf, a.peer, TAG_ACT))
                elif a.kind == RECV_B:
                    out = grad_like(a.mb)
                    buf = incoming[("B", a.mb)] = self._buffer(("B", a.mb), out.shape, out.dtype)
                    recvs.append(comm.irecv(buf, a.peer, TAG_GRAD))
                else:  # SEND_B
                    sends.append(comm.isend(outgoing.pop(("B", a.mb)), a.peer, TAG_GRAD))
        for req in recvs:
            req.wait()
