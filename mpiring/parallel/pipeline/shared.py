"""Activations and gradients through shared memory, for the stages of a pipeline on one host.

Over MPI a 128 KB activation is copied twice, into the library's shared-memory
queue by the sender's ``Isend`` and out of it by the receiver's test, and
each side pays the library's calls, cold, right after a compute action. When
every stage of the pipeline runs on one host, the transport instead gives each
of a rank's incoming messages a slot in one MPI-3 shared-memory window
(``comm.shared_window``), laid out once the first step has agreed the shapes:

    [flag: int64, padding to 64 bytes][data, padded to 64 bytes] per (channel, stage, mb)

The producer copies its tensor straight into the consumer's slot, issues a
memory barrier (``Win_sync``) and writes the step's number into the flag; the
consumer polls the flag, issues the barrier, and computes on the slot itself
(no copy: the slot is its input, or its output's gradient). One copy, no
library call on either side.

A slot is written again only in the next step, and every step starts with the
schedule's argument exchange, a collective: by then the consumer is done with
what the slot held. So a stage's input is valid during its step only (as
over MPI, where the next step receives into the same buffer). Waits keep the
communicator's deadline (its stall report names the slot and the peer) and
every message is one trace record, as over MPI (``"via": "shared"``).

A new layout reuses the window when it fits, and otherwise takes a new one;
the old stays mapped while a tensor the user kept still points into it (freed
at a later layout once nothing does, ``release``, else at ``close()``). The
window needs room in /dev/shm (``comm.shared_window`` falls back to MPI when
there is not). ``MPIRING_PP_SHARED=0`` keeps the MPI path.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import torch

from mpiring.runtime.trace import clock

ALIGN = 64


def enabled() -> bool:
    """``MPIRING_PP_SHARED``: unset or 1 uses shared memory where it can, 0 never."""
    value = os.environ.get("MPIRING_PP_SHARED", "1").strip().lower()
    if value not in ("0", "1", "off", "on", ""):
        raise ValueError(f"MPIRING_PP_SHARED={value!r}: use 1 (shared memory between stages "
                         "on one host, the default) or 0 (always MPI messages)")
    return value in ("1", "on", "")


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _key(key: tuple[str, int, int]) -> str:
    """A slot's name (a JSON key, and the stall report's): its receive, ``1RECV_F3`` for
    (channel "F", the receiving stage 1, micro-batch 3)."""
    channel, stage, mb = key
    return f"{stage}RECV_{channel}{mb}"


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _view(segment: np.ndarray, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    nbytes = _nbytes(shape, dtype)
    raw = torch.from_numpy(segment[offset:offset + nbytes])
    return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


class SharedSlots:
    """One pipeline's shared window: this rank's incoming slots and its neighbours'.

    Build it with ``SharedSlots.create`` (collective).
    """

    def __init__(self, comm, window, layouts: list[dict]):
        self.comm, self.window, self.layouts = comm, window, layouts
        # Bound once: a send or an arrival runs right after a compute action, when every
        # attribute lookup misses the caches that the compute has just filled.
        self._sync, self._record = window.sync, comm.record_message
        mine = window.segments[comm.rank]
        self._recv = {k: _slot(mine, off, shape, dt)
                      for k, (off, shape, dt) in layouts[comm.rank].items()}
        self._send: dict[tuple[str, int, int], tuple] = {}  # the consumer's key -> its slot

    @classmethod
    def create(cls, comm, incoming: dict, outgoing: dict,
               old: SharedSlots | None = None) -> SharedSlots | None:
        """Collective over the pipeline's communicator: the slots, or None on every rank.

        Args:
            incoming: (channel, stage, mb) -> (shape, dtype) of what this rank's
                stages receive.
            outgoing: (channel, the receiving stage, mb) -> (peer rank, shape, dtype)
                of what they send.
            old: the slots of the last layout: their window is used again if the new
                layout fits in it on every rank.
        """
        layout, offset = {}, 0
        for key, (shape, dtype) in sorted(incoming.items()):
            layout[_key(key)] = (offset, list(shape), _dtype_name(dtype))
            offset += ALIGN + _round(_nbytes(shape, dtype))
        fits_old = old is not None and offset <= len(old.window.segments[comm.rank])
        if comm.control.allreduce_scalar(float(fits_old), "min") >= 1:
            window = old.window
        else:
            window = comm.shared_window(offset)
            if window is None:
                return None
        layouts = comm.control.allgather_json(layout)
        # What each producer sends must be what its consumer laid out (the first step's
        # agreed shapes, seen from both ends): else the MPI path, on every rank.
        fits = all(layouts[peer].get(_key(key), [None, None, None])[1:] ==
                   [list(shape), _dtype_name(dtype)]
                   for key, (peer, shape, dtype) in outgoing.items())
        if comm.control.allreduce_scalar(float(fits), "min") < 1:
            if window is not (old.window if old is not None else None):
                window.free()
            return None
        slots = cls(comm, window, layouts)
        for _, flag, _, _ in slots._recv.values():
            flag[0] = 0  # the window's memory is not zeroed: no step is numbered 0
        window.sync()
        comm.barrier()  # every flag cleared before any producer writes one
        return slots

    def buffer(self, key: tuple[str, int, int]) -> torch.Tensor:
        """This rank's slot for (channel, stage, mb): where the message lands, used in place."""
        return self._recv[_key(key)][0]

    def send(self, key: tuple[str, int, int], peer: int, t: torch.Tensor, step: int,
             tag: int):
        """Copy ``t`` into slot ``key`` (the consumer's name) of rank ``peer`` and announce
        it as step ``step``'s."""
        entry = self._send.get(key)
        if entry is None:
            off, shape, dt = self.layouts[peer][_key(key)]
            entry = self._send[key] = _slot(self.window.segments[peer], off, shape, dt)
        data, flag, nbytes, dt = entry
        if t.shape != data.shape or t.dtype != data.dtype:  # copy_ would cast or broadcast
            raise ValueError(f"got {t.dtype} of shape {tuple(t.shape)}, the slot holds "
                             f"{data.dtype} of shape {tuple(data.shape)}")
        t0 = clock()
        data.copy_(t)
        self._sync()  # the data before the flag, on every memory model
        flag[0] = step
        self._record("send", peer, tag, nbytes, dt, t0, "shared")

    def arrival(self, key: tuple[str, int, int], peer: int, step: int, tag: int) -> Arrival:
        return Arrival(self, self._recv[_key(key)], peer, step, tag, _key(key))


