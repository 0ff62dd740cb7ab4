"""The GPU code paths checked against the real CuPy and NCCL APIs, without a GPU.

* ``make_backend`` counts the ranks on each *physical* GPU (NCCL's own test:
  the GPU's UUID), so that a launcher giving every rank its own
  CUDA_VISIBLE_DEVICES (each rank sees one GPU, device 0) is not refused as
  "K ranks share 1 GPU", and two ranks sent to one GPU are refused before NCCL
  starts, on every rank.
* ``CupyDevice`` and the staging copy-back order torch's stream by its handle
  through the CUDA runtime, not through ``cupy.cuda.ExternalStream``, which
  CuPy 14 deprecates with a DeprecationWarning on every construction
  (cupy/cuda/stream.pyx); and the waits go the right way round.
* ``tests/fake_nccl.py`` now refuses what ``NcclCommunicator`` refuses
  (argument count and order, dtype/op enums by NCCL version, roots and peers,
  NCCL's in-place rule), so a backend call that would be wrong on a GPU fails here.
* A torch CUDA tensor on a GPU that is not torch's current device (cuda:1 in
  a process that never called ``torch.cuda.set_device(1)``) goes through
  DLPack: torch's ``__dlpack__`` refuses a tensor off its current device, and
  a bfloat16 one was then misreported as "this CuPy cannot take bfloat16".
* One GPU-only check (skipped here): the stream rule on one rank, where the
  collectives themselves move nothing and so cannot show a missing wait.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
from conftest import data
from fake_nccl import FakeNccl, check_call, fake_backend

import mpiring
import mpiring.backends.gpu as cuda
from mpiring.backends import nccl as nccl_mod
from mpiring.backends.mpi import MPIBackend
from mpiring.comm.communicator import Communicator
from mpiring.core import buffers
from mpiring.core.buffers import Buffer, as_buffer


# --- ranks per physical GPU ----------------------------------------------------------------
class _Runtime:
    def __init__(self, uuids):
        self.uuids = uuids  # one per device this process sees; an Exception: no answer

    def getDeviceCount(self):  # noqa: N802 - CUDA's names
        return len(self.uuids)

    def getDeviceProperties(self, i):  # noqa: N802
        if isinstance(self.uuids[i], Exception):
            raise self.uuids[i]
        return {"uuid": self.uuids[i], "pciDomainID": 0, "pciBusID": 0x17 + i,
                "pciDeviceID": 0}


def _stack(monkeypatch, uuids, version=23001):
    used = []
    device = lambda i: types.SimpleNamespace(use=lambda: used.append(i))  # noqa: E731
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_Runtime(uuids),
                                                            Device=device))
    lib = types.SimpleNamespace(get_version=lambda: version)
    monkeypatch.setattr(nccl_mod, "import_cupy", lambda: (cupy, None))
    monkeypatch.setattr(nccl_mod, "import_nccl", lambda: (lib, None))
    # NCCL itself is not here: stop where the communicator would be created.
    monkeypatch.setattr(nccl_mod, "_create",
                        lambda mpi, cupy, nccl, device_id, version: (device_id, version))
    return used


def _uuid(tag: int) -> bytes:
    return bytes([tag + 1]) * 16


def test_one_visible_gpu_per_rank_is_not_taken_for_a_shared_gpu(world, monkeypatch):
    # srun --gpus-per-task=1 and similar: every rank sees one GPU, its own.
    used = _stack(monkeypatch, [_uuid(world.rank)], version=22903)
    monkeypatch.delenv(nccl_mod.MULTI_RANK_ENV, raising=False)
    assert nccl_mod.make_backend(world.mpi_comm) == (0, (2, 29, 3))
    assert used == [0]


def test_ranks_sent_to_one_gpu_are_refused_on_every_rank_before_nccl(world, monkeypatch):
    # Every rank sees four GPUs but is told to use device 2: one GPU for all of them
    # (the old estimate, local ranks over devices, said 1 rank per GPU).
    _stack(monkeypatch, [_uuid(i) for i in range(4)], version=22903)
    monkeypatch.delenv(nccl_mod.MULTI_RANK_ENV, raising=False)
    if world.size == 1:
        assert nccl_mod.make_backend(world.mpi_comm, device_id=2) == (2, (2, 29, 3))
        return
    with pytest.raises(mpiring.BackendUnavailable) as info:
        nccl_mod.make_backend(world.mpi_comm, device_id=2)
    text = str(info.value)
    assert f"on every rank: {world.size} ranks of this communicator use this rank's GPU" in text
    assert "NCCL 2.29.3 allows 1 rank(s) per GPU" in text and "one rank per GPU" in text


def test_nccl_2_30_switch_allows_two_ranks_on_one_gpu_not_three(world, monkeypatch):
    _stack(monkeypatch, [_uuid(world.rank // 2)], version=23001)  # ranks 0,1 | 2,3 pair up
    monkeypatch.setenv(nccl_mod.MULTI_RANK_ENV, "1")
    assert nccl_mod.make_backend(world.mpi_comm) == (0, (2, 30, 1))
    _stack(monkeypatch, [_uuid(0)], version=23001)  # every rank on one GPU
    if world.size <= 2:
        assert nccl_mod.make_backend(world.mpi_comm)[0] == 0
        return
    with pytest.raises(mpiring.BackendUnavailable, match="allows 2 rank"):
        nccl_mod.make_backend(world.mpi_comm)


def test_without_a_gpu_identity_the_estimate_decides(world, monkeypatch):
    # No properties on one rank: every rank falls back to local ranks over devices.
    uuid = RuntimeError("no properties") if world.rank == 0 else _uuid(world.rank)
    _stack(monkeypatch, [uuid], version=22903)
    be = MPIBackend(world.mpi_comm.Dup())
    local_rank, local_size = be.local_rank()
    if local_size == 1:
        assert nccl_mod.check_devices(be, local_rank, local_size) == (0, (2, 29, 3))
    else:
        with pytest.raises(mpiring.BackendUnavailable, match=r"ranks on this host share 1 GPU"):
            nccl_mod.check_devices(be, local_rank, local_size)
    be.free()


def test_gpu_identity_prefers_the_uuid_and_falls_back_to_the_pci_address():
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_Runtime(
        [_uuid(3), b"\0" * 16, RuntimeError("x")])))
    assert nccl_mod.gpu_identity(cupy, 0) == b"uuid:" + _uuid(3)
    assert nccl_mod.gpu_identity(cupy, 1).startswith(b"pci:")
    assert nccl_mod.gpu_identity(cupy, 2) == b""
    assert nccl_mod.count_sharing([b"a", b"b", b"a"], b"a") == 2
    assert nccl_mod.count_sharing([b"a", b""], b"a") is None


# --- streams: the CuPy 14 API, and which stream waits for which -----------------------------
class _Event:
    n = 0

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        _Event.n += 1
        self.ptr = 10_000 + _Event.n
        self.disable_timing = disable_timing


class _FakeCupy:
    """The stream calls of CuPy 14 (cupy/cuda/stream.pyx, cupy_backends runtime.pyx),
    logging each as (what, stream ptr, event ptr)."""

    def __init__(self):
        log = self.log = []
        state = self.state = {"device": 0, "current": None}
        fake = self

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptr=None):
                self.ptr = 0 if null else (ptr if ptr is not None else 2000)
                self.non_blocking = non_blocking
                self.device_id = state["device"]

            def record(self, event=None):
                event = event if event is not None else _Event()
                log.append(("record", self.ptr, event.ptr))
                return event

            def wait_event(self, event):
                log.append(("wait", self.ptr, event.ptr))

            def use(self):
                state["current"] = self
                return self

            def synchronize(self):
                log.append(("sync", self.ptr, None))

        class ExternalStream(Stream):
            def __init__(self, ptr, device_id=-1):
                # CuPy 14, stream.pyx: ExternalStream.__init__ warns on every call.
                warnings.warn("ExternalStream is deprecated. Use Stream.from_external() "
                              "instead", DeprecationWarning, stacklevel=2)
                super().__init__(ptr=ptr)

        class Runtime:
            def getDevice(self):  # noqa: N802
                return state["device"]

            def setDevice(self, d):  # noqa: N802
                state["device"] = d

            def eventRecord(self, event, stream):  # noqa: N802
                log.append(("record", stream, event))

            def streamWaitEvent(self, stream, event, flags=0):  # noqa: N802
                log.append(("wait", stream, event))

        self.Stream, self.ExternalStream = Stream, ExternalStream
        caller = Stream(ptr=1000)
        state["current"] = caller
        self.caller = caller

        class Device:
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                self.prev = state["device"]
                state["device"] = self.i

            def __exit__(self, *exc):
                state["device"] = self.prev

        self.cuda = types.SimpleNamespace(
            Stream=Stream, ExternalStream=ExternalStream, Event=_Event, Device=Device,
            runtime=Runtime(), get_current_stream=lambda: fake.state["current"])


def _torch_buffer(monkeypatch, torch_stream_ptr):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=torch_stream_ptr))
    tensor = types.SimpleNamespace(device="cuda:1")
    return Buffer(tensor, None, "float32", "cuda", "torch")


@pytest.mark.parametrize("torch_ptr", (None, 777, 1000))
def test_cupy_device_orders_the_caller_and_torch_streams_with_cupy_14(monkeypatch, torch_ptr):
    fake = _FakeCupy()
    dev = nccl_mod.CupyDevice(fake, 1)
    assert dev.stream.non_blocking and dev.stream.device_id == 1
    if torch_ptr is None:
        buf = Buffer(None, None, "float32", "cuda", "cupy")
    else:  # 1000: torch's current stream is CuPy's (then it is not waited on twice)
        buf = _torch_buffer(monkeypatch, torch_ptr)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        dev.enter(buf)
        assert fake.state["device"] == 1 and fake.state["current"] is dev.stream
        assert dev.stream_ptr() == 2000  # NCCL calls and the ring's kernels go here
        dev.leave()
    assert fake.state["device"] == 0 and fake.state["current"] is fake.caller
    log, backend = fake.log, 2000
    callers = {1000} | ({torch_ptr} if torch_ptr else set())
    recorded_on = {e: s for what, s, e in log if what == "record"}
    done = [e for what, s, e in log if what == "record" and s == backend][-1]
    entered = log[:log.index(("record", backend, done))]
    # enter: the backend's stream waits for every caller stream's queued work...
    assert {recorded_on[e] for what, s, e in entered if what == "wait" and s == backend} \
        == callers
    # ...and at leave every caller stream waits for the backend's last event.
    assert {s for what, s, e in log if what == "wait" and e == done} == callers


def test_staged_copy_back_orders_torch_stream_with_cupy_14(monkeypatch):
    fake = _FakeCupy()
    ops = object.__new__(cuda._CupyOps)
    ops.cupy = fake
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=777))
    event = _Event()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ops.torch_wait(types.SimpleNamespace(device="cuda:0"), event)
    assert fake.log == [("wait", 777, event.ptr)]


@pytest.mark.parametrize("torch_ptr", (777, 1000))
def test_cupy_device_orders_a_message_with_torch_s_stream(monkeypatch, torch_ptr):
    # NCCL's point-to-point calls go to CuPy's current stream (1000); a torch tensor
    # written under `with torch.cuda.stream(s)` (777) was sent before its kernels ran
    # and read before its message came.
    fake = _FakeCupy()
    dev = nccl_mod.CupyDevice(fake, 0)
    buf = _torch_buffer(monkeypatch, torch_ptr)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = dev.torch_event(buf)
        if torch_ptr == 1000:  # torch's stream is CuPy's: nothing to order
            assert got is None and fake.log == []
            return
        ready, ptr = got
        dev.current_waits(ready)
        dev.streams_wait_current({ptr})
    done = fake.log[2][2]
    assert fake.log == [("record", 777, ready.ptr), ("wait", 1000, ready.ptr),
                        ("record", 1000, done), ("wait", 777, done)]


def test_point_to_point_over_nccl_waits_on_torch_s_stream_around_the_group(comm, monkeypatch):
    torch = pytest.importorskip("torch")
    c = Communicator(fake_backend(comm.mpi_comm), comm.tracer, check=True)
    if c.size < 2:
        pytest.skip("a message needs two ranks")
    dev, log = c._be.device, []
    monkeypatch.setattr(dev, "torch_event", lambda buf: log.append("post") or ("ev", 777))
    monkeypatch.setattr(dev, "current_waits", lambda ev: log.append(("wait", ev)), raising=False)
    monkeypatch.setattr(dev, "streams_wait_current", lambda ptrs: log.append(("after", ptrs)),
                        raising=False)
    real_start = c._be.nccl.groupStart
    monkeypatch.setattr(c._be.nccl, "groupStart", lambda: log.append("group") or real_start())
    peer = c.rank ^ 1
    out = torch.zeros(5, dtype=torch.float64)
    if peer < c.size:
        with c.group():
            c.isend(torch.arange(5, dtype=torch.float64) + c.rank, peer)
            c.irecv(out, peer)
        assert out.tolist() == (torch.arange(5) + peer).tolist()
        assert log == ["post", "post", ("wait", "ev"), ("wait", "ev"), "group",
                       ("after", {777})]


# --- DLPack from a torch tensor that is not on torch's current device ----------------------
class _TorchCudaTensor:
    """What ``as_buffer`` reads of a torch CUDA tensor, and torch 2.13's ``__dlpack__`` rule."""

    __module__ = "torch.fake"

    def __init__(self, torch, dtype, index, state):
        self.dtype, self.device, self._state = dtype, torch.device("cuda", index), state
        self.requires_grad, self.layout = False, torch.strided

    def is_contiguous(self):
        return True

    def reshape(self, *shape):
        return self

    def __dlpack_device__(self):
        return 2, self.device.index  # kDLCUDA

    def __dlpack__(self, stream=None, max_version=None, copy=None):
        # torch/_tensor.py (2.13): the export checks torch's current device.
        if self.device.index != self._state["torch"]:
            raise BufferError("Can't export tensors on a different CUDA device index. "
                              f"Expected: {self.device.index}. Current device: "
                              f"{self._state['torch']}.")
        return "capsule"


