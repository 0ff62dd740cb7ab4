"""GPU tests: CuPy and torch CUDA buffers on the MPI backend, and the NCCL backend.

They register only where every rank of the job sees a usable GPU; elsewhere
every rank skips all of them with the same stated reason (decided on each rank,
then agreed over MPI at import, so no rank runs a collective the others skip).

* MPI backend, K = 1..4 ranks on however many GPUs (ranks share them): host
  staging, or device pointers on a CUDA-aware MPI.
* NCCL, one rank per communicator: native and ring.
* NCCL, two ranks of one communicator on one GPU: needs NCCL >= 2.30 with
  NCCL_MULTI_RANK_GPU_ENABLE=1 (set here before any NCCL call when the version
  allows it); older NCCL refuses ("Duplicate GPU detected"), so skipped, saying so.
* The stream rule: a result is ready for the caller's stream when the collective
  returns, even when the input was produced, and the result is read, on a busy
  non-default stream.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import data
from mpi4py import MPI

from mpiring.backends.gpu import cuda_aware_mpi, import_cupy, import_nccl, nccl_version_tuple
from mpiring.comm.communicator import Communicator
from mpiring.core.buffers import BFLOAT16

WORLD = MPI.COMM_WORLD


def _agreed(local: str | None) -> str | None:
    """None if no rank has a reason to skip, else every rank's reasons (same on all ranks)."""
    reasons = WORLD.allgather(local)
    found = sorted({r for r in reasons if r})
    return "; ".join(found) if found else None


def _gpu_reason() -> str | None:
    cupy, reason = import_cupy()
    if cupy is None:
        return reason
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return f"no usable CUDA device ({type(exc).__name__})"
    return None


NO_GPU = _agreed(_gpu_reason())
pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU: {NO_GPU}")

NCCL_VERSION = None
if NO_GPU is None:
    import cupy

    _lib, _why = import_nccl()
    NO_NCCL = _agreed(_why)
    if NO_NCCL is None:
        NCCL_VERSION = nccl_version_tuple(_lib.get_version())
        if NCCL_VERSION >= (2, 30):
            # Read by NCCL when a communicator is created: set before the first one.
            os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    _node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    DEVICE = _node.Get_rank() % cupy.cuda.runtime.getDeviceCount()
    _node.Free()
    cupy.cuda.Device(DEVICE).use()
else:
    NO_NCCL = NO_GPU
    DEVICE = 0

MULTI = None
# The 2-rank communicator is world ranks 0 and 1: they share a GPU only where they sit
# on one host with the same device (a host with several GPUs gives them two).
_WHERE = WORLD.allgather((MPI.Get_processor_name(), DEVICE))
if NCCL_VERSION is not None and len(_WHERE) > 1 and _WHERE[0] == _WHERE[1]:
    if NCCL_VERSION < (2, 30):
        MULTI = (f"NCCL {'.'.join(map(str, NCCL_VERSION))} < 2.30 refuses two ranks of one "
                 "communicator on one GPU ('Duplicate GPU detected')")
    elif os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        MULTI = "NCCL_MULTI_RANK_GPU_ENABLE is not 1"
    MULTI = _agreed(MULTI)


def np_dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def reference(k, n, dtype, op, salt=0):
    stack = np.stack([data(r, n, dtype, op, salt).astype(np.float64) for r in range(k)])
    out = {"sum": stack.sum(0), "avg": stack.sum(0) / k, "max": stack.max(0),
           "min": stack.min(0), "prod": stack.prod(0)}[op]
    return out.astype(dtype)


