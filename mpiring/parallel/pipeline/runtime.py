"""Execute a schedule's actions on the stages, and the four schedules users call.

    stage = PipelineStage(block, comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, n_microbatches=8, loss_fn=lm_loss)
    out = sched.step(x)                                  # first stage
    out = sched.step(target=y, losses=losses)            # last stage
    sched.step()                                         # the others

The runtime walks this rank's program (``schedules.build``, checked by
``validate.check`` on every rank before anything moves). A compute action runs
on the stage; a run of consecutive sends and receives is posted together: a
send is an ``isend`` (waited for at the end of the step, so a send never holds
its rank up), the receives are waited for before the next compute action. On
NCCL the run is one ``comm.group()``. The shapes and dtypes of the activations
are agreed once per input shape (``transport``); then each message is its
tensor alone, into the buffer the step before received into, or, when every
stage runs on one host, copied straight into the consumer's slot of a shared
window (``shared``).

On MPI the neighbour should have its data as soon as it exists: every receive
of a step is posted when the step starts (``Transport.start_step``), and a
send that the program lists right after the compute action producing it is
posted by that action, before anything else runs (``_Plan.eager``, made once
from the program).
"""

from __future__ import annotations

import inspect
import time
import zlib

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpiring.parallel import clip
from mpiring.parallel.pipeline import data_parallel, packing
from mpiring.parallel.pipeline.actions import (
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    format_schedule,
    groups,
)
from mpiring.parallel.pipeline.schedules import (
    build,
    check_sizes,
    lower,
    stage_ranks,
    stages_of,
)
from mpiring.parallel.pipeline.stage import PipelineStage, tied_layout
from mpiring.parallel.pipeline.transport import DTYPES, MAX_DIMS, Transport
from mpiring.parallel.pipeline.validate import Span, check


class PipelineError(RuntimeError):
    """A stage failed while running an action; the message names the rank, stage and action."""


