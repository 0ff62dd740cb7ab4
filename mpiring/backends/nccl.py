r"""NCCL backend over ``cupy.cuda.nccl``: the ring's point-to-point and NCCL's own collectives.

MPI still launches the ranks and is the control plane: it tells each rank its
local rank (which picks the GPU), carries rank 0's NCCL unique id to the others
(raw bytes, no pickle), checks arguments (``exchange``) and splits
communicators. NCCL moves the data.

Point-to-point, and why the receive is deferred
-----------------------------------------------
The ring files are written once, in the lecture's MPI style::

    req = be.irecv(buffer, left); be.send(x[send_chunk], right); be.wait(req)

In NCCL a receive and the send it must overlap with have to be in one
``groupStart()/groupEnd()``, or both neighbours block in their sends. So
``irecv`` only records the receive; the next ``send`` (or ``sendrecv``) issues it
together with the send in one group; ``wait`` issues a receive that is still
pending on its own and otherwise does nothing on the host. Every NCCL call and
every reduction (the NumPy ufunc in ``mpiring.core.ops``, which dispatches to CuPy)
is enqueued on one stream, the backend's, so the reduction after ``wait`` runs
after the data has arrived, and the next step's send after the reduction,
without the host ever waiting::

    r:  [recv c2 | send c3] -> add(c2) -> [recv c1 | send c2] -> add(c1) -> ...
         one group              kernel      one group

Streams
-------
The Communicator brackets every collective with ``begin``/``end``: ``begin``
makes the backend's stream wait for the caller's current stream (so the input
is complete) and makes it current, so the ring's reductions go to it; ``end``
makes the caller's stream (CuPy's current stream, and torch's for a torch
tensor) wait for the backend's stream and restores it. Result: **when a
collective returns, its result is ready for work queued afterwards on the
caller's stream**; the host is not blocked (call ``.get()`` or synchronize the
stream to read it on the host). For the same reason a step trace on NCCL
(``--log steps``) records when each step was enqueued, not when the GPU ran it.

Native collectives
------------------
``ncclAllReduce``, ``ncclReduceScatter``, ``ncclAllGather``, ``ncclBroadcast`` and
``ncclReduce``, all in place. NCCL's ReduceScatter/AllGather need equal chunks;
for a count that K does not divide, mpiring's ``numpy.array_split`` chunks are
handled as one group of K Reduce (or Broadcast) calls, one rooted at each rank.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpiring.backends.control import of
from mpiring.backends.gpu import (
    GPU_INSTALL_HINT,
    import_cupy,
    import_nccl,
    nccl_version_tuple,
)
from mpiring.backends.mpi import MPIBackend, world_backend
from mpiring.core.buffers import Buffer
from mpiring.core.chunking import chunk_bounds
from mpiring.core.errors import BackendUnavailable

# ncclDataType_t and ncclRedOp_t (nccl.h); CuPy exposes them as module constants
# too, but not NCCL_BFLOAT16/NCCL_AVG in every version, so the values live here.
NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
NCCL_UINT8 = NCCL_DTYPES["uint8"]
# bfloat16 and ncclAvg arrived in NCCL 2.10.
_NEEDS_2_10 = (2, 10)
UNIQUE_ID_BYTES = 128
MULTI_RANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"


# --- the NCCL unique id over MPI: raw bytes, both CuPy representations ------------------
_ID_BYTES, _ID_SIGNED, _ID_UNSIGNED = 0, 1, 2


def encode_unique_id(uid) -> bytes:
    """129 bytes: a kind byte, then the 128 id bytes.

    CuPy >= 14 returns the id as ``bytes``; CuPy 13 as a tuple of 128 ints,
    the C ``char`` values (signed on x86, unsigned on Arm). The kind byte lets
    the receivers rebuild exactly what ``NcclCommunicator`` on their (identical)
    CuPy expects.
    """
    if isinstance(uid, (bytes, bytearray)):
        kind, raw = _ID_BYTES, bytes(uid)
    else:
        values = [int(v) for v in uid]
        if any(v < -128 or v > 255 for v in values):
            raise ValueError("NCCL unique id values must be bytes (-128..255)")
        kind = _ID_SIGNED if any(v < 0 for v in values) else _ID_UNSIGNED
        raw = bytes(v & 0xFF for v in values)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id has {len(raw)} bytes, expected {UNIQUE_ID_BYTES}")
    return bytes([kind]) + raw


def decode_unique_id(data: bytes):
    """Invert ``encode_unique_id``."""
    kind, raw = data[0], bytes(data[1:1 + UNIQUE_ID_BYTES])
    if kind == _ID_BYTES:
        return raw
    if kind == _ID_SIGNED:
        return tuple(b - 256 if b > 127 else b for b in raw)
    return tuple(raw)


def broadcast_unique_id(comm, uid, root: int = 0):
    """Rank ``root``'s NCCL id on every rank of ``comm`` (a backend, Communicator or
    ``mpi4py`` communicator), over the control channel."""
    control = of(comm)
    data = encode_unique_id(uid) if control.rank == root else None
    return decode_unique_id(control.bcast_bytes(data, root))


# --- can NCCL run here? decided locally, then agreed by every rank ---------------------
def probe(local_size: int, env: dict | None = None, *,
          sharing: int | None = None) -> tuple[str | None, str, dict]:
    """Check CuPy, a CUDA device, NCCL and the ranks-per-GPU limit on this rank.

    Args:
        local_size: ranks of the communicator on this host.
        env: the environment (``os.environ`` by default).
        sharing: how many ranks of the communicator use this rank's physical GPU
            (``count_sharing``); None estimates it as ``local_size`` over the
            devices this rank sees, 0 leaves the limit unchecked.

    Returns:
        ``(problem, fix, facts)``: ``problem`` is None when NCCL can run; facts
        holds ``devices`` and ``version`` (a tuple) when they were found.
    """
    env = os.environ if env is None else env
    facts: dict[str, Any] = {}
    cupy, reason = import_cupy()
    if cupy is None:
        return reason, GPU_INSTALL_HINT, facts
    try:
        ndev = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError and friends
        return (f"no usable CUDA device ({_first_line(exc)})",
                "run on a machine with an NVIDIA GPU and driver (check nvidia-smi and "
                "CUDA_VISIBLE_DEVICES), or run with --backend mpi", facts)
    if ndev == 0:
        return ("no CUDA device", "check nvidia-smi and CUDA_VISIBLE_DEVICES, or run with "
                "--backend mpi", facts)
    facts["devices"] = ndev
    nccl, reason = import_nccl()
    if nccl is None:
        return (reason, "pip install nvidia-nccl-cu12 (nvidia-nccl-cu13 for CUDA 13; both "
                "come with the gpu extras), or run with --backend mpi", facts)
    try:
        version = nccl_version_tuple(nccl.get_version())
    except Exception as exc:  # noqa: BLE001
        return (f"NCCL does not answer ncclGetVersion ({_first_line(exc)})",
                "reinstall nvidia-nccl-cu12/-cu13, or run with --backend mpi", facts)
    facts["version"] = version
    if sharing is None:
        # An estimate: right when every rank sees every GPU of its host.
        sharing = math.ceil(local_size / ndev)
        subject = f"{local_size} ranks on this host share {ndev} GPU(s)"
    else:
        subject = f"{sharing} ranks of this communicator use this rank's GPU"
    problem, fix = _sharing_problem(sharing, subject, version, env)
    return problem, fix, facts


def _sharing_problem(sharing: int, subject: str, version: tuple,
                     env) -> tuple[str | None, str]:
    if sharing <= 1:
        return None, ""
    allowed = 1
    # NCCL >= 2.30 lets ranks share a GPU behind this switch; its guide says
    # "up to 2 ranks per GPU" with the default resources, and more can hang.
    if version >= (2, 30) and env.get(MULTI_RANK_ENV, "") == "1":
        allowed = 2
    if sharing <= allowed:
        return None, ""
    text = ".".join(map(str, version))
    return (f"{subject} and NCCL {text} allows {allowed} rank(s) per GPU",
            "start one rank per GPU (mpiexec -n <GPUs> per host; see "
            "hostfiles/gpu-nodes.example), or with NCCL >= 2.30 set "
            f"{MULTI_RANK_ENV}=1 for up to 2 ranks per GPU, or run with --backend mpi")


def gpu_identity(cupy, device_id: int) -> bytes:
    """Which physical GPU CUDA device ``device_id`` of this process is; b"" if unknown.

    Device numbers are per process: under a launcher that gives each rank its
    own CUDA_VISIBLE_DEVICES, every rank's GPU is device 0. NCCL itself tells
    ranks apart by the GPU's UUID (``peerInfo.gpuUuid`` in its init.cc), so
    that is what is compared; the PCI address on this host is the fallback.
    """
    try:
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
    except Exception:  # noqa: BLE001 - no answer: the estimate is used instead
        return b""
    uuid = props.get("uuid")
    if uuid and any(bytes(uuid)):
        return b"uuid:" + bytes(uuid)
    pci = tuple(props.get(k) for k in ("pciDomainID", "pciBusID", "pciDeviceID"))
    if None in pci:
        return b""
    return f"pci:{socket.gethostname()}:{pci[0]}:{pci[1]}:{pci[2]}".encode()


def count_sharing(identities: list[bytes], mine: bytes) -> int | None:
    """How many ranks name the same physical GPU as ``mine`` (None if any is unknown)."""
    if not mine or not all(identities):
        return None
    return identities.count(mine)


def check_devices(mpi: MPIBackend, local_rank: int, local_size: int,
                  device_id: int | None = None, env: dict | None = None) -> tuple[int, tuple]:
    """Probe this rank, count the ranks on each physical GPU, and agree (collective).

    Returns:
        ``(device_id, version)`` for this rank.

    Raises:
        BackendUnavailable: on every rank, if any rank cannot run NCCL.
    """
    problem, fix, facts = probe(local_size, env, sharing=0)
    mine = b""
    if problem is None:
        if device_id is None:
            device_id = local_rank % facts["devices"]
        cupy, _ = import_cupy()
        mine = gpu_identity(cupy, device_id)
    # Collective: every rank sends its GPU's identity, b"" when it has none.
    identities = mpi.exchange_bytes(mine)
    if problem is None:
        sharing = count_sharing(identities, mine)
        if sharing is None:
            problem, fix, _ = probe(local_size, env)  # no identity: the estimate
        else:
            problem, fix = _sharing_problem(
                sharing, f"{sharing} ranks of this communicator use this rank's GPU "
                f"(device {device_id} here)", facts["version"], os.environ if env is None else env)
    agree(mpi, problem, fix)  # all ranks raise together, or none does
    return device_id, facts["version"]


def agree(mpi: MPIBackend, problem: str | None, fix: str) -> None:
    """Raise ``BackendUnavailable`` on every rank if NCCL cannot run on any rank."""
    local = "" if problem is None else f"{problem}\x00{fix}"
    reports = mpi.exchange_bytes(local.encode())
    by_problem: dict[tuple[str, str], list[int]] = {}
    for rank, report in enumerate(reports):
        if report:
            text, _, hint = report.decode(errors="replace").partition("\x00")
            by_problem.setdefault((text, hint), []).append(rank)
    if not by_problem:
        return
    lines = []
    for (text, hint), ranks in by_problem.items():
        where = "every rank" if len(ranks) == mpi.size else ", ".join(f"r{r}" for r in ranks)
        lines.append(f"  on {where}: {text}.\n    Fix: {hint}.")
    raise BackendUnavailable("backend='nccl' cannot start:\n" + "\n".join(lines))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


# --- the CUDA side of the backend: device, streams, pointers -----------------------------
class CupyDevice:
    """One GPU and the backend's stream on it (the tests swap in a host fake)."""

    def __init__(self, cupy, device_id: int):
        self.cupy = cupy
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            # Non-blocking: the legacy default stream must not serialize with it.
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._saved: list = []

    def check_buffer(self, buf: Buffer) -> None:
        if buf.device != "cuda":
            raise TypeError(
                f"backend 'nccl' moves GPU memory only, got a {buf.kind} buffer on the CPU: "
                "move it to the GPU (cupy.asarray(x), tensor.cuda()) or use backend='mpi'")
        dev = getattr(getattr(buf.array, "device", None), "id", self.device_id)
        if dev != self.device_id:
            raise TypeError(
                f"buffer is on GPU {dev} but this rank's NCCL communicator uses GPU "
                f"{self.device_id}: allocate it under cupy.cuda.Device({self.device_id}) "
                f"(torch: device='cuda:{self.device_id}')")

    def pointer(self, a) -> int:
        return int(a.data.ptr)

    def stream_ptr(self) -> int:
        # The current stream: the backend's inside a collective (``enter`` made it
        # current), the caller's if the ring code is driven directly.
        return int(self.cupy.cuda.get_current_stream().ptr)

    def empty(self, n: int, dtype):
        return self.cupy.empty(n, dtype=dtype)

    def enter(self, buf: Buffer) -> None:
        cupy = self.cupy
        previous_device = cupy.cuda.runtime.getDevice()
        if previous_device != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)
        caller = cupy.cuda.get_current_stream()
        # The input is complete once the caller's queued work is.
        self.stream.wait_event(caller.record(self._event()))
        torch_ptr = self._torch_stream_ptr(buf)
        if torch_ptr is not None:
            # torch's stream by its handle, through the runtime: CuPy 14 deprecates
            # ExternalStream (a DeprecationWarning on every collective).
            ready = self._event()
            cupy.cuda.runtime.eventRecord(ready.ptr, torch_ptr)
            self.stream.wait_event(ready)
        self._saved.append((previous_device, caller, torch_ptr))
        self.stream.use()

    def leave(self) -> None:
        previous_device, caller, torch_ptr = self._saved.pop()
        done = self.stream.record(self._event())
        caller.wait_event(done)
        if torch_ptr is not None:
            self.cupy.cuda.runtime.streamWaitEvent(torch_ptr, done.ptr)
        caller.use()
        if previous_device != self.device_id:
            self.cupy.cuda.runtime.setDevice(previous_device)

    def torch_event(self, buf: Buffer):
        """An event at the end of torch's queued work on ``buf``'s GPU (when torch's current
        stream is not CuPy's), with that stream: ``(event, torch stream)`` or None."""
        torch_ptr = self._torch_stream_ptr(buf)
        if torch_ptr is None:
            return None
        ready = self._event()
        self.cupy.cuda.runtime.eventRecord(ready.ptr, torch_ptr)
        return ready, torch_ptr

    def current_waits(self, event) -> None:
        """CuPy's current stream (where the next NCCL calls go) waits for ``event``."""
        self.cupy.cuda.get_current_stream().wait_event(event)

    def streams_wait_current(self, stream_ptrs) -> None:
        """Each of ``stream_ptrs`` waits for what is queued on CuPy's current stream now."""
        done = self.cupy.cuda.get_current_stream().record(self._event())
        for ptr in stream_ptrs:
            self.cupy.cuda.runtime.streamWaitEvent(ptr, done.ptr)

    def _event(self):
        # Ordering only: an event without timing is the cheaper kind to record.
        return self.cupy.cuda.Event(disable_timing=True)

    def _torch_stream_ptr(self, buf: Buffer) -> int | None:
        """torch's current stream on the tensor's GPU, unless it is CuPy's current one."""
        if buf.kind != "torch":
            return None
        import torch

        ptr = int(torch.cuda.current_stream(buf.obj.device).cuda_stream)
        if ptr == self.cupy.cuda.get_current_stream().ptr:
            return None
        return ptr

    def synchronize(self) -> None:
        self.stream.synchronize()