def check_collectives(c: Communicator, algo: str, dtypes=("float32", "bfloat16", "int32")):
    """Every collective on CuPy arrays against the reference; data by rank and index."""
    k, rank = c.size, c.rank
    for n in (0, 1, k, 1000 + k):
        for dtype in dtypes:
            dt = np_dtype(dtype)
            if algo == "native" and dtype == "bfloat16" and c.backend == "mpi":
                continue  # MPI has no bfloat16 reduction (a TypeError, tested on the CPU)
            for op in ("sum", "max") + (("avg",) if dt.kind == "f" or dtype == "bfloat16"
                                         else ()):
                x = cupy.asarray(data(rank, n, dt, op))
                out = c.all_reduce(x, op=op, algo=algo)
                assert out is x
                np.testing.assert_array_equal(cupy.asnumpy(x), reference(k, n, dt, op),
                                              err_msg=f"all_reduce {dtype} {op} n={n}")
        lo, hi = c.chunk_bounds(n)[rank]
        y = cupy.asarray(data(rank, n, np.float32))
        view = c.reduce_scatter(y, op="sum", algo=algo)
        assert isinstance(view, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(view),
                                      reference(k, n, np.float32, "sum")[lo:hi])
        bounds = c.chunk_bounds(n)
        full = np.concatenate([data(r, n, np.float32, salt=2)[a:b]
                               for r, (a, b) in enumerate(bounds)]).astype(np.float32)
        g = cupy.zeros(n, dtype=np.float32)
        g[lo:hi] = cupy.asarray(full[lo:hi])
        c.all_gather(g, algo=algo)
        np.testing.assert_array_equal(cupy.asnumpy(g), full)
        root = n % k
        b = cupy.asarray(data(rank, n, np.float16, salt=3))
        c.broadcast(b, root=root, algo="native" if algo == "native" else "pipelined", chunks=3)
        np.testing.assert_array_equal(cupy.asnumpy(b), data(root, n, np.float16, salt=3))
        r = cupy.asarray(data(rank, n, np.float32, salt=4))
        c.reduce(r, root=root, op="sum", algo="native" if algo == "native" else "pipelined", chunks=2)
        expected = (reference(k, n, np.float32, "sum", salt=4) if rank == root
                    else data(rank, n, np.float32, salt=4))
        np.testing.assert_array_equal(cupy.asnumpy(r), expected)


def check_torch(c: Communicator, algo: str):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    k, rank, n = c.size, c.rank, 1000 + c.size
    t = torch.as_tensor(data(rank, n, np.float32)).to(f"cuda:{DEVICE}")
    out = c.all_reduce(t, op="avg", algo=algo)
    assert out is t
    np.testing.assert_array_equal(t.cpu().numpy(), reference(k, n, np.float32, "avg"))
    lo, hi = c.chunk_bounds(n)[rank]
    t = torch.as_tensor(data(rank, n, np.float32)).to(f"cuda:{DEVICE}")
    view = c.reduce_scatter(t, algo=algo)
    assert isinstance(view, torch.Tensor) and view.is_cuda
    assert view.data_ptr() == t.data_ptr() + lo * 4, "must be a view of the tensor"
    np.testing.assert_array_equal(view.cpu().numpy(), reference(k, n, np.float32, "sum")[lo:hi])
    # bfloat16 through DLPack needs a CuPy that maps it (CuPy >= 14 with ml_dtypes)
    t = torch.as_tensor(data(rank, n, np.float32)).to(f"cuda:{DEVICE}").to(torch.bfloat16)
    try:
        cupy.from_dlpack(t)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"this CuPy takes no bfloat16 through DLPack ({type(exc).__name__})")
    if algo == "native" and c.backend == "mpi":
        return  # MPI has no bfloat16 reduction
    c.all_reduce(t, op="sum", algo=algo)
    np.testing.assert_array_equal(t.float().cpu().numpy(), reference(k, n, np.float32, "sum"))


def check_streams(c: Communicator, algo: str):
    """Input produced on a busy side stream, result read on it straight after the call."""
    k, n = c.size, 1 << 20
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        slow = cupy.ones(4 << 20, dtype=cupy.float32)
        for _ in range(30):  # keep the side stream busy so that a missing wait shows
            slow = cupy.sqrt(slow * slow)
        x = cupy.empty(n, dtype=cupy.float32)
        x[...] = slow[:n] * (c.rank + 1)
        c.all_reduce(x, op="sum", algo=algo)
        y = x * 2  # queued on the side stream right after the call
        got = cupy.asnumpy(y, stream=side)
        side.synchronize()
    assert (got == 2.0 * k * (k + 1) / 2).all(), np.unique(got)[:5]


# --- MPI backend with GPU buffers ---------------------------------------------------
def test_mpi_path_is_reported(world):
    aware, how = cuda_aware_mpi()
    print(f"GPU buffers on the MPI backend: {'CUDA-aware' if aware else 'staged'} ({how})")


@pytest.mark.deadline(180)
@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_cupy_buffers_on_mpi_backend(comm, algo):
    check_collectives(comm, algo)


@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_torch_cuda_tensors_on_mpi_backend(comm, algo):
    check_torch(comm, algo)


@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_mpi_backend_stream_rule(comm, algo):
    check_streams(comm, algo)


# --- NCCL, one rank per communicator ------------------------------------------------
@pytest.fixture(scope="module")
def nccl1():
    if NO_NCCL is not None:
        pytest.skip(f"no NCCL: {NO_NCCL}")
    from mpiring.backends.nccl import make_backend

    # A one-rank communicator on every rank: any number of them may share a GPU.
    return Communicator(make_backend(MPI.COMM_SELF, device_id=DEVICE))


@pytest.mark.deadline(180)
@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_nccl_one_rank(nccl1, algo):
    assert nccl1.backend == "nccl" and nccl1.size == 1
    check_collectives(nccl1, algo)
    check_streams(nccl1, algo)


def test_nccl_one_rank_torch(nccl1):
    check_torch(nccl1, "native")


def test_nccl_rejects_host_buffers_on_every_rank(nccl1):
    with pytest.raises(TypeError, match="moves GPU memory only"):
        nccl1.all_reduce(np.zeros(4, dtype=np.float32))


# --- NCCL, two ranks (on one GPU or two) -------------------------------------------------------
@pytest.fixture(scope="module")
def nccl2(subcomms, world):
    if NO_NCCL is not None:
        pytest.skip(f"no NCCL: {NO_NCCL}")
    if MULTI is not None:
        pytest.skip(f"two ranks of one NCCL communicator on one GPU: {MULTI}")
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    sub = subcomms[2]
    if sub is None:
        pytest.skip(f"rank {world.rank} is not in the 2-rank sub-communicator")
    from mpiring.backends.nccl import make_backend

    return Communicator(make_backend(sub.mpi_comm))


@pytest.mark.deadline(180)
@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_nccl_two_ranks(nccl2, algo):
    assert nccl2.size == 2
    check_collectives(nccl2, algo)
    check_streams(nccl2, algo)
    check_torch(nccl2, algo)


@pytest.mark.deadline(120)
def test_nccl_two_ranks_dup_and_split(nccl2):
    twin = nccl2.dup()
    assert twin.backend == "nccl" and twin.size == 2
    check_streams(twin, "ring")
    alone = nccl2.split(color=nccl2.rank)  # two one-rank communicators
    assert alone.size == 1
    x = cupy.arange(10, dtype=cupy.float32)
    alone.all_reduce(x, algo="native")
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(10, dtype=np.float32))


# --- point-to-point with device buffers ------------------------------------------------
def check_p2p(comm, make):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for n in (0, 1, 1000 + comm.rank * 0, 4099):
        out = make(np.arange(n, dtype=np.float32) + 100 * comm.rank)
        got = make(np.full(n, -1, dtype=np.float32))
        comm.sendrecv(out, right, got, left, tag=n % 7)
        host = got.get() if hasattr(got, "get") else got.cpu().numpy()
        np.testing.assert_array_equal(host, np.arange(n, dtype=np.float32) + 100 * left)
    with comm.group():
        a = comm.irecv(make(np.zeros(5, np.float32)), left, tag=1)
        comm.isend(make(np.full(5, comm.rank, np.float32)), right, tag=1)
    host = a.wait()
    host = host.get() if hasattr(host, "get") else host.cpu().numpy()
    assert (host == left).all()


def test_p2p_cupy_and_torch_cuda_on_mpi_backend(comm):
    import torch

    check_p2p(comm, cupy.asarray)
    check_p2p(comm, lambda a: torch.from_numpy(a).cuda())


def test_p2p_on_nccl_one_rank(nccl1):
    check_p2p(nccl1, cupy.asarray)


def test_p2p_on_nccl_two_ranks(nccl2):
    import torch

    check_p2p(nccl2, cupy.asarray)
    check_p2p(nccl2, lambda a: torch.from_numpy(a).cuda())
    with pytest.raises(TypeError, match="moves GPU memory only"):
        nccl2.send(np.zeros(3, np.float32), 1 - nccl2.rank)