class Arrival:
    """A message into a shared slot, as a request: ``test()`` reads the flag, ``wait()``
    waits under the communicator's deadline."""

    __slots__ = ("_slots", "_slot", "_flag", "_peer", "_step", "_tag", "_name", "_t0", "_done")

    def __init__(self, slots, slot, peer, step, tag, name):
        self._slots, self._slot, self._flag, self._peer = slots, slot, slot[1], peer
        self._step, self._tag, self._name = step, tag, name
        self._t0, self._done = clock(), False

    def test(self) -> bool:
        if not self._done and self._flag[0] == self._step:
            slots = self._slots
            slots._sync()  # the flag before the data
            self._done = True
            _, _, nbytes, dt = self._slot
            slots._record("recv", self._peer, self._tag, nbytes, dt, self._t0, "shared")
        return self._done

    def wait(self) -> torch.Tensor:
        if not self.test():
            self._slots.comm.wait_until(
                self.test, f"Wait(shared slot {self._name} from r{self._peer}, step "
                           f"{self._step})", self._peer)
        return self._slot[0]


def _slot(segment: np.ndarray, offset: int, shape, dtype_name: str) -> tuple:
    """(data view, flag, data bytes, dtype name) of the slot at ``offset``: what a send or
    an arrival needs each step, worked out once (right after a compute action every
    lookup runs cold)."""
    dtype = _dtype(dtype_name)
    return (_view(segment, offset + ALIGN, shape, dtype), _flag(segment, offset),
            _nbytes(shape, dtype), dtype_name)


def _flag(segment: np.ndarray, offset: int) -> memoryview:
    """A slot's flag, one int64: a memoryview, whose ``[0]`` reads and writes a Python int
    (a NumPy element would build a scalar object on each poll)."""
    return memoryview(segment[offset:offset + 8]).cast("B").cast("q")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _refs(arrays: list) -> list[int]:
    """Each array's reference count, every one held the same way (the list, the loop)."""
    return [sys.getrefcount(a) for a in arrays]


def in_use(window) -> bool:
    """Whether anything but ``window`` itself points into its memory on this rank.

    Every view of the window (a slot's tensor, a view of that tensor, a flag) holds
    a reference to the NumPy segment it was cut from (``torch.from_numpy`` keeps
    its array, a slice keeps its base), so a count above what a list alone gives is
    a tensor or view still alive: unmapping the window under it would turn its next
    read into a segmentation fault.
    """
    alone = _refs([np.empty(0)])[0]  # measured, not assumed: the count varies by Python
    return any(n > alone for n in _refs(window.segments))


def release(comm, windows: list) -> list:
    """Collective: free the windows that nothing points into on any rank; returns the rest.

    ``windows`` must be the same list on every rank (windows made together, in order).
    """
    if not windows:
        return windows
    mine = [in_use(w) for w in windows]
    if any(mine):
        # A step's autograd graph can leave its tensors in reference cycles, alive until
        # the cyclic collector runs: collect them once (only here, a new layout's step)
        # rather than keep a window that nothing reachable points into.
        gc.collect()
        mine = [in_use(w) for w in windows]
    used = comm.control.allgather_array([int(u) for u in mine]).any(axis=0)
    for window, keep in zip(windows, used):
        if not keep:
            window.free()
    return [w for w, keep in zip(windows, used) if keep]
