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

import argparse
import json
import sys

from mpiring.cli import positive_int

PRESETS = ("megatron-1t", "megatron-145b", "llama-3.1-405b", "deepseek-v3")


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="a published run's model, cluster, batch and tokens")
    p.add_argument("--check", action="store_true",
                   help="print the published tables (Megatron-LM, ZeRO, DeepSeek-V3, Llama 3.1) "
                        "beside the predictions")
    p.add_argument("--gpu", choices=("a100", "h100", "h800"), default=None,
                   help="the cluster of a model you describe (default a100); a preset brings "
                        "its own")
    p.add_argument("--precision", choices=("bf16", "fp8"), default=None,
                   help="GEMM precision for --gpu (default bf16); fp8 only for h800, priced with "
                        "the constants of DeepSeek-V3's FP8 MoE trace")
    p.add_argument("--gpus", type=positive_int, default=None, help="GPUs in the cluster")
    for name, help_ in (("layers", "l"), ("hidden", "h"), ("heads", "a"), ("seq", "s"),
                        ("vocab", "V"), ("ffn", "MLP inner size (default 4h)")):
        p.add_argument(f"--{name}", type=positive_int, default=None, help=help_)
    p.add_argument("--batch", type=positive_int, default=None, help="global batch in sequences")
    p.add_argument("--tokens", type=_tokens, default=None,
                   help="token budget for GPU-hours, e.g. 3e11 (0: none)")
    p.add_argument("--top", type=positive_int, default=5, help="layouts to print (default 5)")
    p.add_argument("--local", nargs="*", metavar="JSON", default=None,
                   help="this host: with no file, fit alpha/beta and the FLOP rate, run the DDP, "
                        "TP and PP benches on --ranks ranks and print predicted vs measured; "
                        "with BENCH_JSON DDP_JSON, price that 'bench -a ring' + 'bench-ddp' pair")
    p.add_argument("--local-size", choices=("tiny", "default"), default="default",
                   help="bench sizes for --local (tiny: a plumbing check in seconds)")
    p.add_argument("--ranks", type=int, default=2, help="ranks for --local (default 2)")
    p.add_argument("--rounds", type=int, default=2,
                   help="--local: rounds of the three benches, alternating order (default 2)")
    p.add_argument("--calibrate", nargs=2, metavar=("SPEC", "OUT"), default=None,
                   help="under mpiexec: time the GEMMs, attention and elementwise passes of the "
                        "SPEC JSON on every rank at once (one thread each), write OUT, then run "
                        "the command after --then in the same job (what --local does per bench)")
    p.add_argument("--then", nargs=argparse.REMAINDER, default=None,
                   help="with --calibrate: the mpiring command to run next, e.g. bench-tp ...")
    p.add_argument("--json", metavar="FILE", help="write the layouts (or --check tables) as JSON")
    p.add_argument("--plot", metavar="PNG", help="stacked bars of each layout's step time")


