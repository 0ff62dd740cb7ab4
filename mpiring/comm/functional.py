"""torch.distributed's collective and point-to-point functions, over mpiring's Communicator.

    import mpiring as dist                       # where a script had torch.distributed
    dist.init_process_group()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # mpiring's ring, traced and deadline-checked
    dist.broadcast(weights, src=0)
    dist.barrier()

Each function takes torch's arguments and runs the Communicator's own call on
``group`` (a Communicator; None: the default one from ``init_process_group``).
As in torch, ``src``/``dst`` are ranks of the whole job (``group_src``/``group_dst``:
ranks of ``group``), and ``all_gather_into_tensor``/``reduce_scatter_tensor`` take
an output and an input of ``group.size`` equal parts.

The collectives finish before they return: ``async_op=True`` gives a handle whose
``wait()`` returns at once and whose ``get_future()`` holds the outputs, as torch's
over gloo. ``isend``/``irecv`` return a handle on the Communicator's request, which
does overlap. ``recv``/``irecv`` with ``src=None`` (and no ``group_src``) take a
message from any rank of the group (MPI's ANY_SOURCE; the NCCL backend refuses
it): ``recv`` returns the sender's job rank and an ``irecv`` handle's
``source_rank()`` its rank in the group, as torch's do. A ``P2POp`` names its
peer, as torch's does.

Tensors of every dtype gloo takes are taken: bool travels as its bytes (so SUM and
MAX are a logical or, PRODUCT and MIN an and, as gloo's), complex as its pairs of
floats (SUM and AVG; torch refuses the other reductions on complex tensors).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from mpiring.comm.communicator import Communicator
from mpiring.comm.default import (
    BACKEND_NAMES,
    NON_GROUP_MEMBER,
    NotInGroup,
    backend_name,
    default_comm,
    require_default,
    resolve,
    seconds,
)
from mpiring.comm.p2p import check_tag
from mpiring.core import objects
from mpiring.core.buffers import as_buffer

__all__ = ["Backend", "P2POp", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor",
           "all_gather_object", "all_gather_single", "all_reduce", "all_to_all",
           "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
           "broadcast_object_list", "gather", "gather_object", "get_backend",
           "get_global_rank", "get_group_rank", "get_node_local_rank",
           "get_process_group_ranks", "irecv", "is_available", "is_backend_available",
           "is_gloo_available", "is_mpi_available", "is_nccl_available",
           "is_torchelastic_launched", "is_ucc_available", "isend", "monitored_barrier",
           "new_group", "new_subgroups", "new_subgroups_by_enumeration", "recv",
           "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_single",
           "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
           "send_object_list"]


class ReduceOp:
    """torch's reduction names, as the strings mpiring's collectives take."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "prod"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"  # named so that code can test for it; refused by _op


_TORCH_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max",
              "BAND": "band", "BOR": "bor", "BXOR": "bxor"}
# What each op does to 0/1 bytes: gloo reduces bool with C++'s bool arithmetic, where
# a sum saturates at true (or) and a product is an and.
_BOOL_OPS = {"sum": "max", "max": "max", "bor": "max", "prod": "min", "min": "min",
             "band": "min", "bxor": "bxor"}


def _op(op: Any, what: str, tensor=None) -> str:
    """mpiring's op for ``op`` (ours, or torch.distributed.ReduceOp's member of that name)
    on ``tensor``'s dtype: bool's as its bytes reduce, complex only SUM and AVG."""
    if isinstance(op, str) and op in _TORCH_OPS.values():
        how = op
    else:
        # torch's ReduceOp(...) object (what its own code passes around) holds its
        # RedOpType in .op; the RedOpType member is what the name lookup below reads.
        inner = getattr(op, "op", None)
        op = inner if inner is not None and not isinstance(op, str) else op
        # torch's ReduceOp.SUM prints as "RedOpType.SUM" (or "ReduceOp.SUM"): its last part.
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        if name not in _TORCH_OPS:
            raise ValueError(f"{what}: op={op!r}: use ReduceOp.SUM, AVG, PRODUCT, MIN, MAX, "
                             "BAND, BOR or BXOR (PREMUL_SUM: multiply the tensor first, "
                             "then SUM)")
        how = _TORCH_OPS[name]
    kind = _kind(tensor)
    if kind == "bool":
        if how == "avg":
            raise ValueError(f"{what}: AVG of a bool tensor is not a bool: use SUM (a "
                             "logical or) or PRODUCT (an and), or cast to a float dtype")
        return _BOOL_OPS[how]
    if kind == "complex" and how not in ("sum", "avg"):
        raise ValueError(f"{what}: {how} is not defined on complex tensors (as in torch): "
                         "use SUM or AVG, or reduce the real and imaginary parts yourself")
    return how


