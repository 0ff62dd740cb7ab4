"""docs/pipeline-bench.md from one run of scripts/pipeline_bench.sh (its JSON and text).

    python scripts/pipeline_page.py out/pipeline --commit abc1234 > docs/pipeline-bench.md

The goals of the pipeline work, each computed from the rows of that one run:
bubble measured against the schedule's prediction (GPipe, 1F1B), ZB-H1's
bubble and peak activations against 1F1B's, 1F1B's step against torch's
Schedule1F1B (and torch's against the schedule's compute bound), GPipe with
recomputation's memory against its model, interleaved 1F1B's bubble and ZB-V's
idle time and peak against 1F1B's, the interleaved zero bubble's against
interleaved 1F1B's, DualPipeV's against ZB-V's. When the run launched the bench
more than once (``small-2.json``, ...), the goals of every launch side by side,
with their median: one launch's ratios move with the shared machine. Then the
bench's own tables and a measured step drawn to scale, as printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mpiring.tools.models.gpt import PRESETS  # noqa: E402

PRESET_NOTES = {"small": "d=256, 4 blocks, 64 tokens: compute-bound",
                "tiny": "d=64, 2 blocks, 32 tokens: the runtime's share is large"}


def _by(rows):
    return {(r["mode"], r["m"]): r for r in rows}


def _input_mib(preset: str, mb_rows: int, stage: int) -> float:
    """One micro-batch's stage input: token ids (int64) on stage 0, float32 rows after."""
    cfg = PRESETS[preset]
    per_token = 8 if stage == 0 else 4 * cfg.d_model
    return mb_rows * cfg.seq_len * per_token / 2**20