class PipelineSchedule:
    """Runs any valid per-rank action list (``actions``) on ``stage``; the base of the schedules.

    Args:
        stage: this rank's ``PipelineStage``, or a list of them when the rank holds
            several (stages r, r + p, ... of p ranks: ``ScheduleInterleaved1F1B``).
        n_microbatches: micro-batches per step (the input is split along dim 0 with
            numpy.array_split's bounds, so the batch need not divide).
        loss_fn: ``loss_fn(output, target)`` on the last stage.
        actions: every rank's program (``schedules.build`` or hand-written).
        scale_grads: gradients of the mean of the micro-batch losses (torch's
            ``scale_grads=True``); False: of their sum.
        placement: where ``actions`` put the stages (``schedules.stage_ranks``):
            "loop" (rank r: r, r + p, ...; the default) or "v" (a ZB-V program's
            r and 2p-1-r); the schedule classes set their own.
    """

    name = "custom"

    def __init__(self, stage: PipelineStage | list[PipelineStage], n_microbatches: int,
                 loss_fn=None, *, actions: list[list[Action]] | None = None,
                 scale_grads: bool = True, placement: str | None = None):
        if placement is not None:
            if placement not in ("loop", "v"):
                raise ValueError(f"placement={placement!r}: use 'loop' or 'v'")
            self.placement = placement  # this schedule's, over the class's
        stages = _local_stages(stage, self.placement)
        stage = stages[0]
        try:
            _, n_microbatches = check_sizes(stage.num_stages, n_microbatches)
            size_error = None
        except (TypeError, ValueError) as exc:
            # Agreed below, in the exchange every rank makes: raised here alone, it
            # would leave the other ranks waiting there to the deadline.
            size_error, n_microbatches = str(exc), None
        # ``stage``: this rank's (first) stage, as torch's single-stage schedules have it.
        self.stage, self.n_microbatches, self.loss_fn = stage, n_microbatches, loss_fn
        self.stages = stages
        self._at = {st.stage_index: st for st in stages}
        ranks, self.num_stages = stage.comm.size, stage.num_stages
        self.ranks = stage_ranks(ranks, self.num_stages, self.placement)  # checked above
        if actions is None and size_error is None:
            if self.name == "custom":  # torch's base classes map here (get_schedule_class)
                raise ValueError(f"{type(self).__name__} runs the program it is given: pass "
                                 "actions= (schedules.build, load_csv or your own), or use a "
                                 "schedule class such as Schedule1F1B")
            actions = build(self.name, ranks, n_microbatches, len(stages))
        mine = [self.name, n_microbatches,
                "" if actions is None else format_schedule(actions), loss_fn is not None,
                any(st.ddp is not None for st in stages),
                any(data_parallel.is_fsdp(st.ddp) for st in stages), size_error]
        table = stage.comm.control.allgather_json(mine) if stage.comm.size > 1 else [mine]
        bad = [f"r{r}: {row[6]}" for r, row in enumerate(table) if row[6]]
        if bad:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(bad))
        if any(row[:3] != table[0][:3] for row in table):
            raise ValueError(f"{type(self).__name__}: the ranks built different schedules "
                             f"(name, n_microbatches: {[row[:2] for row in table]}); build the "
                             "same one on every rank")
        if len(actions) != ranks:  # the same list on every rank (checked above)
            raise ValueError(f"{type(self).__name__}: actions holds {len(actions)} programs for "
                             f"{ranks} ranks: give one per rank")
        if not table[self.ranks[-1]][3]:
            raise ValueError(f"{type(self).__name__}: give loss_fn on the last stage (for "
                             "forwards alone, build the schedule with the training loss_fn "
                             "and call eval(), with or without a target)")
        if any(row[4] for row in table) and not self.allows_ddp:
            raise ValueError(f"{type(self).__name__} steps each stage's optimizer after every "
                             "micro-batch, so its replicas would need a reduction per micro-batch: "
                             "give it unwrapped stages (no DistributedDataParallel), or use "
                             "Schedule1F1B or ScheduleZeroBubble with data parallelism")
        multi = self.num_stages > ranks
        if multi and stage.comm.backend != "mpi":
            # NCCL matches a pair of ranks' messages in order, whatever the stages: the
            # interleaved sends cross (rank 0 sends stage 0's F and stage 2's B to rank 1).
            raise ValueError(f"{type(self).__name__}: several stages per rank run on the MPI "
                             "backend only (NCCL would meet the crossing sends out of order): "
                             "use --backend mpi, or one stage per rank")
        # ScheduleError on every rank alike. One stage per rank: portable to NCCL too
        # (the rendezvous model); several: MPI's, the only backend that runs them.
        self.simulated = check(actions, n_microbatches, self.num_stages, rendezvous=not multi,
                               ranks=self.ranks)
        if any(row[5] and any(a.kind == W for a in actions[r]) for r, row in enumerate(table)):
            raise ValueError(f"{type(self).__name__}: {data_parallel.FSDP_SPLIT}")
        self.actions = actions
        program = actions[stage.comm.rank]
        self._split = {(a.stage, a.mb) for a in program if a.kind == W}
        self._last_b, self._last_w, self._sync_in_b, self._sync_in_w = {}, {}, {}, {}
        for st in stages:
            s = st.stage_index
            # Every stage but an FSDP one (refused above with W's): an unsplit B adds the
            # Linear weights' gradients into .grad in the same GEMM.
            if not data_parallel.is_fsdp(st.ddp):
                st.split_backward()
            backwards = [i for i, a in enumerate(program) if a.kind == B and a.stage == s]
            weights = [i for i, a in enumerate(program) if a.kind == W and a.stage == s]
            self._last_b[s] = program[backwards[-1]].mb if backwards else -1
            self._last_w[s] = program[weights[-1]].mb if weights else -1
            # Each stage of a rank reduces its own replicas (reduction_points).
            ddp = st.ddp is not None
            in_b, in_w = reduction_points(program, s)
            self._sync_in_b[s], self._sync_in_w[s] = ddp and in_b, ddp and in_w
        self._first = self._at.get(0)                     # None unless this rank has it
        self._last = self._at.get(self.num_stages - 1)
        self._where = ("stage" if len(stages) == 1 else "stages") + " " + ", ".join(
            str(st.stage_index) for st in stages)
        self._tied = _TiedPair(stages, multi)
        # The stages' parameters were checked (none on "meta", the tied ones theirs) at
        # a step that went through: the checks walk every parameter, so once is enough.
        self._params_checked = False
        self._kwargs_fit: dict[tuple, str] = {}  # (inputs, keyword names) -> _kwarg_fit's
        self.scale = 1.0 / n_microbatches if scale_grads else 1.0
        self.transport = Transport(stage.comm, self.ranks)  # collective (a dup), as above
        # NCCL: a send goes in its group, with the receive (no send posted early).
        eager = _eager_sends(program) if self.transport.mpi else {}
        self._train = _Plan(program, groups(program), eager, self.transport)
        self._eval: _Plan | None = None  # made at the first eval(), on every rank alike
        self._plan = self._train
        self.timeline: list[Span] = []       # the last step()'s compute spans
        # With several stages per rank and counting on: what the rank's stages held
        # together at most in the last step (one stage: ``stage.peak_activation_bytes``).
        self.peak_activation_bytes = 0
        self.eval_timeline: list[Span] = []  # the last eval()'s
        self._closed = False

    # --- the step ---------------------------------------------------------------
    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs):
        """One training step's forward and backward over the micro-batches.

        Args:
            args: the input batch, on the first stage only: one tensor, or several
                (the first stage's positional arguments), each split along dim 0.
            target: the targets, on the last stage only.
            losses: a list the last stage fills with each micro-batch's loss
                (cleared first, as torch's).
            return_outputs: False: return None on the last stage too (torch's).
            loss_kwargs: refused, naming the fix (bind them into ``loss_fn``).
            kwargs: the first stage's keyword inputs (an attention mask, position
                ids), on its rank only: each tensor with rows (in containers too) is
                split along dim 0 as the input is (the same rows), anything else
                goes to every micro-batch as it is (docs/pipeline.md says where
                torch differs).

        Returns:
            The merged output (micro-batches concatenated) on the last stage, else None.

        Raises:
            ValueError: on every rank, before any data moves, when some rank's
                arguments do not fit (missing input, too few rows, keyword inputs
                off the first stage or of other rows, ...).
            PipelineError: on the rank whose stage failed; the others stop at the
                communicator's deadline.
        """
        if loss_kwargs:  # checked with the other arguments, on every rank alike
            kwargs = {**kwargs, "loss_kwargs": loss_kwargs}
        out = self._run(self._train, args, target, losses, kwargs)
        return out if return_outputs else None

    def eval(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, **kwargs):
        """The forwards alone, under ``torch.no_grad`` (torch's ``schedule.eval``).

        The micro-batches go through the stages in order (GPipe's forward half),
        nothing is kept for a backward and no gradient or optimizer state is
        touched; call ``module.eval()`` first for dropout and batch norm, as
        without a pipeline. The target is optional: with it, ``losses`` gets
        each micro-batch's loss. Collective: every rank calls it. Its messages go
        on a transport of their own (a communicator, and a shared window unless
        ``close()`` came first), so training steps keep their agreed shapes and
        buffers; its spans go to ``eval_timeline``, and the stages' activation
        counts are left as the last step() left them.

        Returns:
            The merged output on the last stage, else None.
        """
        if self._eval is None:
            m = self.n_microbatches
            # Each of the rank's stages forwards every micro-batch, the stages in order
            # (on several stages per rank, the loop back to rank 0 waits for the round).
            program = lower([Action(st.stage_index, F, k) for st in self.stages
                             for k in range(m)], self.num_stages)
            transport = Transport(self.stage.comm, self.ranks)  # collective: every first eval()
            if self._closed:  # closed before: no new window either (collective, as close())
                transport.close()
            eager = _eager_sends(program) if transport.mpi else {}
            self._eval = _Plan(program, groups(program), eager, transport, train=False)
        # Under torch.inference_mode the buffers and shared slots made here would be
        # inference tensors, which a later step() or plain eval() may not write into;
        # the forwards run under no_grad all the same.
        with torch.inference_mode(False):
            return self._run(self._eval, args, target, losses, kwargs)

    def free(self) -> None:
        """Collective: ``close()``, and give back the communicators the schedule made
        (its step()'s and eval()'s). No step or eval after this; the stage's own
        communicator is the stage's (``stage.free()``)."""
        self._closed = True
        for plan in (self._train, self._eval):
            if plan is not None:
                plan.transport.free()
        self._tied.free()

    def renegotiate(self) -> None:
        """Agree the activations' shapes again at the next step() and eval(); call it on
        every rank before a step whose stage outputs change shape while the input's
        does not (data-dependent shapes)."""
        for plan in (self._train, self._eval):
            if plan is not None:
                plan.signature = None
                plan.transport.renegotiate()

    def _run(self, plan: _Plan, args: tuple, target, losses, kwargs: dict):
        m = self.n_microbatches
        x = _input(args)
        self._agree(plan, x, target, losses, kwargs)
        if self._first is None:
            self._xs = None
        elif isinstance(x, tuple):  # several inputs: micro-batch k takes row block k of each
            self._xs = list(zip(*(torch.tensor_split(t, m) for t in x)))
        else:
            self._xs = list(torch.tensor_split(x, m))
        self._kws = _split_kwargs(kwargs, m) if kwargs else None  # the first stage's
        last = self._last is not None
        self._ts = (list(torch.tensor_split(target, m)) if last and target is not None
                    else None)
        if plan.train:  # eval() holds nothing on the stage: its counts stay the step's
            for st in self.stages:
                st.reset()
                if st.ddp is not None:
                    data_parallel.start_step(st.ddp)
            self.timeline = []
            self.peak_activation_bytes = 0
            self._tied.start()
        else:
            self.eval_timeline = []
        # ("F" | "B", stage, mb): received by, or to be sent from, this rank's ``stage``.
        self._recv: dict[tuple[str, int, int], torch.Tensor] = {}
        self._send: dict[tuple[str, int, int], torch.Tensor] = {}
        self._outs: dict[int, torch.Tensor] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._sends = sends = []
        self._plan = plan
        plan.transport.start_step(plan.program)
        for run in plan.groups:
            try:
                if run[0].is_comm:
                    self._communicate(run, sends)
                elif plan.train:
                    self._compute(run[0])
                else:
                    self._evaluate(run[0])
            except PipelineError:
                raise
            except Exception as exc:
                comm = self.stage.comm
                raise PipelineError(
                    f"[r{comm.rank}] pipeline stage {run[0].stage} failed in "
                    f"{' '.join(map(str, run))} ({type(exc).__name__}: {exc}){_hint(exc)}; the other "
                    f"stages stop at their next wait for this one, within the communicator's "
                    f"deadline ({comm.timeout:g} s)") from exc
        for req in sends:
            req.wait()
        plan.transport.end_step()
        if plan.train:
            for st in self.stages:
                s = st.stage_index
                if st.ddp is not None and not (self._sync_in_b[s] or self._sync_in_w[s]):
                    data_parallel.reduce_now(st.ddp)
            self._tied.reduce()
        if losses is not None and last and self._losses:
            losses.clear()  # torch's step() replaces the list's contents, not appends
            losses.extend(self._losses[k] for k in range(m))
        outs = [self._outs[k] for k in range(m)] if last else []
        # Nothing of this step kept past it but what is returned (the last stage's
        # outputs would be held twice, beside the merged copy, until the next step).
        self._outs, self._losses, self._xs, self._ts = {}, {}, None, None
        self._kws = None
        if not outs:
            return None
        if not isinstance(outs[0], torch.Tensor):  # a tuple: each part merged
            return _like(outs[0], [_merged(list(col)) for col in zip(*outs)])
        return _merged(outs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """After ``step()``: clip every stage's gradients by the whole model's norm, as
        ``torch.nn.utils.clip_grad_norm_`` on the unsplit model; returns that norm.
        Collective over the pipeline (see ``mpiring/parallel/clip.py``)."""
        return clip.clip_grad_norm_(self.stages, max_norm, norm_type,
                                    error_if_nonfinite=error_if_nonfinite)

    def close(self) -> None:
        """Collective: free what the schedule holds between steps (the shared-memory window
        of stages on one host). Later steps still run, over MPI messages."""
        self._closed = True
        self.transport.close()
        if self._eval is not None:
            self._eval.transport.close()

    def _agree(self, plan: _Plan, x, target, losses, kwargs: dict) -> None:
        """Every rank's argument errors and the input's shape, in one small exchange."""
        m = self.n_microbatches
        has_first, has_last = self._first is not None, self._last is not None
        what = "step()" if plan.train else "eval()"
        # Before the checks: a to_empty() since the last step. A tied name that names
        # no parameter now (fully_shard took it) has the parameters checked again.
        check = not all([st.find_tied() for st in self.stages]) or not self._params_checked
        if plan.train and not torch.is_grad_enabled():
            # Every backward would find nothing to differentiate and the step would
            # train nothing, silently: refused, as loss.backward() would be.
            err = (f"{self._where}: step() under torch.no_grad() or torch.inference_mode() "
                   "computes no gradient: call it with autograd on, or call eval() for the "
                   "forwards alone")
        elif check and (bad := self._parameter_error()):
            err = bad
        elif "loss_kwargs" in kwargs:
            err = (f"{self._where}: loss_kwargs={kwargs['loss_kwargs']!r}: bind them into "
                   "loss_fn instead (functools.partial(loss_fn, **loss_kwargs)) when the "
                   "schedule is built")
        elif kwargs and not has_first:
            err = (f"{self._where}: keyword inputs {sorted(kwargs)}: they go to the first "
                   "stage's forward: give them on the rank that holds stage 0 only")
        else:
            err = _arg_error(self._where, has_first, has_last, self.num_stages, m, x, target,
                             losses, need_target=plan.train)
            if not err and kwargs:
                err = _kwarg_error(kwargs, x) or self._kwarg_fit(x, kwargs)
        first = x[0] if isinstance(x, tuple) else x
        rows_x = int(first.shape[0]) if has_first and not err else -1
        # eval() without a target: nothing to compare the input's rows with.
        rows_t = (int(target.shape[0]) if target is not None else -2) if has_last and not err \
            else -1
        shape = [-1] * (MAX_DIMS + 3)
        if has_first and not err:
            inputs = x if isinstance(x, tuple) else (x,)
            # Several inputs: their count and a checksum of every shape and dtype stand
            # for them (the row has a fixed size); the first one's shape in full.
            # The keyword inputs' too: a mask of another shape may change what flows.
            sig = repr([(str(t.dtype), tuple(t.shape)) for t in inputs] +
                       _kwarg_signature(kwargs)).encode()
            shape[:first.dim() + 3] = [len(inputs), zlib.crc32(sig),
                                       DTYPES.index(first.dtype) if first.dtype in DTYPES else -2,
                                       *first.shape]
        row = [int(bool(err)), rows_x, rows_t, *shape]
        comm = self.stage.comm
        table = comm.control.allgather_array(row) if comm.size > 1 else np.array([row])
        if table[:, 0].any():
            texts = comm.control.allgather_json(err) if comm.size > 1 else [err]
            raise ValueError(f"{what}: " + "; ".join(f"r{r}: {t}" for r, t in enumerate(texts)
                                                     if t))
        self._params_checked = True
        head, tail = table[self.ranks[0]], table[self.ranks[-1]]  # the first and last stage's
        if tail[2] != -2 and head[1] != tail[2]:
            raise ValueError(f"{what}: the input has {head[1]} rows on the first stage but "
                             f"the target {tail[2]} on the last; give them the same batch")
        signature = head[3:].tolist()
        if signature != plan.signature:  # a new input shape: agree the activations again
            plan.signature = signature
            plan.transport.renegotiate()

    def _kwarg_fit(self, x, kwargs: dict) -> str:
        """Whether stage 0's forward takes these keywords ("" if it does): a misspelled
        one would fail in the first forward, on this rank alone, mid-schedule."""
        key = (len(x) if isinstance(x, tuple) else 1, tuple(sorted(kwargs)))
        if key not in self._kwargs_fit:
            module = self._first.module
            try:
                inspect.signature(module.forward).bind(*((None,) * key[0]), **kwargs)
                self._kwargs_fit[key] = ""
            except TypeError as exc:
                self._kwargs_fit[key] = (f"stage 0: {type(module).__name__}.forward does not "
                                         f"take these inputs ({exc}): keyword inputs "
                                         f"{sorted(kwargs)} go to the first stage's forward")
            except ValueError:  # no signature to read (a builtin): its forward will say
                self._kwargs_fit[key] = ""
        return self._kwargs_fit[key]

    def _parameter_error(self) -> str | None:
        """Why this rank's stages cannot step with the parameters they hold, or None."""
        if any(t.is_meta for st in self.stages
               for t in (*st.module.parameters(), *st.module.buffers())):
            # A stage built on "meta" (torchtitan's order) before its to_empty(): its
            # forward would fail on this rank alone, mid-schedule, and leave the others
            # waiting for it until the deadline.
            return (f"{self._where}: parameters or buffers on the meta device: materialize "
                    "them first (module.to_empty(device=...), then initialize the weights)")
        stale = [i for st in self.stages for i, p in enumerate(st.tied_parameters)
                 if not any(p is q for q in st.module.parameters())]
        if stale:
            # The tied sum would add gradients that no backward writes (to_empty or
            # fully_shard took the Parameter out of the module), silently.
            return (f"{self._where}: tied_parameters {stale} are no longer parameters of the "
                    "stage's module (to_empty() or fully_shard replaced them, and no "
                    "parameter of the module has their name now): give PipelineStage the "
                    "parameters the module holds when it steps")
        return None

    def _compute(self, a: Action) -> None:
        st, t0, t1 = self._at[a.stage], time.perf_counter(), None
        s = a.stage
        if a.kind == F:
            x = self._xs[a.mb] if st.is_first else self._received(s, a.mb)
            out, loss = st.forward(a.mb, x, recompute=self.recompute, stash=self.stash,
                                   target=self._ts[a.mb] if st.is_last else None,
                                   loss_fn=self.loss_fn, scale=self.scale,
                                   max_held=self.max_held_bytes, split=(s, a.mb) in self._split,
                                   kwargs=self._kws[a.mb] if st.is_first and self._kws else None)
            if st.is_last:
                self._outs[a.mb], self._losses[a.mb] = _detached(out), loss.detach()
            else:
                t1 = self._hand_on(a, out)
        elif a.kind == B:
            grad = None if st.is_last else self._grad(s, a.mb)
            gin = st.backward(a.mb, grad, split=(s, a.mb) in self._split,
                              sync=self._sync_in_b[s] and a.mb == self._last_b[s])
            self.after_backward(a.mb)  # PipeDream's update: compute, before the send
            if not st.is_first:
                t1 = self._output(a, gin.contiguous() if isinstance(gin, torch.Tensor)
                                  else packing.pack(gin))
        else:
            st.weight(a.mb, sync=self._sync_in_w[s] and a.mb == self._last_w[s])
        self._record(a, t0, time.perf_counter() if t1 is None else t1)
        if st.count_activations and len(self.stages) > 1:
            # The rank's stages together, between actions (each peaks at its F's end).
            live = sum(x.live_bytes for x in self.stages)
            self.peak_activation_bytes = max(self.peak_activation_bytes, live)

    def _record(self, a: Action, t0: float, t1: float) -> None:
        """The compute span of ``a``: in this step's timeline, and the trace's."""
        st = self._at[a.stage]
        (self.timeline if self._plan.train else self.eval_timeline).append(Span(a, t0, t1))
        tracer = st.comm.tracer
        if tracer.enabled:
            tracer.event(str(a), "pipeline", t0, t1, action=a.kind, stage=a.stage, mb=a.mb,
                         schedule=self.name if self._plan.train else f"{self.name}.eval",
                         microbatches=self.n_microbatches,
                         replica=0 if st.ddp is None else st.ddp.comm.rank)

    def _hand_on(self, a: Action, out) -> float:
        """Send forward ``a``'s output (one tensor, or a tuple packed into one message)."""
        if isinstance(out, torch.Tensor):
            return self._output(a, out.detach().contiguous())
        return self._output(a, packing.pack([o.detach() for o in _parts(out)]))

    def _evaluate(self, a: Action) -> None:
        """Micro-batch ``a.mb``'s forward alone (eval()): nothing kept for a backward."""
        st, t0 = self._at[a.stage], time.perf_counter()
        x = self._xs[a.mb] if st.is_first else self._received(a.stage, a.mb)
        kw = self._kws[a.mb] if st.is_first and self._kws else {}
        with torch.no_grad():
            out = st.module(*(x if isinstance(x, tuple) else (x,)), **kw)
            if st.is_last and self._ts is not None:
                self._losses[a.mb] = self.loss_fn(out, self._ts[a.mb]).detach()
        if st.is_last:
            self._outs[a.mb] = _detached(out)
            t1 = time.perf_counter()
        else:
            t1 = self._hand_on(a, out)
        self._record(a, t0, t1)

    def _received(self, stage: int, mb: int):
        """Micro-batch ``mb``'s input to ``stage`` from the stage before: its tensor, or
        its parts."""
        buf = self._recv.pop(("F", stage, mb))
        layout = self._plan.transport.layout(stage, mb)
        return buf if layout is None else packing.unpack(buf, layout)

    def _grad(self, stage: int, mb: int):
        """The gradient of micro-batch ``mb``'s output of ``stage``, from the stage after
        (per floating-point part, for a tuple)."""
        buf = self._recv.pop(("B", stage, mb))
        out = self._at[stage]._out[mb]
        if isinstance(out, torch.Tensor) or isinstance(buf, tuple):  # a tuple: handed over
            return buf
        return packing.unpack(buf, packing.grad_layout(_layout(out)))

    def _grad_like(self, stage: int, mb: int):
        """What the gradient of micro-batch ``mb``'s output of ``stage`` arrives as (shape
        and dtype)."""
        out = self._at[stage]._out[mb]
        if isinstance(out, torch.Tensor):
            return out
        _, total = packing.spans(packing.grad_layout(_layout(out)))
        return torch.empty(total, dtype=torch.uint8, device="meta")

    def _output(self, a: Action, t: torch.Tensor) -> float:
        """Hand ``a``'s output to the transport: sent now if the program sends it next.

        Returns the compute action's end (before the send: posting it is not compute).
        """
        t1 = time.perf_counter()
        to = a.stage + 1 if a.kind == F else a.stage - 1
        if to in self._at:  # this rank's own next stage (ZB-V's turn): handed over as it is
            self._recv[(a.kind, to, a.mb)] = (packing.unpack(t.data, t.layout)
                                              if isinstance(t, packing.Packed) else t)
            return t1
        key = (a.kind, a.stage, a.mb)
        send = self._plan.eager.get(key)
        if send is not None:
            self._plan.transport.send(send, t, self._sends)
        else:
            self._send[key] = t
        return t1

    def _communicate(self, run: list[Action], sends: list) -> None:
        self._plan.transport.exchange(run, self._send, self._recv, self._grad_like, sends)

    # --- what the schedules change -------------------------------------------------
    recompute = False
    stash = False
    allows_ddp = True
    max_held_bytes: int | None = None  # ScheduleZeroBubble's memory limit
    placement = "loop"  # the stages' ranks (schedules.stage_ranks)

    def after_backward(self, mb: int) -> None:
        """Called after each micro-batch's B (PipeDream updates the weights here)."""


def reduction_points(program: list[Action], stage: int) -> tuple[bool, bool]:
    """Where ``stage``'s data-parallel replicas reduce in ``program``: (in its last B, in
    its last W), at most one of them.

    In the stage's last gradient-writing action, whose buckets then overlap it: the
    last B when it comes after every W (a whole backward: 1F1B's, or DualPipeV's
    head stage, whose split backwards' W's run in the warm-up), else the last W (W
    writes .grad outside autograd; that W runs through it: ``data_parallel``).
    """
    last_b = max((i for i, a in enumerate(program) if a.stage == stage and a.kind == B),
                 default=-1)
    last_w = max((i for i, a in enumerate(program) if a.stage == stage and a.kind == W),
                 default=-1)
    return last_b > last_w, last_w > last_b


def _local_stages(stage, placement: str = "loop") -> list[PipelineStage]:
    """This rank's stages, in order, from one ``PipelineStage`` or a list of them; a
    ValueError naming the fix, on every rank (collective over the lowest stage's
    communicator), for a list that is not the placement's (r, r + p, ...; or ZB-V's
    r, 2p-1-r) of one pipeline."""
    stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    if not stages or not all(isinstance(st, PipelineStage) for st in stages):
        raise TypeError("give the schedule this rank's PipelineStage, or a list of them "
                        "(one per stage the rank holds)")
    first = stages[0]
    p, n = first.comm.size, first.num_stages
    got = [st.stage_index for st in stages]
    err = ""
    try:
        want = stages_of(first.comm.rank, p, n, placement)
    except ValueError as exc:  # ZB-V's V on a pipeline of other than 2 stages per rank
        err = f"{exc}: build 2 stages per rank, of num_stages={2 * p}"
    else:
        if got != want or any(st.num_stages != n for st in stages):
            err = (f"this rank's stages are {got} of {[st.num_stages for st in stages]}; with "
                   f"{n} stages on {p} ranks, rank {first.comm.rank} holds stages {want}: give "
                   "all of them, in that order")
        elif any(st.comm.world_ranks != first.comm.world_ranks for st in stages):
            # Every message goes over the first stage's communicator: a stage checked
            # against other processes would be fed by ranks it never agreed with.
            err = ("this rank's stages were built on different communicators: build every "
                   "stage of the pipeline on the same one")
    if p > 1:  # the others are about to agree the schedule: all raise, or none
        # On the lowest stage's communicator: the same round on every rank, whatever
        # order a rank gave its list in.
        low = min(stages, key=lambda st: st.stage_index)
        errors = low.comm.control.allgather_json(err)
        err = "; ".join(f"r{r}: {e}" for r, e in enumerate(errors) if e)
    if err:
        raise ValueError(err)
    return stages


class _TiedPair:
    """The parameters tied between the first and the last stage, summed after each step.

    With one stage per rank the two stages' ranks share ``stage.tied_comm``. A rank
    holding several stages sums over a pair of ranks of its own, made here
    (collective), or, when it holds both ends (one rank), adds the two copies itself.
    """

    def __init__(self, stages: list[PipelineStage], multi: bool):
        self.comm, self.params, self.local, self.owned = None, [], None, multi
        self._before: list[torch.Tensor | None] = []
        st = stages[0]
        if not multi:
            self.comm, self.params = st.tied_comm, st.tied_parameters
            return
        n = st.num_stages
        ends = [x for x in stages if x.stage_index in (0, n - 1) and x.tied_parameters]
        mine = [[x.stage_index, tied_layout(x.tied_parameters)] for x in ends]
        table = st.comm.control.allgather_json(mine) if st.comm.size > 1 else [mine]
        by_stage = {s: desc for rows in table for s, desc in rows}
        if by_stage and by_stage.get(0) != by_stage.get(n - 1):
            raise ValueError(f"tied_parameters differ: stage 0 {by_stage.get(0)}, stage {n - 1} "
                             f"{by_stage.get(n - 1)} (shapes, then dtype and requires_grad): "
                             "give the same tied parameters, in order, on both")
        if not by_stage:
            return
        if any(len(rows) == 2 for rows in table):  # both ends on one rank (ZB-V's rank 0)
            if len(ends) == 2:  # this one
                self.local = (ends[0].tied_parameters, ends[1].tied_parameters)
            return  # no pair to make, on any rank
        self.comm = st.comm.split(0 if ends else None, key=st.comm.rank)
        self.params = ends[0].tied_parameters if ends else []

    def _summed(self) -> list[torch.Tensor]:
        # The copies whose gradients reduce() sums in: the pair's, or the last stage's
        # when this rank holds both ends.
        return list(self.local[1]) if self.local is not None else list(self.params)

    def start(self) -> None:
        """Before a step: what the tied gradients already hold (accumulated over earlier
        steps without zero_grad, the same on both ends after the last reduce), so that
        reduce() sums this step's part alone: summing the whole .grad would count the
        earlier steps twice, where the unsplit model counts them once."""
        self._before = [None if q.grad is None or not q.grad.any() else q.grad.detach().clone()
                        for q in self._summed()]

    def reduce(self) -> None:
        before = self._before or [None] * len(self._summed())
        self._before = []
        if self.local is not None:
            for a, b, old in zip(*self.local, before):
                if a is b or not a.requires_grad:  # one Parameter, or frozen on both ends
                    continue
                for q in (a, b):
                    if q.grad is None:
                        q.grad = torch.zeros_like(q)
                a.grad.add_(b.grad)  # in place: a DDP bucket view stays the bucket's
                if old is not None:
                    a.grad.sub_(old)
                b.grad.copy_(a.grad)
            return
        if self.comm is None:
            return
        for q, old in zip(self.params, before):
            if not q.requires_grad:  # frozen on both ends (agreed): no gradient to sum
                continue
            if q.grad is None:
                q.grad = torch.zeros_like(q)
            g = q.grad.detach()
            if old is not None:
                g.sub_(old)           # this step's part: the earlier steps' is on both ends
            self.comm.all_reduce(g)   # in place, on the same storage
            if old is not None:
                g.add_(old)

    def free(self) -> None:
        """The pair's own communicator (several stages per rank; with one, the stage's
        ``tied_comm`` is the stage's to free)."""
        if self.owned and self.comm is not None:
            self.comm.free()
        self.comm = None


def _hint(exc: Exception) -> str:
    """The fix for a failure whose torch message names a symptom, not the cut."""
    if "leaf Variable that requires grad is being used in an in-place" in str(exc):
        # A received input is a leaf (its gradient goes back to the stage before), as
        # in torch's pipelining; without the pipeline the same op had a graph before it.
        return (" - the stage changes its received input in place (an inplace=True "
                "activation first?): make that op out of place, or cut the model elsewhere")
    return ""


def _merged(outs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(outs) if outs[0].dim() == 0 else torch.cat(outs)  # 0-dim: a loss


def _parts(out) -> tuple:
    """A non-last stage's output as the parts of a packed boundary, or the fix."""
    if isinstance(out, (tuple, list)):
        why = packing.check_parts(out, DTYPES, MAX_DIMS)
    else:
        why = (f"a {type(out).__name__}; a stage hands the next one a tensor or a tuple of "
               "tensors (its forward's positional arguments): return the tensors in a tuple")
    if why:
        raise TypeError(f"the stage's forward returned {why}")
    return tuple(out)


def _layout(out) -> packing.Layout:
    return tuple((o.dtype, tuple(o.shape)) for o in out)


def _like(seq, items: list):
    """``items`` in a sequence of ``seq``'s type (a namedtuple's fields by position)."""
    kind = type(seq)
    return kind._make(items) if hasattr(kind, "_make") else kind(items)


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return _like(out, [o.detach() for o in out])
    raise TypeError(f"the last stage's forward returned a {type(out).__name__}; step() merges "
                    "a tensor or a tuple of tensors: return those (loss_fn gets the same)")


def _eager_sends(program: list[Action]) -> dict[tuple[str, int, int], Action]:
    """(kind, stage, mb) -> the send of that compute action's output, where the program
    lists it in the run right after the action (what ``schedules.lower`` always does)
    and no send of the same stage on the same channel comes before it in that run
    (messages between a pair of stages arrive in the order they were posted, so
    posting it early must not overtake one)."""
    out = {}
    for i, a in enumerate(program):
        if a.is_comm:
            continue
        for b in program[i + 1:]:
            if not b.is_comm:
                break
            if b.kind in (SEND_F, SEND_B) and b.channel == a.kind and b.stage == a.stage:
                if b.mb == a.mb:
                    out[(a.kind, a.stage, a.mb)] = b
                break  # the first send on this channel in the run; a later one must wait
    return out


def _arg_error(where: str, first: bool, last: bool, num_stages: int, m: int, x, target,
               losses, *, need_target: bool = True) -> str:
    """What is wrong with step()'s arguments on a rank holding ``where`` (its stages;
    ``first``/``last``: whether they include the first and the last), or ""."""
    def rows(name, t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return f"give {name} as a tensor with a batch dimension"
        if t.shape[0] == 0:  # no micro-batch count fits: the batch is what is wrong
            return (f"{name} has 0 rows (an empty batch): give at least n_microbatches={m} "
                    "rows, one per micro-batch")
        if t.shape[0] < m:
            return (f"{name} has {t.shape[0]} rows, fewer than n_microbatches={m}: use at most "
                    f"{t.shape[0]} micro-batches or a larger batch")
        return ""
    if first:
        inputs = x if isinstance(x, tuple) else (x,)
        for i, t in enumerate(inputs):
            name = "x" if len(inputs) == 1 else f"input {i}"
            if (e := rows(name, t)):
                return f"stage 0: {e}"
            if t.dim() > MAX_DIMS:  # the first one's shape is a row of the step's agreement
                return (f"stage 0: {name} has {t.dim()} dimensions; the first stage's inputs "
                        f"may have up to {MAX_DIMS}: fold some into one (x.flatten(1, 2), say)")
        if len({int(t.shape[0]) for t in inputs}) > 1:
            return (f"stage 0: the inputs have {[int(t.shape[0]) for t in inputs]} rows; each "
                    "is split into the micro-batches along dim 0: give them one batch size")
    elif x is not None:
        return f"{where}: x is given, but only the first stage takes the input"
    if last:
        if (need_target or target is not None) and (e := rows("target", target)):
            return f"stage {num_stages - 1}: {e}"
        if losses is not None and not isinstance(losses, list):
            return f"stage {num_stages - 1}: losses must be a list (or None)"
    elif target is not None:
        return f"{where}: target is given, but only the last stage takes it"
    return ""


def _split_kwarg(v) -> bool:
    """Whether a keyword input's leaf is split into the micro-batches (a tensor with rows)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0


def _split_kwargs(kwargs: dict, m: int) -> list[dict]:
    """Each micro-batch's keyword inputs: every tensor with rows, inside lists, tuples and
    dicts too (torch's flattening), split along dim 0 as the input is; the rest as given."""
    leaves, spec = tree_flatten(kwargs)
    parts = [torch.tensor_split(v, m) if _split_kwarg(v) else None for v in leaves]
    return [tree_unflatten([v if p is None else p[i] for v, p in zip(leaves, parts)], spec)
            for i in range(m)]


def _kwarg_error(kwargs: dict, x) -> str:
    """What is wrong with the first stage's keyword inputs' rows, or ""."""
    rows = int((x[0] if isinstance(x, tuple) else x).shape[0])
    bad = {}
    for k, v in kwargs.items():
        got = [int(t.shape[0]) for t in tree_flatten(v)[0] if _split_kwarg(t)]
        if any(n != rows for n in got):
            bad[k] = got[0] if len(got) == 1 else got
    if bad:
        return (f"stage 0: keyword inputs {bad} (rows) are split into the micro-batches "
                f"along dim 0 as the input is, which has {rows} rows: give them the same "
                "batch size (or a 0-dim tensor, or a non-tensor, to pass as it is)")
    return ""


def _kwarg_signature(kwargs: dict) -> list:
    """What of the keyword inputs may set the activations' shapes: each tensor's dtype and
    shape, each int, bool, string or None itself (a width, a flag); of anything else its
    type (a float changing every step must not re-agree every step)."""
    def leaf(v):
        if isinstance(v, torch.Tensor):
            return (str(v.dtype), tuple(v.shape))
        return v if v is None or isinstance(v, (int, str)) else type(v).__name__
    return [(k, [leaf(v) for v in tree_flatten(kwargs[k])[0]]) for k in sorted(kwargs)]


def _input(args: tuple):
    """step()'s positional arguments: None (no input on this stage), one tensor, or a tuple."""
    if len(args) == 0 or (len(args) == 1 and args[0] is None):
        return None
    return args[0] if len(args) == 1 else tuple(args)


class _Plan:
    """What one kind of step runs: this rank's program, its runs of actions, the sends
    posted by the action before them, and the transport (shapes agreed per plan)."""

    def __init__(self, program, runs, eager, transport, *, train: bool = True):
        self.program, self.groups, self.eager, self.transport = program, runs, eager, transport
        self.train = train
        self.signature: list[int] | None = None


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards; ``recompute=True`` keeps only each
    micro-batch's stage input and runs its forward again in backward."""

    name = "gpipe"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None, *,
                 recompute: bool = False, scale_grads: bool = True):
        self.recompute = recompute
        super().__init__(stage, n_microbatches, loss_fn, scale_grads=scale_grads)


class Schedule1F1B(PipelineSchedule):
    """1F1B: warm-up, one forward and one backward in turn, cool-down; at most
    min(p - i, m) micro-batches in flight on stage i."""

    name = "1f1b"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None, *,
                 scale_grads: bool = True):
        super().__init__(stage, n_microbatches, loss_fn, scale_grads=scale_grads)


class ScheduleZeroBubble(PipelineSchedule):
    """ZB-H1: 1F1B with the backward split into B (input) and W (weights), W
    deferred into the cool-down's bubbles; as many micro-batches in flight as
    1F1B's first stage.

    ``max_held_bytes``: the most this rank's deferred weight gradients may keep
    alive (their layers' inputs and output gradients) through each forward,
    where a stage's activations peak: a memory limit in the spirit of the
    zero-bubble paper's. Before a forward, the queued W's beyond it run at once
    (on the critical path, so the bubble grows: those with the least weight-gradient
    work per byte they keep first), the rest wait for their W. Between forwards (the
    cool-down's B's) the queues may hold more, below the peak. For a stage whose
    micro-batches are larger than the first stage's, ``1F1B's peak on the first
    stage - its own 1F1B peak`` keeps its peak at 1F1B's (``bench-pp`` measures it).
    None: no limit.
    """

    name = "zb"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None, *,
                 scale_grads: bool = True, max_held_bytes: int | None = None):
        if max_held_bytes is not None and (isinstance(max_held_bytes, bool) or
                                           not isinstance(max_held_bytes, int) or
                                           max_held_bytes < 0):
            raise ValueError(f"max_held_bytes={max_held_bytes!r}: give a number of bytes >= 0, "
                             "or None for no limit")
        super().__init__(stage, n_microbatches, loss_fn, scale_grads=scale_grads)
        self.max_held_bytes = max_held_bytes


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B (Megatron-LM's virtual pipeline, torch's class of the same name):
    each rank holds v stages, r, r + p, ..., and runs them 1F1B-fashion in rounds of p
    micro-batches; the bubble is (p-1)/(vm+p-1), v times smaller than 1F1B's, for v
    times the messages. MPI only (the sends of a rank's stages cross; see
    ``schedules.interleaved_1f1b``). Give m a multiple of p: otherwise the rounds
    are larger, and so is the warm-up's memory (for p < m < 2p, GPipe's m).

    ``stages``: this rank's ``PipelineStage`` list, in stage order (one stage: 1F1B).
    """

    name = "interleaved"

    def __init__(self, stages: list[PipelineStage] | PipelineStage, n_microbatches: int,
                 loss_fn=None, *, scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads)


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """Interleaved zero bubble (torch's class of the same name; the zero-bubble paper's
    ZB-H1 on v stages per rank): ``ScheduleInterleaved1F1B``'s stages and order, the
    backward split into B and W as in ``ScheduleZeroBubble``, rank r holding back its
    first r W's to fill the cool-down. With equal F, B and W times the bubble is a
    third of the interleaved one, with no more micro-batches in flight. MPI only, as
    the interleaved schedule (see ``schedules.interleaved_zb``). Give m a multiple
    of p, as there: a larger first round is a longer warm-up, and more memory.

    ``stages``: this rank's ``PipelineStage`` list, in stage order (one stage: ZB-H1).
    """

    name = "interleaved-zb"

    def __init__(self, stages: list[PipelineStage] | PipelineStage, n_microbatches: int,
                 loss_fn=None, *, scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads)


class ScheduleZBVZeroBubble(PipelineSchedule):
    """ZB-V (the zero-bubble paper's V schedule; torch's class of the same name): 2p
    stages in a V, rank r holding stages r and 2p-1-r, the backward split into B and
    W as in ``ScheduleZeroBubble``. With equal F, B and W times and m >= 2p the only
    idle is the lead (p-1 stage forwards on rank p-1), at 1F1B's peak count of
    micro-batches in flight. The last stage's activations turn round on rank p-1
    without a message; rank 0 holds the input and the loss (and both ends of a tied
    embedding). MPI only, as the interleaved schedule (see ``schedules.zb_v``).

    ``stages``: this rank's two ``PipelineStage`` objects, in stage order (r, 2p-1-r).
    """

    name = "zbv"
    placement = "v"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None, *,
                 scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads)


class ScheduleDualPipeV(PipelineSchedule):
    """DualPipeV (DeepSeek's DualPipe cut in half; torch's class of the same name): ZB-V's
    2p stages in a V (rank r holds stages r and 2p-1-r) in DeepSeek's phases, the steady
    state a forward of one stage beside a full backward of the other, the backward split
    only in the warm-up and the cool-down (see ``schedules.dualpipe_v``). On a GPU the
    pair overlaps, hiding an expert-parallel all-to-all behind the other's compute; here
    they run one after the other, so the gain over ZB-V is its order: never more idle
    than ZB-V in the simulations, less from p = 3 on when F, B and W differ (p = 2: unless
    W is the longest), for one more stage micro-batch in flight (2p + 1). Needs
    n_microbatches >= 2p. MPI only, as ZB-V.

    ``stages``: this rank's two ``PipelineStage`` objects, in stage order (r, 2p-1-r).
    """

    name = "dualpipev"
    placement = "v"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None, *,
                 scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads)


class ScheduleLoopedBFS(PipelineSchedule):
    """Looped BFS (breadth-first pipelining; torch's class of the same name): the
    interleaved placement (rank r holds stages r, r + p, ...), each stage running all
    its micro-batches' forwards back to back, then the backwards, last stage first (see
    ``schedules.looped_bfs``). Every micro-batch is in flight on every stage at the turn,
    as in GPipe; from m = p the idle is the interleaved schedule's. Several stages per
    rank run on MPI only, as the interleaved schedule.

    ``stages``: this rank's ``PipelineStage`` list, in stage order (one stage: GPipe's
    order with the backwards reversed).
    """

    name = "looped-bfs"

    def __init__(self, stages: list[PipelineStage] | PipelineStage, n_microbatches: int,
                 loss_fn=None, *, scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=scale_grads)