def _dlpack_stack(monkeypatch, bfloat16_ok=True):
    torch = pytest.importorskip("torch")
    state = {"torch": 0, "runtime": 0}  # torch's lazily-set target device vs the runtime's

    def from_dlpack(t):  # cupy/_core/dlpack.pyx: set the runtime's device, export, restore
        _, dev = t.__dlpack_device__()
        prev, state["runtime"] = state["runtime"], dev
        try:
            t.__dlpack__(stream=1, max_version=(1, 0), copy=None)
        finally:
            state["runtime"] = prev
        if t.dtype == torch.bfloat16 and not bfloat16_ok:
            raise NotImplementedError("CuPy does not support bfloat16. Please install "
                                      "ml_dtypes to use bfloat16.")
        return types.SimpleNamespace(device=types.SimpleNamespace(id=dev))

    class device:  # noqa: N801 - torch.cuda.device
        def __init__(self, d):
            self.index = d.index

        def __enter__(self):
            self.prev, state["torch"] = state["torch"], self.index

        def __exit__(self, *exc):
            state["torch"] = self.prev

    monkeypatch.setattr(buffers, "_import_cupy", lambda: types.SimpleNamespace(
        from_dlpack=from_dlpack))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["torch"])
    monkeypatch.setattr(torch.cuda, "device", device)
    return torch, state


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_tensor_off_torch_s_current_device_goes_through_dlpack(monkeypatch, dtype):
    torch, state = _dlpack_stack(monkeypatch)
    t = _TorchCudaTensor(torch, getattr(torch, dtype), 1, state)
    buf = as_buffer(t)
    assert buf.kind == "torch" and buf.device == "cuda" and buf.dtype == dtype
    assert buf.array.device.id == 1
    assert state["torch"] == 0, "torch's current device must be left as it was"