def goals(rows: list[dict]) -> list[str]:
    by = _by(rows)
    ms = sorted({r["m"] for r in rows})
    preset, mb_rows = rows[0]["preset"], rows[0]["mb_rows"]
    out = ["| goal | " + " | ".join(f"m={m}" for m in ms) + " |",
           "|---|" + "---:|" * len(ms)]

    def line(name, fn):
        cells = []
        for m in ms:
            try:
                cells.append(fn(m))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("-")
        out.append(f"| {name} | " + " | ".join(cells) + " |")

    line("GPipe bubble, measured / predicted (goal <= 1.10)",
         lambda m: f"{by['gpipe', m]['bubble'] / by['gpipe', m]['predicted']:.2f}")
    line("1F1B bubble, measured / predicted (goal <= 1.10)",
         lambda m: f"{by['1f1b', m]['bubble'] / by['1f1b', m]['predicted']:.2f}")
    # ZB-H1 against 1F1B in idle time, the paper's bubble size: the same work at the same
    # m, so a share of each step would divide ZB-H1's idle by its own shorter step.
    def idle(mode, key):
        return lambda m: f"{by[mode, m][key] / by['1f1b', m][key]:.2f}"
    line("ZB-H1 / 1F1B idle time of the busiest stage, measured (goal <= 0.5)",
         idle("zb", "idle_busiest_ms"))
    line("ZB-H1, the same, the schedules' prediction",
         idle("zb", "predicted_idle_busiest_ms"))
    line("ZB-H1 / 1F1B idle time of the worst rank, measured (predicted)",
         lambda m: f"{idle('zb', 'idle_ms')(m)} ({idle('zb', 'predicted_idle_ms')(m)})")
    line("peak activations MiB, ZB-H1 / 1F1B (max over stages)",
         lambda m: f"{by['zb', m]['peak_act_mib']:.2f} / {by['1f1b', m]['peak_act_mib']:.2f}")
    line("ZB-H1 within 1F1B's peak (zb-cap) / 1F1B idle time of the busiest stage, "
         "measured (goal <= 0.5)", idle("zb-cap", "idle_busiest_ms"))
    line("zb-cap, the same, the schedules' prediction",
         idle("zb-cap", "predicted_idle_busiest_ms"))
    line("zb-cap / 1F1B idle time of the worst rank, measured",
         idle("zb-cap", "idle_ms"))
    line("peak activations MiB, zb-cap / 1F1B (max over stages)",
         lambda m: f"{by['zb-cap', m]['peak_act_mib']:.2f} / "
                   f"{by['1f1b', m]['peak_act_mib']:.2f}")
    line("as shares of each step: ZB-H1 / 1F1B and zb-cap / 1F1B bubble, busiest stage",
         lambda m: f"{by['zb', m]['bubble_busiest'] / by['1f1b', m]['bubble_busiest']:.2f} / "
                   f"{by['zb-cap', m]['bubble_busiest'] / by['1f1b', m]['bubble_busiest']:.2f}")
    line("1F1B step / torch Schedule1F1B step (goal <= 0.9)",
         lambda m: f"{by['1f1b', m]['step_ms'] / by['torch-1f1b', m]['step_ms']:.2f}")
    line("torch step / 1F1B's simulated compute bound",
         lambda m: f"{by['torch-1f1b', m]['step_ms'] / by['1f1b', m]['ideal_ms']:.2f}")
    line("1F1B, weight gradients added in the GEMM / by autograd: step (compute bound)",
         lambda m: f"{by['1f1b', m]['step_ms'] / by['1f1b-autograd', m]['step_ms']:.2f} "
                   f"({by['1f1b', m]['ideal_ms'] / by['1f1b-autograd', m]['ideal_ms']:.2f})")

    line("interleaved 1F1B (2 stages per rank) bubble, measured / predicted",
         lambda m: f"{by['interleaved', m]['bubble'] / by['interleaved', m]['predicted']:.2f}")
    line("interleaved / 1F1B bubble, measured (predicted)",
         lambda m: f"{by['interleaved', m]['bubble'] / by['1f1b', m]['bubble']:.2f} "
                   f"({by['interleaved', m]['predicted'] / by['1f1b', m]['predicted']:.2f})")
    line("interleaved / 1F1B step",
         lambda m: f"{by['interleaved', m]['step_ms'] / by['1f1b', m]['step_ms']:.2f}")

    def vs_interleaved(key):
        return lambda m: f"{by['interleaved-zb', m][key] / by['interleaved', m][key]:.2f}"
    line("interleaved zero bubble / interleaved 1F1B idle time of the busiest rank, measured "
         "(predicted)",
         lambda m: f"{vs_interleaved('idle_busiest_ms')(m)} "
                   f"({vs_interleaved('predicted_idle_busiest_ms')(m)})")
    line("peak activations MiB, interleaved zero bubble / interleaved 1F1B (max over ranks)",
         lambda m: f"{by['interleaved-zb', m]['peak_act_mib']:.2f} / "
                   f"{by['interleaved', m]['peak_act_mib']:.2f}")
    line("interleaved zero bubble / interleaved 1F1B step", vs_interleaved("step_ms"))

    line("ZB-V (2 stages per rank in a V) / 1F1B idle time of the busiest stage, measured "
         "(predicted)",
         lambda m: f"{idle('zbv', 'idle_busiest_ms')(m)} "
                   f"({idle('zbv', 'predicted_idle_busiest_ms')(m)})")
    line("ZB-V / 1F1B idle time of the worst rank, measured", idle("zbv", "idle_ms"))
    line("peak activations MiB, ZB-V / 1F1B (max over ranks)",
         lambda m: f"{by['zbv', m]['peak_act_mib']:.2f} / {by['1f1b', m]['peak_act_mib']:.2f}")
    line("ZB-V / 1F1B step",
         lambda m: f"{by['zbv', m]['step_ms'] / by['1f1b', m]['step_ms']:.2f}")

    def vs_zbv(key):
        return lambda m: f"{by['dualpipev', m][key] / by['zbv', m][key]:.2f}"
    line("DualPipeV / ZB-V (the same stages and V) idle time of the busiest stage, measured "
         "(predicted)",
         lambda m: f"{vs_zbv('idle_busiest_ms')(m)} ({vs_zbv('predicted_idle_busiest_ms')(m)})")
    line("peak activations MiB, DualPipeV / ZB-V (max over ranks)",
         lambda m: f"{by['dualpipev', m]['peak_act_mib']:.2f} / "
                   f"{by['zbv', m]['peak_act_mib']:.2f}")
    line("DualPipeV / ZB-V step", vs_zbv("step_ms"))

    def recompute_mem(m):
        r, g = by["gpipe-recompute", m], by["gpipe", m]
        pred = [g["peak_act_mib_per_stage"][s] / m + m * _input_mib(preset, mb_rows, s)
                for s in range(r["ranks"])]
        return f"{r['peak_act_mib']:.2f} / {max(pred):.2f}"
    line("GPipe recompute peak MiB, measured / m inputs + one micro-batch", recompute_mem)
    line("GPipe recompute step / GPipe step",
         lambda m: f"{by['gpipe-recompute', m]['step_ms'] / by['gpipe', m]['step_ms']:.2f}")
    return out


