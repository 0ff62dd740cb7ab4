"""torch.distributed's process-group functions, over a default mpiring Communicator.

    import mpiring as dist                 # where a script had torch.distributed
    dist.init_process_group()              # backend "mpi" on the CPU, "nccl" if asked
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mpiring.DistributedDataParallel(net)   # no comm: the default one
    dist.destroy_process_group()

MPI already knows every rank, so there is no rendezvous: ``init_method``,
``MASTER_ADDR`` and ``MASTER_PORT`` are not needed. What the environment says
is still checked: a script started by ``torchrun`` instead of ``mpiexec`` would
see an MPI world of one process per rank and train K unrelated models, so a
``WORLD_SIZE`` or ``RANK`` that disagrees with MPI is an error, not a warning.
"""

from __future__ import annotations

import datetime
import numbers
import os
from typing import Any

from mpiring.comm.communicator import Communicator
from mpiring.comm.start import ConfigError, start

__all__ = ["destroy_process_group", "get_rank", "get_world_size", "init_process_group",
           "is_initialized", "default_comm", "resolve"]

#: torch's backend names -> mpiring's. gloo and mpi are torch's CPU transports;
#: mpiring's "mpi" backend is the CPU one here.
BACKEND_NAMES = {None: "mpi", "mpi": "mpi", "gloo": "mpi", "nccl": "nccl",
                 "cpu:gloo,cuda:nccl": "nccl", "cuda:nccl,cpu:gloo": "nccl"}

_default: Communicator | None = None
_backend_name = "mpi"  # the name init_process_group was given, for get_backend()
_LAUNCH_HINT = "launch with: mpiexec -n K python -m mpiring.run SCRIPT [ARGS]"


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: datetime.timedelta | float | None = None, world_size: int = -1,
                       rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None) -> Communicator:
    """Make the default Communicator over every MPI rank (torch's signature).

    Args:
        backend: None or "mpi"/"gloo": mpiring's MPI backend (CPU tensors; CUDA
            tensors are staged). "nccl": NCCL over the GPU of ``device_id`` (or
            of ``local_rank % device_count``).
        init_method: None or a URL (``env://``, ``tcp://...``, ``file://...``), not
            used: MPI has already connected the ranks. A ``rank`` or
            ``world_size`` in its query is checked as the arguments are.
        timeout: a ``timedelta`` or seconds: the deadline of one blocking wait
            (mpiring's watchdog; default ``MPIRING_TIMEOUT`` or 300 s).
        world_size, rank: -1, or the values MPI gives (checked).
        store: must be None (no rendezvous store is used).
        group_name: accepted and not used.
        pg_options: must be None.
        device_id: the CUDA device for "nccl" (an int or ``torch.device``).

    Returns:
        The new default Communicator (torch returns None; the value is a bonus).

    Raises:
        RuntimeError: called twice without ``destroy_process_group()``.
        ConfigError: (a ValueError) on every rank together: an unknown backend, a
            ``world_size``/``rank`` argument, ``init_method`` query or
            ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` variable that MPI contradicts,
            a store, options or ``device_id`` that cannot be honoured, or any
            of ``mpiring.init``'s refusals (a bad timeout, ``MPIRING_*`` variable...).
    """
    global _default, _backend_name
    if _default is not None:
        raise RuntimeError("init_process_group: the default process group is already "
                           "initialized; call destroy_process_group() first")
    # Argument problems go through init's agreement: a rank that raised here alone
    # would leave the others waiting in it.
    problems = []
    name = backend.lower() if isinstance(backend, str) else backend
    if not isinstance(name, (str, type(None))) or name not in BACKEND_NAMES:
        problems.append(f"init_process_group: backend={backend!r}: use None, 'mpi', 'gloo' "
                        "(both: mpiring's MPI backend) or 'nccl'")
        name = None
    if store is not None or pg_options is not None:
        problems.append("init_process_group: store= and pg_options= are torch's rendezvous "
                        "and ProcessGroup options; mpiring's ranks come from MPI: leave "
                        "them None")
    if init_method is not None and not isinstance(init_method, str):
        problems.append(f"init_process_group: init_method={init_method!r}: give a URL "
                        "string (env://, tcp://..., file://...) or leave it out: MPI has "
                        "already connected the ranks")
    if device_id is not None and not _device_like(device_id):
        problems.append(f"init_process_group: device_id={device_id!r}: give a torch.device "
                        "(e.g. torch.device('cuda', local_rank)) or a device index")
    # launcher=False: _check_agrees below names WORLD_SIZE/RANK/LOCAL_RANK with the rest.
    comm = start(backend=BACKEND_NAMES[name], timeout=seconds(timeout), problems=problems,
                 launcher=False)
    if device_id is not None:
        _check_device(comm, device_id)
    _check_agrees(comm, world_size, rank, _url_settings(init_method))
    _default, _backend_name = comm, name or "mpi"
    return comm