def test_bfloat16_tensor_on_a_cupy_without_bfloat16_names_the_upgrade(monkeypatch):
    torch, state = _dlpack_stack(monkeypatch, bfloat16_ok=False)
    with pytest.raises(TypeError, match="CuPy >= 14 with ml_dtypes"):
        as_buffer(_TorchCudaTensor(torch, torch.bfloat16, 0, state))


# --- the fake refuses what NCCL refuses -------------------------------------------------------
def test_fake_nccl_enforces_the_real_signatures():
    ok = [("allReduce", 64, 64, 4, 7, 0, 5), ("reduce", 64, 64, 4, 7, 4, 1, 5),
          ("bcast", 64, 16, 1, 0, 5), ("send", 64, 16, 1, 1, 5),
          ("reduceScatter", 64, 64 + 2 * 4 * 4, 4, 7, 0, 5),  # rank 2 in place
          ("allGather", 64 + 2 * 16, 64, 16, 1, 5)]
    for op in ok:
        check_call(op, rank=2, size=4, version=(2, 30, 0))
    bad = {
        "broadcast(send, recv, ...) order into bcast": ("bcast", 64, 64, 16, 1, 0, 5),
        "count as bytes of float32 overlapping": ("allReduce", 64, 96, 16, 7, 0, 5),
        "root out of range": ("reduce", 64, 64, 4, 7, 0, 4, 5),
        "peer out of range": ("recv", 64, 4, 7, -1, 5),
        "not in place, overlapping": ("reduceScatter", 64, 64 + 4, 4, 7, 0, 5),
        "allGather off by one chunk": ("allGather", 64 + 16, 64, 16, 1, 5),
        "no such dtype": ("allReduce", 64, 64, 4, 10, 0, 5),
        "float count": ("send", 64, 4.0, 7, 1, 5),
    }
    for what, op in bad.items():
        with pytest.raises(AssertionError):
            check_call(op, rank=2, size=4, version=(2, 30, 0))
            pytest.fail(what)
    for op in (("allReduce", 64, 64, 4, 9, 0, 5), ("allReduce", 64, 64, 4, 7, 4, 5)):
        check_call(op, rank=0, size=2, version=(2, 10, 3))
        with pytest.raises(AssertionError, match="needs NCCL 2.10"):
            check_call(op, rank=0, size=2, version=(2, 8, 4))


