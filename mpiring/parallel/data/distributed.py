"""``mpiring.DistributedDataParallel``: torch DDP's contract on mpiring's ring collectives.

    mpiring.init_process_group()             # or pass a Communicator: DDP(net, comm)
    model = mpiring.DistributedDataParallel(net)
    loss = loss_fn(model(x), y)
    loss.backward()          # returns with every .grad = mean over ranks
    optimizer.step()

The signature is torch's, so a torch script ports by its import lines. At
construction every rank checks that all ranks hold the same parameters and
buffers (names, shapes, dtypes; only fixed-size hashes and, on a difference,
fixed-size descriptions cross the wire) and takes rank 0's values. Each forward
optionally re-broadcasts rank 0's buffers (BatchNorm statistics); each backward
is reduced by the ``Reducer`` (buckets, hooks, communication thread).

Under ``torch.compile`` (either ``compile(DDP(m))`` or ``DDP(compile(m))``) the
communication stays outside the graph: the work before and after the wrapped
module's forward runs eagerly (a graph break), and the gradient hooks fire on
real tensors after the compiled backward. A compiled graph produces all of its
gradients at its end, so buckets cannot start while it runs backward (torch
overlaps there by splitting the graph at its own DDP's bucket boundaries).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO
from mpiring.parallel.data.reducer import Reducer, outside_compile
from mpiring.parallel.data.torch_args import (
    check_devices,
    is_comm,
    resolve_comm,
    same_comm,
    to_device,
)

_DESC_BYTES = 200


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: gradients are averaged over the ranks during backward.

    torch's arguments, in torch's order; then mpiring's own, by keyword.
    ``DistributedDataParallel(module, comm)`` (a Communicator second) still works.

    Args:
        module: the model; the same architecture on every rank, on one device.
        device_ids: None (CPU modules, and CUDA ones left where they are), or
            ``[i]`` for a module on ``cuda:i`` (``[local_rank]`` under
            ``mpiring.run``); inputs are then moved to that device, as torch does.
            Several devices per process (torch's deprecated mode) are refused.
        output_device: None or the module's device (outputs stay where the
            module puts them).
        dim: accepted for torch's signature; it only matters when one process
            drives several devices, which is refused.
        broadcast_buffers: copy the root's buffers (rank 0's) to every rank
            at the start of a forward, as torch does: of the first forward and of
            each one that follows a synced forward (with gradients, outside
            ``no_sync()``), so an eval forward after training runs with rank 0's
            BatchNorm statistics, and a synced forward after ``no_sync()`` ones
            keeps each rank's own.
        process_group: the ``mpiring.Communicator`` over the replicas (default:
            the one ``mpiring.init_process_group()`` made). A torch ProcessGroup
            is refused: mpiring's collectives run on its own communicators.
        bucket_cap_mb: bucket size cap in MiB (None: torch's 25).
        find_unused_parameters: allow parameters that get no gradient in some
            iterations (their gradient counts as zero on that rank). Off, such a
            parameter makes every rank raise at the end of backward.
        check_reduction: accepted and ignored (torch deprecated it too).
        gradient_as_bucket_view: ``.grad`` becomes a view into the bucket buffer
            (saves a copy and the memory of one gradient copy).
        static_graph: the set of used parameters never changes. As in torch,
            parameters no rank used in the first synced backward need no
            ``find_unused_parameters``: they count as zero from then on (their
            ``.grad`` stays None). The buckets are rebuilt once from the first
            iteration's order, as mpiring's reducer does anyway (without
            ``find_unused_parameters``). A parameter whose gradient arrives twice
            in one backward (reentrant activation checkpointing, which torch
            allows with static_graph) is still an error here.
        comm: the same as ``process_group`` (mpiring's name).
        init_sync: take rank 0's parameters and buffers at construction (torch's
            ``init_sync``; the model is compared across ranks either way). With
            ``broadcast_buffers=False`` each rank keeps its own buffers, as in torch.
        forward_sync_buffers: torch 2.13's successor of ``broadcast_buffers``: when
            given, it decides the forward broadcasts, and the buffers are taken
            from rank 0 at construction whatever its value.
        first_bucket_mb: size of the first bucket in MiB (default 1), small so
            that communication starts early in backward.
        overlap: True launches each bucket's AllReduce as soon as its gradients
            are ready, overlapping the rest of backward; False waits for the whole
            backward first (the naive design).
        algo: AllReduce algorithm for the buckets: "ring-seg" (the default:
            the lecture's ring, cut into 1 MiB segments, so that its receive
            buffer is 2 MiB and not a chunk of the largest bucket), "ring" (the
            lecture's loop as written), any other of ``Communicator.all_reduce``'s
            ("auto", ...), or "native" (the library's own).
        quiet_wait: wait for all ranks before each bucket's AllReduce without
            spinning a core (``comm.control.barrier(poll_s=...)``); default on for
            CPU buckets on the MPI backend.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``process_group`` is
            not a Communicator, or the module has sparse embeddings.
        ValueError: a bad argument (on every rank, naming the ranks), no
            communicator, or the model differs across ranks (every rank raises,
            naming the first difference and the ranks).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = True, init_sync: bool = True,
                 process_group=None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, *,
                 comm=None, first_bucket_mb: float = 1.0, overlap: bool = True,
                 algo: str = DEFAULT_BUCKET_ALGO, quiet_wait: bool | None = None,
                 forward_sync_buffers: bool | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got "
                            f"{type(module).__name__}")
        if is_comm(device_ids):  # the old call DistributedDataParallel(module, comm)
            device_ids, comm = None, same_comm(comm, device_ids)
        if not isinstance(init_sync, bool):
            # torch 2.x put init_sync before process_group: a group passed sixth, in the
            # older order, would be taken for init_sync and the default group used.
            raise TypeError(f"init_sync={init_sync!r} is not a bool: torch's order is (module, "
                            "device_ids, output_device, dim, broadcast_buffers, init_sync, "
                            "process_group, bucket_cap_mb, ...); pass process_group=... by name")
        comm = resolve_comm(same_comm(comm, process_group))
        if comm.size > 1:
            # Before any control message: a rank that runs a collective instead of
            # wrapping its model must see an error, not mix its messages with ours.
            comm.agree_call("DistributedDataParallel")
        bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb
        from mpiring.comm.communicator import ALGOS

        problem = None
        if not (_mib(bucket_cap_mb) and _mib(first_bucket_mb)):
            problem = (f"bucket_cap_mb={bucket_cap_mb!r} and first_bucket_mb={first_bucket_mb!r}: "
                       "bucket sizes must be positive, finite numbers of MiB (e.g. 25)")
        elif algo not in ALGOS["all_reduce"]:
            problem = f"algo={algo!r}: use one of {', '.join(ALGOS['all_reduce'])}"
        # Agreed with the device checks: a rank-dependent bad value must make every
        # rank raise, not leave the others waiting in the next exchange.
        self.device = check_devices(comm, module, device_ids, output_device, dim, problem)
        self.module = module
        self.comm = self.process_group = comm
        self.device_ids = None if device_ids is None else [self.device.index]
        self.output_device = None if output_device is None else self.device
        self.dim = dim
        # torch's rule: the old flag also keeps the buffers out of the initial sync,
        # the new one does not.
        if broadcast_buffers is None:  # torch 2.13's default
            broadcast_buffers = True
        init_buffers = broadcast_buffers if forward_sync_buffers is None else True
        if forward_sync_buffers is not None:
            broadcast_buffers = forward_sync_buffers
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.overlap = overlap
        self.require_backward_grad_sync = True
        # torch's require_forward_param_sync: whether the last forward was synced (True
        # before the first), which decides whether the next one broadcasts buffers.
        self.require_forward_param_sync = True
        self._join = None  # the JoinState while inside join()
        self._hooks_agreed = False  # compared at the first synced forward (_agree_hooks)

        sparse = [n for n, m in module.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Not reduced: one unfrozen later would train on local gradients (torch's too).
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        # The options that shape the buckets and the calls must match too: a bucket cap
        # or an algorithm of its own on one rank meets the others' messages truncated.
        options = [f"option {k}={v!r}" for k, v in (
            ("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb),
            ("find_unused_parameters", find_unused_parameters), ("algo", algo),
            ("broadcast_buffers", broadcast_buffers), ("init_buffers", init_buffers),
            ("init_sync", init_sync),
            ("overlap", overlap), ("static_graph", bool(static_graph)),
            ("sparse embeddings", sparse))]
        check_same_model(comm, describe_module(module) + options)
        if sparse:  # the same on every rank (just compared): all raise alike, before any step
            raise TypeError(f"DistributedDataParallel reduces dense gradients only, and "
                            f"{', '.join(sparse)} {'is' if len(sparse) == 1 else 'are'} built "
                            "with sparse=True: use sparse=False in the embedding")
        if init_sync:
            sync_from_root(comm, [p.detach() for p in module.parameters()]
                           + (list(module.buffers()) if init_buffers else []))
        self._buffers_to_sync = [b for b in module.buffers()]
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], comm,
                               bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                               find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view,
                               overlap=overlap, algo=algo, quiet_wait=quiet_wait,
                               static_graph=static_graph)

    def forward(self, *args, **kwargs):
        grad, sync = self._pre_forward()
        if self.device_ids is not None:
            args, kwargs = to_device((args, kwargs), self.device)
        out = self.module(*args, **kwargs)
        if grad:
            self.reducer.prepare_for_backward(out, sync)
        return out

    @outside_compile
    def _pre_forward(self) -> tuple[bool, bool]:
        # Eager even under torch.compile: the rebuild and the buffer broadcast move
        # real bytes, and the flags must be read at run time, not at trace time.
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        if sync:
            self._check_frozen()
        if grad:
            self.reducer.prepare_forward()
        # Under join() the joined ranks shadow synced forwards only, so only those
        # broadcast there; elsewhere torch's rule (see broadcast_buffers).
        buffers = self.require_forward_param_sync if self._join is None else sync
        if sync:
            root = 0 if self._join is None else self._join.notify()
            self.sync_before_backward(root, buffers=buffers)
        elif buffers:
            self._sync_buffers(0)
        self.require_forward_param_sync = sync
        return grad, sync

    def _check_frozen(self) -> None:
        thawed = [n for n, p in self._frozen if p.requires_grad]
        if thawed:
            # torch DDP silently keeps such gradients local and the replicas drift apart.
            raise RuntimeError(
                f"DistributedDataParallel: parameter(s) {', '.join(thawed[:5])} had "
                "requires_grad=False when the model was wrapped, so their gradients are not "
                "reduced, and now require grad: after unfreezing, ddp.close() and wrap "
                "ddp.module again, or wrap it unfrozen with find_unused_parameters=True")

    def sync_before_backward(self, root: int = 0, buffers: bool = True) -> None:
        """The collectives of a synced forward: the bucket rebuild, the buffer broadcast."""
        if not self._hooks_agreed:  # every rank's first synced forward, hooks registered
            self._agree_hooks()
        self.reducer.rebuild_if_due()
        if buffers:
            self._sync_buffers(root)

    def _sync_buffers(self, root: int) -> None:
        if self.broadcast_buffers and self._buffers_to_sync:
            # The root's running statistics win, as in torch DDP (check off: the
            # shapes were compared at construction).
            sync_from_root(self.comm, self._buffers_to_sync, root=root, check=False)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this block accumulate ``.grad`` locally.

        The first synced backward afterwards reduces the accumulated sum (and
        divides by the world size), as torch DDP's ``no_sync``.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Train on uneven inputs: ranks that run out shadow the others' reductions.

        torch's ``DDP.join()``; see ``mpiring.parallel.data.join.JoinState``::

            with model.join():
                for x, y in my_batches:      # a different count on each rank
                    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        from mpiring.parallel.data.join import join

        return join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    @property
    def bucket_params(self) -> list[list[int]]:
        """Current bucket layout: per bucket, indices into the trainable parameters."""
        return self.reducer.bucket_params

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (torch DDP's API; see ``comm_hooks``).

        The hook receives a ``comm_hooks.GradBucket`` with this rank's undivided
        gradients and returns the mean; call this once, before the first forward.
        ``state`` may be None or this model's communicator (torch's process-group
        state), or a hook's own state object. torch's own ``default_hooks``
        (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``),
        ``noop_hook``, ``powerSGD_hook`` with its ``PowerSGDState`` and the
        ``fp16/bf16_compress_wrapper`` around any of them are replaced by
        mpiring's equivalents (``comm_hooks.torch_equivalent``); its other hooks
        are refused.
        """
        if self._hooks_agreed and self.reducer._comm_hook is None:  # else: "already registered"
            # The ranks compared their hooks at the first forward: one registered now,
            # perhaps on some ranks only, would meet the others' messages truncated.
            raise RuntimeError("register_comm_hook: the model already ran a forward with "
                               "its reduction agreed: register the hook before the first "
                               "forward, on every rank")
        module = getattr(hook, "__module__", None) or ""
        if module.startswith("torch.distributed"):
            # torch's hooks call torch.distributed on the default process group, which
            # would fail on the comm thread at the first backward, after bytes moved.
            from mpiring.parallel.data import comm_hooks

            mapped = comm_hooks.torch_equivalent(state, hook)
            if mapped is None:
                raise TypeError(
                    f"register_comm_hook: {module}.{getattr(hook, '__name__', hook)} runs "
                    "torch.distributed's collectives, not mpiring's: use a hook from "
                    "mpiring.parallel.data.comm_hooks "
                    f"({', '.join(k for k in comm_hooks.__all__ if k.endswith('_hook'))}; "
                    "PowerSGDState takes torch's arguments)")
            state, hook = mapped
        if is_comm(state) and state is not self.comm:
            raise ValueError("register_comm_hook: the state is a communicator other than this "
                             "model's: pass None (the hooks use the model's own)")
        self.reducer.register_comm_hook(None if is_comm(state) else state, hook)

    def _agree_hooks(self) -> None:
        """Every rank must reduce its buckets alike: a comm hook on some ranks only meets
        the others' plain AllReduce in a different message pattern (truncated, then a
        stall). Compared once, at the first synced forward, by the hook's name."""
        self._hooks_agreed = True
        hook = self.reducer._comm_hook
        mine = "none" if hook is None else getattr(hook[1], "__qualname__", repr(hook[1]))
        names = self.comm.control.allgather_json(mine) if self.comm.size > 1 else [mine]
        if len(set(names)) > 1:
            shown = ", ".join(f"r{r}: {n}" for r, n in enumerate(names))
            raise ValueError(f"DistributedDataParallel: the ranks reduce with different comm "
                             f"hooks ({shown}): call register_comm_hook with the same hook on "
                             "every rank, before the first forward")

    def close(self) -> None:
        """Remove the hooks and stop the communication thread.

        ``ddp.module`` stays usable, and so does the wrapper under ``torch.no_grad()``;
        a forward with gradients through the wrapper raises RuntimeError (wrap the
        module again to train). A wrapper dropped without ``close()`` stops its
        thread and removes its hooks when garbage-collected, but keeps its
        communicator (freeing one is a collective): close wrappers you build
        many of, since MPI has a few thousand communicators.

        The trace's buffered tail is written out here (and at exit), so a run that
        ends normally keeps every event.
        """
        self.reducer.close()
        self.comm.tracer.flush()