def _device_like(device_id: Any) -> bool:
    """A torch.device (or anything with a device ``type``) or a non-negative index."""
    if hasattr(device_id, "type") and hasattr(device_id, "index"):
        return True
    return isinstance(device_id, int) and not isinstance(device_id, bool) and device_id >= 0


def _url_settings(init_method: Any) -> dict[str, str]:
    """``rank`` and ``world_size`` of an ``init_method`` URL's query, as torch reads them
    (``tcp://host:port?rank=1&world_size=4``)."""
    if not isinstance(init_method, str) or "?" not in init_method:
        return {}
    from urllib.parse import parse_qs, urlsplit

    query = parse_qs(urlsplit(init_method).query)
    return {k: query[k][-1] for k in ("rank", "world_size") if query.get(k)}


def backend_name(comm: Communicator) -> str:
    """torch's name of ``comm``'s backend: the one the script gave ``init_process_group``
    (``"gloo"`` stays "gloo", though mpiring's MPI backend runs it), else mpiring's."""
    return _backend_name if BACKEND_NAMES.get(_backend_name) == comm.backend else comm.backend


def seconds(timeout: Any) -> Any:
    """torch's ``timeout`` (a timedelta) as the seconds mpiring's deadlines take; anything
    else as it is, for the deadline's own check to accept or refuse."""
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout


def _check_device(comm: Communicator, device_id: Any) -> None:
    """Refuse a ``device_id`` the backend did not take (on every rank)."""
    index = getattr(device_id, "index", device_id)
    if comm.backend == "nccl":
        # The NCCL backend takes GPU local_rank % device_count (mpiring.backends.nccl).
        taken = getattr(getattr(comm, "_be", None), "device", None)
        wrong = not isinstance(index, int) or (taken is not None and int(taken) != index)
    else:
        wrong = False  # the MPI backend moves any tensor; the device is the model's
    flags = comm.control.allgather_array([int(wrong)])[:, 0]
    if flags.any():
        bad = ", ".join(f"r{r}" for r in range(comm.size) if flags[r])
        raise ConfigError(f"init_process_group: device_id={device_id!r} on {bad} is not the "
                          "GPU the NCCL backend uses (local_rank % device_count): leave "
                          "device_id out, or give each rank its local rank's GPU")


def _check_agrees(comm: Communicator, world_size: int, rank: int,
                  url: dict[str, str] | None = None) -> None:
    """Every rank raises the same error if an argument, the ``init_method`` URL or the
    environment contradicts MPI."""
    problems = []
    for what, given, value in (("world_size", world_size, comm.size), ("rank", rank, comm.rank)):
        if given in (-1, None):
            continue
        # int() made 2.5 (or True) agree with rank 2 (or 1); a string of digits, as the
        # launcher's variables are, still counts as its number.
        if isinstance(given, str) and given.strip().isdigit():
            given = int(given)
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given != value:
            problems.append(f"{what}={given!r}")
    for key, value in (url or {}).items():
        if value.strip() != str(comm.size if key == "world_size" else comm.rank):
            problems.append(f"init_method's {key}={value}")
    for var, value in (("WORLD_SIZE", comm.size), ("RANK", comm.rank),
                       ("LOCAL_RANK", comm.local_rank)):
        text = os.environ.get(var)
        if text not in (None, "") and text.strip() != str(value):
            problems.append(f"{var}={text}")
    flags = comm.control.allgather_json(problems)
    bad = [(r, p) for r, p in enumerate(flags) if p]
    if not bad:
        return
    shown = "; ".join(f"r{r} (MPI rank {r} of {comm.size}) got {', '.join(p)}" for r, p in bad)
    raise ConfigError(f"init_process_group: the launcher and MPI disagree: {shown}. mpiring "
                      f"takes rank and size from MPI: {_LAUNCH_HINT} (torchrun starts "
                      "independent MPI singletons), and drop rank=/world_size= or make them "
                      "match")