def test_native_collectives_over_the_strict_fake_and_old_nccl(comm):
    c = Communicator(fake_backend(comm.mpi_comm, version=(2, 8, 4)), comm.tracer, check=True)
    k, rank = c.size, c.rank
    assert isinstance(c._be.nccl, FakeNccl) and c._be.nccl.version == (2, 8, 4)
    for n in (0, 1, k, 3 * k + 1):
        x = data(rank, n, np.float16)
        c.all_reduce(x, op="max", algo="native")
        want = np.stack([data(r, n, np.float16) for r in range(k)]).max(0)
        np.testing.assert_array_equal(x, want)
        # The in-place layouts of ReduceScatter and AllGather (rank-dependent offsets).
        y = data(rank, n, np.int64)
        view = c.reduce_scatter(y, op="sum", algo="native")
        lo, hi = c.chunk_bounds(n)[rank]
        np.testing.assert_array_equal(view, np.stack([data(r, n, np.int64)
                                                      for r in range(k)]).sum(0)[lo:hi])
        c.all_gather(y, algo="native")
        np.testing.assert_array_equal(y, np.stack([data(r, n, np.int64)
                                                   for r in range(k)]).sum(0))
    # bfloat16 and avg never reach an NCCL older than 2.10: refused on every rank first.
    with pytest.raises(TypeError, match="NCCL 2.8.4 has no avg"):
        c.all_reduce(data(rank, 8, np.float32), op="avg", algo="native")
    x = data(rank, 8, np.float32)  # the ring reduces avg itself: fine on old NCCL
    c.all_reduce(x, op="avg", algo="ring")
    assert c._be.nccl.queue == []