def _mib(value) -> bool:
    """Whether ``value`` is a usable bucket size in MiB (inf would not fit in bytes)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < float("inf"))


def describe_module(module: nn.Module) -> list[str]:
    """One line per parameter and buffer: kind, name, shape, dtype, requires_grad."""
    lines = [f"parameter {n} shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
             f"{'' if p.requires_grad else ' (frozen)'}" for n, p in module.named_parameters()]
    lines += [f"buffer {n} shape {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}"
              for n, b in module.named_buffers()]
    return lines


def check_same_model(comm, lines: Sequence[str], what: str = "DistributedDataParallel") -> None:
    """Raise ValueError on every rank unless every rank passed the same ``lines``.

    Only fixed-size data crosses the wire: the count, one 8-byte hash a line,
    and on a difference a fixed-size UTF-8 description of the first differing
    line from each rank (decoded, never unpickled).
    """
    if comm.size > 1 and hasattr(comm, "agree_call"):
        # First make sure every rank is here: one wrapping its model while another
        # runs a collective would otherwise mix their control messages.
        comm.agree_call(what)
    if comm.size == 1:
        return
    control = comm.control
    counts = control.allgather_array([len(lines)])[:, 0]
    width = int(counts.max())
    mine = np.zeros(width, dtype=np.int64)
    for j, line in enumerate(lines):
        mine[j] = int.from_bytes(hashlib.blake2b(line.encode(), digest_size=8).digest(),
                                 "little", signed=True)
    table = control.allgather_array(mine)
    first = None
    for j in range(width):
        present = counts > j
        if not present.all() or (table[:, j] != table[0, j]).any():
            first = j
            break
    if first is None:
        return
    if first < len(lines):
        text = lines[first]
    else:
        text = f"nothing (only {len(lines)} parameters and buffers)"
    descs = control.allgather_bytes(text.encode()[:_DESC_BYTES])
    groups: dict[str, list[int]] = {}
    for r in range(comm.size):
        groups.setdefault(descs[r].decode("utf-8", errors="replace"), []).append(r)
    differ = [r for r in range(comm.size) if descs[r] != descs[0]
              or table[r, first] != table[0, first] or counts[r] <= first]
    parts = "; ".join(f"{', '.join(f'r{r}' for r in ranks)} have {desc}"
                      for desc, ranks in groups.items())
    fix = ("Pass the same arguments on every rank" if text.startswith("option ") else
           "Build the same model (same architecture, arguments and dtypes) on every rank "
           "before wrapping it")
    raise ValueError(
        f"{what}: the model differs across ranks at entry #{first} "
        f"(rank(s) {', '.join(f'r{r}' for r in differ)} differ from r0): {parts}. {fix}")


@outside_compile
def sync_from_root(comm, tensors: Sequence[torch.Tensor], root: int = 0,
                   check: bool | None = None) -> None:
    """Copy ``root``'s values of ``tensors`` into every rank's, in place.

    Tensors travel as raw bytes in one buffer per device, so any dtype (bool and
    int64 buffers included) goes in a single Broadcast.
    """
    if comm.size == 1 or not tensors:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for group in by_device.values():
            flat = torch.cat([_bytes_of(t) for t in group])
            comm.broadcast(flat, root=root, check=check)
            offset = 0
            for t in group:
                n = t.numel() * t.element_size()
                src = flat[offset:offset + n]
                if t.is_contiguous():
                    # Write through a byte view of the target: a slice of ``flat`` may
                    # not be aligned for ``t``'s dtype, the target always is.
                    t.reshape(-1).view(torch.uint8).copy_(src)
                else:
                    t.copy_(src.clone().view(t.dtype).view(t.shape))
                offset += n


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
