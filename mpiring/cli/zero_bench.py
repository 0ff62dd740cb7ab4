"""Memory and step time of one optimizer setup on the GPT model: adamw (DDP), zero1 or zero2.

    mpiexec -n 4 python -m mpiring zero-bench --optimizer zero2 --preset comm --steps 8

One setup per launch, because peak RSS is a per-process high-water mark:
``scripts/zero_memory.sh`` runs adamw, zero1 and zero2 on 1-4 ranks and
collects the lines. ``--optimizer adamw,zero1,zero2`` instead builds all three
in one process and alternates their steps, so that a busy machine slows them
alike: the step-time ratios of that run are the fair ones (no RSS then). Reported (rank 0 prints one line; ``--json FILE`` appends
it as JSON):

* optimizer state bytes per rank (the AdamW moments this rank holds: all of
  them with adamw, about 1/K with zero1/zero2), max over ranks;
* peak RSS per rank (``getrusage``), max over ranks, and its growth over the
  RSS measured just before the first step (the model, data and runtime are in
  the baseline; the optimizer state, gradients and buffers are in the growth);
* bytes each rank sends per step (ring: DDP's AllReduce 2(K-1)/K of the model,
  zero2 ReduceScatter + AllGather the same, zero1 AllReduce + AllGather 3(K-1)/K);
* the median step time (first step excluded).
"""

from __future__ import annotations

import json
import sys

from mpiring.cli import add_backend_arguments, output_file, positive_int, refuse


def add_arguments(p) -> None:
    p.add_argument("--optimizer", default="zero2",
                   help="adamw (DDP + AdamW), zero1 or zero2 (DDP + sharded AdamW); a comma list "
                        "alternates their steps in one process and compares step times")
    p.add_argument("--preset", default="comm", help="GPT preset (default comm, 12.8M params)")
    p.add_argument("--steps", type=positive_int, default=8, help="training steps (default 8)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per rank (default 4)")
    p.add_argument("--max-data-mb", type=float, default=1.0, help="corpus to read (default 1)")
    p.add_argument("--json", metavar="FILE", type=output_file, default=None, help="append the result as a JSON line")
    add_backend_arguments(p)


def run(args) -> int:
    import torch

    import mpiring
    from mpiring.parallel.data.bucketing import MIB
    from mpiring.parallel.data.comm_hooks import ring_bytes_sent
    from mpiring.tools.bench.memory import current_rss_bytes, peak_rss_bytes
    from mpiring.tools.train.loop import TrainConfig, TrainJob

    names = [n.strip() for n in args.optimizer.split(",") if n.strip()]
    if not names or any(n not in ("adamw", "zero1", "zero2") for n in names):
        return refuse(f"zero-bench: --optimizer {args.optimizer!r}: use adamw, zero1, zero2 or "
                      "a comma list of them")
    mpiring.runtime.pages.steady_malloc()  # as in train and bench-ddp (see mpiring.runtime.pages)
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    if len(names) > 1:
        return _interleaved(comm, args, names)
    cfg = TrainConfig(mode="ddp", steps=args.steps, batch_size=args.batch_size,
                      preset=args.preset, optimizer=args.optimizer, max_data_mb=args.max_data_mb)
    job = TrainJob(comm, cfg)
    rss_before = current_rss_bytes() / MIB
    for _ in range(args.steps):
        job.train_step()
    opt = job.optimizer
    inner = getattr(opt, "optim", opt)
    state_bytes = sum(v.numel() * v.element_size() for st in inner.state.values()
                      for v in st.values() if torch.is_tensor(v))
    n_params = sum(p.numel() for p in job.model.parameters())
    itemsize = next(job.model.parameters()).element_size()
    phases = {"adamw": ("rs", "ag"), "zero2": ("rs", "ag"), "zero1": ("rs", "ag", "ag")}
    # zero1: DDP's AllReduce plus the parameter AllGather (the second "ag").
    sent = sum(ring_bytes_sent(n_params, itemsize, comm.size, comm.rank, (ph,))
               for ph in phases[args.optimizer])
    times = sorted(job.step_times[1:] or job.step_times)
    peak = peak_rss_bytes() / MIB
    mine = {"state_bytes": state_bytes, "peak_rss_mib": peak,
            "rss_growth_mib": peak - rss_before, "sent_bytes": sent,
            "step_s": times[len(times) // 2]}
    table = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
    job.close()
    if comm.rank == 0:
        row = {"optimizer": args.optimizer, "ranks": comm.size, "preset": args.preset,
               "params": n_params,
               "state_mib_per_rank": max(t["state_bytes"] for t in table) / 2**20,
               "peak_rss_mib": max(t["peak_rss_mib"] for t in table),
               "rss_growth_mib": max(t["rss_growth_mib"] for t in table),
               "sent_mib_per_step": max(t["sent_bytes"] for t in table) / 2**20,
               "step_ms": 1e3 * max(t["step_s"] for t in table)}
        print(f"zero-bench: optimizer={row['optimizer']} ranks={row['ranks']} "
              f"model={args.preset} {n_params / 1e6:.1f}M params: optimizer state "
              f"{row['state_mib_per_rank']:.1f} MiB/rank, peak RSS {row['peak_rss_mib']:.0f} MiB "
              f"(+{row['rss_growth_mib']:.0f} MiB during training), sends "
              f"{row['sent_mib_per_step']:.1f} MiB/step, median step {row['step_ms']:.0f} ms",
              flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    sys.stdout.flush()
    return 0


def _interleaved(comm, args, names: list[str]) -> int:
    """Alternate the steps of one job per optimizer; print median step times and ratios."""
    import statistics

    from mpiring.tools.train.data import shared_corpus
    from mpiring.tools.train.loop import TrainConfig, TrainJob

    data = shared_corpus(comm, int(args.max_data_mb * (1 << 20)))
    jobs = [TrainJob(comm, TrainConfig(mode="ddp", steps=args.steps, batch_size=args.batch_size,
                                       preset=args.preset, optimizer=name),
                     train_data=data[0], val_data=data[1]) for name in names]
    for _ in range(args.steps):
        for job in jobs:
            job.train_step()
    mine = [statistics.median(job.step_times[1:] or job.step_times) for job in jobs]
    table = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
    for job in jobs:
        job.close()
    if comm.rank == 0:
        steps = [max(t[j] for t in table) for j in range(len(names))]
        parts = ", ".join(f"{n} {s * 1e3:.0f} ms ({s / steps[0]:.2f}x)" for n, s in zip(names, steps))
        print(f"zero-bench: ranks={comm.size} model={args.preset}, steps alternated, median step "
              f"time: {parts}", flush=True)
    return 0
