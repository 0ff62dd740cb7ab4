"""Plan a layout for a real cluster: memory, step time, MFU and GPU-hours, predicted.

Searches every data/tensor/pipeline layout (micro-batch, schedule, ZeRO stage,
recomputation) that fits in memory and prints the fastest few with where their
time goes. Presets are the published runs; --check prints the published
tables beside the predictions. No MPI needed::

    python -m mpiring plan --preset llama-3.1-405b
    python -m mpiring plan --gpu a100 --gpus 1024 --layers 80 --hidden 12288 --heads 96 --batch 2048
    python -m mpiring plan --check
    python -m mpiring plan --local                 # this host: DDP, TP=2, PP=2 on 2 ranks
"""

from __future__ import annotations

import json
import sys

PRESETS = ("megatron-1t", "megatron-145b", "llama-3.1-405b", "deepseek-v3")


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="a published run's model, cluster, batch and tokens")
    p.add_argument("--check", action="store_true",
                   help="print the published tables (Megatron-LM, ZeRO, DeepSeek-V3, Llama 3.1) "
                        "beside the predictions")
    p.add_argument("--gpu", choices=("a100", "h100", "h800"), default="a100")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the cluster")
    for name, help_ in (("layers", "l"), ("hidden", "h"), ("heads", "a"), ("seq", "s"),
                        ("vocab", "V"), ("ffn", "MLP inner size (default 4h)")):
        p.add_argument(f"--{name}", type=int, default=None, help=help_)
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences")
    p.add_argument("--tokens", type=float, default=0.0, help="token budget for GPU-hours, e.g. 3e11")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    p.add_argument("--local", nargs="*", metavar="JSON", default=None,
                   help="this host: with no file, fit alpha/beta and the FLOP rate, run the DDP, "
                        "TP and PP benches on --ranks ranks and print predicted vs measured; "
                        "with BENCH_JSON DDP_JSON, price that 'bench -a ring' + 'bench-ddp' pair")
    p.add_argument("--local-size", choices=("tiny", "default"), default="default",
                   help="bench sizes for --local (tiny: a plumbing check in seconds)")
    p.add_argument("--ranks", type=int, default=2, help="ranks for --local (default 2)")
    p.add_argument("--rounds", type=int, default=2,
                   help="--local: rounds of the three benches, alternating order (default 2)")
    p.add_argument("--json", metavar="FILE", help="write the layouts (or --check tables) as JSON")
    p.add_argument("--plot", metavar="PNG", help="stacked bars of each layout's step time")


def _problem(args):
    from mpiring.core.stepmodel import GPT
    from mpiring.tools.plan import presets as pr

    clusters = {"a100": pr.selene, "h100": pr.h100_cluster, "h800": pr.h800_cluster}
    if args.preset in ("megatron-1t", "megatron-145b"):
        row = pr.MEGATRON_TABLE[-1 if args.preset == "megatron-1t" else 6]
        g, c, batch, tokens = row.model(), pr.selene(row.gpus), row.batch, 0.0
    elif args.preset:
        run = pr.RUNS[args.preset]()
        g, c, batch, tokens = run.model, run.cluster, run.batch, run.tokens
    else:
        g = GPT(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
        c, batch, tokens = clusters[args.gpu](args.gpus or 64), 512, 0.0
    changes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab", "ffn")
               if getattr(args, k) is not None}
    if changes:
        g = g.with_(**changes)
    if args.gpus:
        c = c.with_(gpus=args.gpus)
    return g, c, args.batch or batch, args.tokens or tokens