class _Recv:
    """A receive recorded by ``irecv`` and issued with the next send (or by ``wait``)."""

    __slots__ = ("buf", "src", "issued")

    def __init__(self, buf, src: int):
        self.buf, self.src, self.issued = buf, src, False


class _P2P:
    """A public send or receive, recorded until its group is issued."""

    __slots__ = ("what", "buf", "peer", "desc", "issued", "error", "torch")

    def __init__(self, what: str, buf, peer: int, desc):
        self.what, self.buf, self.peer, self.desc = what, buf, peer, desc
        self.issued, self.error = False, None
        self.torch = None  # (event, stream) of torch's current stream at the post


class NCCLBackend:
    """Point-to-point and native collectives on one NCCL communicator.

    Args:
        mpi: the MPI backend over the same ranks (control plane).
        nccl_comm: a ``cupy.cuda.nccl.NcclCommunicator`` of the same ranks.
        lib: the module with ``groupStart``/``groupEnd`` (``cupy.cuda.nccl``).
        device: the GPU and stream helper (``CupyDevice``).
        version: NCCL's version as a tuple.
        factory: builds a backend over another MPI communicator (``split``, ``dup``).
    """

    name = "nccl"
    accepts_cuda = True

    def __init__(self, mpi: MPIBackend, nccl_comm, lib, device, version=(2, 30, 0),
                 factory=None):
        self._mpi = mpi
        self.comm = mpi.comm
        self.rank = mpi.rank
        self.size = mpi.size
        self.activity = getattr(mpi, "activity", None)
        self.control = mpi.control  # MPI is the control plane
        self.nccl = nccl_comm
        self._lib = lib
        self.device = device
        self.version = tuple(version)
        self._factory = factory
        self._pending: list[_Recv] = []
        self._p2p_pending: list[_P2P] = []
        self._scratch: dict = {}

    # --- point-to-point, as in the lecture's pseudocode ---------------------
    def irecv(self, buf, src: int) -> _Recv:
        req = _Recv(buf, src)
        self._pending.append(req)  # issued with the next send: see the module docstring
        return req

    def send(self, buf, dst: int) -> None:
        with self.group():
            self._issue_pending()
            self._p2p("send", buf, dst)

    def wait(self, req: _Recv) -> None:
        if not req.issued:  # no send followed the irecv: the receive goes alone
            with self.group():
                self._issue_pending()
        # Nothing to wait for on the host: the next kernel on the stream runs
        # after the receive.

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int) -> None:
        with self.group():
            self._issue_pending()
            self._p2p("send", sendbuf, dst)
            self._p2p("recv", recvbuf, src)

    @contextmanager
    def group(self):
        """``groupStart()``/``groupEnd()``: everything inside is issued as one operation."""
        self._lib.groupStart()
        try:
            yield
        finally:
            self._lib.groupEnd()

    def _issue_pending(self) -> None:
        pending, self._pending = self._pending, []
        for req in pending:
            self._p2p("recv", req.buf, req.src)
            req.issued = True

    def _p2p(self, what: str, buf, peer: int) -> None:
        nbytes = int(buf.nbytes)
        if nbytes == 0:  # both ends see the same chunk size, so both skip it
            return
        # Raw bytes, as the MPI backend: every dtype travels the same way.
        getattr(self.nccl, what)(self.device.pointer(buf), nbytes, NCCL_UINT8, peer,
                                 self.device.stream_ptr())

    # --- the public point-to-point calls -------------------------------------
    # Descriptors travel over MPI and are checked before NCCL moves any data;
    # the data is recorded and issued, sends and receives together in one
    # group, at the first wait or test (or at the end of ``Communicator.group``),
    # because an NCCL send issued alone blocks until its peer's receive runs.
    def post_send(self, buf, dst: int, tag: int, header: np.ndarray | None) -> _P2P:
        desc = None if header is None else self._mpi.post_send(header, dst, tag, None)
        if desc is not None:
            desc.reqs = desc.reqs[:1]  # only the descriptor goes over MPI
        return self._record(_P2P("send", buf, dst, desc))

    def post_recv(self, buf, src: int, tag: int, header: np.ndarray | None, check=None) -> _P2P:
        desc = None if header is None else self._mpi.post_recv(header, src, tag, None)
        if desc is not None:
            desc.reqs, desc.check = desc.reqs[:1], check
        return self._record(_P2P("recv", buf, src, desc))

    def _record(self, op: _P2P) -> _P2P:
        self._p2p_pending.append(op)
        return op

    def follow_torch_stream(self, op: _P2P, buf: Buffer) -> None:
        """Order ``op`` (a posted send or receive of the torch tensor ``buf``) with torch's
        current stream when it is not CuPy's: the message waits for the kernels that
        wrote (or last read) the tensor before the post, and torch's stream waits for
        the message before its next kernel. NCCL's calls go to CuPy's stream only.
        """
        op.torch = self.device.torch_event(buf)

    def complete(self, op: _P2P, what: str, peer: int) -> None:
        if not op.issued:
            self.flush(what)
        if op.error is not None:
            raise op.error
        # The host does not wait for the data: work queued on the stream after
        # this runs after it (see the module docstring's Streams).

    def done(self, op: _P2P) -> bool:
        self.complete(op, f"test({op.what})", op.peer)
        return True

    def flush(self, what: str = "group") -> None:
        pending, self._p2p_pending = self._p2p_pending, []
        live = []
        for op in pending:
            op.issued = True
            if op.desc is not None:
                try:
                    self._mpi.complete(op.desc, f"{what}: descriptor", op.peer)
                except Exception as exc:  # noqa: BLE001 - refused: this op moves nothing
                    op.error = exc
                    continue
            live.append(op)
        if live:
            torch_streams = [op.torch for op in live if op.torch is not None]
            for ready, _ in torch_streams:
                self.device.current_waits(ready)
            with self.group():
                for op in live:
                    self._p2p(op.what, op.buf, op.peer)
            if torch_streams:
                self.device.streams_wait_current({ptr for _, ptr in torch_streams})

    def synchronize(self) -> None:
        """Issue a receive that no send or wait picked up (the host does not block)."""
        if self._pending:
            with self.group():
                self._issue_pending()

    def begin(self, buf: Buffer) -> None:
        """Start a collective: the backend's stream waits for the caller's and becomes current."""
        self.device.enter(buf)

    def end(self) -> None:
        """Finish a collective: the caller's stream waits for the backend's (see Streams)."""
        self.synchronize()
        self.device.leave()

    def abandon(self) -> None:
        """A collective raised midway: drop its unissued receives, hand the stream back.

        A receive left recorded would be issued with the next call's first send,
        into a buffer the failed call owned.
        """
        self._pending.clear()
        self.device.leave()

    def scratch(self, like, n: int):
        """A device receive buffer of ``n`` elements of ``like``'s dtype, reused across calls."""
        key = like.dtype
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            buf = self.device.empty(max(n, 1), like.dtype)
            self._scratch[key] = buf
        return buf[:n]

    # --- control plane: MPI ---------------------------------------------------
    def exchange(self, values: np.ndarray) -> np.ndarray:
        return self._mpi.exchange(values)

    def exchange_bytes(self, data: bytes) -> list[bytes]:
        return self._mpi.exchange_bytes(data)

    def barrier(self) -> None:
        self._mpi.barrier()

    def check_buffer(self, buf: Buffer, collective: str, algo: str, op: str | None) -> None:
        """TypeError (naming the fix) for a buffer this backend cannot take."""
        self.device.check_buffer(buf)

    # --- NCCL's own collectives ----------------------------------------------
    def check_native(self, collective: str, dtype: str, op: str | None) -> None:
        if dtype not in NCCL_DTYPES:
            raise TypeError(f"algo='native' {collective}: NCCL has no {dtype} type; use "
                            "algo='ring' or cast to one of " + ", ".join(NCCL_DTYPES))
        if op is not None and op not in NCCL_OPS:  # the bitwise ones: NCCL has none
            raise TypeError(f"algo='native' {collective}: NCCL has no op {op!r}; use "
                            "algo='ring' (mpiring's ring reduces with it), or one of "
                            + ", ".join(NCCL_OPS))
        old = self.version < _NEEDS_2_10
        text = ".".join(map(str, self.version))
        if old and dtype == "bfloat16":
            raise TypeError(f"algo='native' {collective}: NCCL {text} has no bfloat16 (needs "
                            "2.10): use algo='ring', or upgrade nvidia-nccl")
        if old and op == "avg":
            raise TypeError(f"algo='native' {collective}: NCCL {text} has no avg (needs "
                            "2.10): use op='sum' and divide, algo='ring', or upgrade nvidia-nccl")

    def _args(self, x):
        return self.device.pointer(x), NCCL_DTYPES[_dtype_name(x)], x.itemsize

    def native_all_reduce(self, x, op: str):
        if x.size:
            p, dt, _ = self._args(x)
            self.nccl.allReduce(p, p, x.size, dt, NCCL_OPS[op], self.device.stream_ptr())
        return x

    def native_reduce_scatter(self, x, op: str):
        bounds = chunk_bounds(x.size, self.size)
        lo, hi = bounds[self.rank]
        if not x.size:
            return lo, hi
        p, dt, item = self._args(x)
        stream, nop = self.device.stream_ptr(), NCCL_OPS[op]
        if x.size % self.size == 0:
            # In place: NCCL's receive buffer is chunk ``rank`` of the send buffer.
            self.nccl.reduceScatter(p, p + lo * item, hi - lo, dt, nop, stream)
        else:
            with self.group():  # unequal chunks: one Reduce rooted at each chunk's owner
                for root, (a, b) in enumerate(bounds):
                    if b > a:
                        self.nccl.reduce(p + a * item, p + a * item, b - a, dt, nop, root,
                                         stream)
        return lo, hi

    def native_all_gather(self, x):
        bounds = chunk_bounds(x.size, self.size)
        if not x.size:
            return x
        p, _, item = self._args(x)
        stream = self.device.stream_ptr()
        if x.size % self.size == 0:
            lo, hi = bounds[self.rank]
            self.nccl.allGather(p + lo * item, p, (hi - lo) * item, NCCL_UINT8, stream)
        else:
            with self.group():  # unequal chunks: one Broadcast from each chunk's owner
                for root, (a, b) in enumerate(bounds):
                    if b > a:
                        self.nccl.bcast(p + a * item, (b - a) * item, NCCL_UINT8, root, stream)
        return x

    def native_broadcast(self, x, root: int):
        if x.size:
            self.nccl.bcast(self.device.pointer(x), int(x.nbytes), NCCL_UINT8, root,
                            self.device.stream_ptr())
        return x

    def native_reduce(self, x, op: str, root: int):
        if x.size:
            p, dt, _ = self._args(x)
            # In place; NCCL ignores the receive buffer on the other ranks, so
            # their x stays unchanged (as with MPI_Reduce).
            self.nccl.reduce(p, p, x.size, dt, NCCL_OPS[op], root, self.device.stream_ptr())
        return x

    # --- communicators --------------------------------------------------------
    def split(self, color: int | None, key: int):
        sub = self._mpi.split(color, key)
        return None if sub is None else self._factory(sub)

    def dup(self):
        return self._factory(self._mpi.dup())

    def create_group(self, ranks: list[int], tag: int):
        return self._factory(self._mpi.create_group(ranks, tag))

    def free(self) -> None:
        """Collective: the NCCL communicator, then its MPI control plane."""
        self.synchronize()  # a receive no send picked up is issued first
        self.device.synchronize()  # and what is queued on the stream has run
        destroy = getattr(self.nccl, "destroy", None)
        if destroy is not None:
            destroy()
        self._mpi.free()

    def local_rank(self) -> tuple[int, int]:
        return self._mpi.local_rank()

    def abort(self, code: int = 1) -> None:
        try:
            self.nccl.abort()
        finally:
            self._mpi.abort(code)