def _tokens(text: str) -> float:
    """argparse type: a finite token count >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: use a token count >= 0, e.g. 3e11")
    return value


def _problem(args):
    from mpiring.core.stepmodel import GPT
    from mpiring.tools.plan import presets as pr

    # The H800's FP8 constants are DeepSeek-V3's (an FP8 MoE recipe with its routing and
    # quantisation work): a what-if for other models, so BF16 unless asked.
    clusters = {"a100": pr.selene, "h100": pr.h100_cluster,
                "h800": lambda n: pr.h800_cluster(n, fp8=args.precision == "fp8")}
    if args.preset and (args.gpu or args.precision):
        raise ValueError(f"--gpu/--precision with --preset {args.preset}: a preset brings its "
                         "own cluster; drop them (or --preset, and describe the model)")
    if args.precision == "fp8" and args.gpu != "h800":
        raise ValueError("--precision fp8 has constants only for --gpu h800 (DeepSeek-V3's "
                         "trace): use --gpu h800 or bf16")
    if args.preset in ("megatron-1t", "megatron-145b"):
        row = pr.MEGATRON_TABLE[-1 if args.preset == "megatron-1t" else 6]
        g, c, batch, tokens = row.model(), pr.selene(row.gpus), row.batch, 0.0
    elif args.preset:
        run = pr.RUNS[args.preset]()
        g, c, batch, tokens = run.model, run.cluster, run.batch, run.tokens
    else:
        g = GPT(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
        c, batch, tokens = clusters[args.gpu or "a100"](64), 512, 0.0
    changes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab", "ffn")
               if getattr(args, k) is not None}
    if changes:
        g = pr.reshape(g, **changes)
    if args.gpus is not None:
        c = c.with_(gpus=args.gpus)
    return (g, c, batch if args.batch is None else args.batch,
            tokens if args.tokens is None else args.tokens)


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
    from mpiring.tools.plan import calibrate, local
    from mpiring.tools.plan.local_work import spec_for

    with open(bench_json) as f:
        ab = local.fit_ring_rows(json.load(f))
    with open(ddp_json) as f:
        runs = {"ddp": [r for r in json.load(f) if r["mode"] in ("compute", "ddp")]}
    if not runs["ddp"]:
        sys.stderr.write(f"python -m mpiring plan: {ddp_json} has no compute or ddp rows\n")
        return 2
    # Timed here, in this one process: not under the bench's contention (docs/planner.md).
    cal = calibrate.calibrate(None, spec_for(local.run_works(runs, pp_preset="small",
                                                              pp_mb_rows=2)))
    print(f"ring fit: {ab.describe()}; calibrated in this process alone")
    for r in local.compare_runs(runs, ab, cal, pp_preset="small", pp_mb_rows=2,
                                ranks=runs["ddp"][0]["ranks"], cores=_cores()):
        print(_line("-", r))
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_HEAD = (f"{'round':>5} {'run':<14} {'what':<36} {'measured':>9} {'predicted':>9} {'resid':>6} "
         f"{'GEMM GF/s':>9} {'gemm':>7} {'attn':>6} {'elem':>6} {'other':>6} {'one set':>8} "
         f"{'on-core':>9} {'resid':>6} {'share':>5}")


def _line(i, r: dict, one: dict | None = None, oc: dict | None = None,
          share: float | None = None) -> str:
    other = (r.get("tp_comm_ms", 0) + r.get("pp_comm_ms", 0) + r.get("bubble_ms", 0)
             + r.get("dp_exposed_ms", 0) + r.get("optimizer_ms", 0) + r.get("bucket_ms", 0))
    tail = f" {one['residual'] * 100:>+7.0f}%" if one else ""
    if oc:
        tail += f" {oc['predicted_ms']:>9.1f} {oc['residual'] * 100:>+5.0f}% {share:>5.2f}"
    return (f"{i:>5} {r['run']:<14} {r['what']:<36} {r['measured_ms']:>9.1f} "
            f"{r['predicted_ms']:>9.1f} {r['residual'] * 100:>+5.0f}% {r['gemm_rate'] / 1e9:>9.1f} "
            f"{r['host_gemm_ms']:>7.1f} {r['host_attention_ms']:>6.1f} "
            f"{r['host_elementwise_ms']:>6.1f} {other:>6.1f}{tail}")


def _ddp_check(rows: list[dict]) -> dict | None:
    """DDP's cost over compute alone and its bucket AllReduces, predicted against measured."""
    by = {r["run"]: r for r in rows}
    base, ddp = by.get("compute alone"), next((r for r in rows if r["run"].startswith("DDP")), None)
    if not base or not ddp:
        return None
    return {"extra_measured_ms": ddp["measured_ms"] - base["measured_ms"],
            "extra_predicted_ms": ddp["predicted_ms"] - base["predicted_ms"],
            "ring_exposed_ms": ddp["dp_exposed_ms"], "copies_ms": ddp["bucket_ms"],
            "allreduce_measured_ms": ddp.get("comm_measured_ms"),
            "allreduce_predicted_ms": ddp["dp_total_ms"]}


def _calibrate_then(args) -> int:
    import time

    import mpiring
    from mpiring.cli import main
    from mpiring.tools.plan import calibrate

    comm = mpiring.init()
    with open(args.calibrate[0]) as f:
        spec = json.load(f)
    # Before and after the command: the pair brackets it, so a change of the host's
    # load while it runs shows up in the rates as it does in the command's times.
    before = calibrate.calibrate(comm, spec)
    wall, cpu = time.perf_counter(), time.process_time()
    rc = main(args.then) if args.then else 0
    share = (time.process_time() - cpu) / max(1e-9, time.perf_counter() - wall)
    got = calibrate.combine(before, calibrate.calibrate(comm, spec))
    got["bench_share"] = comm.control.allgather_json(share) if comm.size > 1 else [share]
    if comm.rank == 0:
        with open(args.calibrate[1], "w") as f:
            json.dump(got, f)
    return rc


