"""What gradient compression costs: validation loss vs step, bytes and step time, per DDP comm hook.

    mpiexec -n 4 python -m mpiring hook-curves --steps 150 --out docs/compression_curves

Trains the GPT model once per hook (same seed, same data, same everything
else; the jobs' steps alternate, so a busy machine slows every hook alike), evaluates the validation loss every ``--eval-every`` steps, and counts
the bytes each hook puts on the wire. Rank 0 prints a table (bytes per step
after the hook's start, the ratio to plain DDP, median step time and its ratio,
final validation loss) and writes ``OUT.json`` and ``OUT.png`` (validation loss
against step for each hook, next to no compression). ``scripts/compression_curves.sh``
runs it with the settings of the committed figure.
"""

from __future__ import annotations

import json
import statistics
import sys

from mpiring.cli import add_backend_arguments, output_file, refuse

DEFAULT_HOOKS = "none,fp16,bf16,topk,powersgd"


def add_arguments(p) -> None:
    p.add_argument("--hooks", default=DEFAULT_HOOKS,
                   help=f"comma-separated comm hooks to compare (default {DEFAULT_HOOKS})")
    p.add_argument("--steps", type=int, default=150, help="training steps per hook (default 150)")
    p.add_argument("--eval-every", type=int, default=15, help="validation every N steps (default 15)")
    p.add_argument("--val-batches", type=int, default=4, help="validation batches per rank (default 4)")
    p.add_argument("--preset", default="small", help="GPT preset (default small, 3.2M params)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--topk-ratio", type=float, default=0.01, help="topk: fraction sent (default 0.01)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="powersgd: rank (default 1)")
    p.add_argument("--hook-start", type=int, default=10,
                   help="topk/powersgd: plain AllReduce for the first N steps (default 10)")
    p.add_argument("--max-data-mb", type=float, default=4.0, help="corpus to read (default 4)")
    p.add_argument("--out", default="docs/compression_curves", type=output_file,
                   help="write OUT.json and OUT.png on rank 0 (default docs/compression_curves)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw OUT.png from OUT.json (no training, no MPI)")
    add_backend_arguments(p)


def _dense_bytes(job) -> int:
    """Bytes rank 0 sends per step with plain DDP: a ring AllReduce of every bucket."""
    from mpiring.parallel.data.comm_hooks import ring_bytes_sent

    reducer = job.wrapped.reducer
    return sum(ring_bytes_sent(b.numel, b.flat.element_size(), job.comm.size, job.comm.rank,
                               ("rs", "ag")) for b in reducer.buckets)


def run_hooks(comm, args, hooks: list[str], data) -> list[dict]:
    """Train one job per hook, their steps alternated; return curves and costs (collective).

    Alternating the steps (hook A's step 1, hook B's step 1, ...) exposes every
    hook to the same machine load, so the step-time ratios are fair even on a
    busy machine.
    """
    from mpiring.tools.train.loop import TrainConfig, TrainJob

    jobs = []
    for hook in hooks:
        cfg = TrainConfig(mode="ddp", steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                          seed=args.seed, preset=args.preset, max_data_mb=args.max_data_mb,
                          val_batches=args.val_batches, comm_hook=hook,
                          topk_ratio=args.topk_ratio, powersgd_rank=args.powersgd_rank,
                          hook_start=args.hook_start)
        jobs.append(TrainJob(comm, cfg, train_data=data[0], val_data=data[1]))
    curves = [[(0, job.evaluate())] for job in jobs]
    sent = [[] for _ in jobs]
    try:
        for _ in range(args.steps):
            for job, per_step in zip(jobs, sent):
                before = job.comm_hook_state.bytes_sent if job.comm_hook_state else 0
                job.train_step()
                if job.comm_hook_state is not None:
                    per_step.append(job.comm_hook_state.bytes_sent - before)
                else:
                    per_step.append(_dense_bytes(job))
            step = jobs[0].step
            if step % args.eval_every == 0 or step == args.steps:
                for job, curve in zip(jobs, curves):
                    curve.append((step, job.evaluate()))
            if comm.rank == 0 and step % args.eval_every == 0:
                print(f"hook-curves: step {step}/{args.steps}: val loss "
                      + ", ".join(f"{h} {c[-1][1]:.3f}" for h, c in zip(hooks, curves)),
                      file=sys.stderr, flush=True)
    finally:
        for job in jobs:
            job.close()
    results = []
    for hook, job, curve, per_step in zip(hooks, jobs, curves, sent):
        # Steady state: the steps after the hook's plain-AllReduce warm-up.
        steady = per_step[args.hook_start + 1:] or per_step
        times = job.step_times[1:] or job.step_times
        mine = {"step_s": statistics.median(times), "sent": statistics.median(steady)}
        table = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
        results.append({"hook": hook, "curve": curve, "losses": job.global_mean(job.losses),
                        "step_s": max(t["step_s"] for t in table),
                        "sent_bytes_per_step": max(t["sent"] for t in table)})
    return results


def plot(results: list[dict], path: str, title: str) -> None:
    """Validation loss vs step per hook (left) and bytes per step vs step time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for r in results:
        steps, vals = zip(*r["curve"])
        width = 2.2 if r["hook"] == "none" else 1.4
        ax.plot(steps, vals, marker="o", markersize=3, label=_label(r["hook"]),
                color=_COLORS.get(r["hook"]), linewidth=width)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    base = next((r for r in results if r["hook"] == "none"), results[0])
    for r in results:
        x = r["sent_bytes_per_step"] / 2**20
        y = r["step_s"] * 1e3
        bx.scatter([x], [y], s=40, color=_COLORS.get(r["hook"]))
        ratio = base["sent_bytes_per_step"] / r["sent_bytes_per_step"] if r["sent_bytes_per_step"] else 0
        bx.annotate(f"{_label(r['hook'])}\n{ratio:.0f}x fewer bytes" if r is not base
                    else "none (plain DDP)", (x, y), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    bx.set_xscale("log")
    bx.margins(x=0.35, y=0.2)
    bx.set_xlabel("MiB sent per step by one rank (log)")
    bx.set_ylabel("median step time (ms)")
    bx.set_title("wire bytes vs step time", fontsize=10)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _title(preset: str, ranks: int, batch: int, ratio: float, rank: int) -> str:
    return (f"GPT '{preset}' on {ranks} ranks, batch {ranks}x{batch}, top-k {ratio:g}, "
            f"PowerSGD rank {rank}")


_COLORS = {"none": "black", "allreduce": "gray", "fp16": "tab:blue", "bf16": "tab:orange",
           "topk": "tab:green", "powersgd": "tab:red"}


def _label(hook: str) -> str:
    return {"none": "none (fp32 AllReduce)", "topk": "top-k", "powersgd": "PowerSGD"}.get(hook, hook)


def run(args) -> int:
    import mpiring
    from mpiring.parallel.data.comm_hooks import HOOKS
    from mpiring.tools.train.data import shared_corpus

    if args.replot:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        s = saved["settings"]
        plot(saved["results"], args.out + ".png", _title(s["preset"], s["ranks"], s["batch_size"],
                                                        s["topk_ratio"], s["powersgd_rank"]))
        print(f"hook-curves: redrew {args.out}.png from {args.out}.json")
        return 0
    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    bad = [h for h in hooks if h not in HOOKS]
    if bad or not hooks:
        return refuse(f"hook-curves: unknown hook(s) {', '.join(bad) or '(none given)'}: use "
                      f"some of {', '.join(HOOKS)}")
    mpiring.runtime.pages.steady_malloc()  # as in train and bench-ddp (see mpiring.runtime.pages)
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    data = shared_corpus(comm, int(args.max_data_mb * (1 << 20)))
    results = run_hooks(comm, args, hooks, data)
    if comm.rank == 0:
        base = next((r for r in results if r["hook"] == "none"), results[0])
        print(f"hook-curves: {comm.size} ranks, {args.preset} GPT, {args.steps} steps, batch "
              f"{comm.size}x{args.batch_size}, hook start {args.hook_start}, top-k ratio "
              f"{args.topk_ratio}, PowerSGD rank {args.powersgd_rank}")
        print(f"{'hook':<10} {'MiB/step':>9} {'x fewer':>8} {'ms/step':>8} {'time ratio':>10} "
              f"{'val loss':>8}")
        for r in results:
            fewer = base["sent_bytes_per_step"] / r["sent_bytes_per_step"] if r["sent_bytes_per_step"] else 0
            print(f"{r['hook']:<10} {r['sent_bytes_per_step'] / 2**20:>9.3f} {fewer:>8.1f} "
                  f"{r['step_s'] * 1e3:>8.0f} {r['step_s'] / base['step_s']:>10.2f} "
                  f"{r['curve'][-1][1]:>8.3f}")
        meta = {"ranks": comm.size, "preset": args.preset, "steps": args.steps,
                "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                "topk_ratio": args.topk_ratio, "powersgd_rank": args.powersgd_rank,
                "hook_start": args.hook_start, "eval_every": args.eval_every}
        with open(args.out + ".json", "w") as f:
            json.dump({"settings": meta, "results": results}, f, indent=1)
        plot(results, args.out + ".png", _title(args.preset, comm.size, args.batch_size,
                                                args.topk_ratio, args.powersgd_rank))
        print(f"hook-curves: wrote {args.out}.json and {args.out}.png")
    return 0
