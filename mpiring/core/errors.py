"""Exceptions raised by mpiring."""


class MismatchError(ValueError):
    """Ranks called the same collective with different arguments."""


class MpiringTimeout(RuntimeError):
    """A blocking wait ran past its deadline."""


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine (missing GPU, NCCL, CuPy).

    Raised on every rank together (the ranks agree first), so an uncaught one
    ends each rank by itself: no rank is left waiting and the job is not aborted.
    """

    on_every_rank = True