# --- on a GPU: the stream rule where the collective itself moves nothing -----------------------
def _gpu():
    n, reason = cuda.usable_devices()
    if not n:
        pytest.skip(f"no GPU: {reason}")
    import cupy

    return cupy


def test_on_gpu_backend_stream_waits_for_and_hands_back_to_the_caller_stream():
    # A one-rank collective moves nothing, so tests/test_gpu.py's check_streams cannot
    # fail on one rank; here the backend's stream does real work between enter and
    # leave, with the input produced and the result read on a busy side stream.
    cupy = _gpu()
    dev = nccl_mod.CupyDevice(cupy, cupy.cuda.runtime.getDevice())
    side = cupy.cuda.Stream(non_blocking=True)
    n = 1 << 20
    with side:
        slow = cupy.ones(8 << 20, dtype=cupy.float32)
        for _ in range(50):  # keep the side stream busy so that a missing wait shows
            slow = cupy.sqrt(slow * slow)
        x = cupy.empty(n, dtype=cupy.float32)
        x[...] = slow[:n] * 3
        dev.enter(Buffer(x, x, "float32", "cuda", "cupy"))
        assert cupy.cuda.get_current_stream() == dev.stream
        # On the backend's stream, as the ring's reductions are, and slow, so that a
        # caller stream that did not wait for it would read x too early.
        busy = cupy.ones(8 << 20, dtype=cupy.float32)
        for _ in range(50):
            busy = cupy.sqrt(busy * busy)
        x *= busy[:n] * 2
        dev.leave()
        assert cupy.cuda.get_current_stream() == side
        got = cupy.asnumpy(x + 1, stream=side)
        side.synchronize()
    assert (got == 7).all(), np.unique(got)[:5]
