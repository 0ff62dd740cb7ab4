r"""The reducer: gradient buckets filled by backward hooks, reduced while backward runs.

The lecture's call chain, as it appears here::

    autograd_hook(param)            _on_grad_ready      (post-accumulate-grad hook)
      mark_variable_ready           copy grad / K into the bucket, pending -= 1
        mark_bucket_ready           pending == 0
          all_reduce_bucket         handed to the communication thread, strictly
                                    in bucket order (_launch_ready_buckets)
    end of backward                 _finalize (queued with queue_callback): wait
                                    for every bucket, copy the means back to .grad

Timeline on one rank with ``overlap=True`` (buckets in reverse layer order)::

    main thread   |-- backward L4 --|-- L3 --|-- L2 --|-- L1 --|wait|
    comm thread                     |AR b0   |AR b1   |AR b2   |AR b3|

and with ``overlap=False`` (the naive design the lecture improves on)::

    main thread   |-- backward L4 --|-- L3 --|-- L2 --|-- L1 --|wait..........|
    comm thread                                                |AR b0..b3     |

Why a thread: on the MPI backend a non-blocking request makes no progress while
the process makes no MPI call, so an ``Irecv`` posted from a hook would sit idle
until backward ends. A dedicated thread making blocking calls on its own
duplicated communicator progresses the ring while the main thread computes
(mpi4py and torch's backward both release the GIL). Buckets go to the thread
strictly in index order, so every rank issues the same collectives in the same
order even when its hooks fire in a different order.

Consistency checks ride on the data: the last bucket carries a small status tail
(one slot per rank: an error code and that rank's synced-backward count mod
``STEP_MOD``; one slot per parameter: 1 where that parameter got no gradient
on this rank). Ranks whose counts differ are reducing different
steps' gradients (a rank's backward failed after its buckets started and was
caught, or it ran one under ``no_sync`` alone): every rank raises instead of
stepping with mixed means. A backward that fails before any bucket started
finishes no synced backward and is not caught by the count: that rank's next
step pairs with the others' previous one, as in torch. After the last AllReduce
every rank knows, without another collective, whether any rank missed a gradient and
which parameters did, so with ``find_unused_parameters=False`` every rank
raises the same error instead of one rank waiting forever for a bucket.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpiring.parallel.data.bucket_layout import BucketLayout, _Bucket
from mpiring.parallel.data.bucketing import (
    BUCKET_SEGMENT_BYTES,
    DEFAULT_BUCKET_ALGO,
    MIB,
)
from mpiring.parallel.data.comm_thread import CommThread
from mpiring.parallel.data.eager import outside_compile
from mpiring.parallel.data.end_of_backward import _CODES, _OK, _TWICE, STEP_MOD, EndOfBackward
from mpiring.runtime import desync
from mpiring.runtime.trace import clock

#: Seconds a rank sleeps between polls while it waits for its peers before a bucket.
QUIET_POLL_S = 2e-4

class Reducer(BucketLayout, EndOfBackward):
    """Buckets, hooks and the communication schedule for one DDP model.

    Args:
        params: the parameters to reduce (those that require grad), in
            registration order, without duplicates.
        names: a readable name per parameter (for errors and traces).
        comm: the Communicator the model's replicas share (default: the one
            ``mpiring.init_process_group()`` made).
        bucket_cap_mb: bucket size cap in MiB.
        first_bucket_mb: cap of the first bucket in MiB.
        find_unused_parameters: allow parameters that get no gradient.
        static_graph: the set of used parameters never changes (torch's flag): the
            ones unused on every rank in the first synced backward count as zero
            from then on, without the graph walk of ``find_unused_parameters``.
        gradient_as_bucket_view: make ``.grad`` a view into the bucket (no copy
            back, less memory).
        overlap: launch each bucket as soon as it is complete (True) or only after
            backward has finished (False, the naive design).
        algo: the AllReduce algorithm for buckets (default "ring-seg"; any of
            ``Communicator.all_reduce``'s).
        quiet_wait: before each bucket's AllReduce, wait for every rank with
            ``comm.control.barrier(poll_s=QUIET_POLL_S)``, which sleeps instead of
            spinning (MPICH busy-polls inside blocking calls, and a rank that spins
            while its peers still compute takes their core); default: on the MPI
            backend with CPU buckets.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], comm=None, *,
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 overlap: bool = True, algo: str = DEFAULT_BUCKET_ALGO, quiet_wait: bool | None = None,
                 static_graph: bool = False):
        self.params = list(params)
        self.names = list(names)
        if not self.params:
            raise ValueError("DistributedDataParallel: the module has no parameter that requires "
                             "grad, so there is nothing to reduce: wrap a trainable module")
        from mpiring.comm.default import resolve

        self.comm = comm = resolve(comm, "Reducer")
        self.rank, self.size = comm.rank, comm.size
        # What each gradient is divided by before the sum: the world size, or the
        # number of ranks still training under DDP.join(divide_by_initial_world_size=False).
        self.divisor = self.size
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * MIB))
        self.first_bucket_bytes = max(1, int(first_bucket_mb * MIB))
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        # With static_graph: the parameters no rank used in the first synced
        # backward (None until it ran), marked ready with zeros in every later one.
        self._static_unused: list[int] | None = None
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.overlap = overlap
        self.algo = algo
        self.quiet_wait = quiet_wait
        # The bucket AllReduces run on their own communicator: the comm thread's
        # messages can never match a collective the main thread issues meanwhile.
        self._bucket_comm = comm.dup()
        # With algo "ring-seg" (or "auto" choosing it) the receive buffer is two
        # segments: 2 MiB, not a chunk of the largest bucket (see BUCKET_SEGMENT_BYTES).
        self._bucket_comm.segment_bytes = BUCKET_SEGMENT_BYTES
        self._thread = CommThread(name=f"mpiring-ddp-r{self.rank}")
        self.iteration = 0            # synced backward passes finished
        self.rebuilt = False
        self._observed: list[int] = []  # hook order in the first synced backward
        self._rebuild_due = False
        self._comm_hook: tuple[Any, Callable] | None = None  # register_comm_hook
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, p in enumerate(self.params)]
        # torch's DDP has no close(), so wrappers are often just dropped: then stop the
        # thread and remove the hooks (both local). Freeing the communicator is a
        # collective, which garbage collection cannot time alike on every rank: only
        # close() frees it.
        weakref.finalize(self, _release, self._thread, self._handles)
        self._build(order=None)
        if (overlap and comm.backend == "mpi" and not self.buckets[0].flat.is_cuda
                and not os.environ.get("MPIRING_IDLE")):
            # The comm thread shares the cores with backward: waiting for a peer by
            # spinning (MPICH's way) or yielding would take CPU from the backward it
            # overlaps, so it sleeps between polls (mpiring/backends/mpi.py
            # IDLE_MODES). An MPIRING_IDLE of the user's choice applies here too.
            self._bucket_comm.idle = "sleep"
        self._expect = False
        self._synced_forward = False
        # For the desync detector's report: the synced forward whose backward never
        # ran here (0: none), and the no_sync() forwards since the last synced backward.
        self._lost = 0
        self._local = 0
        desync.add_context(self._desync_hint)
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        n = len(self.params)
        self._fired = [False] * n
        self._ready = [False] * n
        self._pending = [len(b.params) for b in self.buckets]
        self._next_launch = 0
        self._started = False
        self._error_code = _OK
        self._sent_code = _OK  # the error code the status tail carried to every rank
        self._unused: list[int] = []
        self._carried: list[int] = []
        self._records: list[dict[str, Any]] = []
        self._t_backward = 0.0
        self._exposed_s = 0.0

    @outside_compile
    def prepare_forward(self) -> None:
        """Refuse a new forward while a synced backward is half done (a bug upstream),
        or after ``close()``."""
        if self._thread.closed:
            # The hooks are gone and the thread stopped: a backward would wait for
            # reductions nobody runs. Raise before any byte moves instead.
            raise RuntimeError(
                "DistributedDataParallel: this model was closed (close()), so its gradients "
                "can no longer be reduced: wrap the module again to train, or run ddp.module "
                "(or the wrapper under torch.no_grad()) for evaluation")
        if self._started:
            raise RuntimeError(
                "DistributedDataParallel: a new forward started while the previous backward "
                "was still reducing gradients (it raised before it finished?). Run one "
                "backward per forward, and stop training after a failed backward")
        if self._expect:  # the last synced forward's backward never started (legal: eval)
            self._lost = self.iteration + 1

    def _desync_hint(self) -> str:
        """This model's state, for the watchdog's desync report (its monitor thread)."""
        if not self._handles:
            return ""
        n = self.iteration + 1
        if self._started:
            text = (f"DDP is reducing the gradients of synced backward #{n} (buckets on comm "
                    f"{self._bucket_comm.name})")
        elif self._lost:
            text = (f"DDP: the backward of synced forward #{self._lost} never ran on this "
                    "rank (it failed and was caught?)")
        elif self._expect:
            text = f"DDP ran synced forward #{n}; its backward has not run"
        else:
            text = f"DDP finished synced backward #{self.iteration}"
        if self._local:
            text += f"; {self._local} forward(s) under no_sync() since then"
        return text

    @outside_compile
    def prepare_for_backward(self, outputs: Any, sync: bool) -> None:
        """Arm the hooks for the backward of this forward (or disarm them under no_sync)."""
        self._reset_iteration()
        self._expect = sync
        self._synced_forward = False  # set by _finalize once this forward's backward ran
        if not sync:
            self._local += 1
            return
        tensors = [t for t in _tensors(outputs) if t.requires_grad]
        if self.find_unused_parameters:
            # Like torch DDP: parameters the outputs do not depend on will get no
            # gradient; mark them ready at the first hook so their buckets need
            # not wait for the end of backward.
            reached = _graph_leaves(tensors)
            unreached = [i for i, p in enumerate(self.params) if id(p) not in reached]
            # One that no_sync's micro-batches gave a gradient is not unused: its hook
            # will not fire in this backward, so it goes in with what it holds (torch's
            # reducer does the same), or its accumulated gradient is never averaged.
            self._carried = [i for i in unreached if self.params[i].grad is not None]
            self._unused = [i for i in unreached if self.params[i].grad is None]
        if tensors and tensors[0].grad_fn is not None:
            tensors[0].register_hook(self._on_output_grad)

    @outside_compile
    def _on_output_grad(self, grad):
        if self._expect:
            self._start_backward()
        elif self._synced_forward:
            # The output of a forward whose gradients were reduced already: a second
            # backward (retain_graph) would add unreduced gradients on this rank only.
            raise RuntimeError(
                "DistributedDataParallel: a second backward of the same forward's outputs "
                f"on r{self.rank}: its gradients would not be reduced and the replicas would "
                "diverge. Run one backward per forward (sum the losses first), or run the "
                "extra backward under no_sync() on every rank")
        return None

    def _start_backward(self) -> None:
        if self._started:
            return
        self._started = True
        self._t_backward = clock()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for i in self._unused:
            self._mark_ready(i, zero=True)
        for i in self._static_unused or ():
            self._mark_ready(i, zero=True)
        for i in self._carried:
            self._on_grad_ready(i, self.params[i])

    def _make_hook(self, i: int):
        # Eager under compiled autograd too: the hook copies into the bucket and may
        # hand it to the communication thread, which needs real memory.
        # The parameters hold their hooks: a weak reference lets a dropped wrapper go.
        ref = weakref.ref(self)

        @outside_compile
        def hook(p: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._on_grad_ready(i, p)
        return hook

    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        if not self._expect:
            return  # no_sync, or backward of a forward that did not go through DDP
        self._start_backward()
        if self._ready[i]:
            # Reduced already (or marked unused): the gradient would be lost. Record
            # it; the status tail makes every rank raise at the end of backward.
            self._error_code = max(self._error_code, _TWICE)
            return
        self._fired[i] = True
        if self.iteration == 0 and not self.rebuilt:
            self._observed.append(i)
        b, off = self._where[i]
        grad = p.grad
        if grad.is_sparse:
            raise TypeError(f"parameter {self.names[i]} has a sparse gradient: "
                            "DistributedDataParallel reduces dense gradients only; "
                            "use sparse=False in the embedding")
        slot = self.buckets[b].flat[off:off + p.numel()]
        # Divide by the world size BEFORE the sum, not after: summing K float16
        # gradients first can overflow (max 65504) where the mean would not.
        # A comm hook gets the undivided gradients and divides itself (torch's contract).
        divisor = self.divisor
        divide = divisor != 1 and self._comm_hook is None
        if self.gradient_as_bucket_view:
            view = slot.view_as(p)
            if grad.data_ptr() == view.data_ptr():  # accumulated into the bucket already
                if divide:
                    slot.div_(divisor)
            else:  # a new gradient tensor (e.g. after zero_grad(set_to_none=True)):
                if divide:  # one pass, divided on the way in
                    torch.div(grad, divisor, out=view)
                else:
                    view.copy_(grad)
                p.grad = view
        elif divide:
            torch.div(grad.reshape(-1), divisor, out=slot)
        else:
            slot.copy_(grad.reshape(-1))
        self._mark_ready(i, zero=False)

    def _mark_ready(self, i: int, zero: bool) -> None:
        if self._ready[i]:
            return
        self._ready[i] = True
        b, off = self._where[i]
        if zero:
            self.buckets[b].flat[off:off + self.params[i].numel()].zero_()
        self._pending[b] -= 1
        if self._pending[b] == 0 and self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order: a bucket that completes early waits for its
        # predecessors, so every rank issues its AllReduces in the same order.
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.tail is not None:
            self._fill_tail(bucket)
        copy_back = [] if self.gradient_as_bucket_view else [
            (self.params[i], off) for i, off in zip(bucket.params, bucket.offsets) if self._fired[i]]
        if bucket.flat.is_cuda:
            # The comm thread must not read the bucket before the copies into it,
            # queued on this thread's stream, have run.
            event = torch.cuda.Event()
            event.record()
        else:
            event = None
        record = {"bucket": bucket.index, "iteration": self.iteration,
                  "bytes": bucket.numel * bucket.flat.element_size(),
                  "params": len(bucket.params), "launch": clock()}
        self._records.append(record)
        comm, algo = self._bucket_comm, self.algo
        quiet = self.quiet_wait
        if quiet is None:
            quiet = comm.backend == "mpi" and not bucket.flat.is_cuda and comm.size > 1
        hook = self._comm_hook
        if hook is not None:
            hook_args = (bucket.index, bucket.flat, bucket.numel,
                         [self.params[i] for i in bucket.params], bucket.offsets,
                         bucket.index == len(self.buckets) - 1, bucket.tail, self.iteration)

        def all_reduce_bucket() -> None:
            if event is not None:
                torch.cuda.set_device(bucket.flat.device)  # a new thread starts on GPU 0
                event.synchronize()
            # The AllReduce starts here; with quiet_wait its first part is the wait
            # for the other ranks (``t_peers``: when the last one arrived).
            record["t_start"] = clock()
            if quiet:
                comm.control.barrier(poll_s=QUIET_POLL_S)
            record["t_peers"] = clock()
            if hook is not None:
                from mpiring.parallel.data.comm_hooks import run_comm_hook

                run_comm_hook(hook[0], hook[1], comm, *hook_args, algo=algo)
            else:
                # Pre-divided by K in the hook, so a sum gives the mean; the ring check
                # is off because every rank built the same layout (checked at construction).
                comm.all_reduce(_real(bucket.flat), op="sum", algo=algo, check=False)
            record["t_end"] = clock()
            # Copy the means back into .grad right away: autograd has finished with
            # these parameters (their post-accumulate hooks have fired).
            for p, off in copy_back:
                p.grad.copy_(bucket.flat[off:off + p.numel()].view_as(p))
            if bucket.flat.is_cuda:
                torch.cuda.current_stream(bucket.flat.device).synchronize()

        self._thread.submit(all_reduce_bucket)

    def _fill_tail(self, bucket: _Bucket) -> None:
        status = torch.zeros(self.size + len(self.params), dtype=torch.float32)
        # A slot per rank (its error code and step) and one per parameter (unfired).
        status[self.rank] = float(self._error_code + _CODES * (self.iteration % STEP_MOD + 1))
        self._sent_code = self._error_code
        for i, fired in enumerate(self._fired):
            if not fired:
                status[self.size + i] = 1.0
        bucket.flat[bucket.tail:].copy_(status)

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the plain AllReduce.

        Raises:
            RuntimeError: a hook is already registered, or a backward already ran.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook: a communication hook is already registered; "
                               "register one hook, once")
        complex_ = [n for n, p in zip(self.names, self.params) if p.is_complex()]
        if complex_:
            # A hook sees real flat buffers (fp16 casts, top-k, PowerSGD's matrices).
            raise TypeError(f"register_comm_hook: {', '.join(complex_[:3])} "
                            f"{'is' if len(complex_) == 1 else 'are'} complex, and comm hooks "
                            "reduce real gradients: keep such a parameter as a real one with a "
                            "last dimension of 2 (torch.view_as_complex in forward), or use no hook")
        if self.iteration > 0 or self._started:
            raise RuntimeError("register_comm_hook: register the hook before the first backward "
                               "(the reducer divides gradients differently with a hook)")
        self._comm_hook = (state, hook)

    @property
    def exposed_comm_s(self) -> float:
        """Seconds the last synced backward waited for communication after autograd ended."""
        return self._exposed_s

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for h in self._handles:
            h.remove()
        self._handles.clear()  # the finalizer's list too
        if self._thread.close():  # a thread still inside a collective keeps its communicator
            self._bucket_comm.free()  # the thread's duplicate: MPI has a few thousand


def _release(thread: CommThread, handles: list) -> None:
    """A dropped reducer's finalizer: remove its hooks, let its thread end."""
    for h in handles:
        h.remove()
    thread.stop()


def _real(flat: torch.Tensor) -> torch.Tensor:
    """A complex bucket as the real buffer the collectives sum (real and imaginary parts)."""
    return torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclass-like outputs."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # as torch's _find_tensors
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def _graph_leaves(tensors: Sequence[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``tensors`` reaches."""
    seen: set[int] = set()
    leaves: set[int] = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    for t in tensors:
        if t.grad_fn is None and t.requires_grad:
            leaves.add(id(t))
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves
