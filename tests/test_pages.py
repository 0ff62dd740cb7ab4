"""mpiring.runtime.pages: huge-page host buffers and glibc's malloc thresholds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mpiring.parallel.data import DistributedDataParallel as DDP
from mpiring.parallel.data.bucketing import BUCKET_SEGMENT_BYTES, MIB
from mpiring.runtime import pages

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


needs_thp = pytest.mark.skipif(not pages.enabled() or not os.path.exists("/proc/self/smaps"),
                               reason="no MADV_HUGEPAGE or no /proc (not Linux)")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_large_buffers_are_aligned_zeroed_and_advised_huge(dtype):
    n = (3 * pages.HUGE_PAGE) // torch.empty(0, dtype=dtype).element_size() + 7
    t = pages.zeros(n, dtype)
    assert (t.dtype, t.shape, t.device.type) == (dtype, (n,), "cpu") and t.is_contiguous()
    assert t.data_ptr() % pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr()), "the mapping is not advised MADV_HUGEPAGE"
    assert int(t.count_nonzero()) == 0
    t[-1] = 3  # the whole length is writable, to the last element
    assert int(t.count_nonzero()) == 1


@needs_thp
def test_views_keep_the_mapping_alive():
    import gc

    t = pages.zeros(pages.HUGE_PAGE, torch.float32)
    t += torch.arange(t.numel(), dtype=torch.float32)
    tail = t[-5:].view(5, 1)
    del t
    gc.collect()
    assert tail.reshape(-1).tolist() == [float(pages.HUGE_PAGE - 5 + i) for i in range(5)]


def test_reachable_from_the_package_without_torch():
    code = ("import sys, mpiring; assert callable(mpiring.runtime.pages.zeros); "
            "assert callable(mpiring.runtime.pages.steady_malloc); assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_describe_says_what_zeros_does_here(monkeypatch):
    assert pages.thp_mode() in ("always", "madvise", "never", "unknown")
    monkeypatch.setenv("MPIRING_HUGE_PAGES", "0")
    assert pages.describe() == "4 KiB pages (MPIRING_HUGE_PAGES=0)"
    monkeypatch.delenv("MPIRING_HUGE_PAGES")
    if pages.enabled() and pages.thp_mode() in ("always", "madvise"):
        assert pages.describe() == f"huge pages advised (transparent huge pages: {pages.thp_mode()})"


def test_small_buffers_and_switched_off_are_plain_zeros(monkeypatch):
    small = pages.zeros(100, torch.float16)
    assert small.dtype == torch.float16 and int(small.count_nonzero()) == 0
    monkeypatch.setenv("MPIRING_HUGE_PAGES", "0")
    assert not pages.enabled()
    big = pages.zeros(pages.HUGE_PAGE, torch.float32)
    assert big.numel() == pages.HUGE_PAGE and int(big.count_nonzero()) == 0
    if os.path.exists("/proc/self/smaps"):
        assert "hg" not in vm_flags(big.data_ptr())


def _steady(env: dict[str, str]) -> str:
    code = "from mpiring.runtime.pages import steady_malloc; print(steady_malloc())"
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "MPIRING_STEADY"))}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_steady_malloc_sets_the_thresholds_unless_the_environment_did():
    assert _steady({}) == "True"
    assert _steady({"MPIRING_STEADY_MALLOC": "0"}) == "False"
    assert _steady({"MALLOC_TRIM_THRESHOLD_": "1000000"}) == "False"
    assert _steady({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1000000"}) == "False"


@needs_thp
@pytest.mark.parametrize("view", [False, True], ids=["copied", "bucket-view"])
def test_ddp_buckets_on_huge_pages_reduce_exactly(comm, view):
    """A 4.5 MB bucket on huge pages: the gradients are the global batch's, on every rank."""
    torch.manual_seed(5)
    model = nn.Linear(512, 1100).double()
    ref = nn.Linear(512, 1100).double()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(77 + comm.size)
    X = torch.randn(2 * comm.size, 512, generator=g, dtype=torch.float64)
    Y = torch.randn(2 * comm.size, 1100, generator=g, dtype=torch.float64)
    ddp = DDP(model, comm, bucket_cap_mb=8, first_bucket_mb=8, gradient_as_bucket_view=view)
    try:
        flat = ddp.reducer.buckets[0].flat
        assert flat.numel() * 8 > 4 * MIB and flat.data_ptr() % pages.HUGE_PAGE == 0
        assert "hg" in vm_flags(flat.data_ptr())
        mine = slice(2 * comm.rank, 2 * comm.rank + 2)
        for _ in range(2):  # the second backward runs on the rebuilt buckets
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            ((ddp(X[mine]) - Y[mine]) ** 2).mean().backward()
            ((ref(X) - Y) ** 2).mean().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
        # The default bucket algorithm (ring-seg, 1 MiB segments) receives into two
        # segments: 2 MiB, where the lecture's ring would take a chunk (2.25 MB on 2 ranks).
        held = sum(b.nbytes for b in ddp.reducer._bucket_comm._be._scratch.values())
        assert held <= 2 * BUCKET_SEGMENT_BYTES, held
    finally:
        ddp.close()
