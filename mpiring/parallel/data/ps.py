r"""The parameter-server baseline: push gradients with Reduce, pull parameters with Broadcast.

The classic design the lecture starts from (Lec13), on the project's own
collectives::

    every rank:   forward, backward                 (local gradients)
    push:         Reduce(grads / K) -> server        comm.reduce(..., root=server)
    server:       optimizer.step()                   (the only optimizer state)
    pull:         Broadcast(params) <- server        comm.broadcast(..., root=server)

Here the server is also a worker (rank ``server`` computes gradients on its
shard too), so the global batch and the training result are the same as DDP's
up to floating-point order. Everything happens after backward and every byte
goes through one rank in both directions: the two weaknesses the lecture names
(no overlap, a hot spot at the server) are visible in its step time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mpiring.parallel.data.bucketing import MIB, bucket_offsets, compute_buckets
from mpiring.parallel.data.distributed import check_same_model, describe_module, sync_from_root
from mpiring.parallel.data.reducer import QUIET_POLL_S
from mpiring.runtime import pages


class ParameterServer:
    """Reduce gradients to a server rank, update there, broadcast the parameters back.

    Args:
        module: the model, the same on every rank.
        comm: a Communicator over the workers.
        optimizer: ``params -> torch.optim.Optimizer``; called on the server only.
        server: the server's rank.
        bucket_cap_mb: gradients move in buckets of at most this size (one dtype
            each), so no rank needs a second full copy of the model.
        algo: "pipelined" (default), "ring" or "native", for both Reduce and
            Broadcast.

    Use ``step()`` after ``loss.backward()`` instead of ``optimizer.step()``.

    The pushed gradient is the mean of the ranks' gradients, as DDP's: with
    batches of different sizes per rank it is not the gradient of the whole
    global batch (each rank's mean counts alike); scale each rank's loss by
    ``K * n_rank / n_total`` for that. A rank with fewer batches than the
    others trains inside ``with ps.join():`` (else the others wait for it until
    the deadline aborts the job).
    """

    def __init__(self, module: nn.Module, comm,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 server: int = 0, bucket_cap_mb: float = 25.0, algo: str = "pipelined"):
        if not 0 <= server < comm.size:
            raise ValueError(f"server={server}: use a rank in 0..{comm.size - 1}")
        if algo not in ("pipelined", "ring", "native"):
            raise ValueError(f"algo={algo!r}: use 'pipelined', 'ring' or 'native'")
        self.module = module
        self.comm = comm
        self.server = server
        self.algo = algo
        check_same_model(comm, describe_module(module), what="ParameterServer")
        sync_from_root(comm, [p.detach() for p in module.parameters()] + list(module.buffers()),
                       root=server)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.is_server = comm.rank == server
        self.optimizer = None
        error: Exception | None = None
        if not self.params:
            error = ValueError("ParameterServer: the model has no trainable parameters (every "
                               "requires_grad is False): unfreeze some, or train without it")
        elif self.is_server:
            # The factory runs on the server only: its error (an empty list, a bad
            # lr) must stop every rank here, not leave the workers waiting in step().
            try:
                self.optimizer = optimizer(self.params)
            except Exception as exc:  # noqa: BLE001 - any factory error is reported alike
                error = exc
        desc = None if error is None else f"{type(error).__name__}: {error}"
        table = comm.control.allgather_json(desc) if comm.size > 1 else [desc]
        if error is not None:
            raise error
        bad = [r for r, d in enumerate(table) if d is not None]
        if bad:
            raise ValueError(f"ParameterServer: rank(s) {', '.join(f'r{r}' for r in bad)} "
                             f"failed to build ({table[bad[0]]}); no rank went on")
        nbytes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, str(p.device)) for p in self.params]
        cap = max(1, int(bucket_cap_mb * MIB))
        numels = [p.numel() for p in self.params]
        self.buckets = []
        for group in compute_buckets(nbytes, keys, bucket_cap_bytes=cap, first_bucket_bytes=cap):
            offsets, total = bucket_offsets(group, numels)
            first = self.params[group[0]]
            flat = pages.zeros(total, first.dtype, first.device)  # huge pages: faster MPI copies
            self.buckets.append((group, offsets, flat))

    def step(self) -> None:
        """Push the gradients, update on the server, pull the parameters (collective)."""
        self._step(active=True)

    @contextmanager
    def join(self) -> Iterator[None]:
        """Train on inputs of different lengths per rank (torch DDP's ``join()``, for the PS).

        Without it, a rank that runs out of batches stops calling ``step()`` and
        the others wait in their next one until the deadline aborts the job.
        Inside ``with ps.join():`` a rank that leaves its loop keeps answering
        the others' steps with zero gradients until every rank is done, so the
        mean stays over all K ranks (torch's ``divide_by_initial_world_size``
        default) and every rank ends with the server's parameters.
        """
        yield
        # Only on a normal exit: after an exception the others would wait anyway.
        while self._step(active=False):
            pass

    def _step(self, active: bool) -> bool:
        """One step; ``active=False`` answers it with zero gradients. False once no rank trains."""
        k = self.comm.size
        if k > 1 and self.comm.backend == "mpi" and self.params[0].device.type == "cpu":
            self.comm.control.barrier(poll_s=QUIET_POLL_S)  # no spinning while slower workers compute
        # A parameter with no gradient on any rank keeps grad None on the server, so
        # its optimizer skips it as torch and DDP do (a zero one would still get
        # weight decay and momentum): one small exchange of flags, which also says
        # whether any rank still trains (a joined rank has no gradients).
        flags = [int(active)] + [int(active and p.grad is not None) for p in self.params]
        if k > 1:
            flags = self.comm.control.allgather_array(flags).max(axis=0).tolist()
        if not flags[0]:
            return False  # every rank is in join()'s wait: nothing to step
        flags = flags[1:]
        with torch.no_grad():
            for group, offsets, flat in self.buckets:
                for i, off in zip(group, offsets):
                    p = self.params[i]
                    slot = flat[off:off + p.numel()]
                    if p.grad is None or not active:
                        slot.zero_()  # no gradient here counts as zero, as in DDP
                    else:
                        # Divide before summing: K float16 gradients can overflow.
                        torch.div(p.grad.reshape(-1), k, out=slot)
                self.comm.reduce(flat, root=self.server, op="sum", algo=self.algo, check=False)
                if self.is_server:
                    for i, off in zip(group, offsets):
                        p = self.params[i]
                        view = flat[off:off + p.numel()].view_as(p)
                        if not flags[i]:
                            p.grad = None
                        elif p.grad is None or not active:
                            p.grad = view.clone()
                        else:
                            p.grad.copy_(view)
            if self.is_server:
                self.optimizer.step()
            for group, offsets, flat in self.buckets:
                if self.is_server:
                    for i, off in zip(group, offsets):
                        flat[off:off + self.params[i].numel()].copy_(self.params[i].reshape(-1))
                self.comm.broadcast(flat, root=self.server, algo=self.algo, check=False)
                if not self.is_server:
                    for i, off in zip(group, offsets):
                        p = self.params[i]
                        p.copy_(flat[off:off + p.numel()].view_as(p))
        # Buffers (BatchNorm statistics) follow the server too.
        buffers = list(self.module.buffers())
        if buffers:
            sync_from_root(self.comm, buffers, root=self.server, check=False)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients on every rank (the server's optimizer included)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            for p in self.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
