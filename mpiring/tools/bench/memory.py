r"""What data parallelism costs in memory: peak RSS of a training run, per DDP setup.

One setup per process, because peak RSS (``getrusage``) is a per-process
high-water mark; ``scripts/ddp_memory.sh`` launches each setup and collects the
lines. Setups, on the same GPT, data and optimizer (AdamW):

* ``compute``: the bare model, no communication: the baseline;
* ``ddp``: ``mpiring.DistributedDataParallel`` (``.grad`` and the buckets are
  separate: one more copy of the gradients);
* ``ddp-view``: the same with ``gradient_as_bucket_view=True`` (``.grad`` lives
  in the buckets: no extra copy);
* ``torch-ddp`` and ``torch-ddp-view``: PyTorch's DDP over gloo, for comparison.

Each process records its RSS just before wrapping the model (the model, its
data and the runtime are in it) and its peak after the training steps. The
growth minus the growth of ``compute`` is what the data-parallel wrapper adds,
reported in MiB and in copies of the gradients::

    extra copies = (growth(setup) - growth(compute)) / gradient bytes

Beside the buckets, the ring holds a receive buffer of one chunk of the
largest bucket (``bucket_cap / K`` for ``ring``, a few 4 MiB segments for
``ring-seg``), which does not grow with the model.
"""

from __future__ import annotations

import resource
from typing import Any

from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO

SETUPS = ("compute", "ddp", "ddp-view", "torch-ddp", "torch-ddp-view")


def peak_rss_bytes() -> int:
    """This process's high-water mark of resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; else the peak)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:  # not Linux
        return peak_rss_bytes()


def measure_setup(comm, setup: str, *, preset: str = "comm", batch_size: int = 1,
                  steps: int = 5, bucket_mb: float = 25.0, algo: str = DEFAULT_BUCKET_ALGO,
                  max_data_mb: float = 1.0) -> dict[str, Any]:
    """Train ``steps`` steps in ``setup``; this rank's RSS before wrapping and at its peak."""
    import torch

    from mpiring.parallel.data.distributed import DistributedDataParallel
    from mpiring.tools.models.gpt import GPT, PRESETS, lm_loss
    from mpiring.tools.train.data import Windows, shared_corpus

    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}: use one of {', '.join(SETUPS)}")
    cfg = PRESETS[preset]
    train, _ = shared_corpus(comm, int(max_data_mb * (1 << 20)))
    windows = Windows(train, cfg.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pg = None
    before = current_rss_bytes()
    view = setup.endswith("-view")
    if setup.startswith("ddp"):
        wrapped = DistributedDataParallel(model, comm, bucket_cap_mb=bucket_mb, algo=algo,
                                          gradient_as_bucket_view=view)
    elif setup.startswith("torch-ddp"):
        from mpiring.tools.train.torch_pg import init_torch_process_group

        pg = init_torch_process_group(comm, torch.device("cpu"))
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, process_group=pg, gradient_as_bucket_view=view)
    else:
        wrapped = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = len(windows)
    try:
        for step in range(steps):
            start = (step * comm.size + comm.rank) * batch_size % max(1, n - batch_size)
            x, y = windows.batch(list(range(start, start + batch_size)), torch.device("cpu"))
            opt.zero_grad(set_to_none=True)
            lm_loss(wrapped(x), y).backward()
            opt.step()
    finally:
        if setup.startswith("ddp"):
            wrapped.close()
        if pg is not None:
            from mpiring.tools.train.torch_pg import destroy_torch_process_group

            wrapped = pg = None  # torch's DDP must not outlive its group
            destroy_torch_process_group(comm)
    # getrusage and /proc count pages slightly apart, so the kernel's high-water
    # mark can read a little below a resident size measured earlier; the peak is
    # at least every reading taken, "before" included.
    peak = max(peak_rss_bytes(), current_rss_bytes(), before)
    return {"setup": setup, "ranks": comm.size, "preset": preset, "grad_bytes": grad_bytes,
            "bucket_mb": bucket_mb, "algo": algo, "steps": steps,
            "rss_before": before, "rss_peak": peak, "growth": peak - before}


def format_memory_line(row: dict[str, Any]) -> str:
    mib = 1 << 20
    return (f"bench-ddp --memory: setup={row['setup']} ranks={row['ranks']} "
            f"preset={row['preset']} gradients {row['grad_bytes'] / mib:.1f} MiB: RSS before "
            f"wrapping {row['rss_before'] / mib:.0f} MiB, peak {row['rss_peak'] / mib:.0f} MiB, "
            f"growth {row['growth'] / mib:.0f} MiB (max over ranks)")


def memory_table(rows: list[dict[str, Any]]) -> str:
    """Each setup's growth, and its extra over ``compute`` in MiB and in gradient copies."""
    mib = 1 << 20
    base = {(r["ranks"], r["preset"]): r["growth"] for r in rows if r["setup"] == "compute"}
    out = ["| ranks | setup | peak RSS (MiB) | growth (MiB) | extra vs compute (MiB) | "
           "extra (gradient copies) |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get((r["ranks"], r["preset"]))
        extra = "" if b is None else f"{(r['growth'] - b) / mib:+.0f}"
        copies = "" if b is None else f"{(r['growth'] - b) / r['grad_bytes']:+.2f}"
        out.append(f"| {r['ranks']} | {r['setup']} | {r['rss_peak'] / mib:.0f} | "
                   f"{r['growth'] / mib:.0f} | {extra} | {copies} |")
    return "\n".join(out)