def _local_all(args) -> int:
    import os

    from mpiring.tools.plan import local, local_runs

    if args.ranks < 2:
        sys.stderr.write("python -m mpiring plan: --local needs --ranks >= 2\n")
        return 2
    load0 = os.getloadavg()[0]
    got = local_runs.measure_all(args.local_size, args.ranks, max(1, args.rounds))
    ab = local.fit_ring_rows(got["bench"])
    preset, mb_rows = local_runs.pp_shape(args.local_size)
    print(f"ring fit: {ab.describe()}; {got['ranks']} ranks on {got['cores']} cores; "
          f"load {load0:.2f} before")
    print(_HEAD)
    table, checks = [], []
    for i, (runs, cal) in enumerate(zip(got["runs"], got["calib"])):
        rows = local.compare_runs(runs, ab, cal, pp_preset=preset, pp_mb_rows=mb_rows,
                                  ranks=got["ranks"], cores=got["cores"])
        kinds = {"compute alone": "ddp", "TP": "tp", "PP": "pp"}
        # The same rows priced with one calibration for all three (the DDP job's).
        ones = local.compare_runs(runs, ab, cal["ddp"], pp_preset=preset, pp_mb_rows=mb_rows,
                                  ranks=got["ranks"], cores=got["cores"])
        # And at the CPU-time rates over the share of a core each bench measured.
        ocs = local.compare_runs(runs, ab, cal, pp_preset=preset, pp_mb_rows=mb_rows,
                                 ranks=got["ranks"], cores=got["cores"], oncore=True)
        for r, one, oc in zip(rows, ones, ocs):
            kind = next((v for k, v in kinds.items() if r["run"].startswith(k)), "ddp")
            share = min(cal[kind]["bench_share"])
            print(_line(i, r, one, oc, share))
            table.append({"round": i, "load": got["loads"][i][kind], "bench_share":
                          cal[kind]["bench_share"], "residual_one_set": one["residual"],
                          "oncore_predicted_ms": oc["predicted_ms"],
                          "oncore_residual": oc["residual"], **r})
        chk = _ddp_check(rows)
        if chk:
            ar = chk["allreduce_measured_ms"]
            print(f"      DDP over compute alone: measured {chk['extra_measured_ms']:.1f} ms, "
                  f"predicted {chk['extra_predicted_ms']:.1f} (ring {chk['ring_exposed_ms']:.1f} "
                  f"exposed: no free core for the comm thread; bucket copies "
                  f"{chk['copies_ms']:.1f}); bucket AllReduces measured "
                  f"{ar if ar is not None else float('nan'):.1f} ms, ring fit "
                  f"{chk['allreduce_predicted_ms']:.1f}")
            checks.append({"round": i, **chk})
        c = cal["ddp"]
        print(f"      calibration around DDP: {len(c['gemm'])} GEMM shapes "
              f"{min(c['gemm'].values()) / 1e9:.0f}-{max(c['gemm'].values()) / 1e9:.0f} GFLOP/s, "
              f"elementwise {min(c['probe'].values()) / 1e9:.1f}-"
              f"{max(c['probe'].values()) / 1e9:.1f} GB/s, stream {c['stream_bw'] / 1e9:.1f} GB/s; "
              f"loads {', '.join(f'{k} {v:.2f}' for k, v in got['loads'][i].items())}")
    print(f"load {os.getloadavg()[0]:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"alpha_s": ab.alpha, "beta_Bps": ab.beta, "load_before": load0,
                       "load_after": os.getloadavg()[0], "cores": got["cores"], "rows": table,
                       "ddp_check": checks, "calib": got["calib"],
                       "bench_rows": got["runs"]}, f, indent=1)
    return 0


def run(args) -> int:
    from mpiring.tools.plan.report import format_candidates, plot_candidates
    from mpiring.tools.plan.search import search

    if args.check:
        return _check(args)
    if args.calibrate:
        return _calibrate_then(args)
    if args.local is not None:
        if len(args.local) == 2:
            return _local(*args.local)
        if args.local:
            sys.stderr.write("python -m mpiring plan: --local takes no file or BENCH_JSON DDP_JSON\n")
            return 2
        return _local_all(args)
    try:
        g, c, batch, tokens = _problem(args)
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