def _dtype_name(x) -> str:
    from mpiring.core.buffers import _canonical

    return _canonical(x.dtype)


# --- construction -------------------------------------------------------------------
def make_backend(comm=None, *, device_id: int | None = None) -> NCCLBackend:
    """An NCCL backend over the ranks of mpi4py communicator ``comm``.

    Each rank takes GPU ``local_rank % device_count`` (or ``device_id``). Collective
    over ``comm``: every rank calls it.

    Raises:
        BackendUnavailable: on every rank, if CuPy, a CUDA device or NCCL is
            missing on any rank, or too many ranks share a GPU; the message
            names what is missing where and how to fix it.
    """
    mpi = world_backend() if comm is None else MPIBackend(comm.Dup())
    local_rank, local_size = mpi.local_rank()
    device_id, version = check_devices(mpi, local_rank, local_size, device_id)
    cupy, _ = import_cupy()
    nccl, _ = import_nccl()
    cupy.cuda.Device(device_id).use()
    return _create(mpi, cupy, nccl, device_id, version)


def _create(mpi: MPIBackend, cupy, nccl, device_id: int, version) -> NCCLBackend:
    uid = nccl.get_unique_id() if mpi.rank == 0 else None
    uid = broadcast_unique_id(mpi, uid)
    try:
        with cupy.cuda.Device(device_id):
            nccl_comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
    except Exception as exc:  # noqa: BLE001 - NcclError, CUDARuntimeError
        message = (f"[r{mpi.rank}] NCCL communicator init failed on GPU {device_id}: "
                   f"{_first_line(exc)}")
        if mpi.size == 1:
            raise BackendUnavailable(message) from None
        # The other ranks may be inside NCCL's bootstrap waiting for this one:
        # end the job rather than leave them waiting.
        sys.stderr.write(message + "; aborting the job so that no rank waits forever\n")
        sys.stderr.flush()
        from mpiring.backends.mpi import forget_shared_memory

        forget_shared_memory()
        mpi.comm.Abort(1)
        raise BackendUnavailable(message) from None  # pragma: no cover - Abort does not return

    def factory(sub: MPIBackend) -> NCCLBackend:
        return _create(sub, cupy, nccl, device_id, version)

    return NCCLBackend(mpi, nccl_comm, nccl, CupyDevice(cupy, device_id), version, factory)