def destroy_process_group(group: Communicator | None = None) -> None:
    """Forget the default Communicator (collective: waits for every rank first), or free
    ``group``, a group from ``new_group`` (collective over its members), as torch's.

    Args:
        group: None or the default Communicator: the default group; a group from
            ``new_group``/``new_subgroups``: that group (``NON_GROUP_MEMBER``: nothing).

    Raises:
        ValueError: ``group`` is not a communicator.
    """
    global _default
    if group is NON_GROUP_MEMBER:
        return  # torch's cleanup loop passes every subgroup; this rank is in none of these
    if group is not None and group is not _default:
        if not isinstance(group, Communicator):
            raise ValueError(f"destroy_process_group: group={group!r}: pass None (the "
                             "default group) or a group from new_group")
        group.free()
        return
    if _default is None:
        return
    comm, _default = _default, None
    # Nobody may still be inside a collective on it when its ranks move on.
    comm.control.barrier(poll_s=1e-3)
    comm.tracer.flush()


def is_initialized() -> bool:
    """True between ``init_process_group()`` and ``destroy_process_group()``."""
    return _default is not None


def get_rank(group: Communicator | None = None) -> int:
    """This process's rank in ``group`` (default: the default group; -1 outside it, as
    torch's)."""
    if group is NON_GROUP_MEMBER:
        return -1
    return (group if group is not None else require_default("get_rank")).rank


def get_world_size(group: Communicator | None = None) -> int:
    """The number of ranks in ``group`` (default: the default group; -1 outside it, as
    torch's)."""
    if group is NON_GROUP_MEMBER:
        return -1
    return (group if group is not None else require_default("get_world_size")).size


def default_comm() -> Communicator | None:
    """The Communicator ``init_process_group()`` made, or None."""
    return _default


class NotInGroup(ValueError):
    """A call on ``NON_GROUP_MEMBER``: this rank is not in the group ``new_group`` made."""


class _NonGroupMember:
    """What ``new_group`` gives a rank outside the group (torch's
    ``GroupMember.NON_GROUP_MEMBER``). torch.distributed's functions called with it do
    nothing on that rank, as torch's (a script calls a group's collective on every
    rank); mpiring's own calls refuse it."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()


class GroupMember:
    """torch's ``dist.group`` / ``dist.GroupMember``: ``WORLD`` is the default group (looked
    up when read, so it follows ``init_process_group``; None before it, as torch's),
    ``NON_GROUP_MEMBER`` what ``new_group`` gives a rank outside the group."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER

    @property
    def WORLD(self) -> Communicator | None:  # noqa: N802 - torch's name
        return _default


group = GroupMember = GroupMember()


def resolve(comm: Communicator | None, what: str = "mpiring") -> Communicator:
    """``comm`` if given, else the default Communicator.

    Args:
        comm: a Communicator or None.
        what: the caller's name, for the error message.

    Raises:
        ValueError: ``comm`` is None and ``init_process_group()`` has not run.
    """
    if comm is NON_GROUP_MEMBER:
        raise NotInGroup(f"{what}: this rank is not in the group (new_group gave it "
                         "NON_GROUP_MEMBER): call it on the group's members only")
    if comm is not None:
        return comm
    if _default is None:
        raise ValueError(f"{what}: no communicator: call mpiring.init_process_group() first "
                         "(then it is the default everywhere), or pass comm=mpiring.init()")
    return _default


def require_default(what: str) -> Communicator:
    """The default Communicator; a ValueError naming ``what`` and the fix before
    ``init_process_group()``."""
    if _default is None:
        raise ValueError(f"{what}: the default process group is not initialized: call "
                         "mpiring.init_process_group() first")
    return _default