# --- the tensor-parallel layer on CUDA tensors ------------------------------------------
def check_vocab_parallel_cross_entropy(c: Communicator):
    """The loss and its gradient on CUDA logits against F.cross_entropy on the full ones."""
    import torch
    from torch.nn import functional as F

    from mpiring.parallel.tensor import vocab_parallel_cross_entropy, vocab_range

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    dev, vocab = torch.device(f"cuda:{DEVICE}"), 37
    lo, hi = vocab_range(vocab, c)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g, dtype=torch.float64).to(dev)
    target = (torch.arange(6) * 7 + 2).remainder(vocab).to(dev)
    target[2] = -100  # an ignored row: its masked_fill runs on the GPU too
    for kw in (dict(reduction="mean"), dict(reduction="none", label_smoothing=0.2)):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, **kw)
        weight = torch.arange(1.0, 1.0 + want.numel(), dtype=torch.float64, device=dev)
        (want.reshape(-1) * weight).sum().backward()
        for vocab_size in (vocab, None):  # None: the size is summed over the group
            local = logits[:, lo:hi].clone().requires_grad_()
            got = vocab_parallel_cross_entropy(local, target, c, vocab_size=vocab_size, **kw)
            assert got.device == dev, f"the loss came back on {got.device}"
            torch.testing.assert_close(got, want.detach(), rtol=1e-11, atol=1e-12)
            (got.reshape(-1) * weight).sum().backward()
            assert local.grad.device == dev
            torch.testing.assert_close(local.grad, full.grad[:, lo:hi], rtol=1e-11, atol=1e-12)


def test_vocab_parallel_cross_entropy_on_cuda_mpi_backend(comm):
    check_vocab_parallel_cross_entropy(comm)


def test_vocab_parallel_cross_entropy_on_nccl_one_rank(nccl1):
    check_vocab_parallel_cross_entropy(nccl1)


def test_rng_streams_fork_the_cuda_generator(comm):
    # On a GPU dropout draws from the CUDA generator: the streams must replace that one
    # (the CPU's is left alone), or the shared stream would not keep replicas identical.
    import torch
    from torch.nn import functional as F

    from mpiring.parallel.tensor import RNGStreams

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    dev = torch.device(f"cuda:{DEVICE}")
    streams = RNGStreams(seed=5, tp_rank=comm.rank)  # default device cpu: follows the tensor
    torch.cuda.manual_seed(1000 + comm.rank)  # the global stream differs per rank on purpose
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state(dev)
    draws = {}
    for name in ("shared", "tensor"):
        with streams.fork(name, dev):
            draws[name] = F.dropout(torch.ones(256, dtype=torch.float64, device=dev), 0.5)
    assert torch.equal(torch.cuda.get_rng_state(dev), cuda), "fork must restore CUDA's generator"
    assert torch.equal(torch.get_rng_state(), cpu), "a CUDA fork must leave the CPU's alone"
    for name, mine in draws.items():
        everyone = torch.zeros(comm.size, 256, dtype=torch.float64, device=dev)
        everyone[comm.rank] = mine
        comm.all_gather(everyone)
        same = all(torch.equal(everyone[0], everyone[i]) for i in range(comm.size))
        assert same if name == "shared" else (comm.size == 1 or not same), name


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_gpt_on_cuda(comm, sp):
    # The loss and gradients equal the full GPT's on the GPU, and with dropout the
    # replicated residual stream stays identical on every rank.
    import torch

    from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
    from mpiring.tools.models.gpt_tp import TensorParallelGPT

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    dev = torch.device(f"cuda:{DEVICE}")
    cfg = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_layers=2, n_heads=3, dropout=0.0)
    seq = torch.randint(0, 37, (3, 8), generator=torch.Generator().manual_seed(1)).to(dev)
    x, y = seq[:, :-1], seq[:, 1:]
    torch.manual_seed(7)
    full = GPT(cfg).double().to(dev)
    model = TensorParallelGPT.from_full(full, comm, sequence_parallel=sp)
    want = lm_loss(full(x), y)
    want.backward()
    got = model.loss(model(x), y)
    assert got.device == dev
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12)
    got.backward()
    grads = dict(full.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, model.shard(name, grads[name].grad), rtol=1e-9,
                                   atol=1e-11, msg=lambda m, n=name: f"gradient of {n}: {m}")
    if sp:
        return  # each rank holds its own tokens: nothing replicated to compare
    torch.manual_seed(7)
    model = TensorParallelGPT.from_full(GPT(cfg.with_(dropout=0.2)).double().to(dev), comm,
                                        hidden_dropout=0.3, seed=11)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, out: seen.append(out.detach().clone()))
    torch.cuda.manual_seed(100 + comm.rank)  # CUDA's own generator differs per rank
    model.train()
    model(x)
    for i, mine in enumerate(seen):
        everyone = torch.zeros(comm.size, *mine.shape, dtype=mine.dtype, device=dev)
        everyone[comm.rank] = mine
        comm.all_gather(everyone)
        for r in range(comm.size):
            assert torch.equal(everyone[r], everyone[0]), f"block {i}: r{r}'s stream differs"
