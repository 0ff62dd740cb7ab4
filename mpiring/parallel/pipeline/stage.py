"""``PipelineStage``: one rank's part of the model, and what it does for F, B and W.

The stage holds, per micro-batch in flight, the input it received (a leaf that
requires grad, so that backward leaves the gradient to send back in
``input.grad``), its output or loss, and what the schedule asked for:

* recomputation (GPipe's re-materialisation): F runs under ``no_grad`` and keeps
  only the input and the RNG state; B runs the forward again, then backward;
* split backward (zero bubble): B computes the input gradient, W the Linear
  layers' weight gradients (``split_backward``);
* weight stashing (PipeDream): F runs on a snapshot of the weights that B uses
  again, while the live weights move on after every backward.

With ``count_activations`` on, the bytes autograd saves for backward are
counted (``live_bytes``, ``peak_activation_bytes``) so that a bench can compare
the schedules' activation memory; between a split micro-batch's B and its W,
the bytes its queued weight gradients keep (each Linear's input and output
gradient) are counted instead. Off by default: counting runs a Python hook for
every tensor autograd saves, a few percent of a small model's forward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.func import functional_call

from mpiring.parallel.pipeline import data_parallel, packing, split_backward
from mpiring.parallel.pipeline.schedules import as_int
from mpiring.parallel.tensor.random import get_rng_states, replay_rng_states


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``submodule`` on this rank of ``comm``.

    Args:
        submodule: this stage's layers; its forward takes the previous stage's
            output (the first stage: the step's input micro-batch). Wrapped in
            ``DistributedDataParallel`` over the stage's data-parallel group, the
            replicas' gradients are averaged at the end of each step
            (``data_parallel``); the stage runs the wrapped layers itself.
        stage_index: this stage's number, 0 .. num_stages - 1: ``comm.rank``, or
            with several stages per rank (``ScheduleInterleaved1F1B``) one of
            ``comm.rank + k * comm.size`` (``ScheduleZBVZeroBubble``: ``comm.rank``
            and ``2 * comm.size - 1 - comm.rank``).
        num_stages: the number of stages: ``comm.size``, or a multiple of it
            (every rank builds its k-th stage at the same point, k = 0, 1, ...).
        comm: the pipeline's communicator (one rank per stage, in order; rank r
            holds stages r, r + size, ... when there are more stages than ranks).
        tied_parameters: parameters shared between the first and the last stage
            (a tied embedding): the same number, shapes and order on both; after
            each step their gradients are summed between the two stages.
        count_activations: count the activation bytes held per micro-batch
            (``live_bytes``, ``peak_activation_bytes``; also an attribute, to turn
            on for some steps only).
        input_args, output_args: torch's shape hints, taken and not needed: the
            stages agree their activations' shapes at the first step (and again
            when the input's shape changes).

    ``submod``, ``group_rank`` and ``group_size`` are torch's names for the
    module, ``comm.rank`` and ``comm.size``.

    Raises:
        ValueError: on every rank, when any rank's stage_index, num_stages or
            tied parameters do not fit the communicator (or are not integers).
        TypeError: ``comm`` is not a Communicator (where torch's PipelineStage
            takes the device).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, comm, *,
                 tied_parameters: list[nn.Parameter] | None = None,
                 count_activations: bool = False, input_args=None, output_args=None):
        if not all(hasattr(comm, a) for a in ("rank", "size", "control", "dup")):
            # torch's PipelineStage takes the device fourth: a ported call lands it here.
            # Every rank makes the same call, so every rank raises before any message.
            raise TypeError(f"PipelineStage: comm is a {type(comm).__name__}, not an mpiring "
                            "Communicator. mpiring's PipelineStage(submodule, stage_index, "
                            "num_stages, comm) takes the pipeline's communicator (mpiring.init(), "
                            "or a split of it) where torch's takes the device: move the submodule "
                            "to its device first (submodule.to(device)) and pass the communicator")
        # A NumPy integer counts (as_int), and travels in the layout's JSON below as a
        # plain int; anything else (True, 1.0, an object) travels as its repr, which
        # JSON always carries, for _check_layout to refuse by name on every rank: the
        # value itself could fail to serialise on one rank and leave the others waiting.
        stage_index, num_stages = (repr(v) if (n := as_int(v)) is None else n
                                   for v in (stage_index, num_stages))
        tied = list(tied_parameters or [])
        own = {id(p) for p in submodule.parameters()}
        mine = {"stage": stage_index, "stages": num_stages,
                "tied": tied_layout(tied),
                "foreign": sum(id(p) not in own for p in tied)}
        table = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
        _check_layout(table, comm.size)
        # DDP only reduces: running its forward would arm the reducer for every
        # micro-batch, while the schedule decides which backward syncs.
        self.module, self.ddp = data_parallel.unwrap(submodule)
        self._given = submodule  # torch's submod: as given, wrapper and all
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        # A communicator of its own: the schedule's tags cannot meet the caller's messages.
        self.comm = comm.dup()
        self.tied_parameters = tied
        # Each tied parameter's name in the stage's module, to find it again after
        # to_empty() (a stage built on the meta device, as torchtitan builds its
        # stages) has put new Parameter objects in the module.
        names: dict[int, str] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        self._tied_names = [names.get(id(p)) for p in tied]
        # Known on every rank, middle stages too (of this round, with several per rank).
        self.has_tied = any(bool(row["tied"]) for row in table)
        ends = (0, num_stages - 1)
        self.tied_comm = None
        # Several stages per rank: the ends are built at different points, so the
        # schedule, which sees them all, pairs them (runtime's _TiedPair).
        if 1 < num_stages == comm.size and table[0]["tied"]:
            self.tied_comm = self.comm.split(0 if stage_index in ends else None, key=stage_index)
        self._sink: split_backward.WeightGradSink | None = None
        self.count_activations = count_activations
        #: An unsplit B adds each large Linear's weight gradient into ``.grad`` with one
        #: GEMM (``split_backward.FUSE_MIN_WEIGHTS``); False: every layer plain nn.Linear,
        #: autograd's accumulation, as without a pipeline.
        self.fuse_weight_grads = True
        self.reset()

    @property
    def submod(self) -> nn.Module:
        """The submodule as given (torch's name; ``module`` is what runs: a DDP
        wrapper's layers)."""
        return self._given

    @property
    def group_rank(self) -> int:
        return self.comm.rank

    @property
    def group_size(self) -> int:
        return self.comm.size

    # --- per-step state -------------------------------------------------------
    def reset(self) -> None:
        """Forget every micro-batch (the start of a step)."""
        self._inp: dict[int, torch.Tensor] = {}
        self._out: dict[int, torch.Tensor] = {}
        self._rng: dict[int, tuple] = {}  # recompute: (CPU, GPU, TP streams) RNG states
        self._stash: dict[int, dict[str, torch.Tensor]] = {}
        self._wq: dict[int, list] = {}
        self._split_fwd: set[int] = set()  # micro-batches whose forward routed for W
        self._loss_args: dict[int, tuple] = {}
        self._kw: dict[int, dict] = {}  # recompute: the first stage's keyword inputs
        self._held: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_activation_bytes = 0
        # Once a step, not once a forward: the optimizer updates the weights in place.
        self._param_ptrs = {p.data_ptr() for p in self.module.parameters()}

    def find_tied(self) -> bool:
        """Each tied parameter, found again by its name (a ``to_empty()`` since the stage
        was made puts new Parameter objects in the module); the schedule's every step and
        eval start with it. False if a name no longer names a parameter there."""
        found = True
        for i, name in enumerate(self._tied_names):
            # In place: the schedule's tied pair holds this list.
            p = _parameter(self.module, name)
            if p is not None:
                self.tied_parameters[i] = p
            elif name is not None:
                found = False
        return found

    def free(self) -> None:
        """Collective: give back the stage's communicators (its own duplicate, and the
        tied pair's); after its schedules' ``free()``, when the stage is done."""
        if self.tied_comm is not None:
            self.tied_comm.free()
        self.comm.free()

    def split_backward(self) -> None:
        """Route the stage's Linear layers through ``split_backward`` (idempotent): B may
        leave their weight gradients to W, and an unsplit B adds them into ``.grad`` with
        one GEMM each. Not for an FSDP stage, whose flat gradient W cannot feed."""
        if self._sink is None:
            self._sink = split_backward.install(self.module)
            # The DDP's hook on each parameter does nothing unless its reducer is armed.
            self._sink.inert_hooks = 0 if self.ddp is None else 1

    # --- F --------------------------------------------------------------------
    def forward(self, mb: int, x: torch.Tensor, *, recompute: bool = False,
                stash: bool = False, target=None, loss_fn=None, scale: float = 1.0,
                max_held: int | None = None, split: bool = False, kwargs: dict | None = None):
        """Run micro-batch ``mb``'s forward; returns the output (the loss on the last stage).

        ``kwargs``: the module's keyword inputs (the first stage's, this micro-batch's).
        ``x``: a tensor, or the parts of a packed boundary (a tuple: the module's
        positional arguments). ``max_held``: the most bytes the queued weight
        gradients may keep through this forward (``ScheduleZeroBubble``'s limit).
        ``split``: this micro-batch's backward will leave the weight gradients to W.
        On the last stage ``loss_fn`` must return a one-element tensor (TypeError
        naming it otherwise).
        """
        if max_held is not None and self._wq:
            self._hold_at_most(max_held)
        if isinstance(x, tuple):
            args = x if self.is_first else tuple(_leaf(a) for a in x)
            self._inp[mb] = args
        else:  # one tensor: the common case, without the tuple's steps
            inp = self._inp[mb] = _leaf(x) if not self.is_first else x
            args = (inp,)
        last = self.is_last
        if recompute:
            # torch's generators (the CPU's, and the GPU's the layers draw from there) and
            # the tensor-parallel dropout streams (which stand in for them inside TP
            # layers): the recompute must draw this forward's masks.
            gpu = _gpu_of(self.module)
            self._rng[mb] = (torch.get_rng_state(),
                             None if gpu is None else torch.cuda.get_rng_state(gpu),
                             get_rng_states())
            with torch.no_grad():
                out = self._call(args, None, kwargs)
                loss = loss_fn(out, target) if last else None
            self._loss_args[mb] = (loss_fn, target, scale)
            if kwargs:
                self._kw[mb] = kwargs  # the replay's
            if self.count_activations:
                self._held[mb] = sum(a.nelement() * a.element_size() for a in args)
        else:
            params = None
            if stash:  # PipeDream: this micro-batch's weights, kept until its backward
                params = {n: p.detach().clone().requires_grad_(p.requires_grad)
                          for n, p in self.module.named_parameters()}
                self._stash[mb] = params

            def run():  # the loss's saved tensors (the log-softmax) count as activations too
                y = self._call(args, params, kwargs)
                return y, (loss_fn(y, target) if last else None)
            with self._routed(split):
                (out, loss), self._held[mb] = self._counted(run)
            if split:
                self._split_fwd.add(mb)
        self._grow(self._held.get(mb, 0))  # recomputation without counting holds none
        if last:
            # Checked at F, where the loss is made: B's autograd error ("grad can be
            # implicitly created only for scalar outputs") would not name loss_fn.
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(_loss_error(loss))
            self._out[mb] = loss * scale
            return out, loss
        self._out[mb] = out
        return out, None

    @contextlib.contextmanager
    def _routed(self, split: bool):
        """A forward whose Linear layers go through ``split_backward``'s: all of them when its
        backward defers to W, the large ones when it adds into ``.grad`` in the GEMM
        (``fuse_weight_grads``; ``split_backward.FUSE_MIN_WEIGHTS``); else none."""
        sink = self._sink
        if sink is None:
            yield
            return
        sink.route = (0 if split else
                      split_backward.FUSE_MIN_WEIGHTS if self.fuse_weight_grads else None)
        try:
            yield
        finally:
            sink.route = None

    def _call(self, args: tuple, params, kwargs: dict | None = None):
        kwargs = kwargs or {}
        return (self.module(*args, **kwargs) if params is None
                else functional_call(self.module, params, args, kwargs))

    def _counted(self, fn):
        """Run ``fn``; with ``count_activations``, also the activation bytes autograd saves
        (parameters excluded), else 0."""
        if not self.count_activations:
            return fn(), 0
        seen: set[int] = set()
        skip = self._param_ptrs
        total = [0]

        def pack(t: torch.Tensor):
            ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
            if ptr not in seen and t.data_ptr() not in skip:
                seen.add(ptr)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, total[0]

    def _grow(self, n: int) -> None:
        self.live_bytes += n
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_bytes)

    # --- B and W --------------------------------------------------------------
    def backward(self, mb: int, grad: torch.Tensor | None, *, split: bool = False,
                 sync: bool = False) -> torch.Tensor | None:
        """Micro-batch ``mb``'s backward (input gradient, and the weights' unless ``split``).

        ``sync`` (with a DDP-wrapped stage): this backward also reduces the
        gradients accumulated so far over the data-parallel replicas.

        ``grad``: the output's gradient; for a tuple output, one per floating-point
        part, in order.

        Returns the gradient for the previous stage (None on the first stage): a
        tensor, or for a tuple input one per floating-point part.
        """
        if split and mb not in self._rng and mb not in self._split_fwd:
            # Its Linear layers ran as autograd's: B would compute their weight gradients.
            raise ValueError(f"backward(split=True) of micro-batch {mb}, whose forward was not "
                             "split: pass split=True to forward() too")
        self._split_fwd.discard(mb)
        inp, out = self._inp.pop(mb), self._out.pop(mb)
        kept: list = []  # recompute: the buffers as the replay found them
        if mb in self._rng:  # recompute: the forward again, with the same random numbers
            args = inp if isinstance(inp, tuple) else (inp,)
            if not self.is_first:  # received leaves; the first stage's input is the user's
                args = tuple(a.detach().requires_grad_(a.requires_grad) for a in args)
                inp = args if isinstance(inp, tuple) else args[0]
            cpu, cuda, streams = self._rng.pop(mb)
            gpu = _gpu_of(self.module) if cuda is not None else None
            with torch.random.fork_rng(devices=[] if gpu is None else [gpu]), \
                    replay_rng_states(streams):
                torch.set_rng_state(cpu)
                if gpu is not None:
                    torch.cuda.set_rng_state(cuda, gpu)
                loss_fn, target, scale = self._loss_args.pop(mb)
                kw = self._kw.pop(mb, {})

                def run():
                    y = self.module(*args, **kw)
                    return loss_fn(y, target) * scale if self.is_last else y
                # The forward already updated the running statistics (batch norm's)
                # once for this micro-batch: the replay's update is undone after the
                # backward (which checks the ones it saved), as the unsplit model makes
                # one. Every buffer is copied: batch norm's kernel writes its statistics
                # without moving their version counter, so no cheaper test tells which
                # ones a forward writes.
                kept = [(m, k, b.clone()) for m in self.module.modules()
                        for k, b in m._buffers.items() if b is not None]
                with self._routed(split):
                    out, extra = self._counted(run)
                self._grow(extra)
                self._grow(-extra)  # freed by the backward below
        if self._sink is not None:
            self._sink.queue = self._wq.setdefault(mb, []) if split else None
        if sync and self.ddp is not None:
            data_parallel.arm(self.ddp, out)
        elif self._sink is not None:
            # The armed backward keeps autograd's accumulation: its hooks fill the buckets.
            self._sink.fuse = self.fuse_weight_grads
        # An output that needs no gradient (a frozen first stage, an integer output)
        # has no backward: nothing before it learns.
        try:
            if isinstance(out, torch.Tensor):
                if out.requires_grad:
                    torch.autograd.backward(out, None if self.is_last else grad)
            else:  # a tuple: the gradients came for its floating-point and complex parts
                floats = [o for o in out if packing.differentiable(o.dtype)]
                pairs = [(o, g) for o, g in zip(floats, grad) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            if self._sink is not None:
                self._sink.queue, self._sink.fuse = None, False
            _put_back(kept)
        self._release(mb)
        if split and self.count_activations:  # autograd freed the graph; W's X and dY stay
            self._held[mb] = split_backward.held_bytes(self._wq.get(mb, []))
            self._grow(self._held[mb])
        if self.is_first:
            return None
        # An input the stage did not use, or one that takes no gradient (integers): the
        # stage before still waits for a gradient, which is zero.
        if isinstance(inp, tuple):
            return tuple(a.grad if a.grad is not None else torch.zeros_like(a)
                         for a in inp if packing.differentiable(a.dtype))
        return inp.grad if inp.grad is not None else torch.zeros_like(inp)

    def _hold_at_most(self, limit: int) -> None:
        """Run deferred weight gradients now until the queued ones keep at most ``limit``
        bytes (the rest wait for W).

        Called before a forward: the stage's activations peak at the end of a forward
        (and the start of the B after it), over what the queues keep then. The items that
        run now are on the critical path, so the ones that would fill the least bubble
        per byte go first (``Deferred.worth``; the oldest micro-batch's among equals).
        """
        # Each micro-batch's storages, with the bytes they keep and how many of its queued
        # items' tensors keep them (held_bytes' count, kept up to date as items run).
        refs = {mb: split_backward.storage_refs(q) for mb, q in self._wq.items()}
        held = {mb: sum(n for n, _ in r.values()) for mb, r in refs.items()}
        total = sum(held.values())
        if total <= limit:
            return
        order = sorted((d.worth(), mb, i) for mb, q in self._wq.items() for i, d in enumerate(q))
        done = {mb: set() for mb in self._wq}
        for _, mb, i in order:
            if total <= limit:
                break
            item = self._wq[mb][i]
            item.run()
            done[mb].add(i)
            for t in item.tensors:
                entry = refs[mb][t.untyped_storage().data_ptr()]
                entry[1] -= 1
                if entry[1] == 0:  # no item left keeps it
                    held[mb] -= entry[0]
                    total -= entry[0]
        for mb, ran in done.items():
            if ran:
                self._wq[mb] = [d for j, d in enumerate(self._wq[mb]) if j not in ran]
                if self.count_activations:
                    self._grow(held[mb] - self._held[mb])
                    self._held[mb] = held[mb]

    def weight(self, mb: int, *, sync: bool = False) -> None:
        """Micro-batch ``mb``'s deferred weight gradients (the W action).

        ``sync`` (with a DDP-wrapped stage, on the step's last W): this W also
        reduces the gradients over the data-parallel replicas, each bucket as
        soon as its gradients are done (``data_parallel.reduce_in_w``).
        """
        queue = self._wq.pop(mb, [])
        if sync and self.ddp is not None:
            data_parallel.reduce_in_w(self.ddp, queue)
        else:
            for item in queue:
                item.run()
        self._release(mb)

    def stashed_grads(self, mb: int) -> dict[str, torch.Tensor | None]:
        """The gradients B left on micro-batch ``mb``'s stashed weights (PipeDream)."""
        return {n: t.grad for n, t in self._stash.pop(mb).items()}

    def _release(self, mb: int) -> None:
        self._grow(-self._held.pop(mb, 0))


def _put_back(kept: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    with torch.no_grad():
        for m, k, old in kept:
            now = m._buffers.get(k)
            if now is not None and now.shape == old.shape and now.dtype == old.dtype:
                now.copy_(old)  # in place: whoever holds the buffer sees it
            else:
                m._buffers[k] = old


def _parameter(module: nn.Module, name: str | None) -> nn.Parameter | None:
    """``module``'s parameter ``name``, or None (no name, or not a parameter there now:
    a sharded module holds a stand-in in its place)."""
    if name is None:
        return None
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


def _loss_error(loss) -> str:
    """Why ``loss``, loss_fn's value for one micro-batch, cannot start a backward."""
    what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}")
    return (f"loss_fn returned {what}; each micro-batch's backward starts from its loss, "
            "a one-element tensor (as in torch's pipelining): reduce it in loss_fn "
            "(.mean() or .sum()), and compute it with torch ops on the output")


def _gpu_of(module: nn.Module) -> torch.device | None:
    """The CUDA device of ``module``'s parameters, or None (a CPU stage)."""
    p = next(module.parameters(), None)
    return p.device if p is not None and p.device.type == "cuda" else None


def tied_layout(params) -> list:
    """What the two ends of a tie compare: each parameter's shape, dtype, requires_grad."""
    return [[*p.shape, str(p.dtype), bool(p.requires_grad)] for p in params]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A received input, as a leaf whose gradient B leaves in ``.grad`` (floating point
    and complex only)."""
    return x.requires_grad_(True) if packing.differentiable(x.dtype) else x


def _check_layout(table: list[dict], size: int) -> None:
    # Not integers (a repr, from __init__): named before any arithmetic on them. A bool
    # or a float would compare equal to the rank (True == 1, 1.0 == 1) and pass below.
    errors = [f"r{r} gave {key}={row[k]}, not an integer"
              for r, row in enumerate(table)
              for k, key in (("stage", "stage_index"), ("stages", "num_stages"))
              if not isinstance(row[k], int)]
    if errors:
        raise ValueError("PipelineStage: " + "; ".join(errors) + ". Give each rank of the "
                         "pipeline's communicator stage_index=comm.rank and "
                         "num_stages=comm.size as integers (or the layout of several stages "
                         "per rank, see PipelineStage)")
    n = table[0]["stages"]
    rnd = table[0]["stage"] // size
    # A round of stages goes up the ranks (rank r: rnd * size + r), or the second, on
    # ZB-V's way back up the V, down them (rank r: 2 * size - 1 - r).
    down = size > 1 and rnd == 1 and table[0]["stage"] == 2 * size - 1
    for r, row in enumerate(table):
        want = (rnd + 1) * size - 1 - r if down else rnd * size + r
        if row["stages"] != n or n % size or n < size:
            errors.append(f"r{r} gave num_stages={row['stages']} on a {size}-rank communicator")
        elif row["stage"] != want or not 0 <= row["stage"] < n:
            errors.append(f"r{r} gave stage_index={row['stage']}")
    ends = [r for r, row in enumerate(table) if row["stage"] in (0, n - 1)]
    if not errors and n == size > 1 and table[0]["tied"] != table[-1]["tied"]:
        errors.append(f"tied_parameters differ: first stage {table[0]['tied']}, last stage "
                      f"{table[-1]['tied']} (shapes, then dtype and requires_grad)")
    for r, row in enumerate(table):
        if row["foreign"]:
            errors.append(f"r{r} gave {row['foreign']} tied parameter(s) that are not "
                          "parameters of its submodule")
    for r, row in enumerate(table):
        if row["tied"] and r not in ends and not errors:
            errors.append(f"r{r} (stage {row['stage']}) is neither the first nor the last stage "
                          "but gave tied_parameters")
    if errors:
        raise ValueError("PipelineStage: " + "; ".join(errors) + ". Give each rank of the "
                         "pipeline's communicator stage_index=comm.rank, num_stages=comm.size "
                         "(or, with v stages per rank, its k-th stage_index=comm.rank + "
                         "k * comm.size of num_stages=v * comm.size, built on every rank "
                         "together; ZB-V's second: 2 * comm.size - 1 - comm.rank), and the "
                         "tied parameters on the first and last stage only")