def across(runs: list[list[dict]]) -> list[str]:
    """The goal rows of several launches side by side: each launch's value, then their
    median (a launch's ratios come from its own steps; the launches share nothing)."""
    tables = [goals(rows) for rows in runs]
    out = tables[0][:2]
    for i, line in enumerate(tables[0][2:], start=2):
        name = line.split(" | ")[0].removeprefix("| ")
        if "(goal <=" not in name:
            continue
        cols = [t[i].strip("| ").split(" | ")[1:] for t in tables]
        cells = []
        for values in zip(*cols):
            try:
                numbers = sorted(float(v) for v in values)
            except ValueError:  # a launch without that mode
                cells.append(", ".join(values))
                continue
            k = len(numbers)
            mid = numbers[k // 2] if k % 2 else (numbers[k // 2 - 1] + numbers[k // 2]) / 2
            cells.append(f"{', '.join(values)} (median {mid:.2f})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _launches(directory: str, preset: str) -> list[str]:
    """The JSON of each launch of ``preset``: ``small.json`` (the first, the one printed
    and drawn), then ``small-2.json``, ``small-3.json``, ..."""
    paths, k = [], 1
    while os.path.exists(path := os.path.join(directory, f"{preset}.json" if k == 1 else
                                             f"{preset}-{k}.json")):
        paths.append(path)
        k += 1
    return paths


def page(directory: str, commit: str) -> str:
    machine = json.load(open(os.path.join(directory, "machine.json")))
    parts = ["# Pipeline benchmark", "",
             "Written by `scripts/pipeline_bench.sh` from one run (commit "
             f"`{commit}`; {machine['cores']} cores, load average {machine['load_before']} before "
             f"and {machine['load_after']} after). Ratios compare modes of the same launch, whose "
             "steps went round-robin; each row is its mode's fastest step. The columns and the "
             "definitions are in [pipeline.md](pipeline.md#benchmark).", ""]
    for preset in ("small", "tiny"):
        paths = _launches(directory, preset)
        if not paths:
            continue
        runs = [json.load(open(path)) for path in paths]
        parts += [f"## {preset} ({PRESET_NOTES.get(preset, '')})", ""]
        parts += goals(runs[0])
        if len(runs) > 1:
            parts += ["", f"The goals in each of the run's {len(runs)} launches of bench-pp "
                      "(separate `mpiexec`s, one after the other; the table above and the "
                      "output below are the first), and their median:", ""]
            parts += across(runs)
        parts += ["", "As printed:", "", "```"]
        parts += open(os.path.join(directory, f"{preset}.txt")).read().rstrip().splitlines()
        parts += ["```", ""]
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    sys.stdout.write(page(args.directory, args.commit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