def _check(args) -> int:
    from mpiring.tools.plan import validate as v
    from mpiring.tools.plan.report import format_residuals

    mega, zero, runs = v.megatron_rows(), v.zero_rows(), v.run_rows()
    for r in mega:
        r["_label"] = f"{r['params_b']:g}B tp{r['tp']} pp{r['pp']} {r['gpus']} GPUs"
    for r in zero:
        r["_label"], r["residual"] = f"ZeRO stage {r['stage']}", v.residual(r["printed"],
                                                                              r["published_gb"])
    for r in runs:
        r["_label"] = r["run"]
        r["published_mh"], r["predicted_mh"] = (r["published_gpu_hours"] / 1e6,
                                                r["predicted_gpu_hours"] / 1e6)
    print("Megatron-LM SC'21 Table 1, TFLOP/s per GPU (one set of A100 constants)")
    print(format_residuals(mega, "run", "published_tflops", "predicted_tflops"))
    print("\nZeRO Figure 1, GB per GPU (7.5B parameters, N_d = 64)")
    print(format_residuals(zero, "stage", "published_gb", "printed"))
    print("\nThe lecture's runs, million GPU-hours")
    print(format_residuals(runs, "run", "published_mh", "predicted_mh", "{:.2f}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"megatron": mega, "zero": zero, "runs": runs}, f, indent=1, default=str)
    return 0


def _local(bench_json: str, ddp_json: str) -> int:
    import os

    from mpiring.core.steptime import Layout
    from mpiring.tools.models.gpt import PRESETS as GPT_PRESETS
    from mpiring.tools.plan import local

    with open(bench_json) as f:
        ab = local.fit_ring_rows(json.load(f))
    with open(ddp_json) as f:
        rows = [r for r in json.load(f) if r["mode"] in ("compute", "ddp")]
    print(f"ring fit: {ab.describe()}")
    for r in rows:
        cfg = GPT_PRESETS[r["preset"]]
        g = local.local_model(cfg.d_model, cfg.n_layers, cfg.n_heads, r["seq_len"], cfg.vocab_size)
        threads = max(1, (os.cpu_count() or 1) // r["ranks"])  # as bench-ddp sets them
        rate = local.measure_flop_rate(r["batch"] * r["seq_len"], cfg.d_model, 4 * cfg.d_model,
                                       threads)
        dp = r["ranks"] if r["mode"] == "ddp" else 1
        pred = local.predict(g, Layout(dp=dp, micro_batch=r["batch"]), r["batch"] * dp, ab, rate)
        cmp_ = local.compare(r["step_ms"], pred)
        print(f"{r['mode']:>8} on {r['ranks']} ranks: measured {cmp_['measured_ms']:.1f} ms, "
              f"predicted {cmp_['predicted_ms']:.1f} ms ({cmp_['residual'] * 100:+.0f}%); "
              f"FLOP rate {rate / 1e9:.1f} GFLOP/s, gradient reduction "
              f"{pred['dp_total_ms']:.1f} ms by the fit, {r.get('comm_total_ms') or 0:.1f} ms measured")
    return 0


def _local_all(args) -> int:
    import os

    from mpiring.tools.plan import local, local_runs

    if args.ranks < 2:
        sys.stderr.write("python -m mpiring plan: --local needs --ranks >= 2\n")
        return 2
    load0 = os.getloadavg()[0]
    got = local_runs.measure_all(args.local_size, args.ranks, max(1, args.rounds))
    ab = local.fit_ring_rows(got["bench"])
    pp_args = local_runs.SIZES[args.local_size]["pp"]
    preset, mb_rows = pp_args[pp_args.index("--preset") + 1], 2
    if "--mb-rows" in pp_args:
        mb_rows = int(pp_args[pp_args.index("--mb-rows") + 1])
    print(f"ring fit: {ab.describe()}; {got['ranks']} ranks on {got['cores']} cores; "
          f"load {load0:.2f} before")
    print(f"{'round':>5} {'run':<14} {'what':<40} {'measured ms':>11} {'predicted ms':>12} "
          f"{'residual':>8} {'GFLOP/s':>8}")
    table = []
    for i, runs in enumerate(got["runs"]):
        rows = local.compare_runs(runs, ab, pp_preset=preset, pp_mb_rows=mb_rows,
                                  ranks=got["ranks"], cores=got["cores"])
        for r in rows:
            print(f"{i:>5} {r['run']:<14} {r['what']:<40} {r['measured_ms']:>11.1f} "
                  f"{r['predicted_ms']:>12.1f} {r['residual'] * 100:>+7.0f}% "
                  f"{r['flop_rate'] / 1e9:>8.1f}")
            table.append({"round": i, **r})
    print(f"load {os.getloadavg()[0]:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"alpha_s": ab.alpha, "beta_Bps": ab.beta, "load_before": load0,
                       "load_after": os.getloadavg()[0], "cores": got["cores"], "rows": table},
                      f, indent=1)
    return 0


def run(args) -> int:
    from mpiring.tools.plan.report import format_candidates, plot_candidates
    from mpiring.tools.plan.search import search

    if args.check:
        return _check(args)
    if args.local is not None:
        if len(args.local) == 2:
            return _local(*args.local)
        if args.local:
            sys.stderr.write("python -m mpiring plan: --local takes no file or BENCH_JSON DDP_JSON\n")
            return 2
        return _local_all(args)
    g, c, batch, tokens = _problem(args)
    try:
        cands = search(g, c, batch, tokens, top=args.top)
    except ValueError as exc:
        sys.stderr.write(f"python -m mpiring plan: {exc}\n")
        return 2
    title = (f"{g.name or 'GPT'}: l={g.layers} h={g.hidden} a={g.heads} s={g.seq} V={g.vocab}; "
             f"{c.gpus} x {c.name}, batch {batch} sequences")
    print(format_candidates(cands, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "layouts": [x.as_dict() for x in cands]}, f, indent=1)
    if args.plot:
        plot_candidates(cands, args.plot, title)
    return 0