def _kind(x) -> str:
    """"bool", "complex" or "" for a tensor's or an array's dtype (anything else: "")."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return ""
    if hasattr(x, "is_complex"):  # torch
        return "complex" if x.is_complex() else "bool" if x.dtype is _torch_bool() else ""
    kind = getattr(dtype, "kind", "")  # NumPy's and CuPy's
    return "complex" if kind == "c" else "bool" if kind == "b" else ""


def _torch_bool():
    import torch  # a torch tensor is in hand, so torch is imported already

    return torch.bool


def _wire(x):
    """``x`` as mpiring's collectives move it, over the same memory: a bool tensor as
    uint8 (gloo moves bools as bytes too), a complex one as its (real, imaginary) float
    pairs (torch's ``view_as_real``: what torch itself sends for complex). Others as
    they are."""
    kind = _kind(x)
    if not kind:
        return x
    if hasattr(x, "is_complex"):  # torch
        import torch

        return torch.view_as_real(x) if kind == "complex" else x.view(torch.uint8)
    if kind == "bool":
        return x.view("uint8")
    # An array's complex view needs its last axis contiguous: a strided one is refused
    # by the buffer check, naming the dtype.
    return x.view(x.real.dtype) if x.flags.c_contiguous else x


class Work:
    """What ``async_op=True`` returns: the call has already completed; the handle holds
    its output tensors (torch's ``Work.result()`` and ``get_future().value()``)."""

    __slots__ = ("_outputs",)

    def __init__(self, outputs: list | tuple = ()):
        self._outputs = list(outputs)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list:
        """The output tensors, in torch's order."""
        return list(self._outputs)

    def get_future(self):
        """A completed ``torch.futures.Future`` whose value is ``result()`` (for
        ``.then()`` chains written against torch's Work)."""
        import torch

        fut = torch.futures.Future()
        fut.set_result(self.result())
        return fut


class _P2PWork(Work):
    """What the drop-in's ``isend``/``irecv`` return: torch's Work over mpiring's Request
    (``wait()`` completes the message and returns True, as torch's)."""

    __slots__ = ("_req",)

    def __init__(self, req, tensor):
        super().__init__([tensor])
        self._req = req

    def wait(self, timeout: Any = None) -> bool:
        self._req.wait()  # under the Communicator's deadline
        return True

    def is_completed(self) -> bool:
        return self._req.test()

    def source_rank(self) -> int:
        """The sender's rank in the handle's group (a receive's), as torch's
        ``Work.source_rank`` gives it; from any source, once ``wait()`` has returned."""
        if self._req._op != "recv":
            raise ValueError("source_rank: this handle is a send's; only a receive has a "
                             "source")
        return self._req.source

    _source_rank = source_rank  # the name torch's own recv calls

    def get_future(self):
        self.wait()
        return super().get_future()


def _done(async_op: bool, *outputs) -> Work | None:
    return Work(outputs) if async_op else None


def _members_only(fn):
    """torch's rule for a rank outside ``group`` (``new_group`` gave it NON_GROUP_MEMBER):
    the call does nothing there but warn, so a script may call a group's collective on
    every rank. (resolve() raises NotInGroup first thing, before any byte moves.)"""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotInGroup:
            warnings.warn(f"{fn.__name__}: this rank is not in the group it was given "
                          "(NON_GROUP_MEMBER): nothing done here", stacklevel=2)
            return None
    return call


def _data(x):
    """``x``'s memory as mpiring moves it (``_wire``): for a tensor that requires grad, its
    detached alias.

    torch's collectives write a parameter in place outside autograd
    (``dist.broadcast(p, 0)`` syncs a model); the Communicator refuses such a
    tensor so that its own callers notice, and a ported script keeps torch's rule.
    """
    return _wire(x.detach() if getattr(x, "requires_grad", False) else x)


def _dense(x):
    """``x`` (``_data``), or a contiguous copy of it when it is strided (a transposed
    view, a slice). torch's collectives read and write strided tensors in place;
    mpiring's move flat buffers, so a strided one goes through a copy and
    ``_assign`` writes the result back."""
    x = _data(x)
    if _contiguous(x):
        return x
    # torch's, or an array's copy (NumPy's and CuPy's are C-ordered).
    return x.contiguous() if hasattr(x, "contiguous") else x.copy()


def _assign(x, values) -> None:
    """Write ``values`` (any layout, ``x``'s element count) into ``x`` in place, whatever
    ``x``'s strides: not through ``reshape(-1)``, which copies a strided tensor."""
    x = _data(x)
    if hasattr(x, "copy_"):  # torch
        x.copy_(values.reshape(x.shape))
    else:
        x[...] = values.reshape(x.shape)


def _in_place(x, run) -> None:
    """``run(buf)`` on ``x``'s data in one contiguous buffer, written back if it was a copy."""
    buf = _dense(x)
    run(buf)
    if not _contiguous(x):
        _assign(x, buf)


def _group_rank(comm: Communicator, world_rank: int | None, group_rank: int | None,
                what: str, name: str) -> int:
    """``group``'s rank for torch's ``src``/``dst`` (a job rank) or ``group_src``/``group_dst``."""
    if (world_rank is None) == (group_rank is None):
        raise ValueError(f"{what}: give exactly one of {name}= (a rank of the job) and "
                         f"group_{name}= (a rank of the group)")
    if group_rank is not None:
        if not 0 <= int(group_rank) < comm.size:
            raise ValueError(f"{what}: group_{name}={group_rank} is not a rank of this "
                             f"{comm.size}-rank group")
        return int(group_rank)
    ranks = comm.world_ranks
    if int(world_rank) not in ranks:
        raise ValueError(f"{what}: {name}={world_rank} is not in the group (its ranks in the "
                         f"job: {list(ranks)}); pass a member, or group_{name}= for a rank of "
                         "the group")
    return ranks.index(int(world_rank))


def is_available() -> bool:
    """True: mpiring's collectives are always built (torch's check for its C extension)."""
    return True


class Backend(str):
    """torch's ``Backend``: a backend's lowercase name (``Backend("GLOO") == "gloo"``),
    and the names as constants. mpiring runs "mpi" and "gloo" on its MPI backend."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    UCC = "ucc"
    XCCL = "xccl"
    default_device_backend_map = {"cpu": "gloo", "cuda": "nccl"}

    def __new__(cls, name: str):
        if not isinstance(name, str):
            raise ValueError(f"Backend({name!r}): give a backend's name, e.g. 'gloo'")
        value = name.lower()
        if value not in BACKEND_NAMES:
            raise ValueError(f"Backend({name!r}): mpiring runs 'mpi' and 'gloo' (its MPI "
                             "backend) and 'nccl'")
        return str.__new__(cls, value)


def get_backend(group: Communicator | None = None) -> Backend:
    """The group's backend, by the name ``init_process_group`` was given ("gloo" when the
    script asked for gloo, which mpiring's MPI backend serves), else "mpi" or "nccl"."""
    return Backend(backend_name(resolve(group, "get_backend")))


def is_mpi_available() -> bool:
    """True: mpiring's default backend is MPI."""
    return True


def is_gloo_available() -> bool:
    """True: ``init_process_group("gloo")`` runs, on mpiring's MPI backend."""
    return True


def is_nccl_available() -> bool:
    """Whether ``init_process_group("nccl")`` can run here: CuPy's NCCL binding loads."""
    from mpiring.backends.gpu import import_nccl

    return import_nccl()[0] is not None


def is_ucc_available() -> bool:
    """False: UCC is not one of mpiring's backends."""
    return False


def is_backend_available(backend: str) -> bool:
    """Whether ``init_process_group(backend)`` can run here."""
    name = str(backend).lower()
    if name not in BACKEND_NAMES:
        return False
    return is_nccl_available() if BACKEND_NAMES[name] == "nccl" else True


def is_torchelastic_launched() -> bool:
    """Whether torchelastic (torchrun) started this process, by torch's test: mpiexec (and
    ``python -m mpiring.run``) is not torchelastic."""
    import os

    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank among those of its host: MPI's once the default group exists,
    else ``LOCAL_RANK`` from the environment, else ``fallback_rank``.

    Raises:
        RuntimeError: none of the three is there.
    """
    import os

    comm = default_comm()
    if comm is not None:
        return comm.local_rank
    if os.environ.get("LOCAL_RANK", "") != "":
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("get_node_local_rank: no default group and no LOCAL_RANK: call "
                       "mpiring.init_process_group() first (MPI knows each host's ranks), "
                       "or pass fallback_rank=")


def get_process_group_ranks(group: Communicator | None = None) -> list[int]:
    """The job ranks of ``group``'s members, in group-rank order."""
    return list(resolve(group, "get_process_group_ranks").world_ranks)


def get_global_rank(group: Communicator | None, group_rank: int) -> int:
    """The job rank of ``group``'s rank ``group_rank``."""
    comm = resolve(group, "get_global_rank")
    return comm.world_ranks[_group_rank(comm, None, group_rank, "get_global_rank", "rank")]


def get_group_rank(group: Communicator | None, global_rank: int) -> int:
    """``group``'s rank of the job's rank ``global_rank``."""
    comm = resolve(group, "get_group_rank")
    return _group_rank(comm, global_rank, None, "get_group_rank", "global_rank")


@_members_only
def monitored_barrier(group: Communicator | None = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """``barrier`` under ``timeout`` (a timedelta or seconds; None: the group's deadline).

    Past it the job ends with mpiring's stall report, which names the ranks that did
    not arrive (torch raises there instead; the report is what its message says).
    """
    comm = resolve(group, "monitored_barrier")
    if timeout is None:
        comm.barrier()
        return
    kept = comm.timeout
    comm.timeout = seconds(timeout)  # refused (ValueError, naming the fix) unless seconds >= 0
    try:
        comm.barrier()
    finally:
        comm.timeout = kept


@_members_only
def barrier(group: Communicator | None = None, async_op: bool = False,
            device_ids: Any = None, timeout: Any = None) -> Work | None:
    """Wait until every rank of the group has called it (``device_ids``, ``timeout``:
    accepted; the group's own deadline bounds the wait)."""
    resolve(group, "barrier").barrier()
    return _done(async_op)


@_members_only
def all_reduce(tensor, op: Any = ReduceOp.SUM, group: Communicator | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over the group, in place, on every rank."""
    comm, how = resolve(group, "all_reduce"), _op(op, "all_reduce", tensor)
    _in_place(tensor, lambda buf: comm.all_reduce(buf, op=how))
    return _done(async_op, tensor)


@_members_only
def broadcast(tensor, src: int | None = None, group: Communicator | None = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``src``'s ``tensor`` into every rank's."""
    comm = resolve(group, "broadcast")
    root = _group_rank(comm, src, group_src, "broadcast", "src")
    _in_place(tensor, lambda buf: comm.broadcast(buf, root=root))
    return _done(async_op, tensor)


@_members_only
def reduce(tensor, dst: int | None = None, op: Any = ReduceOp.SUM,
           group: Communicator | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` over the group into ``dst``'s ``tensor``."""
    comm = resolve(group, "reduce")
    root, how = _group_rank(comm, dst, group_dst, "reduce", "dst"), _op(op, "reduce", tensor)
    _in_place(tensor, lambda buf: comm.reduce(buf, root=root, op=how))
    return _done(async_op, tensor)


def _numel(x) -> int:
    n = getattr(x, "numel", None)
    return int(n()) if callable(n) else int(x.size)


def _parts_error(what: str, whole, part, k: int, whole_name: str, part_name: str) -> str | None:
    if whole.dtype != part.dtype:
        return f"{what}: {whole_name} is {whole.dtype} and {part_name} {part.dtype}: give one dtype"
    if _numel(whole) != k * _numel(part):
        return (f"{what}: {whole_name} has {_numel(whole)} elements, {part_name} "
                f"{_numel(part)}: {whole_name} must hold the group's {k} parts, "
                f"{k} x {_numel(part)} elements")
    return None


def _like_error(what: str, name: str, parts, like, k: int) -> str | None:
    """Why ``parts`` is not k buffers of ``like``'s dtype and size (None: it is). Any
    layout: they are read through copies and written through ``_assign``."""
    if parts is None or len(parts) != k:
        return (f"{what}: {name} has {0 if parts is None else len(parts)} tensors: give one "
                f"per rank of the group ({k})")
    for i, t in enumerate(parts):
        if not _is_buffer(t):
            return f"{what}: {name}[{i}] is a {type(t).__name__}: give tensors"
        if t.dtype != like.dtype or _numel(t) != _numel(like):
            return (f"{what}: {name}[{i}] is {tuple(t.shape)} {t.dtype}, the tensor "
                    f"{tuple(like.shape)} {like.dtype}: give tensors like it")
    return None


def _is_buffer(x) -> bool:
    """A tensor or an array: what the checks below may ask for dtype, shape and layout."""
    return hasattr(x, "dtype") and hasattr(x, "shape")


def _contiguous(x) -> bool:
    f = getattr(x, "is_contiguous", None)
    return f() if callable(f) else bool(x.flags.c_contiguous)


def _refuse_if(comm: Communicator, collective: str, problem: str | None) -> None:
    """Refuse the coming ``collective`` on every rank when this rank has a ``problem``:
    the collective's own argument check carries it to the others (``Communicator.refuse``),
    so a good call costs no exchange of its own."""
    if problem:
        comm.refuse(collective, ValueError(f"r{comm.rank}: {problem}"))


def _raise_together(comm: Communicator, problem: str | None, shape: tuple | None = None,
                    what: str = "", end: str = "") -> None:
    """Every rank raises (with every rank's problem) or none does, before a byte moves:
    for the calls made of point-to-point messages, which have no argument check.

    ``shape``: this rank's (group root, element count, dtype) for a rooted call
    (gather, scatter): every rank must name the same root and pass a tensor of
    the root's count and dtype (the root's list holds tensors like its own).
    """
    mine = [problem, None if shape is None else list(shape)]
    rows = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
    bad = [f"r{r}: {p}" for r, (p, _) in enumerate(rows) if p]
    if not bad and shape is not None:
        roots = [s[0] for _, s in rows]
        if len(set(roots)) > 1:
            bad = [f"{what}: the ranks name different roots ("
                   + ", ".join(f"r{r}: group rank {x}" for r, x in enumerate(roots))
                   + f"): pass the same {end} on every rank"]
        else:
            _, n, dtype = rows[roots[0]][1]
            bad = [f"{what}: r{r}'s tensor is {s[1]} x {s[2]}, {end} r{roots[0]}'s "
                   f"{n} x {dtype}" for r, (_, s) in enumerate(rows) if s[1:] != [n, dtype]]
            if bad:
                bad[-1] += (": give every rank a tensor of the root's size and dtype "
                            "(as the root's list holds)")
    if bad:
        raise ValueError("; ".join(bad))


@_members_only
def all_gather_into_tensor(output_tensor, input_tensor, group: Communicator | None = None,
                           async_op: bool = False) -> Work | None:
    """Concatenate every rank's ``input_tensor`` into each rank's ``output_tensor``
    (group.size equal parts, in group-rank order)."""
    comm = resolve(group, "all_gather_into_tensor")
    _refuse_if(comm, "all_gather", _parts_error("all_gather_into_tensor", output_tensor,
                                                input_tensor, comm.size, "output_tensor",
                                                "input_tensor"))
    mine = _data(input_tensor)
    n = _numel(mine)

    def run(out):
        out.reshape(-1)[comm.rank * n:(comm.rank + 1) * n] = mine.reshape(-1)
        comm.all_gather(out)  # its chunks (array_split's) are the n-element parts
    _in_place(output_tensor, run)
    return _done(async_op, output_tensor)


@_members_only
def all_gather(tensor_list: list, tensor, group: Communicator | None = None,
               async_op: bool = False) -> Work | None:
    """Fill ``tensor_list[r]`` with rank r's ``tensor``, on every rank."""
    comm = resolve(group, "all_gather")
    _refuse_if(comm, "all_gather",
               _like_error("all_gather", "tensor_list", tensor_list, tensor, comm.size))
    mine = _data(tensor)
    n = _numel(mine)
    flat = _empty_like_flat(mine, comm.size * n)
    flat[comm.rank * n:(comm.rank + 1) * n] = mine.reshape(-1)
    comm.all_gather(flat)
    for r, t in enumerate(tensor_list):
        _assign(t, flat[r * n:(r + 1) * n])
    return _done(async_op, *tensor_list)


@_members_only
def reduce_scatter_tensor(output, input, op: Any = ReduceOp.SUM,  # noqa: A002 - torch's name
                          group: Communicator | None = None,
                          async_op: bool = False) -> Work | None:
    """Reduce ``input`` (group.size equal parts) over the group; rank r's ``output``
    gets part r. ``input`` is left as it was, as in torch."""
    comm = resolve(group, "reduce_scatter_tensor")
    how = _op(op, "reduce_scatter_tensor", input)
    problem = _parts_error("reduce_scatter_tensor", input, output, comm.size, "input", "output")
    _refuse_if(comm, "reduce_scatter", problem)
    data = _data(input)
    work = _empty_like_flat(data, _numel(data))
    work[:] = data.reshape(-1)
    _assign(output, comm.reduce_scatter(work, op=how))
    return _done(async_op, output)


@_members_only
def reduce_scatter(output, input_list: list, op: Any = ReduceOp.SUM,
                   group: Communicator | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``input_list`` (one tensor like ``output`` per rank) over the group; rank r's
    ``output`` gets the reduction of every rank's ``input_list[r]``."""
    comm = resolve(group, "reduce_scatter")
    how = _op(op, "reduce_scatter", output)
    problem = _like_error("reduce_scatter", "input_list", input_list, output, comm.size)
    _refuse_if(comm, "reduce_scatter", problem)
    like = _data(output)
    n = _numel(like)
    work = _empty_like_flat(like, comm.size * n)
    for r, t in enumerate(input_list):  # the parts side by side: the ring's n-element chunks
        work[r * n:(r + 1) * n] = _data(t).reshape(-1)
    _assign(output, comm.reduce_scatter(work, op=how))
    return _done(async_op, output)


# torch 2.13's names for the two (the old ones warn there that they are deprecated).
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def _exchange(comm: Communicator, sends: list, recvs: list) -> None:
    """Post every receive, then every send, on a private duplicate of ``comm`` (so that
    no message can meet the caller's own point-to-point traffic); wait for all.

    ``sends``/``recvs``: (group rank, buffer) pairs.
    """
    private = comm.dup()
    try:
        reqs = [private.irecv(buf, peer, 0) for peer, buf in recvs]
        reqs += [private.isend(buf, peer, 0) for peer, buf in sends]
        for r in reqs:
            r.wait()
    finally:
        private.free()


def _rooted(what: str, tensor, parts, root_rank, group_root, group, async_op: bool,
            to_root: bool) -> Work | None:
    """gather (``to_root``: every rank's ``tensor`` into the root's ``parts``) and scatter
    (the root's ``parts`` into every rank's ``tensor``): one message per other rank."""
    comm = resolve(group, what)
    end, listname = ("dst", "gather_list") if to_root else ("src", "scatter_list")
    try:
        root, problem = _group_rank(comm, root_rank, group_root, what, end), None
    except ValueError as exc:  # on this rank alone, maybe: raised with the others' below
        root, problem = -1, str(exc)
    if problem is None and comm.rank == root:
        problem = _like_error(what, listname, parts, tensor, comm.size)
    elif problem is None:
        problem = (f"{what}: {listname} is given on a rank that is not {end}: pass it on "
                   f"{end} only" if parts else None)
    # Every rank's root, element count and dtype ride on the problem exchange: a
    # tensor unlike the root's list (or a root that differs) raised only at the
    # receiving end, or left a receive that nothing matches, while the others returned.
    _raise_together(comm, problem, (root, _numel(tensor), str(tensor.dtype)), what, end)
    # Strided tensors go through contiguous copies (_dense), written back (_assign).
    if comm.rank == root:
        if to_root:
            _assign(parts[root], _data(tensor))
        else:
            _assign(tensor, _data(parts[root]))
        others = [(r, _dense(t)) for r, t in enumerate(parts) if r != root]
        _exchange(comm, [] if to_root else others, others if to_root else [])
        if to_root:
            for r, buf in others:
                if not _contiguous(parts[r]):
                    _assign(parts[r], buf)
    elif to_root:
        _exchange(comm, [(root, _dense(tensor))], [])
    else:
        _in_place(tensor, lambda buf: _exchange(comm, [], [(root, buf)]))
    if to_root:
        return _done(async_op, *(parts if comm.rank == root else ()))
    return _done(async_op, tensor)


@_members_only
def gather(tensor, gather_list: list | None = None, dst: int | None = None,
           group: Communicator | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """``dst``'s ``gather_list[r]`` gets rank r's ``tensor``; the other ranks pass no list."""
    return _rooted("gather", tensor, gather_list, dst, group_dst, group, async_op, True)


@_members_only
def scatter(tensor, scatter_list: list | None = None, src: int | None = None,
            group: Communicator | None = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """Rank r's ``tensor`` gets ``src``'s ``scatter_list[r]``; the other ranks pass no list."""
    return _rooted("scatter", tensor, scatter_list, src, group_src, group, async_op, False)


@_members_only
def all_to_all_single(output, input, output_split_sizes: list[int] | None = None,  # noqa: A002
                      input_split_sizes: list[int] | None = None,
                      group: Communicator | None = None, async_op: bool = False) -> Work | None:
    """Rank a's part b of ``input`` goes to rank b's part a of ``output``: equal parts of
    the flat tensors, or rows of dimension 0 in the given split sizes (MoE's dispatch)."""
    comm = resolve(group, "all_to_all_single")
    k = comm.size
    problem, ins, outs = _split_plan(output, input, output_split_sizes, input_split_sizes, k)
    _counts_agree(comm, "all_to_all_single", problem, ins, outs, str(input.dtype),
                  "rank b's output_split_sizes[a] is rank a's input_split_sizes[b]")
    src, dst = _unaliased(input, [output]), _data(output).reshape(-1)
    if _kind(input) == "complex":  # the counts are of complex elements, the buffers' of floats
        ins, outs = [2 * c for c in ins], [2 * c for c in outs]
    lo_in = [sum(ins[:r]) for r in range(k)]
    lo_out = [sum(outs[:r]) for r in range(k)]
    me = comm.rank
    dst[lo_out[me]:lo_out[me] + outs[me]] = src[lo_in[me]:lo_in[me] + ins[me]]
    # Zero-length parts are not sent: both ends know the count and skip them alike.
    _exchange(comm,
              [(r, src[lo_in[r]:lo_in[r] + ins[r]]) for r in range(k) if r != me and ins[r]],
              [(r, dst[lo_out[r]:lo_out[r] + outs[r]]) for r in range(k) if r != me and outs[r]])
    return _done(async_op, output)


@_members_only
def all_to_all(output_tensor_list: list, input_tensor_list: list,
               group: Communicator | None = None, async_op: bool = False) -> Work | None:
    """Rank a's ``input_tensor_list[b]`` goes to rank b's ``output_tensor_list[a]``; the
    pairs may differ in size (checked across ranks before anything moves)."""
    comm = resolve(group, "all_to_all")
    k, me = comm.size, comm.rank
    problem, ins, outs = None, [], []
    for name, parts in (("input_tensor_list", input_tensor_list),
                        ("output_tensor_list", output_tensor_list)):
        given = len(parts) if isinstance(parts, (list, tuple)) else 0
        if problem is None and given != k:
            problem = (f"all_to_all: {name} has {given} tensors: give one per rank of the "
                       f"group ({k})")
    dtype = ""
    if problem is None:
        strange = [t for t in [*input_tensor_list, *output_tensor_list] if not _is_buffer(t)]
        if strange:
            problem = f"all_to_all: the lists hold a {type(strange[0]).__name__}: give tensors"
    if problem is None:
        dtypes = {str(t.dtype) for t in [*input_tensor_list, *output_tensor_list]}
        if len(dtypes) > 1:
            problem = f"all_to_all: the tensors mix dtypes {sorted(dtypes)}: give one dtype"
        elif not all(_contiguous(t) for t in output_tensor_list):
            problem = "all_to_all: pass contiguous output tensors (.contiguous())"
        ins = [_numel(t) for t in input_tensor_list]
        outs = [_numel(t) for t in output_tensor_list]
        dtype = dtypes.pop()
    _counts_agree(comm, "all_to_all", problem, ins, outs, dtype,
                  "rank b's output_tensor_list[a] has as many elements as rank a's "
                  "input_tensor_list[b]")
    sends = [(r, _unaliased(t, output_tensor_list))
             for r, t in enumerate(input_tensor_list) if r != me and ins[r]]
    _data(output_tensor_list[me]).reshape(-1)[:] = _data(input_tensor_list[me]).reshape(-1)
    _exchange(comm,  # an input may be strided: sent from a contiguous copy
              sends,
              [(r, _data(t).reshape(-1)) for r, t in enumerate(output_tensor_list)
               if r != me and outs[r]])
    return _done(async_op, *output_tensor_list)


def _unaliased(x, outputs: list):
    """``x`` as one flat contiguous buffer to send from: itself, or a copy when it is
    strided or shares memory with one of ``outputs``.

    An all-to-all called in place (the same tensor or list as input and output) would
    otherwise receive into memory that is still to be sent, or copy its own part over
    it: the copy is taken before anything is written.
    """
    x = _data(x)
    if any(_shares(x, o) for o in outputs):
        return (x.clone() if hasattr(x, "clone") else x.copy()).reshape(-1)  # C order
    return _dense(x).reshape(-1)


def _shares(a, b) -> bool:
    """Whether ``a`` and ``b`` may share memory (a torch storage, a NumPy base; else: yes)."""
    if hasattr(a, "untyped_storage") and hasattr(b, "untyped_storage"):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    import numpy as np

    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    return True  # another kind (CuPy, a mix): a copy is always right


def _counts_agree(comm: Communicator, what: str, problem: str | None, ins: list[int],
                  outs: list[int], dtype: str, rule: str) -> None:
    """Every rank raises, naming each rank's problem, the dtypes or each pair whose counts
    differ, or none does: what rank a sends rank b must be what b expects from a."""
    k = comm.size
    mine = [problem, ins, outs, dtype]
    rows = comm.control.allgather_json(mine) if k > 1 else [mine]
    bad = [f"r{r}: {p}" for r, (p, _, _, _) in enumerate(rows) if p]
    if not bad and len({d for _, _, _, d in rows}) > 1:
        bad = [f"{what}: the ranks' tensors differ in dtype ("
               + ", ".join(f"r{r}: {d}" for r, (_, _, _, d) in enumerate(rows))
               + "): give every rank one dtype"]
    if not bad:
        bad = [f"r{a} sends {rows[a][1][b]} elements to r{b}, which expects {rows[b][2][a]}"
               for a in range(k) for b in range(k) if rows[a][1][b] != rows[b][2][a]]
        if bad:
            bad = [f"{what}: the sizes do not match across ranks: " + "; ".join(bad[:4])
                   + f" ({rule})"]
    if bad:
        raise ValueError("; ".join(bad))


def _split_plan(output, input, out_sizes, in_sizes, k: int):  # noqa: A002
    """(problem, elements sent to each rank, elements received from each rank)."""
    what = "all_to_all_single"
    if output.dtype != input.dtype:
        return f"{what}: output is {output.dtype} and input {input.dtype}: give one dtype", [], []
    if not (_contiguous(output) and _contiguous(input)):
        return f"{what}: pass contiguous tensors (.contiguous())", [], []
    counts = []
    for name, t, sizes in (("input", input, in_sizes), ("output", output, out_sizes)):
        n = _numel(t)
        if sizes is None:
            if n % k:
                return (f"{what}: {name} has {n} elements, not {k} equal parts: give "
                        f"{name}_split_sizes", [], [])
            counts.append([n // k] * k)
            continue
        sizes = [int(s) for s in sizes]
        rows = t.shape[0] if len(t.shape) else 1
        if len(sizes) != k or min(sizes, default=0) < 0 or sum(sizes) != rows:
            return (f"{what}: {name}_split_sizes={sizes}: give {k} sizes >= 0 that sum to "
                    f"{name}'s {rows} rows", [], [])
        per_row = n // rows if rows else 0
        counts.append([s * per_row for s in sizes])
    return None, counts[0], counts[1]


def _empty_like_flat(x, n: int):
    """A new flat buffer of ``n`` elements of ``x``'s kind, dtype and device."""
    if hasattr(x, "new_empty"):  # torch
        return x.new_empty(n)
    import numpy as np

    if isinstance(x, np.ndarray):
        return np.empty(n, dtype=x.dtype)
    from mpiring.backends.gpu import empty_like_device  # a CuPy array

    return empty_like_device(x, n)


@_members_only
def send(tensor, dst: int | None = None, group: Communicator | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst``; returns once the buffer may be reused."""
    comm = resolve(group, "send")
    comm.send(_data(tensor), _peer(comm, dst, group_dst, "send", "dst"), tag)


@_members_only
def recv(tensor, src: int | None = None, group: Communicator | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank of the group); returns the
    sender's job rank, as torch's."""
    comm = resolve(group, "recv")
    peer = _source(comm, src, group_src, "recv")
    req = comm.irecv(_data(tensor), peer, tag)
    req.wait()
    # torch returns a job rank, whatever group it was given.
    return comm.world_ranks[req.source]


@_members_only
def isend(tensor, dst: int | None = None, group: Communicator | None = None, tag: int = 0,
          group_dst: int | None = None):
    """Start sending ``tensor`` to ``dst``; the handle's ``wait()`` completes it."""
    comm = resolve(group, "isend")
    peer = _peer(comm, dst, group_dst, "isend", "dst")
    return _P2PWork(comm.isend(_data(tensor), peer, tag), tensor)


@_members_only
def irecv(tensor, src: int | None = None, group: Communicator | None = None, tag: int = 0,
          group_src: int | None = None):
    """Start receiving into ``tensor`` from ``src`` (None: any rank of the group); the
    handle's ``wait()`` completes it, then its ``source_rank()`` is the sender's group rank."""
    comm = resolve(group, "irecv")
    return _P2PWork(comm.irecv(_data(tensor), _source(comm, src, group_src, "irecv"), tag),
                    tensor)


def _source(comm: Communicator, src: int | None, group_src: int | None,
            what: str) -> int | None:
    """The group rank of a receive's source; None for torch's ``src=None`` with no
    ``group_src``: any rank (as torch's ``recv_anysource``)."""
    if src is None and group_src is None:
        return None
    return _peer(comm, src, group_src, what, "src")


def _peer(comm: Communicator, rank: int | None, group_rank: int | None, what: str,
          name: str) -> int:
    """The group rank of a send's or receive's peer, which is not this rank: torch
    refuses that (a blocking send to oneself would wait for a receive never posted)."""
    peer = _group_rank(comm, rank, group_rank, what, name)
    if peer == comm.rank:
        end = "destination" if name == "dst" else "source"
        raise ValueError(f"{what}: invalid {end} rank: {name} is this process's own rank; "
                         "copy the tensor instead, or name another rank")
    return peer


class P2POp:
    """One send or receive of a ``batch_isend_irecv``, as torch's ``P2POp``.

    ``op`` is ``isend`` or ``irecv`` (this module's, or torch.distributed's);
    ``peer`` is a rank of the job, ``group_peer`` one of ``group``. The peer is
    resolved and the tensor and tag checked when the op is made, so a bad one
    raises here, before anything of its batch is posted.
    """

    __slots__ = ("op", "tensor", "group", "tag", "group_peer", "peer", "_kind")

    def __init__(self, op, tensor, peer: int | None = None, group: Communicator | None = None,
                 tag: int = 0, group_peer: int | None = None):
        kind = _p2p_kind(op)
        comm = resolve(group, "P2POp")
        name = "dst" if kind == "isend" else "src"
        if kind == "irecv" and peer is None and group_peer is None:
            # torch's P2POp refuses it too ("Must specify global_rank or group_rank"): a
            # batch is issued together, and on NCCL each receive names its peer.
            raise ValueError("P2POp(irecv): peer=None (any sender) is not offered in a "
                             "batch, as in torch: name the sender with peer= (or "
                             "group_peer=), or receive from any rank with irecv(tensor) "
                             "(src=None) outside the batch")
        buf = as_buffer(_data(tensor))  # a tensor no post could take: TypeError/ValueError now
        be = comm._be
        if getattr(be, "accepts_cuda", False):  # NCCL: GPU memory of this rank's device
            be.check_buffer(buf, "send" if kind == "isend" else "recv", "p2p", None)
        # op stays the caller's function, as torch keeps it (code may call p.op itself).
        self.op, self._kind, self.tensor, self.group = op, kind, tensor, comm
        self.tag = check_tag(tag)
        self.group_peer = _group_rank(comm, peer, group_peer, f"P2POp({kind})", name)
        self.peer = comm.world_ranks[self.group_peer]

    def __repr__(self) -> str:
        return (f"P2POp({self._kind}, {tuple(getattr(self.tensor, 'shape', ()))}, "
                f"peer={self.peer}, tag={self.tag})")


def _p2p_kind(op) -> str:
    """"isend" or "irecv" for ``op``: this module's function or torch.distributed's."""
    name = getattr(op, "__name__", None)
    module = getattr(op, "__module__", "") or ""
    if name in ("isend", "irecv") and (op in (isend, irecv)
                                       or module.startswith("torch.distributed")):
        return name
    raise ValueError(f"P2POp: op={op!r}: pass isend or irecv (mpiring's, or "
                     "torch.distributed's)")


def batch_isend_irecv(p2p_op_list: list) -> list:
    """Post every ``P2POp`` of the list and return their requests, as torch's.

    Every op is checked before the first is posted, so a bad list moves nothing.
    All of them are posted before any is waited for, in the list's order: each
    rank may list its sends and receives in any order without deadlocking its
    neighbours (on NCCL they are issued together, in one group, at the first wait).

    Raises:
        ValueError: the list is empty, holds something that is not a P2POp, or
            mixes groups (torch asks one group of a batch, and so does NCCL).
    """
    ops = list(p2p_op_list) if isinstance(p2p_op_list, (list, tuple)) else None
    if not ops:
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of "
                         f"P2POp, got {p2p_op_list!r}")
    for i, op in enumerate(ops):
        if not isinstance(op, P2POp):
            raise ValueError(f"batch_isend_irecv: p2p_op_list[{i}] is {type(op).__name__}, "
                             "not a P2POp: build each op as P2POp(isend or irecv, tensor, "
                             "peer)")
    comm = ops[0].group
    for i, op in enumerate(ops):
        if op.group is not comm:
            raise ValueError(f"batch_isend_irecv: p2p_op_list[{i}] is on another group "
                             "than p2p_op_list[0]: one batch takes one group; call it once "
                             "per group")
    return [_P2PWork(comm.isend(_data(op.tensor), op.group_peer, op.tag), op.tensor)
            if op._kind == "isend" else
            _P2PWork(comm.irecv(_data(op.tensor), op.group_peer, op.tag), op.tensor)
            for op in ops]


# --- objects: torch pickles them; here they travel as mpiring.core.objects encodes them ---
# Each call is one allgather of every rank's frame on the control plane: a payload, or
# the problem this rank found, so that every rank raises together before anything is
# unpacked. Objects are small (configurations, metrics), which is what makes sending
# every frame to every rank, even for a gather or a scatter, the simple choice.

def _frame(what: str, comm: Communicator, problem: str | None, make, root: int = -1) -> bytes:
    """This rank's frame: a kind byte (``=``: a payload; ``V``: bad arguments; ``T``: an
    object of a type that cannot be sent), the root this rank named (-1: none), then
    ``make()``'s bytes or the problem."""
    head = root.to_bytes(8, "little", signed=True)
    if problem is not None:
        return b"V" + head + f"r{comm.rank}: {what}: {problem}".encode()
    try:
        return b"=" + head + make()
    except TypeError as exc:
        return b"T" + head + f"r{comm.rank}: {what}: {exc}".encode()
    except RecursionError:
        return b"V" + head + (f"r{comm.rank}: {what}: the object nests too deeply or "
                              "contains itself: send a flat copy").encode()
    except Exception as exc:  # noqa: BLE001 - any failure here must reach every rank
        return b"V" + head + f"r{comm.rank}: {what}: {type(exc).__name__}: {exc}".encode()


def _frames(comm: Communicator, what: str, frame: bytes) -> list[bytes]:
    """Every rank's payload, in rank order; or, on every rank, every rank's problem, or
    the roots when the ranks named different ones."""
    frames = comm.control.allgather_bytes(frame) if comm.size > 1 else [frame]
    bad = [f for f in frames if f[:1] != b"="]
    if bad:
        kind = TypeError if all(f[:1] == b"T" for f in bad) else ValueError
        raise kind("; ".join(f[9:].decode(errors="replace") for f in bad))
    roots = [int.from_bytes(f[1:9], "little", signed=True) for f in frames]
    if len(set(roots)) > 1:
        raise ValueError(f"{what}: the ranks name different roots ("
                         + ", ".join(f"r{r}: group rank {x}" for r, x in enumerate(roots))
                         + "): pass the same src/dst on every rank")
    return [f[9:] for f in frames]


def _object_root(comm: Communicator, what: str, rank: int | None, group_rank: int | None,
                 name: str) -> tuple[int, str | None]:
    """(``group``'s root, problem): the job's rank 0 when neither is given, as torch's
    ``*_object`` calls default; a bad root is a problem for every rank to raise."""
    if rank is None and group_rank is None:
        rank = 0
    try:
        return _group_rank(comm, rank, group_rank, what, name), None
    except ValueError as exc:
        return -1, str(exc).removeprefix(f"{what}: ")
    except TypeError:  # not a number at all
        given = f"{name}={rank!r}" if group_rank is None else f"group_{name}={group_rank!r}"
        return -1, f"{given} is not a rank: give an int"


def _list_problem(name: str, value, k: int | None) -> str | None:
    """A problem when ``value`` is not a list (of ``k`` entries; None: of at least one)."""
    if not isinstance(value, list):
        return f"{name} is a {type(value).__name__}: give a list"
    if k is None and not value:
        return f"{name} is empty: give a list of one entry (e.g. [None]) to receive into"
    if k is not None and len(value) != k:
        return (f"{name} has {len(value)} entries: give one per rank of the group "
                f"(e.g. [None] * {k})")
    return None


@_members_only
def all_gather_object(object_list: list, obj: Any, group: Communicator | None = None) -> None:
    """Fill ``object_list`` (one entry per rank of ``group``) with every rank's ``obj``.

    Objects travel without pickle (mpiring.core.objects says which types do).

    Raises:
        ValueError / TypeError: on every rank, naming each rank's problem, when a
            list has the wrong length or an ``obj`` cannot be sent.
    """
    what = "all_gather_object"
    comm = resolve(group, what)
    problem = _list_problem("object_list", object_list, comm.size)
    payloads = _frames(comm, what, _frame(what, comm, problem,
                                          lambda: objects.encode(obj, "obj")))
    object_list[:] = [objects.decode(p) for p in payloads]


@_members_only
def broadcast_object_list(object_list: list, src: int | None = None,
                          group: Communicator | None = None, device: Any = None,
                          group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries on every rank by those of ``src`` (default: the
    job's rank 0), in place.

    Every rank passes a list of the same length (torch's rule), checked across ranks;
    tensors in the objects arrive on ``device`` (None: the CPU).
    """
    what = "broadcast_object_list"
    comm = resolve(group, what)
    root, problem = _object_root(comm, what, src, group_src, "src")
    problem = problem or _list_problem("object_list", object_list, None)
    mine = (lambda: objects.encode(object_list, "object_list")) if comm.rank == root \
        else (lambda: str(len(object_list)).encode())
    payloads = _frames(comm, what, _frame(what, comm, problem, mine, root))
    got = objects.decode(payloads[root], device)
    lengths = {r: len(got) if r == root else int(p) for r, p in enumerate(payloads)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{what}: the lists differ in length ("
                         + ", ".join(f"r{r}: {n}" for r, n in lengths.items())
                         + "): give every rank a list as long as the source's")
    if comm.rank != root:
        object_list[:] = got


@_members_only
def gather_object(obj: Any, object_gather_list: list | None = None, dst: int | None = None,
                  group: Communicator | None = None, group_dst: int | None = None) -> None:
    """On ``dst`` (default: the job's rank 0), fill ``object_gather_list`` (one entry per
    rank) with every rank's ``obj``; the list is not used on the other ranks."""
    what = "gather_object"
    comm = resolve(group, what)
    root, problem = _object_root(comm, what, dst, group_dst, "dst")
    if problem is None and comm.rank == root:
        problem = _list_problem("object_gather_list", object_gather_list, comm.size)
    payloads = _frames(comm, what, _frame(what, comm, problem,
                                          lambda: objects.encode(obj, "obj"), root))
    if comm.rank == root:
        object_gather_list[:] = [objects.decode(p) for p in payloads]


@_members_only
def scatter_object_list(scatter_object_output_list: list,
                        scatter_object_input_list: list | None = None, src: int | None = None,
                        group: Communicator | None = None,
                        group_src: int | None = None) -> None:
    """Put entry ``r`` of ``src``'s input list (default: the job's rank 0) into
    ``scatter_object_output_list[0]`` on group rank ``r`` (torch's output: a list of at
    least one entry)."""
    what = "scatter_object_list"
    comm = resolve(group, what)
    root, problem = _object_root(comm, what, src, group_src, "src")
    problem = problem or _list_problem("scatter_object_output_list",
                                       scatter_object_output_list, None)
    if problem is None and comm.rank == root:
        problem = _list_problem("scatter_object_input_list", scatter_object_input_list,
                                comm.size)
    mine = (lambda: objects.encode(scatter_object_input_list, "scatter_object_input_list")) \
        if comm.rank == root else (lambda: b"")
    payloads = _frames(comm, what, _frame(what, comm, problem, mine, root))
    scatter_object_output_list[0] = objects.decode(payloads[root])[comm.rank]


@_members_only
def send_object_list(object_list: list, dst: int | None = None,
                     group: Communicator | None = None, device: Any = None,
                     group_dst: int | None = None) -> None:
    """Send ``object_list``'s objects to ``dst``, whose ``recv_object_list`` takes them:
    two messages, the encoding's length and then its bytes (without pickle).

    Raises:
        TypeError: an object cannot be sent (before anything is sent).
        ValueError: ``dst`` is this rank, or not in the group; ``object_list`` is not
            a list.
    """
    import numpy as np

    what = "send_object_list"
    comm = resolve(group, what)
    peer = _peer(comm, dst, group_dst, what, "dst")
    problem = _list_problem("object_list", object_list, None)
    if problem:
        raise ValueError(f"{what}: {problem}")
    data = np.frombuffer(bytearray(objects.encode(object_list, "object_list")), np.uint8)
    comm.send(np.array([data.size, len(object_list)], np.int64), peer)
    comm.send(data, peer)


@_members_only
def recv_object_list(object_list: list, src: int | None = None,
                     group: Communicator | None = None, device: Any = None,
                     group_src: int | None = None) -> int:
    """Fill ``object_list`` (as long as the sender's) with the objects ``src``'s
    ``send_object_list`` sent; tensors in them arrive on ``device`` (None: the CPU).
    Returns the sender's job rank, as torch's.

    ``src=None`` (and no ``group_src``): from any rank of the group, as torch's
    (the MPI backend only; NCCL refuses it before anything is posted).

    Raises:
        ValueError: the list's length is not the sender's (after both messages
            arrived, so the sender is not left waiting).
    """
    import numpy as np

    what = "recv_object_list"
    comm = resolve(group, what)
    peer = _source(comm, src, group_src, what)
    if not isinstance(object_list, list):
        raise ValueError(f"{what}: object_list is a {type(object_list).__name__}: give a "
                         "list as long as the sender's")
    head = np.zeros(2, np.int64)
    req = comm.irecv(head, peer)
    req.wait()
    # From any sender (src=None), the data comes from the head's sender: another
    # sender's head may be next in line, and a rank's two messages keep their order.
    peer = req.source
    data = np.empty(int(head[0]), np.uint8)
    comm.recv(data, peer)
    if int(head[1]) != len(object_list):
        raise ValueError(f"{what}: rank {comm.world_ranks[peer]} sent {int(head[1])} objects "
                         f"and object_list has {len(object_list)} entries: give a list as "
                         "long as the sender's (e.g. [None] * n)")
    object_list[:] = objects.decode(data.tobytes(), device)
    return comm.world_ranks[peer]


def _agreed_groups(comm: Communicator, what: str, lists: list[list[int]]) -> None:
    """Raise on every rank, naming each problem, unless every rank passed the same
    ``lists`` (sorted) of distinct ranks of the job, no rank in two of them."""
    flat = [r for ranks in lists for r in ranks]
    problem = None
    if len(set(flat)) != len(flat) or any(not 0 <= r < comm.size for r in flat):
        problem = (f"ranks={lists[0] if len(lists) == 1 else lists!r}: give distinct ranks of "
                   f"the job, 0..{comm.size - 1}" + ("" if len(lists) == 1 else
                                                      ", each in one group at most"))
    seen = comm.control.allgather_json([lists, problem]) if comm.size > 1 else [[lists,
                                                                                 problem]]
    bad = [f"r{r}: {p}" for r, (_, p) in enumerate(seen) if p]
    if not bad and any(w != lists for w, _ in seen):
        shown = ", ".join(f"r{r} gave {w[0] if len(w) == 1 else w}"
                          for r, (w, _) in enumerate(seen))
        bad = [f"the ranks differ: {shown}; every rank passes the same list"]
    if bad:
        raise ValueError(f"{what}: " + "; ".join(bad))


def new_subgroups_by_enumeration(ranks_per_subgroup_list: list[list[int]],
                                 timeout: Any = None, backend: Any = None,
                                 pg_options: Any = None, group_desc: str | None = None):
    """One group per list of job ranks, all made by one split, as torch's: returns (this
    rank's group, or None where it is in none; every group, ``NON_GROUP_MEMBER`` for those
    this rank is not in). Collective over the default group, every rank with the same
    lists.

    Raises:
        ValueError: on every rank, when the lists differ across ranks, are empty,
            repeat a rank or name one outside the job.
    """
    what = "new_subgroups_by_enumeration"
    comm = require_default(what)
    given = ranks_per_subgroup_list
    if not isinstance(given, (list, tuple)) or not given:
        raise ValueError(f"{what}: ranks_per_subgroup_list={given!r}: give a non-empty list "
                         "of lists of ranks")
    lists = [sorted(int(r) for r in ranks) for ranks in given]
    _agreed_groups(comm, what, lists)
    me = comm.world_ranks[comm.rank]
    mine = next((i for i, ranks in enumerate(lists) if me in ranks), None)
    sub = comm.split(mine, key=me)
    if sub is not None and timeout is not None:
        sub.timeout = seconds(timeout)
    return sub, [sub if i == mine else NON_GROUP_MEMBER for i in range(len(lists))]


def new_subgroups(group_size: int | None = None, group: Communicator | None = None,
                  timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  group_desc: str | None = None):
    """Groups of ``group_size`` consecutive ranks of ``group`` (default: the job), as
    torch's: returns (this rank's group, every group). ``group_size`` None: the ranks
    of one host (torch takes the GPUs of one host, and refuses without CUDA); every
    host must run as many. Collective over the default group.

    Raises:
        ValueError: on every rank, when ``group_size`` does not divide the group's size
            or (None) the hosts run different numbers of ranks.
    """
    what = "new_subgroups"
    comm = require_default(what)
    ranks = get_process_group_ranks(group)
    if group_size is None:
        sizes = set(comm.control.allgather_json(comm.local_size))
        if len(sizes) > 1:
            raise ValueError(f"{what}: the hosts run {sorted(sizes)} ranks: give group_size=")
        group_size = sizes.pop()
    if int(group_size) <= 0 or len(ranks) % int(group_size):
        raise ValueError(f"{what}: group_size={group_size}: give a positive divisor of the "
                         f"group's {len(ranks)} ranks")
    size = int(group_size)
    return new_subgroups_by_enumeration([ranks[i:i + size] for i in range(0, len(ranks), size)],
                                        timeout=timeout)


def new_group(ranks: list[int] | None = None, timeout: Any = None, backend: Any = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None):
    """A group of the job's ``ranks`` (all of them: None), as torch's ``new_group``.

    Collective over the default group: every rank calls it with the same ranks.
    Members get a Communicator (ranks in ascending order, as torch orders them);
    the others get ``GroupMember.NON_GROUP_MEMBER``, as torch's: the functions here do
    nothing on a rank given it, and mpiring's own calls refuse it. With
    ``use_local_synchronization=True`` only the members call it, as in torch
    (``Communicator.create_group``); a non-member that does gets NON_GROUP_MEMBER.

    Raises:
        ValueError: on every rank (every member, with ``use_local_synchronization``),
            when the ranks differ across ranks, repeat, or are not ranks of the job.
    """
    comm = require_default("new_group")
    wanted = list(range(comm.size)) if ranks is None else sorted(int(r) for r in ranks)
    me = comm.world_ranks[comm.rank]
    if use_local_synchronization:
        if me not in wanted:
            return NON_GROUP_MEMBER
        sub = comm.create_group(wanted)  # the default group's ranks are the job's
    else:
        _agreed_groups(comm, "new_group", [wanted])
        sub = comm.split(0 if me in wanted else None, key=me)
    if sub is None:
        return NON_GROUP_MEMBER
    if timeout is not None:
        sub.timeout = seconds(timeout)
    return sub
